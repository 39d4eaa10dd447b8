"""The int8 kernels' gemm as a C function compiled on its own, which the compiled matmuls call by its address.

numba links a compiled function's callees into it and optimizes and emits the whole again, at every level: the
decode step (`decode_layers._team_step` -> its parallel region -> `_team_member` -> `_layer_matmuls` ->
`_gemm_claimed`) carried every row-dot kernel of every weight type it took, compiled five times over, and the
prefill's matmul (`int8k._matmul` -> its parallel gemm) twice more. A cold decode step of a Q4_K_M file compiled
for ~111 s on the 2-core Zen 4 VM, the default model's (int8dot's kernels alone) for ~64 s (a numba event
recorder around a cold load's first decode step, 2026-12-05). Each kernel module now compiles its gemm once,
as a `cfunc` cached on disk like every kernel (`int8dot.gemm_address`: its types; `int8k.gemm_address`: every
int8 type), and the compiled matmuls hold its address: one compiled decode step and one parallel gemm
(`int8dot.gemm_chunks`) for every model, their cost no longer growing with the kernels'. A call costs nothing
measurable beside its work (a chunk of weight groups, a microsecond or more).

`_GEMM` is the C signature, `compile_gemm` makes the C function of a module's Python one, and `call_gemm` is the
call: an intrinsic passing the arrays' data pointers and shapes, which the function rebuilds (`as_arrays`)
to run the same compiled kernels as before: the same bits.

(The embedding's dequantization went the same way in a trial, and gained nothing: its cfunc compiled
`quant._deq_row` for as long as the decode step saved.)
"""

from __future__ import annotations

from typing import Any

import numba
from llvmlite import ir
from numba import types
from numba.core import errors
from numba.extending import intrinsic

_U8P, _I8P, _F32P = types.CPointer(types.uint8), types.CPointer(types.int8), types.CPointer(types.float32)
_I64 = types.int64
# (qtype, packed, groups, group bytes, xq, rows, width, xd, xd cols, xs, xs cols, out, out rows, out cols,
# g_lo, g_hi, col0): every array C-contiguous, xq (rows, width) and the others (rows, their cols).
_GEMM = types.void(_I64, _U8P, _I64, _I64, _I8P, _I64, _I64, _F32P, _I64, _F32P, _I64, _F32P, _I64, _I64, _I64, _I64,
                   _I64)


@numba.njit(inline="always", cache=True, nogil=True, error_model="numpy")
def as_arrays(packed, n_groups, group_bytes, xq, n_rows, width, xd, xd_cols, xs, xs_cols, out, out_rows,
              out_cols):  # type: ignore[no-untyped-def]
    """(packed, xq, xd, xs, out) as arrays again, in a C function of the signature `_GEMM`: the pointers and shapes
    `call_gemm` passed, in its order (the rest of the signature, qtype first and g_lo, g_hi, col0 last, are
    plain numbers)."""
    return (numba.carray(packed, (n_groups, group_bytes)), numba.carray(xq, (n_rows, width)),
            numba.carray(xd, (n_rows, xd_cols)), numba.carray(xs, (n_rows, xs_cols)),
            numba.carray(out, (out_rows, out_cols)))


def compile_gemm(function: Any) -> int:
    """The address of `function`, a Python function of the signature `_GEMM` (a kernel module's gemm over raw
    pointers: `int8dot.gemm_address`, `int8k.gemm_address`), compiled as a C function and cached on disk."""
    return numba.cfunc(_GEMM, cache=True, error_model="numpy")(function).address


@intrinsic
def call_gemm(typingctx, address, qtype, packed, xq, xd, xs, out, g_lo, g_hi, col0):  # type: ignore[no-untyped-def]
    """The function at `address` (`compile_gemm`) on weight groups g_lo .. g_hi - 1 of packed against every row
    of the quantized input (xq, xd, xs), their outputs from column col0 of out. xs: the halves' sums where the
    kernel type reads those (`int8k._activations`). Every array 2-d and C-contiguous: the call passes each one's
    data pointer and shape in the C signature `_GEMM`, and the function rebuilds it (`numba.carray`)."""
    arrays = {"packed": (packed, types.uint8), "xq": (xq, types.int8), "xd": (xd, types.float32),
              "xs": (xs, types.float32), "out": (out, types.float32)}
    for name, (ty, dtype) in arrays.items():
        if not (isinstance(ty, types.Array) and ty.ndim == 2 and ty.layout == "C" and ty.dtype == dtype):
            raise errors.TypingError(f"call_gemm: {name} must be a 2-d C-contiguous {dtype} array, not {ty}")
    sig = types.void(_I64, _I64, packed, xq, xd, xs, out, _I64, _I64, _I64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        w, a, ad, s, o = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args[2:7], args[2:7]))

        def data(view, ty):  # type: ignore[no-untyped-def]
            return builder.bitcast(view.data, context.get_value_type(ty))

        def dim(view, i):  # type: ignore[no-untyped-def]
            return builder.extract_value(view.shape, i)

        values = [args[1], data(w, _U8P), dim(w, 0), dim(w, 1), data(a, _I8P), dim(a, 0), dim(a, 1), data(ad, _F32P),
                  dim(ad, 1), data(s, _F32P), dim(s, 1), data(o, _F32P), dim(o, 0), dim(o, 1), *args[7:]]
        fnty = ir.FunctionType(ir.VoidType(), [context.get_value_type(t) for t in _GEMM.args])
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), values)
        return context.get_dummy_value()

    return sig, codegen
