"""Compile every CUDA kernel of pantheon.kernels.cuda for a real GPU target (PTX, sm_90) without a GPU.

Run as a script in a process *without* the simulator (tests/cuda/test_ptx.py does that). It needs NVVM and
NVRTC (pip: nvidia-nvvm, nvidia-cuda-nvrtc, or numba-cuda[cu13]); without them it prints SKIP and exits 0.
The simulator executes kernels as Python, so only this check catches what the real compiler rejects (typing,
unsupported functions) and float64 arithmetic that slips into float32 kernels. Prints one line per kernel.
"""

from __future__ import annotations

import os
import re
import sys
import types

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"


def main() -> int:
    from numba import cuda
    from numba import types as nt

    try:
        cuda.compile_ptx(lambda a: None, (nt.float32[:],), cc=(9, 0))
    except Exception as exc:  # NVVM / NVRTC not installed
        print(f"SKIP: cannot compile PTX here ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
        return 0
    # Device functions are compiled for "the current device"; there is none, so name one.
    import numba.cuda.dispatcher as dispatcher

    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))

    from pantheon.kernels.cuda import moe, ops, quant, ssm

    def arr(dtype, ndim, layout="C"):
        return nt.Array(dtype, ndim, layout)

    f32, f16, u8, i32, i64, f64 = nt.float32, nt.float16, nt.uint8, nt.int32, nt.int64, nt.float64
    weights = (i64, arr(u8, 2), arr(f16, 2), arr(f32, 2))
    signatures = {
        quant.KERNELS["matmul"]: weights + (arr(f32, 2), arr(f32, 2)),
        quant.KERNELS["embed"]: weights + (arr(i64, 1), arr(f32, 2)),
        ops.KERNELS["rmsnorm"]: (arr(f32, 2), arr(f32, 1), f64, arr(f32, 2)),
        ops.KERNELS["add_rmsnorm"]: (arr(f32, 2), arr(f32, 2), arr(f32, 1), f64, arr(f32, 2)),
        ops.KERNELS["rope"]: (arr(f32, 3), arr(i32, 1), i64, f64, i64, f64),
        ops.KERNELS["swiglu"]: (arr(f32, 1), arr(f32, 1), arr(f32, 1)),
        ops.KERNELS["kv_write"]: (arr(f32, 4), arr(i32, 1), arr(i32, 1), arr(f32, 3)),
        ops.KERNELS["gather_rows"]: (arr(f32, 2), arr(i64, 1), arr(f32, 2)),
        ops.KERNELS["copy_cols"]: (arr(f32, 2), i64, arr(f32, 2)),
        ops.KERNELS["fill"]: (arr(f32, 1), i64),
        ops.KERNELS["attention_prefill"]: (arr(f32, 3), arr(f32, 3), arr(f32, 3), i64, f64, arr(f32, 3)),
        ops.KERNELS["attention_decode"]: (arr(f32, 3), arr(f32, 4), arr(f32, 4), arr(i32, 1), arr(i32, 1), i64, i64,
                                          f64, i64, arr(f32, 3), arr(f32, 3), arr(f32, 4), arr(f32, 3)),
        ops.KERNELS["attention_combine"]: (arr(f32, 3), arr(f32, 3), arr(f32, 4), arr(f32, 3)),
    }
    strided = "A"  # q, k, v of the delta rule are head slices of the conv output
    signatures.update({
        quant.KERNELS["expert_matmul"]: weights + (i64, i64, i64, arr(f32, 2), arr(i64, 1), arr(i64, 1), arr(i64, 1),
                                                   arr(f32, 2)),
        ssm.KERNELS["causal_conv"]: (arr(f32, 3), arr(f32, 3), arr(f32, 2), arr(i32, 1), arr(f32, 3)),
        ssm.KERNELS["gdn_gates"]: (arr(f32, 2), arr(f32, 2), arr(f32, 1), arr(f32, 1), arr(f32, 2), arr(f32, 2)),
        ssm.KERNELS["gated_rmsnorm"]: (arr(f32, 2), arr(f32, 2), arr(f32, 1), f64, arr(f32, 2)),
        ssm.KERNELS["sigmoid_mul"]: (arr(f32, 2), arr(f32, 2), arr(f32, 2)),
        ssm.KERNELS["delta_rule"]: (arr(f32, 4, strided), arr(f32, 4, strided), arr(f32, 4, strided), arr(f32, 3),
                                    arr(f32, 3), arr(f32, 4), arr(i32, 1), arr(i32, 1), f64, f64, arr(f32, 4)),
        moe.KERNELS["moe_route"]: (arr(f32, 2), i64, arr(i32, 2), arr(f32, 2)),
        moe.KERNELS["combine"]: (arr(f32, 2), arr(i64, 2), arr(f32, 2), arr(f32, 2)),
    })
    # Kernels allowed to use float64: rope's angles (on purpose, as on the cpu), the gates' softplus.
    fp64_ok = {"_rope_kernel", "_gdn_gates_kernel", "_moe_route_kernel"}
    failures = 0
    for kernel, sig in signatures.items():
        name = kernel.py_func.__name__
        try:
            ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
        except Exception as exc:
            print(f"FAIL {name}: {type(exc).__name__}: {exc}")
            failures += 1
            continue
        fp64 = len(re.findall(r"^\s*(?:add|sub|mul|fma|div|rcp|sqrt)\.\S*f64", ptx, re.M))
        if fp64 and name not in fp64_ok:
            print(f"FAIL {name}: {fp64} float64 arithmetic instructions")
            failures += 1
        else:
            print(f"ok {name} ({len(ptx)} bytes of PTX, {fp64} f64 ops)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
