"""Small LLVM IR builders shared by the kernels written as numba intrinsics (int8dot, attend_ir) and the benches
that time their instructions (bench/int8_ceiling.py)."""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba.core import cgutils

_i32, _i64 = ir.IntType(32), ir.IntType(64)


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


def counted_loop(builder: ir.IRBuilder, count: ir.Value, carried: list[ir.Value], body: Any,
                 may_be_empty: bool = False) -> list[ir.Value]:
    """for i in range(count): carried = body(i, carried); returns the final carried values. count >= 1 unless
    may_be_empty (then a count of 0 returns the starting values)."""
    entry = builder.basic_block
    loop = builder.append_basic_block("loop")
    done = builder.append_basic_block("loop.done")
    if may_be_empty:
        builder.cbranch(builder.icmp_signed(">", count, ir.Constant(_i64, 0)), loop, done)
    else:
        builder.branch(loop)
    builder.position_at_end(loop)
    i = builder.phi(_i64)
    phis = [builder.phi(value.type) for value in carried]
    updated = body(i, phis)
    i_next = builder.add(i, ir.Constant(_i64, 1))
    end = builder.basic_block
    builder.cbranch(builder.icmp_signed("<", i_next, count), loop, done)
    i.add_incoming(ir.Constant(_i64, 0), entry)
    i.add_incoming(i_next, end)
    for phi, start, value in zip(phis, carried, updated):
        phi.add_incoming(start, entry)
        phi.add_incoming(value, end)
    builder.position_at_end(done)
    if not may_be_empty:
        return updated
    results = []
    for start, value in zip(carried, updated):
        result = builder.phi(value.type)
        result.add_incoming(start, entry)
        result.add_incoming(value, end)
        results.append(result)
    return results
