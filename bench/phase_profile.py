"""Where the compiled decode step's time goes, phase by phase: cycles per step of each team member.

    .venv/bin/python bench/phase_profile.py [--levels 1,8] [--rounds 3] [--tokens 64] [--attention-twice]
                                            [--model FILE.gguf]

`bench/step_profile.py` times backend ops, but the default model's decode step is one compiled call
(kernels/cpu/decode_layers.py: one team of threads, barriers between phases), so it shows as one op. This bench
builds an instrumented copy of `decode_layers` (its source with a cycle-counter read, `llvm.readcyclecounter`,
at each phase boundary of `_team_member`, summed per member into an array passed down from `_team_step`),
writes it to a temporary directory, and runs `bench.batched`'s in-process decoder with the step routed through
it. The phases, per layer summed over the layers: the q|k|v matmul, the attention items, the out matmul, the
first norm, gate|up, the SwiGLU and its quantization, the down matmul, the second norm; then the output matmul.
A matmul's figure includes the barriers around it, so a member's wait for the other shows in the phase after
the one that ran long. Cycles are the time-stamp counter's (a constant rate, printed: measured against a
sleep). `--attention-twice` runs each attention item a second time, right after the first, and
reports that run apart (`attention_again`, not counted in `attn`): the same work with its data in the caches,
which separates the attention's arithmetic from its waits on memory. `barrier_wait` is the part of the phases
that a member spent in the team's barriers (`team.barrier`, timed around each call: its wait for the other
member and the barrier's own atomics), also counted in the phases. The instrumented copy must keep matching
`decode_layers`'s source: a statement it looks for and does not find stops it with the statement's text.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import numpy as np  # noqa: E402

from bench.common import default_model, replace_once  # noqa: E402

PHASES = ["first_quantize", "qkv", "attn", "out", "norm1", "gate_up", "swiglu", "down", "norm2", "output",
          "attention_again", "barrier_wait"]
TEAM_PHASES = 10  # the first ten: a member's step, phase by phase; the others are parts of them
_TIMER = """
from llvmlite import ir as _ir
from numba import types as _types
from numba.extending import intrinsic as _intrinsic


@_intrinsic
def _cycles(typingctx):
    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic("llvm.readcyclecounter", fnty=_ir.FunctionType(_ir.IntType(64), []))
        return builder.call(fn, [])
    return _types.int64(), codegen


@numba.njit
def cycle_count():
    return _cycles()


# Where member t's barrier cycles add up in a timed sync: a cache line of its own past the team's words.
@numba.njit(inline="always")
def _wait_word(n_threads, t):
    return team.PASSED + n_threads + team.LINE_WORDS * (t + 1)


@numba.njit
def _timed_sync(n_threads):
    return np.zeros(_wait_word(n_threads, n_threads), dtype=np.int64)


@numba.njit(nogil=True)
def _timed_barrier(sync, t, n_threads, spin_limit):
    start = _cycles()
    passed = team.barrier(sync, t, n_threads, spin_limit)
    sync[_wait_word(n_threads, t)] += _cycles() - start
    return passed
"""


# (old, new) in decode_layers's source: prof passed from _team_step to _team_member.
_SIGNATURES = [
    ("out_qtype, u(out_packed), u(logits))", "out_qtype, u(out_packed), u(logits), prof)"),
    ("out_packed, logits):\n    \"\"\"Member t's", "out_packed, logits, prof):\n    \"\"\"Member t's"),
    ("scale, n_q_heads):\n    \"\"\"The whole decode step",
     "scale, n_q_heads, prof):\n    \"\"\"The whole decode step"),
]
# (indent, start of a statement of _team_member, index in PHASES of the phase that ends there).
_BOUNDARIES = [
    (" " * 8, "phase = _PHASES * li\n", 8),  # the layer before's second norm (the first layer: nothing)
    (" " * 8, "while True:  # items differ", 1),
    (" " * 8, "if not items_quantize:  # a member", 2),
    (" " * 8, "_add_rmsnorm_quantize_rows(x, o,", 3),
    (" " * 8, "if not _layer_matmuls(gemm, q_d, li, GATE,", 4),
    (" " * 8, "_swiglu_quantize_span(", 5),
    (" " * 8, "# The down matmul asks", 6),
    (" " * 8, "_add_rmsnorm_quantize_rows(x, d,", 7),
    (" " * 4, "_gemm_phases(gemm, q_d, out_qtype", 8),
]


def _replace(source: str, old: str, new: str) -> str:
    return replace_once(source, old, new, "decode_layers changed: expected the statement once")


def _tick(indent: str, phase: int) -> str:
    return f"{indent}_now = _cycles(); prof[t, {phase}] += _now - _last; _last = _now\n"


def instrumented_source(source: str, attention_twice: bool) -> str:
    """decode_layers's source with the per-phase counters (see the module docstring)."""
    if "team.barrier(" not in source:
        raise SystemExit("decode_layers changed: expected team.barrier calls")
    s = source.replace("team.barrier(", "_timed_barrier(")
    s = _replace(s, "log = logging.getLogger", _TIMER + "\nlog = logging.getLogger")
    s = _replace(s, "sync = team.new_sync(n_threads)", "sync = _timed_sync(n_threads)")
    s = _replace(s, "    return logits, sync[team.ABORT] == 0",
                 "    for _t in range(n_threads):\n"
                 f"        prof[_t, {PHASES.index('barrier_wait')}] += sync[_wait_word(n_threads, _t)]\n"
                 "    return logits, sync[team.ABORT] == 0")
    # prof (n_threads, len(PHASES)) int64, from _team_step down to each member.
    for old, new in _SIGNATURES:
        s = _replace(s, old, new)
    member = s.index("def _team_member(")
    head, body = s[:member], s[member:]
    end = body.index("\n@numba.njit")
    body, tail = body[:end], body[end:]
    first = body.index("    _quantize_rows(h, q_d,")
    first_end = body.index("\n", first) + 1
    body = body[:first] + "    _last = _cycles()\n" + body[first:first_end] + _tick("    ", 0) + body[first_end:]
    for indent, statement, phase in _BOUNDARIES:  # the phase that ends where the statement starts
        body = _replace(body, indent + statement, _tick(indent, phase) + indent + statement)
    body = body.rstrip("\n") + "\n" + _tick("    ", 9)
    if attention_twice:
        call = "b, h0, n_heads = ops._attention_qkv_item("
        start = body.index(call)
        stop = body.index(")\n", start) + 2
        again = body[start:stop].replace(call, "ops._attention_qkv_item(")
        body = (body[:stop] + f"{' ' * 12}_again = _cycles()\n{' ' * 12}{again}{' ' * 12}_done = _cycles(); "
                "prof[t, 10] += _done - _again; _last += _done - _again\n" + body[stop:])
    return head + body + "\n" + tail


def load_instrumented(attention_twice: bool) -> Any:
    from pantheon.kernels.cpu import decode_layers

    source = instrumented_source(Path(decode_layers.__file__).read_text(), attention_twice)
    path = Path(tempfile.mkdtemp(prefix="pantheon-phase-")) / "decode_layers_phases.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("decode_layers_phases", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attention-twice", action="store_true")
    ap.add_argument("--model", type=Path, help="another GGUF file (default: the default model); one the compiled "
                    "whole step serves")
    args = ap.parse_args()

    from bench.batched import PantheonBatched
    from bench.concurrency import PROMPTS
    from pantheon.kernels.cpu import decode_layers

    phases = load_instrumented(args.attention_twice)
    phases.cycle_count()
    c0, t0 = phases.cycle_count(), time.perf_counter()
    time.sleep(0.2)
    tsc_hz = (phases.cycle_count() - c0) / (time.perf_counter() - t0)
    prof = np.zeros((args.threads, len(PHASES)), np.int64)

    # decode_step stays as it is (its arguments, team size and fallback); only the team it runs is the copy.
    decode_layers._team_step = lambda *step_args: phases._team_step(*step_args, prof)
    engine = PantheonBatched(args.model or default_model(), args.threads)
    prompts = [engine.prompt_ids(p) for p in PROMPTS]
    print(f"{args.threads} threads, {args.tokens} steps a round, prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens; time-stamp counter {tsc_hz / 1e9:.2f} GHz; per phase, k cycles a step "
          "(member 0 / member 1 ...)")
    for _ in range(args.rounds):
        for level in (int(v) for v in args.levels.split(",")):
            batch = [prompts[i % len(prompts)] for i in range(level)]
            engine.run(batch, 4)  # compiled and warm
            prof[:] = 0
            started = time.perf_counter()
            rate = engine.run(batch, args.tokens)["decode_tok_s"]
            wall = time.perf_counter() - started
            per_step = prof / args.tokens
            step_ms = level / rate * 1e3
            in_team = prof[:, :TEAM_PHASES].sum(axis=1).max() / args.tokens / tsc_hz * 1e3
            print(f"batch {level}: {rate:.0f} tok/s, step {step_ms:.2f} ms, {in_team:.2f} ms of it in the team "
                  f"({wall:.1f} s with prefill; teams given up and redone by one thread, counted too: "
                  f"{decode_layers.team_fallbacks})")
            shown = [name for name in PHASES if args.attention_twice or name != "attention_again"]
            print("   " + "  ".join(f"{name} " + "/".join(f"{per_step[t, PHASES.index(name)] / 1e3:.0f}"
                                                     for t in range(len(prof))) for name in shown))


if __name__ == "__main__":
    main()
