"""What the scheduler costs without HTTP: decode rate of a plain forward loop vs the Scheduler, 1 and 8 sequences.

    .venv/bin/python bench/scheduler_overhead.py [--tokens 96] [--rounds 4]

Both sides run on the same forward thread (`sched/forward_thread.py`; the model is loaded there too, as the
server loads it: with a second OpenMP team alive, libgomp stops spinning between parallel regions and a step
takes ~2.5x longer), with the same chat prompts (one per sequence), greedy, end tokens forbidden. The loop is
`model.forward` + argmax; the scheduler side submits one job per sequence and counts tokens between the
moment every sequence has its first token and the last token (as bench/concurrency.py does over HTTP), so
prefill stays out of both. The ratio scheduler / loop is what the scheduler, its decode runs and the event
loop's delivery cost; bench/concurrency.py's HTTP figures add the server's relay on top.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import numpy as np  # noqa: E402
import trio  # noqa: E402

from bench.common import default_model, write_result  # noqa: E402
from bench.concurrency import PROMPTS  # noqa: E402
from pantheon.cli import GIL_SWITCH_INTERVAL_S  # noqa: E402
from pantheon.config import ModelOptions, read_env  # noqa: E402
from pantheon.engine.loader import load_served_model  # noqa: E402
from pantheon.engine.sampling import SamplingParams  # noqa: E402
from pantheon.kernels.cpu.backend import CpuBackend  # noqa: E402
from pantheon.models.base import BatchRow  # noqa: E402
from pantheon.sched.forward_thread import ForwardThread  # noqa: E402
from pantheon.sched.jobs import GenerationJob, TokenEvent  # noqa: E402
from pantheon.sched.scheduler import Scheduler  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=96, help="tokens each sequence decodes")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as the server runs: the forward thread and the loop share the GIL
    path = default_model()
    env = read_env()
    forward = ForwardThread()
    served = trio.run(forward.run, lambda: load_served_model(ModelOptions(path=path, name="bench"), env,
                                                             CpuBackend(args.threads, int8=env.cpu_int8)))
    model, tokenizer = served.model, served.tokenizer
    ends = sorted(tokenizer.stop_ids)  # the end tokens the server stops on, forbidden below
    prompts = [np.array(tokenizer.encode(served.template.render([{"role": "user", "content": p}],
                                                                add_generation_prompt=True, extra={}),
                                         parse_special=True), np.int32) for p in PROMPTS]
    n = args.tokens

    def loop(batch: int) -> float:
        state = model.new_state(batch, 1024)
        tokens, positions = [], []
        for b in range(batch):
            logits = model.forward(state, [BatchRow(b, prompts[b % len(prompts)], 0)])
            tokens.append(int(np.argmax(logits[0])))
            positions.append(len(prompts[b % len(prompts)]))
        started = time.perf_counter()
        for _ in range(n):
            logits = model.forward(state, [BatchRow(b, np.array([tokens[b]], np.int32), positions[b])
                                           for b in range(batch)])
            for b in range(batch):
                row = logits[b].copy()
                row[ends] = -np.inf
                tokens[b] = int(np.argmax(row))
                positions[b] += 1
        return batch * n / (time.perf_counter() - started)

    scheduler = Scheduler(served, max_sessions=1, max_concurrent=8, queue_depth=8, forward_thread=forward,
                          stream_interval_s=env.stream_interval_ms / 1000.0)  # as the server runs it

    async def via_scheduler(batch: int) -> float:
        times: list[tuple[int, float]] = []

        async def consume(i: int, channel: Any) -> None:
            async for event in channel:
                if isinstance(event, TokenEvent):
                    times.append((i, time.perf_counter()))

        async with trio.open_nursery() as nursery:
            await nursery.start(scheduler.run)
            async with trio.open_nursery() as jobs:
                for i in range(batch):
                    sampling = SamplingParams(temperature=0, logit_bias={t: -100.0 for t in ends})
                    job = GenerationJob(prompt=list(prompts[i % len(prompts)]), sampling=sampling, max_tokens=n + 1,
                                        stop_ids=frozenset())
                    jobs.start_soon(consume, i, scheduler.submit(job))
            nursery.cancel_scope.cancel()
        firsts: dict[int, float] = {}
        for i, t in times:
            firsts.setdefault(i, t)
        start, end = max(firsts.values()), max(t for _, t in times)
        return sum(1 for _, t in times if t > start) / (end - start)

    rates: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for batch in (1, 8):
            plain = trio.run(forward.run, loop, batch)
            sched = trio.run(via_scheduler, batch)
            rates.setdefault(("loop", batch), []).append(plain)
            rates.setdefault(("scheduler", batch), []).append(sched)
            print(f"round {r}, {batch} sequences: loop {plain:.0f} tok/s, scheduler {sched:.0f} tok/s "
                  f"({sched / plain:.3f})", flush=True)
    rows = []
    for batch in (1, 8):
        ratios = [s / p for p, s in zip(rates[("loop", batch)], rates[("scheduler", batch)])]
        row = {"sequences": batch, "loop_tok_s": statistics.median(rates[("loop", batch)]),
               "scheduler_tok_s": statistics.median(rates[("scheduler", batch)]),
               "scheduler_over_loop": statistics.median(ratios)}
        rows.append(row)
        print(f"{batch} sequences: loop {row['loop_tok_s']:.0f} tok/s, scheduler {row['scheduler_tok_s']:.0f} tok/s, "
              f"scheduler / loop {row['scheduler_over_loop']:.3f} (median of per-round ratios)")
    print(f"8 / 1 sequences: loop {rows[1]['loop_tok_s'] / rows[0]['loop_tok_s']:.2f}, "
          f"scheduler {rows[1]['scheduler_tok_s'] / rows[0]['scheduler_tok_s']:.2f}")
    forward.close()
    print(f"wrote {write_result('scheduler_overhead', {'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
