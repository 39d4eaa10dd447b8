"""Small LLVM IR builders shared by the kernels written as numba intrinsics (int8dot, attend_ir)."""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

_i32 = ir.IntType(32)


def call(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
    """A call of the LLVM intrinsic (or runtime function) `name`, declared on first use."""
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)


def fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """a * b + c on float32 vectors, rounded once: an explicit fma, so that LLVM may not reassociate a chain of
    them (a sum is the same sequence of operations wherever it is computed)."""
    return call(builder, f"llvm.fma.v{a.type.count}f32", a.type, [a, b, c])


def splat(builder: ir.IRBuilder, value: ir.Value, n: int) -> ir.Value:
    """A vector of n copies of the scalar `value`."""
    vec = ir.VectorType(value.type, n)
    first = builder.insert_element(ir.Constant(vec, None), value, ir.Constant(_i32, 0))
    return builder.shuffle_vector(first, ir.Constant(vec, None), ir.Constant(ir.VectorType(_i32, n), [0] * n))


def byte_ptr(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value) -> ir.Value:
    """The address `offset` bytes past the pointer `base`."""
    return builder.gep(builder.bitcast(base, ir.IntType(8).as_pointer()), [offset])
