"""How long `pantheon serve` takes to answer `GET /` with no compiled kernels, and again with them cached.

Each round starts the server on the default model with a fresh, empty numba cache folder (NUMBA_CACHE_DIR in a
temporary folder), times it until `GET /` answers, stops it, then starts it once more on the cache the first
start left (a warm start). The server's warm-up log line (`pantheon.models`: the decode step, the wait for the
side-compile child, the rest; see pantheon/engine/side_compile.py) is printed for each cold start.

    .venv/bin/python bench/cold_start.py [--rounds 2] [--tree DIR] [--model FILE.gguf]

--tree: run the `pantheon` package of another checkout (e.g. a `git worktree` of an older commit), for an A/B
in alternating runs of this script. --model: another GGUF file (default: the default model).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import default_model, median, write_result  # noqa: E402

PORT = 18931


def _start_seconds(tree: Path, cache: Path, log: Path, model: Path) -> float:
    """Seconds from launching the server until `GET /` answers; the server is stopped after."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    began = time.perf_counter()
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "pantheon", "serve", "--port", str(PORT), "--model",
                                   f"{model}:m"], cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited ({server.returncode}): {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/", timeout=1.0) as reply:
                    if reply.status == 200:
                        return time.perf_counter() - began
            except OSError:
                time.sleep(0.25)
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--model", type=Path, help="another GGUF file (default: the default model)")
    args = parser.parse_args()
    model = (args.model or default_model()).resolve()
    cold, warm = [], []
    for round_ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="cold-start-") as folder:
            cache, log = Path(folder) / "numba", Path(folder) / "serve.log"
            cold.append(_start_seconds(args.tree, cache, log, model))
            lines = [line for line in log.read_text().splitlines() if "warm-up" in line]
            warm.append(_start_seconds(args.tree, cache, log, model))
        print(f"round {round_ + 1}: cold {cold[-1]:.1f} s, warm {warm[-1]:.1f} s", *lines[-1:], sep="\n  ", flush=True)
    print(f"median: cold {median(cold):.1f} s, warm {median(warm):.1f} s")
    path = write_result("cold-start", {"tree": str(args.tree), "model": str(model), "cold_s": cold, "warm_s": warm,
                                       "cold_median_s": median(cold), "warm_median_s": median(warm)})
    print(f"written to {path}")


if __name__ == "__main__":
    main()
