"""One prepared check of the cuda backend on a machine with an NVIDIA GPU and nothing but Python and CUDA.

It (1) finds the GPU, (2) installs pantheon's dependencies from wheels carried alongside (no network), (3) runs
the kernel tests on the device (tests/cuda with the simulator off: every kernel against the numpy references, a
tiny llama against the cpu backend, the driver-API graph capture), (4) measures each kernel's achieved bandwidth
as a fraction of a measured device-to-device copy, then the default model's shapes and a random-weight qwen35moe
with the 35B-A3B layer shapes on CudaBackend (prefill tok/s, decode tok/s at batch 1 and 8, the graphs and attention
counters, the logits against the cpu backend's), and the default model's decode with its layers replayed as CUDA
graphs against the same kernels launched directly, and (5) serves the default model's shapes and asks one chat completion, reporting `backend`,
`accelerator`, `/admin/dies` and `/admin/models`. It prints each step and writes <out>/<date>-gpu_check.json and
a log per step. Without a GPU it stops at step 1 ("no GPU found", exit 3).

The GPU machine of this project has Python, CUDA, numpy, numba and numba-cuda but no network, so the wheelhouse
holds only what is missing there; build it on a machine with network, from the repository root:

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_31_x86_64 -d .whl \
        trio outcome sniffio hypercorn h2 hpack hyperframe priority wsproto orjson gguf llguidance \
        jsonschema jsonschema-specifications referencing rpds-py pytest-trio
    python3 bench/twin.py skeleton ~/.cache/pantheon/SmolLM2-135M-Instruct.Q4_1.gguf .gpu/smollm2-skeleton.gguf

(the model itself is 98 MB; the skeleton is its metadata and tensor list, from which the GPU machine writes a
random-weight twin with the same shapes), then on the GPU machine:

    python3 bench/gpu_check.py --wheelhouse .whl --skeleton .gpu/smollm2-skeleton.gguf --out OUT_DIR

`--wheelhouse` installs the wheels with `pip install --no-deps --target .gpu-site` and runs every step with that
folder on PYTHONPATH (the machine's own numpy, numba and numba-cuda are used); `--no-install` uses the current
interpreter as it is. `--model PATH` times and serves a real llama GGUF instead of the twin. Steps can be skipped
(--skip tests,measure,serve); each has a time limit (--budget, seconds for the whole run, shared in order).
Honest limits: the numbers are single runs of short loops; the kernels are correct-first (see
pantheon/kernels/cuda/), not tuned, and every step launches its kernels one by one from Python.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NO_GPU_EXIT = 3
SITE = ROOT / ".gpu-site"
WORK = Path(os.environ.get("TMPDIR", "/tmp")) / "pantheon-gpu-check"  # written model files (GBs)
STEPS = ("tests", "serve", "measure")
# Each step's share of --budget (what is left when it starts, capped by this).
STEP_LIMIT_S = {"tests": 200, "serve": 100, "measure": 220}


# ---------------------------------------------------------------------------------------------------------------------
# 1. The GPU, before anything is installed: the driver library and nvidia-smi, standard library only.


def find_gpu() -> dict[str, str] | None:
    """Name, driver and CUDA version of the first GPU, or None. Never raises."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in {"", "-1"}:
        return None
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            header = subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        lines = [line for line in out.stdout.splitlines() if line.strip()]
        if out.returncode == 0 and lines:
            name, driver, memory = (part.strip() for part in lines[0].split(",", 2))
            cuda_version = ""
            if "CUDA Version:" in header:
                cuda_version = header.split("CUDA Version:", 1)[1].split()[0]
            return {"name": name, "driver": driver, "memory": memory, "cuda": cuda_version, "count": str(len(lines))}
        return None
    try:  # no nvidia-smi: ask the driver library directly
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int(0)
        if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
            return None
        version = ctypes.c_int(0)
        lib.cuDriverGetVersion(ctypes.byref(version))
        return {"name": "unknown", "driver": "", "memory": "", "count": str(count.value),
                "cuda": f"{version.value // 1000}.{version.value % 1000 // 10}"}
    except (OSError, AttributeError):
        return None


# ---------------------------------------------------------------------------------------------------------------------
# 2. Install from the wheelhouse (or use the current interpreter).


def install(wheelhouse: Path) -> dict[str, str]:
    """pip-install every wheel in `wheelhouse` into .gpu-site without dependencies; returns the inner steps'
    environment (PYTHONPATH: .gpu-site, then the checkout)."""
    wheels = sorted(str(w) for w in wheelhouse.glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels], check=True)
    return {"PYTHONPATH": os.pathsep.join([str(SITE), str(ROOT)])}


def versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for name in ("numpy", "numba", "numba-cuda", "llvmlite", "cuda-bindings", "cuda-core", "gguf", "trio",
                 "hypercorn", "llguidance", "tokenizers"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "missing"
    return found


def run_step(step: str, args: argparse.Namespace, env_extra: dict[str, str], limit_s: float) -> dict:
    """Run one step in a child interpreter (this file, --inner STEP), streaming its output to stdout and to
    <out>/gpu_check-<step>.log; returns the last RESULT line's JSON (or what went wrong)."""
    env = {**os.environ, **env_extra, "NUMBA_ENABLE_CUDASIM": "0", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, __file__, "--inner", step, "--out", str(args.out)]
    if args.model:
        cmd += ["--model", str(args.model)]
    if args.skeleton:
        cmd += ["--skeleton", str(args.skeleton)]
    if args.quick:
        cmd.append("--quick")
    log_path = Path(args.out) / f"gpu_check-{step}.log"
    result: dict = {"error": f"step {step} printed no RESULT"}
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        try:
            for line in _lines_until(proc, started + limit_s):
                sys.stdout.write(line)
                log.write(line)
                log.flush()
                if line.startswith("RESULT "):
                    result = json.loads(line[len("RESULT "):])
        finally:
            try:
                proc.wait(timeout=max(1.0, started + limit_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                result = {**result, "error": f"step {step} stopped at its {limit_s:.0f} s limit"}
    if proc.returncode not in (0, None) and "error" not in result:
        result["error"] = f"step {step} exited {proc.returncode}"
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def _lines_until(proc: subprocess.Popen, deadline: float):
    """The child's output lines until it ends or the deadline passes (a reader thread, so a silent child cannot
    block past the deadline)."""
    import queue
    import threading

    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return
        if line is None:
            return
        yield line


# ---------------------------------------------------------------------------------------------------------------------
# Inner steps: these run in a child interpreter, with the real driver.


def inner_tests(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", "-o", "faulthandler_timeout=90",
           str(ROOT / "tests" / "cuda")]
    started = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    print(result.stdout[-20000:])
    tail = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    return {"returncode": result.returncode, "summary": tail, "seconds": round(time.perf_counter() - started, 1)}


def _timer(cuda, stream, fn, repeats: int) -> float:
    """Seconds per call of fn (queued on stream), by CUDA events, after one warm-up call."""
    fn()
    stream.synchronize()
    start, end = cuda.event(), cuda.event()
    start.record(stream)
    for _ in range(repeats):
        fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1000.0 / repeats


def inner_kernels(quick: bool, tiny: bool = False) -> dict:
    import numpy as np
    from numba import cuda

    from pantheon.kernels.cuda import ops, quant
    from pantheon.kernels.cuda.backend import CudaBackend
    from pantheon.kernels.reference import quant as reference

    be = CudaBackend()
    stream = be.stream
    repeats = 1 if tiny else 20 if quick else 100
    # The ceiling: a device-to-device copy of 256 MiB (read + write bytes per second).
    n = 4096 if tiny else 64 << 20
    src, dst = cuda.device_array(n, np.float32), cuda.device_array(n, np.float32)
    ops.fill(src, 1.0, stream)
    copy_s = _timer(cuda, stream, lambda: dst.copy_to_device(src, stream=stream), repeats)
    copy_bw = 2 * n * 4 / copy_s
    print(f"device-to-device copy: {copy_bw / 1e9:.1f} GB/s")
    rows = []
    rng = np.random.default_rng(0)

    def record(name: str, seconds: float, nbytes: int) -> None:
        bw = nbytes / seconds
        rows.append({"kernel": name, "us": round(seconds * 1e6, 2), "GB/s": round(bw / 1e9, 1),
                     "of_copy": round(bw / copy_bw, 3)})
        print(f"{name:40s} {seconds * 1e6:10.1f} us {bw / 1e9:8.1f} GB/s {bw / copy_bw:6.1%} of copy")

    n_rows, k_dim = (8, 256) if tiny else (2048, 2048) if quick else (4096, 4096)
    for qtype in sorted(quant.SUPPORTED_TYPES):
        raw = reference.random_weight_bytes(qtype, n_rows, k_dim, rng)
        w = quant.upload_weight(raw, qtype, n_rows, k_dim, be._placeholder, stream)
        for batch in (1, 8):
            x = be.upload(rng.standard_normal((batch, k_dim)).astype(np.float32))
            out = be.empty((batch, n_rows))
            seconds = _timer(cuda, stream, lambda: quant.matmul(w, x, out, stream), repeats)
            record(f"matmul {quant.type_name(qtype)} {n_rows}x{k_dim} B={batch}", seconds,
                   w.nbytes + x.nbytes + out.nbytes)
    d, t = (64, 2) if tiny else (4096, 64)
    x = be.upload(rng.standard_normal((t, d)).astype(np.float32))
    weight = be.upload(np.ones(d, np.float32))
    out = be.empty((t, d))
    record(f"rmsnorm {t}x{d}", _timer(cuda, stream, lambda: ops.rmsnorm(x, weight, 1e-5, out, stream), repeats),
           3 * t * d * 4)
    gate, up = be.upload(rng.standard_normal((t, 4 * d)).astype(np.float32)), be.empty((t, 4 * d))
    ops.fill(up, 1.0, stream)
    act = be.empty((t, 4 * d))
    record(f"swiglu {t}x{4 * d}", _timer(cuda, stream, lambda: ops.swiglu(gate, up, act, stream), repeats),
           3 * t * 4 * d * 4)
    for batch, ctx in ((1, 16), (2, 16)) if tiny else ((1, 4096), (8, 4096)):
        n_kv, hd, n_q = (2, 8, 4) if tiny else (8, 128, 32)
        pool = be.zeros((batch, ctx, n_kv, hd))
        q = be.upload(rng.standard_normal((batch, n_q, hd)).astype(np.float32))
        positions = be.upload(np.full(batch, ctx - 1, np.int32))
        slots = be.upload(np.arange(batch, dtype=np.int32))
        o = be.empty((batch, n_q, hd))
        seconds = _timer(cuda, stream, lambda: be.attention_decode_batch(q, pool, pool, positions, 0.1, o,
                                                                         slot_ids=slots), repeats)
        record(f"attention decode B={batch} ctx={ctx} {n_q}/{n_kv} heads", seconds, 2 * batch * ctx * n_kv * hd * 4)
    return {"copy_GBps": round(copy_bw / 1e9, 1), "kernels": rows}


def _llama_path(args: argparse.Namespace) -> Path:
    """The llama model to time and serve: --model, else the default model if present, else a twin of it."""
    if args.model:
        return Path(args.model)
    from pantheon.config import read_env

    default = read_env().default_model_path
    if default.exists():
        return default
    twin = WORK / "smollm2-twin.gguf"
    if not twin.exists():
        if not args.skeleton:
            raise SystemExit("no default model here: pass --model PATH or --skeleton (see bench/twin.py)")
        sys.path.insert(0, str(ROOT))
        from bench.twin import build_twin

        build_twin(Path(args.skeleton), twin)
    return twin


def _compare(gpu_model: Any, cpu_model: Any, tokens: Any, decode_steps: int) -> dict:
    """A prefill and a few greedy decode steps on both backends: the largest logit difference against the cpu
    backend's logit scale, and whether the greedy tokens agree."""
    import numpy as np

    from pantheon.models.base import BatchRow

    states = [m.new_state(1, len(tokens) + decode_steps + 1) for m in (gpu_model, cpu_model)]
    worst, agree, pos = 0.0, True, 0
    step = np.asarray(tokens, np.int32)
    for _ in range(decode_steps + 1):
        got, want = (m.forward(s, [BatchRow(0, step, pos)]) for m, s in zip((gpu_model, cpu_model), states))
        got, want = np.asarray(gpu_model.backend.to_host(got)), np.asarray(want)
        if not np.isfinite(got).all():
            return {"finite": False}
        worst = max(worst, float(np.abs(got - want).max()) / float(np.abs(want).max()))
        agree = agree and int(np.argmax(got[-1])) == int(np.argmax(want[-1]))
        pos += len(step)
        step = np.array([int(np.argmax(want[-1]))], np.int32)
    return {"finite": True, "max_diff_over_scale": round(worst, 6), "greedy_agrees": agree}


def _sync(backend: Any) -> None:
    getattr(backend, "synchronize", lambda: None)()


def _speed(model: Any, prompt: Any, steps: int) -> dict:
    """Prefill tok/s of the prompt in one row; decode tok/s at batch 1 and 8 (every slot at the prompt's end)."""
    import numpy as np

    from pantheon.models.base import BatchRow

    backend = model.backend
    n = len(prompt)
    results: dict = {}
    state = model.new_state(8, n + 2 * steps + 8)
    model.forward(state, [BatchRow(0, prompt[:8], 0)])  # warm-up: compiles every kernel
    _sync(backend)
    started = time.perf_counter()
    model.forward(state, [BatchRow(0, prompt, 0)])
    _sync(backend)
    results["prefill_tokens"] = n
    results["prefill_tok_s"] = round(n / (time.perf_counter() - started), 1)
    for slot in range(1, 8):
        model.forward(state, [BatchRow(slot, prompt, 0)])
    pos = [n] * 8  # each slot's next position
    tokens = [int(prompt[-1])] * 8
    for batch in (1, 8):
        rows = lambda: [BatchRow(s, np.array([tokens[s]], np.int32), pos[s]) for s in range(batch)]  # noqa: E731

        def step() -> None:
            logits = np.asarray(backend.to_host(model.forward(state, rows()))).reshape(batch, -1)
            for s in range(batch):
                tokens[s], pos[s] = int(np.argmax(logits[s])), pos[s] + 1

        step()  # warm-up at this batch size
        started = time.perf_counter()
        for _ in range(steps):
            step()
        elapsed = time.perf_counter() - started
        results[f"decode_b{batch}_tok_s"] = round(batch * steps / elapsed, 1)
        results[f"decode_b{batch}_ms_per_step"] = round(1000 * elapsed / steps, 2)
    return results


def inner_measure(args: argparse.Namespace) -> dict:
    """Kernels, then the llama model and the hybrid on CudaBackend; prints a RESULT line after each part, so a
    part that runs out of time keeps the ones before it."""
    import numpy as np

    from pantheon.config import read_env
    from pantheon.io.gguf_file import open_gguf
    from pantheon.kernels.cpu.backend import CpuBackend
    from pantheon.kernels.cuda.backend import CudaBackend
    from pantheon.models.registry import load_model

    report: dict = {}

    def part(name: str, fn) -> None:
        started = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as exc:  # report it and go on to the next part
            import traceback

            traceback.print_exc()
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        report[name]["seconds"] = round(time.perf_counter() - started, 1)
        print(f"{name}: {json.dumps(report[name])}")
        print("RESULT " + json.dumps(report), flush=True)

    part("kernels", lambda: inner_kernels(args.quick))
    env = read_env()
    steps = 16 if args.quick else 64

    def timed_and_checked(path: Path, n_prompt: int, n_steps: int, n_compare: int, n_decode: int) -> dict:
        """A model on CudaBackend: speed, residency, then its logits against the cpu backend's."""
        gpu = load_model(open_gguf(path, env.cache_dir), CudaBackend())
        prompt = np.random.default_rng(n_prompt).integers(100, 1000, n_prompt).astype(np.int32)
        result = {"model": path.name, "bytes": path.stat().st_size, **_speed(gpu, prompt, n_steps),
                  "graphs": gpu.backend.graphs.counters(),
                  "attention": gpu.backend.attention_residency.counters(operator=True)}
        cpu = load_model(open_gguf(path, env.cache_dir), CpuBackend())
        result["vs_cpu"] = _compare(gpu, cpu, np.arange(100, 100 + n_compare, dtype=np.int32), n_decode)
        return result

    def hybrid() -> dict:
        sys.path.insert(0, str(ROOT))
        from bench.hybrid import write_model

        path = WORK / "qwen35moe-35b-a3b-shapes.gguf"
        layers, experts = 4, 256
        if not path.exists():
            write_model(path, layers, experts)
        return {"layers": layers, "experts": experts, **timed_and_checked(path, 256, steps // 2, 16, 2)}

    def graphs_vs_direct() -> dict:
        """The llama twin's decode with each layer replayed from its CUDA graph, then with the same model's
        kernels launched directly (its capture layer swapped for one that cannot capture)."""
        from pantheon.kernels.cuda.graphs import UnsupportedCapture

        gpu = load_model(open_gguf(_llama_path(args), env.cache_dir), CudaBackend())
        prompt = np.random.default_rng(64).integers(100, 1000, 64).astype(np.int32)
        graphed = _speed(gpu, prompt, steps)
        counters = gpu.backend.graphs.counters()
        gpu.backend.graphs.capture = UnsupportedCapture("direct launches, for comparison")
        gpu.backend.graphs.invalidate()
        direct = _speed(gpu, prompt, steps)
        return {"graphs": counters, **{f"{k}_graphs": v for k, v in graphed.items() if k.startswith("decode")},
                **{f"{k}_direct": v for k, v in direct.items() if k.startswith("decode")}}

    part("llama", lambda: timed_and_checked(_llama_path(args), 512, steps, 32, 4))
    part("hybrid", hybrid)
    part("graphs_vs_direct", graphs_vs_direct)
    return report


def inner_serve(args: argparse.Namespace) -> dict:
    import httpx

    sys.path.insert(0, str(ROOT))
    from tests.server_process import ServerProcess

    path = _llama_path(args)
    log = Path(args.out) / "gpu_check-serve-server.log"
    server = ServerProcess(["--model", f"{path}:SmolLM2-135M-Instruct"], log_path=log).start(timeout=150)
    try:
        get = lambda route: httpx.get(server.base_url + route, timeout=30).json()  # noqa: E731
        root = get("/")
        body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 64, "temperature": 0,
                "messages": [{"role": "user", "content": "Name three colours."}]}
        httpx.post(server.base_url + "/v1/chat/completions", timeout=300, json={**body, "max_tokens": 4})
        started = time.perf_counter()
        reply = httpx.post(server.base_url + "/v1/chat/completions", timeout=300, json=body).json()
        elapsed = time.perf_counter() - started
        result = {"root": root, "dies": get("/admin/dies"), "models": get("/admin/models"),
                  "seconds": round(elapsed, 2), "usage": reply.get("usage", {}),
                  "finish_reason": reply.get("choices", [{}])[0].get("finish_reason")}
    finally:
        server.stop()
    print(json.dumps(result, indent=2))
    if not result["root"].get("accelerator"):
        print("NOTE: the server answered on a non-accelerator backend")
    return result


INNER = {"tests": inner_tests, "measure": inner_measure, "serve": inner_serve}


# ---------------------------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheelhouse", type=Path, default=None, help="pip-install these wheels into .gpu-site")
    parser.add_argument("--no-install", action="store_true", help="use the current interpreter as it is")
    parser.add_argument("--model", type=Path, default=None, help="a llama GGUF to time and serve")
    parser.add_argument("--skeleton", type=Path, default=None, help="bench/twin.py skeleton of the default model")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where logs and JSON go")
    parser.add_argument("--skip", default="", help="comma-separated steps to skip: " + ",".join(STEPS))
    parser.add_argument("--budget", type=float, default=sum(STEP_LIMIT_S.values()), help="seconds for all steps")
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer repeats")
    parser.add_argument("--inner", choices=sorted(INNER), help=argparse.SUPPRESS)
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    if args.inner:
        result = INNER[args.inner](args)
        print("RESULT " + json.dumps(result))
        return 0

    deadline = time.monotonic() + args.budget
    gpu = find_gpu()
    if gpu is None:
        print("no GPU found (no NVIDIA driver, no device, or CUDA_VISIBLE_DEVICES is empty): nothing to check")
        return NO_GPU_EXIT
    print(f"GPU: {gpu}")
    env_extra: dict[str, str] = {}
    if not args.no_install:
        wheelhouse = args.wheelhouse or ROOT / "wheelhouse"
        if not wheelhouse.is_dir():
            print(f"no wheelhouse at {wheelhouse}: build one (see this file's docstring) or pass --no-install")
            return 2
        env_extra = install(wheelhouse.resolve())
        sys.path.insert(0, str(SITE))  # so that versions() sees what was installed
    report: dict = {"gpu": gpu, "versions": versions()}
    print(f"versions: {report['versions']}")
    out = Path(args.out) / f"{time.strftime('%Y-%m-%d')}-gpu_check.json"
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    for step in STEPS:
        if step in skip:
            continue
        left = deadline - time.monotonic()
        if left < 20:
            report[step] = {"error": "no time left in --budget"}
            continue
        print(f"\n== {step} ==", flush=True)
        report[step] = run_step(step, args, env_extra, min(STEP_LIMIT_S[step], left))
        out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), **report}, indent=2))
    print(f"\nwrote {out}")
    tests = report.get("tests", {})
    return 1 if tests.get("returncode") not in (None, 0) else 0


if __name__ == "__main__":
    sys.exit(main())
