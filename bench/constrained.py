"""Per-token overhead of grammar-constrained decoding (issue 6), side by side in one run.

    .venv/bin/python bench/constrained.py [--tokens 96] [--runs 3]

Decodes the default model greedily through the scheduler's sampling path (Sampler + controller) three ways:
unconstrained, with a tool_choice "required" grammar (Qwen3-Coder XML, two tools), and with a json_schema
grammar; prints ms per token for the forward pass and for sampling+masking, and the overhead ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_model, median, write_result  # noqa: E402
from pantheon.chat import structure  # noqa: E402
from pantheon.chat.request import parse_chat_request  # noqa: E402
from pantheon.config import ModelOptions, read_env  # noqa: E402
from pantheon.engine.loader import load_served_model  # noqa: E402
from pantheon.engine.sampling import Sampler, SamplingParams  # noqa: E402
from pantheon.kernels.cpu.backend import CpuBackend  # noqa: E402
from pantheon.models.base import BatchRow  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city", "days"]}}},
         {"type": "function", "function": {"name": "search_files", "parameters": {"type": "object", "properties": {
             "pattern": {"type": "string"}}, "required": ["pattern"]}}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def controller(served, env, body: dict):
    request = parse_chat_request(body)
    dialect, tools = structure.offered_tools(served, request)
    plan = structure.plan(served, request, env, dialect, tools, "none")
    return structure.grammar_controller(served, plan)


def decode(served, make_controller, n_tokens: int) -> tuple[float, float]:
    """(forward ms/token, sampling+mask ms/token) for one greedy decode of up to n_tokens."""
    model, tokenizer = served.model, served.tokenizer
    prompt = np.array(tokenizer.encode("<|im_start|>user\nWhat's the weather in Paris?<|im_end|>\n"
                                       "<|im_start|>assistant\n"), np.int32)
    state = model.new_state(1, len(prompt) + n_tokens + 8)
    sampler = Sampler(SamplingParams(temperature=0.0), model.vocab_size)
    ctrl = make_controller()
    logits = model.forward(state, [BatchRow(0, prompt, 0)])
    pos, t_forward, t_sample, n = len(prompt), 0.0, 0.0, 0
    for _ in range(n_tokens):
        t0 = time.perf_counter()
        forced = ctrl.forced() if ctrl is not None else None
        token = forced if forced is not None else sampler.sample(logits[0], ctrl.mask() if ctrl else None).token_id
        if ctrl is not None:
            ctrl.advance(token)
        t1 = time.perf_counter()
        if token in tokenizer.stop_ids or (ctrl is not None and ctrl.is_finished()):
            break
        logits = model.forward(state, [BatchRow(0, np.array([token], np.int32), pos)])
        t2 = time.perf_counter()
        pos, n = pos + 1, n + 1
        t_sample += t1 - t0
        t_forward += t2 - t1
    return t_forward / max(n, 1) * 1e3, t_sample / max(n, 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    env = read_env()
    served = load_served_model(ModelOptions(path=default_model(), name="bench"), env, CpuBackend(2))
    msgs = [{"role": "user", "content": "x"}]
    cases = {
        "unconstrained": lambda: None,
        "tools required": lambda: controller(served, env, {"messages": msgs, "tools": TOOLS, "tool_choice": "required"}),
        "json_schema": lambda: controller(served, env, {"messages": msgs, "response_format": {
            "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}),
    }
    results = {}
    print(f"{'case':<16}{'forward ms/tok':>16}{'sample+mask ms/tok':>20}{'overhead':>10}")
    base = None
    for name, make in cases.items():
        runs = [decode(served, make, args.tokens) for _ in range(args.runs)]
        fwd, smp = median([r[0] for r in runs]), median([r[1] for r in runs])
        base = smp if base is None else base
        results[name] = {"forward_ms": fwd, "sample_mask_ms": smp}
        print(f"{name:<16}{fwd:>16.2f}{smp:>20.3f}{(smp - base) / (fwd + base) * 100:>9.1f}%")
    print(f"wrote {write_result('constrained', {'args': vars(args), 'results': results})}")


if __name__ == "__main__":
    main()
