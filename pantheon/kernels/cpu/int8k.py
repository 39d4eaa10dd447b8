"""Integer dot products of K-quant, 5-bit and IQ4 weight rows (Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, IQ4_NL, IQ4_XS)
with int8-quantized activations (x86 only).

The types of llama.cpp's Q4_K_M and Q5_K_M files: Q4_K / Q5_K for most matrices, Q6_K for the output matrix,
attn_v and half of ffn_down (llama.cpp's quantizer also writes the output matrix of its Q4_0 and Q4_1 files as
Q6_K), and Q5_0 / Q5_1 where a matrix's rows are not a multiple of 256 values (SmolLM2's 576: most of its
Q4_K_M file is Q5_0). Same scheme as `int8dot` (read its docstring first): activations quantized once per
matmul to blocks of 32 int8 values, weight rows packed at load in groups of 8 side by side, one 32-bit lane
per row, and each row's exact integer sum per 32-value block scaled once in float32. The packing and the
scales differ:

    Q4_K  superblocks of 256 values: f16 d and dmin, 6-bit scale sc_j and min m_j per 32-value sub-block j,
          4-bit q. Sub-block j is a Q4_1 block with d_w = d * sc_j and m_w = -dmin * m_j (both exact in
          float32): Q4_1's arithmetic, the two scales made from bytes at each block.
    Q5_K  Q4_K with a fifth bit per value (q < 32).
    Q5_1  blocks of 32: f16 d and m, 5-bit q, value d * q + m; Q5_0 (d * (q - 16)) is packed as the Q5_1
          weight it equals, m = -16 d (exact in f16).
    Q6_K  superblocks of 256: f16 d, a signed 8-bit scale per 16 values, 6-bit q (value d * sc * (q - 32)).
          w = q - 32 is signed (-32..31): on AVX2 its magnitude meets the activations with w's sign moved onto
          them (`vpsignb`), as int8dot's Q8_0 does; with VNNI q meets them unsigned and 32 times the
          activations' sum is taken off (`_unsigned_weights`). The two 16-value halves of a block sum apart and
          are scaled by their own d * sc.
    Q3_K  superblocks of 256: f16 d, a 6-bit scale per 16 values (less 32), values -4..3: packed as the Q6_K
          weight it equals.
    IQ4_XS superblocks of 256: f16 d, a 6-bit scale ls per 32 values (d * (ls - 32)), 4-bit indices into a fixed
          table of int8 values (`int8dot.IQ4_VALUES`), looked up by `vpshufb`; then as Q6_K, one scale a block
          (with VNNI the table's values + 128 meet the activations unsigned, 128 times their sum taken off).
    IQ4_NL blocks of 32: f16 d and the same indices.

The packed layouts (`pack_weight`) keep the types' sizes within ~3%: 6-bit scales become bytes, and the values
keep their bits, as a nibble vector (int8dot's Q4_1 layout) plus bit planes that the kernel joins to it. These
kernels have their own compiled functions, apart from int8dot's, so that the decode step compiled for Q4_0 /
Q4_1 / Q8_0 models does not carry them; a model with these matrices runs them matmul by matmul. 8 lanes (256-bit
vectors), and with AVX-512 VNNI 16 (two groups of 8 rows a call on 512-bit vectors, as int8dot's `INT8_WIDE`
kernels; AVX-512 has no `vpsignb`, so there a signed weight's sign moves onto the activations by a compare and a
masked negation).
"""

from __future__ import annotations

import functools
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from pantheon.kernels.cpu import gemm_call, int8dot
from pantheon.kernels.cpu.int8dot import LANES, QK
from pantheon.kernels.cpu.llvm_ir import call, fma, splat

__all__ = ["TYPES", "matmul", "pack_weight"]

Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = 6, 7, 11, 12, 13, 14, 20, 23
TYPES: frozenset[int] = frozenset({Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS})
SUPER = 256  # values per superblock
# Bytes of one packed block (Q5_1: of 32 values; the K types: of a 256-value superblock) of 8 rows (see
# `pack_weight`), and of one row's block in the file.
Q5_1_GROUP, Q4_K_GROUP, Q5_K_GROUP, Q6_K_GROUP, IQ4_NL_GROUP, IQ4_XS_GROUP = 192, 1184, 1440, 1680, 144, 1104
GROUP = {Q5_1: Q5_1_GROUP, Q4_K: Q4_K_GROUP, Q5_K: Q5_K_GROUP, Q6_K: Q6_K_GROUP, IQ4_NL: IQ4_NL_GROUP,
         IQ4_XS: IQ4_XS_GROUP}
FILE_BYTES = {Q5_0: 22, Q5_1: 24, Q3_K: 110, Q4_K: 144, Q5_K: 176, Q6_K: 210, IQ4_NL: 18, IQ4_XS: 136}
_BLOCK_TYPES = (Q5_1, IQ4_NL)  # packed block by block of 32 values; the others by superblocks of 256
# Offsets inside a packed Q4_K / Q5_K superblock (after 8 f16 d and 8 f16 dmin): 8 sub-blocks x 8 scale bytes,
# 8 x 8 min bytes, then the sub-blocks' values (Q4_K 128 nibble bytes each, Q5_K those and a 32-byte bit plane).
_K_SC, _K_M, _K_VALUES = 32, 96, 160
# In a packed Q6_K superblock (after 8 f16 d): 16 halves x 8 int8 scales, then 192 value bytes a sub-block.
_Q6K_SC, _Q6K_VALUES = 16, 144
# In a packed IQ4_XS superblock (after 8 f16 d): 8 sub-blocks x 8 int8 scales (ls - 32), then 128 index bytes a
# sub-block (nibbles, laid out as a Q4_1 block's).
_IQ_SC, _IQ_VALUES = 16, 80
# Bytes of one sub-block's values (the K types) or of a block's (Q5_1: after 8 f16 d and 8 f16 m).
_SUB_BYTES = {Q4_K: 128, Q5_K: 160, Q6_K: 192}
_Q5_VALUES = 32

_i1, _i8, _i32, _i64 = ir.IntType(1), ir.IntType(8), ir.IntType(32), ir.IntType(64)
_f16, _f32 = ir.HalfType(), ir.FloatType()
_v8i8, _v32i8 = ir.VectorType(_i8, 8), ir.VectorType(_i8, 32)
_v16i16, _v8i32 = ir.VectorType(ir.IntType(16), 16), ir.VectorType(_i32, 8)
_v8f16 = ir.VectorType(_f16, 8)


class _Group:
    """The packed weight group a rows-dot reads, on `lanes` lanes: 8 (one group, 256-bit vectors) or 16 (groups g
    and g + 1 side by side on 512-bit vectors, AVX-512 VNNI only). Every load names the bytes of one group, as an
    8-lane type; with 16 lanes it brings the same bytes of the next group too (`int8dot._group_loader`)."""

    def __init__(self, builder: ir.IRBuilder, wptr: ir.Value, row_bytes: ir.Value, lanes: int) -> None:
        self.builder, self.lanes = builder, lanes
        self.bytes_type = ir.VectorType(_i8, 4 * lanes)
        self.f32s = ir.VectorType(_f32, lanes)
        self._load = int8dot._group_loader(builder, wptr, row_bytes, lanes)

    def at(self, base: ir.Value, offset: int | ir.Value, ty: ir.Type) -> ir.Value:
        if isinstance(offset, int):
            offset = ir.Constant(_i64, offset)
        return self._load(self.builder.add(base, offset), ty)

    def f16s(self, base: ir.Value, offset: int | ir.Value) -> ir.Value:
        """One f16 a lane (8 at base + offset) as float32."""
        return self.builder.fpext(self.at(base, offset, _v8f16), self.f32s)

    def lane_bytes(self, base: ir.Value, offset: ir.Value, signed: bool) -> ir.Value:
        """One byte a lane (8 at base + offset) as float32."""
        raw = self.at(base, offset, _v8i8)
        wide = ir.VectorType(_i32, self.lanes)
        if signed:
            return self.builder.sitofp(self.builder.sext(raw, wide), self.f32s)
        return self.builder.uitofp(self.builder.zext(raw, wide), self.f32s)

    def splat_bytes(self, value: int) -> ir.Constant:
        return ir.Constant(self.bytes_type, [value] * self.bytes_type.count)

    def magnitude(self, w: ir.Value) -> ir.Value:
        return call(self.builder, f"llvm.abs.v{w.type.count}i8", w.type, [w, ir.Constant(_i1, 0)])

    def with_sign_of(self, x: ir.Value, w: ir.Value) -> ir.Value:
        """x with w's sign moved onto it (x where w > 0, -x where w < 0; where w is 0 its magnitude is 0, so what
        stands there meets a zero). AVX2's `vpsignb` has no 512-bit form: there a compare and a masked negation."""
        if self.lanes == LANES:
            return call(self.builder, "llvm.x86.avx2.psign.b", _v32i8, [x, w])
        b = self.builder
        return b.select(b.icmp_signed("<", w, ir.Constant(w.type, None)), b.sub(ir.Constant(x.type, None), x), x)

    def table_lookup(self, table: np.ndarray, index: ir.Value) -> ir.Value:
        """table[index] per byte (index 0..15; `vpshufb`, the 16-entry table held in every 128-bit lane)."""
        name = "llvm.x86.avx2.pshuf.b" if self.lanes == LANES else "llvm.x86.avx512.pshuf.b.512"
        entries = ir.Constant(self.bytes_type, [int(v) for v in table] * (self.bytes_type.count // 16))
        return call(self.builder, name, self.bytes_type, [entries, index])


def _superblock(builder: ir.IRBuilder, j: ir.Value, group: int) -> tuple[ir.Value, ir.Value]:
    """(byte offset of block j's superblock in a packed group row, j's sub-block 0..7 in it)."""
    base = builder.mul(builder.lshr(j, ir.Constant(_i64, 3)), ir.Constant(_i64, group))
    return base, builder.and_(j, ir.Constant(_i64, 7))


def _prefetch_next_group(builder: ir.IRBuilder, wptr: ir.Value, row_bytes: ir.Value, j: ir.Value, qtype: int,
                         lanes: int) -> None:
    """Block j's share of the next packed group (a superblock's bytes over its 8 blocks; with 16 lanes, of the next
    two), into the caches int8dot's kernels of as many lanes prefetch into (`int8dot.prefetch_line`)."""
    share = GROUP[qtype] if qtype in _BLOCK_TYPES else GROUP[qtype] // 8
    groups = lanes // LANES
    for step in range(groups, 2 * groups):
        start = builder.add(builder.mul(row_bytes, ir.Constant(_i64, step)), builder.mul(j, ir.Constant(_i64, share)))
        for line in range(0, share, 64):
            int8dot.prefetch_line(builder, builder.gep(wptr, [builder.add(start, ir.Constant(_i64, line))]), lanes)


def _pieces(builder: ir.IRBuilder, xptr: ir.Value, lanes: int) -> list[ir.Value]:
    """The activation block at xptr as 8 vectors, piece u (values 4u..4u+3) broadcast to every lane."""
    return [builder.bitcast(splat(builder, int8dot._load(builder, xptr, ir.Constant(_i64, 4 * u), _i32), lanes),
                            ir.VectorType(_i8, 4 * lanes))
            for u in range(8)]


def _joined_bits(grp: _Group, low: list[ir.Value], plane: ir.Value) -> list[ir.Value]:
    """The 8 value vectors of a 5-bit block: low[u] | (bit u of the plane's bytes) << 4."""
    b, c = grp.builder, grp.splat_bytes
    return [b.or_(v, b.shl(b.and_(b.lshr(plane, c(u)), c(1)), c(4))) for u, v in enumerate(low)]


def _nibble_values(grp: _Group, base: ir.Value, at: ir.Value, five: bool) -> list[ir.Value]:
    """The 8 value vectors (values 4u..4u+3 of each row in vector u) of a block whose 4 nibble vectors start at
    base + at, followed by its bit plane when five."""
    b = grp.builder
    packed = [grp.at(base, b.add(at, ir.Constant(_i64, 32 * t)), _v32i8) for t in range(4)]
    values = [b.and_(v, grp.splat_bytes(15)) for v in packed] + [b.lshr(v, grp.splat_bytes(4)) for v in packed]
    if five:
        values = _joined_bits(grp, values, grp.at(base, b.add(at, ir.Constant(_i64, 128)), _v32i8))
    return values


def _nibble_weights(grp: _Group, j: ir.Value, qtype: int) -> tuple[list[ir.Value], ir.Value]:
    """Block j of a packed Q4_K, Q5_K or Q5_1 group: its 8 value vectors and d_w per lane (d * sc_j; Q5_1: d)."""
    b = grp.builder
    if qtype == Q5_1:
        base = b.mul(j, ir.Constant(_i64, GROUP[Q5_1]))
        return _nibble_values(grp, base, ir.Constant(_i64, _Q5_VALUES), True), grp.f16s(base, 0)
    base, sub = _superblock(b, j, GROUP[qtype])
    sc = grp.lane_bytes(base, b.add(b.mul(sub, ir.Constant(_i64, 8)), ir.Constant(_i64, _K_SC)), signed=False)
    at = b.add(b.mul(sub, ir.Constant(_i64, _SUB_BYTES[qtype])), ir.Constant(_i64, _K_VALUES))
    return _nibble_values(grp, base, at, qtype == Q5_K), b.fmul(grp.f16s(base, 0), sc)


def _m_scales(grp: _Group, j: ir.Value, qtype: int) -> ir.Value:
    """m_w per lane for block j of a packed Q4_K / Q5_K group (-dmin * m_j) or Q5_1 one (m)."""
    b = grp.builder
    if qtype == Q5_1:
        return grp.f16s(b.mul(j, ir.Constant(_i64, GROUP[Q5_1])), 16)
    base, sub = _superblock(b, j, GROUP[qtype])
    mins = grp.lane_bytes(base, b.add(b.mul(sub, ir.Constant(_i64, 8)), ir.Constant(_i64, _K_M)), signed=False)
    return b.fneg(b.fmul(grp.f16s(base, 16), mins))


def _q6_k_weights(grp: _Group, j: ir.Value, unsigned: bool
                  ) -> tuple[list[ir.Value], list[ir.Value], ir.Value, ir.Value]:
    """Block j of a packed Q6_K group: the 8 vectors of w = q - 32 (values 4u..4u+3 of each row in vector u) and
    their magnitudes, or (unsigned) the 8 vectors of q and no magnitudes; and d * sc of the block's two halves
    (values 0..15, 16..31) per lane."""
    b, c = grp.builder, grp.splat_bytes
    base, sub = _superblock(b, j, GROUP[Q6_K])
    d = grp.f16s(base, 0)
    scales = b.add(b.mul(sub, ir.Constant(_i64, 16)), ir.Constant(_i64, _Q6K_SC))
    sc_a = grp.lane_bytes(base, scales, signed=True)
    sc_b = grp.lane_bytes(base, b.add(scales, ir.Constant(_i64, 8)), signed=True)
    values = b.add(b.mul(sub, ir.Constant(_i64, 192)), ir.Constant(_i64, _Q6K_VALUES))
    nibbles = [grp.at(base, b.add(values, ir.Constant(_i64, 32 * t)), _v32i8) for t in range(4)]
    planes = [grp.at(base, b.add(values, ir.Constant(_i64, 128 + 32 * h)), _v32i8) for h in range(2)]
    qs = []
    for u in range(8):
        low = b.and_(nibbles[u], c(15)) if u < 4 else b.lshr(nibbles[u - 4], c(4))
        high = b.and_(b.lshr(planes[u // 4], c(2 * (u % 4))), c(3))
        qs.append(b.or_(low, b.shl(high, c(4))))
    if unsigned:
        return qs, [], b.fmul(d, sc_a), b.fmul(d, sc_b)
    signed = [b.sub(q, c(32)) for q in qs]
    return signed, [grp.magnitude(w) for w in signed], b.fmul(d, sc_a), b.fmul(d, sc_b)


def _iq4_weights(grp: _Group, j: ir.Value, qtype: int, unsigned: bool
                 ) -> tuple[list[ir.Value], list[ir.Value], ir.Value]:
    """Block j of a packed IQ4_NL or IQ4_XS group: the 8 vectors of table values (signed, -127..113; `vpshufb`
    looks the nibbles up in the table) and their magnitudes, or (unsigned) of the values + 128 (1..241) and no
    magnitudes; and the block's scale per lane (IQ4_NL: d; IQ4_XS: d * (ls - 32))."""
    b = grp.builder
    if qtype == IQ4_NL:
        base = b.mul(j, ir.Constant(_i64, IQ4_NL_GROUP))
        d_w = grp.f16s(base, 0)
        at = ir.Constant(_i64, 16)
    else:
        base, sub = _superblock(b, j, IQ4_XS_GROUP)
        sc = grp.lane_bytes(base, b.add(b.mul(sub, ir.Constant(_i64, 8)), ir.Constant(_i64, _IQ_SC)), signed=True)
        d_w = b.fmul(grp.f16s(base, 0), sc)
        at = b.add(b.mul(sub, ir.Constant(_i64, 128)), ir.Constant(_i64, _IQ_VALUES))
    indices = _nibble_values(grp, base, at, False)
    if unsigned:
        return [grp.table_lookup(_IQ4_SHIFTED, index) for index in indices], [], d_w
    signed = [grp.table_lookup(int8dot.IQ4_VALUES, index) for index in indices]
    return signed, [grp.magnitude(w) for w in signed], d_w


# IQ4's table values + 128 (1..241), as the int8 bytes that hold them.
_IQ4_SHIFTED = (int8dot.IQ4_VALUES.astype(np.int16) + 128).astype(np.uint8).view(np.int8)


def _half_sum(builder: ir.IRBuilder, isa: str, pairs: list[tuple[ir.Value, ir.Value]]) -> ir.Value:
    """<lanes x i32>: four (unsigned weights, signed activations) pairs summed per lane. On AVX2 the four
    `vpmaddubsw` results add in 16 bits first: with weights <= 32 (Q6_K's magnitudes; 5-bit values are < 32) and
    |x| <= 127, each is at most 2 * 32 * 127 = 8128 and four at most 32512."""
    if isa == "vnni":
        total = None
        for u, s in pairs:
            total = int8dot._unsigned_signed_dot(builder, isa, u, s, total)
        return total
    chain = None
    for u, s in pairs:
        piece = call(builder, "llvm.x86.avx2.pmadd.ub.sw", _v16i16, [u, s])
        chain = piece if chain is None else builder.add(chain, piece)
    return call(builder, "llvm.x86.avx2.pmadd.wd", _v8i32, [chain, ir.Constant(_v16i16, [1] * 16)])


def _block_sums(builder: ir.IRBuilder, isa: str, qtype: int, pairs: list[tuple[ir.Value, ir.Value]]) -> ir.Value:
    """<lanes x i32>: a block's eight (unsigned values, activations) pairs summed per lane. 4-bit values on AVX2 all
    add in 16 bits (int8dot's Q4_1 sums); 5-bit ones in two halves of four (`_half_sum`)."""
    if isa == "avx2" and qtype == Q4_K:
        return int8dot._q4_block_sums_avx2(builder, pairs)
    if isa == "avx2":
        return builder.add(_half_sum(builder, isa, pairs[:4]), _half_sum(builder, isa, pairs[4:]))
    return _half_sum(builder, isa, pairs)


def _unsigned_weights(isa: str) -> bool:
    """With VNNI, the signed weights meet the activations as unsigned values: Q6_K's q (0..63) as it is, 32 times
    each half's sum of the activations taken off, and IQ4's table values + 128, 128 times the block's sum taken
    off (the sums from `_activations`). No magnitudes, and no moving of signs onto every activation row (`vpsignb`,
    which AVX-512 lacks: a compare and a masked negation there). On AVX2 `vpmaddubsw` could overflow its 16-bit
    sums with those values, so there the signed form stays."""
    return isa == "vnni"


# The types a kernel's arms are compiled for, tested in this order (the last one is the fall-through).
_KERNEL_TYPES = (Q4_K, Q5_K, Q5_1, Q6_K, IQ4_XS, IQ4_NL)
_IQ4 = (IQ4_NL, IQ4_XS)


def _make_rows_dot(n_x: int, isa: str, lanes: int = LANES) -> Any:
    """An intrinsic (qtype, packed, g, xq, xd, xs, b, out, n0), as int8dot's `_make_rows_dot` but for the packed
    groups of `pack_weight` (qtype: `kernel_qtype` of a type of `TYPES`): out[b + r, n0 : n0 + lanes] for r < n_x
    (16 lanes: groups g and g + 1 at once, AVX-512 VNNI only; the caller sees that group g + 1 exists). Float
    operations per output in the same order for every n_x and both widths (batch invariance, the same bits on
    both): blocks in order into one accumulator (Q6_K: half a, then half b), the m terms (Q4_K, Q5_K, Q5_1) into
    a second, added at the end."""

    def rows_dot(typingctx, qtype, packed, g, xq, xd, xs, b, out, n0):
        return types.void(qtype, packed, g, xq, xd, xs, b, out, n0), codegen

    def codegen(context, builder, signature, args):
        def arms(kinds: tuple[int, ...]) -> None:
            if len(kinds) == 1:
                emit(context, builder, signature.args[1:], args[1:], kinds[0])
                return
            this = builder.icmp_signed("==", args[0], ir.Constant(args[0].type, kinds[0]))
            with builder.if_else(this) as (this_arm, other_arms):
                with this_arm:
                    emit(context, builder, signature.args[1:], args[1:], kinds[0])
                with other_arms:
                    arms(kinds[1:])

        arms(_KERNEL_TYPES)
        return context.get_dummy_value()

    def emit(context, builder, arg_types, args, qtype):  # type: ignore[no-untyped-def]
        op = int8dot.RowsDotOperands.of(context, builder, arg_types, args, n_x)
        wptr, row_bytes, n_blocks, xrows, firsts, d, s = (op.wptr, op.row_bytes, op.n_blocks, op.xrows, op.firsts,
                                                           op.xd, op.xs)
        grp = _Group(builder, wptr, row_bytes, lanes)

        def x_scale(r: int, j: ir.Value, scales: Any) -> ir.Value:
            return splat(builder, builder.load(builder.gep(scales.data, [builder.add(firsts[r], j)])), lanes)

        def half_x_sum(r: int, j: ir.Value, h: int) -> ir.Value:
            """i32: the sum of half h of activation row r's block j (`int8dot.XS_HALVES`: in xs, unsigned path)."""
            index = builder.add(builder.mul(builder.add(firsts[r], j), ir.Constant(_i64, 2)), ir.Constant(_i64, h))
            return builder.fptosi(builder.load(builder.gep(s.data, [index])), _i32)

        def scaled(sums: ir.Value, d_w: ir.Value, d_x: ir.Value, acc: ir.Value) -> ir.Value:
            return fma(builder, builder.sitofp(sums, grp.f32s), builder.fmul(d_w, d_x), acc)

        def dots(j: ir.Value, accs: list[ir.Value]) -> list[ir.Value]:
            _prefetch_next_group(builder, wptr, row_bytes, j, qtype, lanes)
            new = []
            if qtype == Q6_K:
                weights, magnitudes, d_a, d_b = _q6_k_weights(grp, j, _unsigned_weights(isa))
            elif qtype in _IQ4:
                weights, magnitudes, d_w = _iq4_weights(grp, j, qtype, _unsigned_weights(isa))
            else:
                values, d_w = _nibble_weights(grp, j, qtype)
            for r in range(n_x):
                pieces = _pieces(builder, builder.gep(xrows[r], [builder.mul(j, ir.Constant(_i64, QK))]), lanes)
                d_x = x_scale(r, j, d)
                if qtype in _IQ4 and _unsigned_weights(isa):
                    # sum(w x) = sum((w + 128) x) - 128 sum(x): exact integers, the same sums as the signed form.
                    sums = None
                    for u in range(8):
                        sums = int8dot._unsigned_signed_dot(builder, isa, weights[u], pieces[u], sums)
                    x_sum = builder.add(half_x_sum(r, j, 0), half_x_sum(r, j, 1))
                    new.append(scaled(builder.sub(sums, splat(builder, builder.shl(x_sum, ir.Constant(_i32, 7)),
                                                               lanes)), d_w, d_x, accs[r]))
                elif qtype in _IQ4:
                    # |w| <= 127: a pair of products can reach 32258, so every vpmaddubsw is widened on its own.
                    sums = None
                    for u in range(8):
                        sums = int8dot._unsigned_signed_dot(builder, isa, magnitudes[u],
                                                            grp.with_sign_of(pieces[u], weights[u]), sums)
                    new.append(scaled(sums, d_w, d_x, accs[r]))
                elif qtype != Q6_K:
                    new.append(scaled(_block_sums(builder, isa, qtype, list(zip(values, pieces))), d_w, d_x, accs[r]))
                elif _unsigned_weights(isa):
                    # sum((q - 32) x) = sum(q x) - 32 sum(x) per half, q (0..63) the unsigned operand; the halves'
                    # sums of x come in xs (`_activations`). Exact integers: the same sums as the signed form.
                    pairs = list(zip(weights, pieces))
                    halves = []
                    for h in range(2):
                        offset = splat(builder, builder.shl(half_x_sum(r, j, h), ir.Constant(_i32, 5)), lanes)
                        halves.append(builder.sub(_half_sum(builder, isa, pairs[4 * h : 4 * h + 4]), offset))
                    new.append(scaled(halves[1], d_b, d_x, scaled(halves[0], d_a, d_x, accs[r])))
                else:
                    pairs = [(magnitudes[u], grp.with_sign_of(pieces[u], weights[u])) for u in range(8)]
                    acc = scaled(_half_sum(builder, isa, pairs[:4]), d_a, d_x, accs[r])
                    new.append(scaled(_half_sum(builder, isa, pairs[4:]), d_b, d_x, acc))
            return new

        def m_terms(j: ir.Value, accs: list[ir.Value]) -> list[ir.Value]:
            m_w = _m_scales(grp, j, qtype)
            return [fma(builder, m_w, x_scale(r, j, s), accs[r]) for r in range(n_x)]

        totals = int8dot._block_loop(builder, n_blocks, n_x, lanes, dots)
        if qtype not in (Q6_K, *_IQ4):
            totals = [builder.fadd(t, m)
                      for t, m in zip(totals, int8dot._block_loop(builder, n_blocks, n_x, lanes, m_terms))]
        op.store(builder, totals, lanes)

    rows_dot.__name__ = rows_dot.__qualname__ = f"k_rows_dot_{n_x}_{isa}_{lanes}"
    return intrinsic(rows_dot)


_ISA = int8dot.INT8_ISA or "avx2"  # never called without one
_UNSIGNED = _unsigned_weights(_ISA)
_dot_1, _dot_4, _dot_8 = (_make_rows_dot(n, _ISA) for n in (1, 4, 8))
# Two groups and 8 activation rows a call on 512-bit vectors with AVX-512 VNNI (`int8dot.INT8_WIDE`); elsewhere never
# called, and the 8-lane kernel stands in so that nothing asks LLVM for instructions the CPU lacks.
_wide_8 = _make_rows_dot(8, _ISA, 2 * LANES) if int8dot.INT8_WIDE else _dot_8
_KERNEL = dict(cache=True, nogil=True, error_model="numpy")


# --- weights ---------------------------------------------------------------------------------------------


@numba.njit(inline="always")
def _scale_min(src, p, j):
    """Q4_K / Q5_K's 6-bit (scale, min) of sub-block j from the 12 bytes at src[p:p+12]."""
    if j < 4:
        return src[p + j] & 63, src[p + 4 + j] & 63
    lo = src[p + 4 + j]
    return (lo & 15) | ((src[p + j - 4] >> 6) << 4), (lo >> 4) | ((src[p + j] >> 6) << 4)


@numba.njit(inline="always")
def _put_nibbles(values, dst, at, lane):
    """32 values' low 4 bits as int8dot's Q4_1 nibble vectors: vector t, lane, byte p holds values 4t + p (low
    nibble) and 4t + p + 16 (high)."""
    for k in range(16):
        dst[at + 32 * (k // 4) + 4 * lane + k % 4] = (values[k] & 15) | ((values[k + 16] & 15) << 4)


@numba.njit(inline="always")
def _put_plane(values, dst, at, lane, bit, width):
    """Bits bit .. bit + width - 1 of 32 values as a plane of 4 bytes a lane: byte p holds those of values 4u + p
    for u = 0..7 / width in bits width * u .. (of the plane's first 32 values per byte; width 2 takes two planes,
    values 4u + p for u = 4h + r in plane h)."""
    per_byte = 8 // width
    for h in range(8 // per_byte):
        for p in range(4):
            byte = 0
            for r in range(per_byte):
                byte |= ((values[4 * (per_byte * h + r) + p] >> bit) & ((1 << width) - 1)) << (width * r)
            dst[at + 32 * h + 4 * lane + p] = byte


@numba.njit(parallel=True, **_KERNEL)
def _pack_k(qtype, data, packed, n_super):
    """GGUF Q4_K / Q5_K rows -> `pack_weight`'s layout. Row superblock: d, dmin (f16), scales[12], (Q5_K: qh[32],)
    qs[128], where value 64c + l (l < 32) is the low nibble of qs[32c + l] and value 64c + 32 + l its high
    nibble; Q5_K's fifth bit of value l of sub-block j is bit j of qh[l]."""
    five = qtype == Q5_K
    file_bytes, group, sub_bytes = (176, Q5_K_GROUP, 160) if five else (144, Q4_K_GROUP, 128)
    qs = 48 if five else 16
    for n in numba.prange(data.shape[0]):
        src = data[n]
        dst = packed[n // LANES]
        lane = n % LANES
        values = np.empty(32, np.uint8)
        for s in range(n_super):
            o, base = s * file_bytes, s * group
            int8dot.put_f16(src, o, dst, base, lane)  # d
            int8dot.put_f16(src, o + 2, dst, base + 16, lane)  # dmin
            for j in range(8):
                sc, mn = _scale_min(src, o + 4, j)
                dst[base + _K_SC + 8 * j + lane] = sc
                dst[base + _K_M + 8 * j + lane] = mn
                first = o + qs + 32 * (j // 2)
                for v in range(32):
                    byte = src[first + v]
                    values[v] = byte >> 4 if j % 2 else byte & 15
                    if five:
                        values[v] |= ((src[o + 16 + v] >> j) & 1) << 4
                at = base + _K_VALUES + sub_bytes * j
                _put_nibbles(values, dst, at, lane)
                if five:
                    _put_plane(values, dst, at + 128, lane, 4, 1)


@numba.njit(parallel=True, **_KERNEL)
def _pack_q5_1(data, packed, n_blocks):
    """GGUF Q5_1 rows (blocks of d, m (f16), qh (uint32: bit k is value k's fifth), qs[16] (value k the low nibble
    of qs[k], value k + 16 its high nibble)) -> `pack_weight`'s layout."""
    for n in numba.prange(data.shape[0]):
        src = data[n]
        dst = packed[n // LANES]
        lane = n % LANES
        values = np.empty(32, np.uint8)
        for blk in range(n_blocks):
            o, base = blk * 24, blk * Q5_1_GROUP
            int8dot.put_f16(src, o, dst, base, lane)  # d
            int8dot.put_f16(src, o + 2, dst, base + 16, lane)  # m
            high = (np.uint32(src[o + 4]) | (np.uint32(src[o + 5]) << 8) | (np.uint32(src[o + 6]) << 16)
                    | (np.uint32(src[o + 7]) << 24))
            for k in range(16):
                byte = src[o + 8 + k]
                values[k] = (byte & 15) | (((high >> k) & 1) << 4)
                values[k + 16] = (byte >> 4) | (((high >> (k + 16)) & 1) << 4)
            _put_nibbles(values, dst, base + _Q5_VALUES, lane)
            _put_plane(values, dst, base + _Q5_VALUES + 128, lane, 4, 1)


@numba.njit(inline="always")
def _put_q6_k(q, scales, src_d, dst, base, lane):
    """One row's superblock into lane `lane` of a packed Q6_K superblock at dst[base]: q its 256 values (0..63),
    scales its 16 int8 scales (as bytes), src_d the 2 bytes of its f16 d."""
    int8dot.put_f16(src_d, 0, dst, base, lane)
    for h in range(16):
        dst[base + _Q6K_SC + 8 * h + lane] = scales[h]  # the scale of values 16h..16h+15
    for j in range(8):
        at = base + _Q6K_VALUES + 192 * j
        values = q[32 * j: 32 * j + 32]
        _put_nibbles(values, dst, at, lane)
        _put_plane(values, dst, at + 128, lane, 4, 2)


@numba.njit(parallel=True, **_KERNEL)
def _pack_q6_k(data, packed, n_super):
    """GGUF Q6_K rows -> `pack_weight`'s layout. Row superblock: ql[128], qh[64], scales[16] (int8), d (f16); in
    each half of 128 values (ql + 64h, qh + 32h), value l, l + 32, l + 64, l + 96 (l < 32) take their low 4 bits
    from ql[l] & 15, ql[l + 32] & 15, ql[l] >> 4, ql[l + 32] >> 4 and their high 2 from qh[l] bits 0-1, 2-3,
    4-5, 6-7."""
    for n in numba.prange(data.shape[0]):
        src = data[n]
        dst = packed[n // LANES]
        lane = n % LANES
        q = np.empty(SUPER, np.uint8)
        for s in range(n_super):
            o = s * 210
            for half in range(2):
                ql, qh, first = o + 64 * half, o + 128 + 32 * half, 128 * half
                for v in range(32):
                    low, high = src[ql + v], src[qh + v]
                    wide = src[ql + v + 32]
                    q[first + v] = (low & 15) | ((high & 3) << 4)
                    q[first + v + 32] = (wide & 15) | (((high >> 2) & 3) << 4)
                    q[first + v + 64] = (low >> 4) | (((high >> 4) & 3) << 4)
                    q[first + v + 96] = (wide >> 4) | (((high >> 6) & 3) << 4)
            _put_q6_k(q, src[o + 192: o + 208], src[o + 208: o + 210], dst, s * Q6_K_GROUP, lane)


@numba.njit(parallel=True, **_KERNEL)
def _pack_q3_k(data, packed, n_super):
    """GGUF Q3_K rows -> the Q6_K layout of the weight they equal. Row superblock: hmask[32], qs[64], scales[12]
    (16 6-bit scales s, the weight's scale s - 32), d (f16); in each half h of 128 values (qs + 32h), value
    32j + l (j < 4, l < 32) is ((qs[l] >> 2j) & 3) - 4, plus 4 where bit 4h + j of hmask[l] is set: -4..3, which
    the Q6_K layout holds as q = value + 32. Scale i: low 4 bits from scales[i] (i < 8) or scales[i - 8] >> 4,
    high 2 from scales[8 + i % 4] >> 2 (i // 4)."""
    for n in numba.prange(data.shape[0]):
        src = data[n]
        dst = packed[n // LANES]
        lane = n % LANES
        q = np.empty(SUPER, np.uint8)
        scales = np.empty(16, np.uint8)
        for s in range(n_super):
            o = s * 110
            for half in range(2):
                for j in range(4):
                    for v in range(32):
                        low = (src[o + 32 + 32 * half + v] >> (2 * j)) & 3
                        high = (src[o + v] >> (4 * half + j)) & 1
                        q[128 * half + 32 * j + v] = low + 4 * high + 28
            for i in range(16):
                packed_low = np.int64(src[o + 96 + i % 8])
                low = packed_low & 15 if i < 8 else packed_low >> 4
                scale = low | (((np.int64(src[o + 104 + i % 4]) >> (2 * (i // 4))) & 3) << 4)
                scales[i] = (scale - 32) & 255
            _put_q6_k(q, scales, src[o + 108: o + 110], dst, s * Q6_K_GROUP, lane)


@numba.njit(inline="always")
def iq4_xs_scale(src, o, b):
    """The signed scale ls - 32 of sub-block b of the IQ4_XS superblock at src[o:] (d, scales_h u16, scales_l[4],
    ...): ls = nibble b of scales_l | bits 2b, 2b + 1 of scales_h << 4."""
    high = np.int64(src[o + 2]) | (np.int64(src[o + 3]) << 8)
    return (((np.int64(src[o + 4 + b // 2]) >> (4 * (b % 2))) & 15) | (((high >> (2 * b)) & 3) << 4)) - 32


@numba.njit(parallel=True, **_KERNEL)
def _pack_iq4_xs(data, packed, n_super):
    """GGUF IQ4_XS rows -> `pack_weight`'s layout. Row superblock: d (f16), scales_h (u16), scales_l[4], qs[128]:
    sub-block b has the 6-bit scale ls = nibble b of scales_l | bits 2b, 2b + 1 of scales_h << 4 (the weight's
    scale d * (ls - 32)) and 16 qs bytes of table indices laid out as a Q4_1 block's nibbles."""
    for n in numba.prange(data.shape[0]):
        src = data[n]
        dst = packed[n // LANES]
        lane = n % LANES
        for s in range(n_super):
            o, base = s * 136, s * IQ4_XS_GROUP
            int8dot.put_f16(src, o, dst, base, lane)  # d
            for b in range(8):
                dst[base + _IQ_SC + 8 * b + lane] = iq4_xs_scale(src, o, b) & 255
                int8dot.put_nibble_bytes(src, o + 8 + 16 * b, dst, base + _IQ_VALUES + 128 * b, lane)


@numba.njit(parallel=True, **_KERNEL)
def _pack_iq4_nl(data, packed, n_blocks):
    """GGUF IQ4_NL rows (blocks of d (f16) and 16 bytes of table indices laid out as Q4_0's nibbles) ->
    `pack_weight`'s layout."""
    for n in numba.prange(data.shape[0]):
        src = data[n]
        dst = packed[n // LANES]
        lane = n % LANES
        for blk in range(n_blocks):
            o, base = blk * 18, blk * IQ4_NL_GROUP
            int8dot.put_f16(src, o, dst, base, lane)  # d
            int8dot.put_nibble_bytes(src, o + 2, dst, base + 16, lane)


def kernel_qtype(qtype: int) -> int:
    """The type whose kernels run a `qtype` weight packed by `pack_weight`: Q5_1 for Q5_0, Q6_K for Q3_K, else
    itself."""
    return {Q5_0: Q5_1, Q3_K: Q6_K}.get(qtype, qtype)


def pack_weight(qtype: int, data: np.ndarray) -> np.ndarray:
    """A weight's rows (raw GGUF bytes, (N, row_bytes) uint8, a type of `TYPES`) rearranged for the row dots,
    once at load: (ceil(N / 8), blocks * group bytes), row g holding weight rows 8g..8g+7 block by block (the K
    types: superblock by superblock), the lanes past the last row zero. A value vector u holds values 4u..4u+3 of
    the 32-value block in each lane; the nibble vectors are int8dot's Q4_1 layout, and a bit plane holds the
    higher bits of values 4u + p (lane, byte p) in bit u (Q5_1, Q5_K) or, two planes of 2 bits, bits 2r of
    plane h for u = 4h + r (Q6_K).

    Q4_K / Q5_K superblock of 8 rows: [8 f16 d][8 f16 dmin][8 sub-blocks x 8 scale bytes (one a lane)][8 x 8 min
    bytes][8 x: sub-block j's 4 nibble vectors (Q5_K: then its bit plane)]. Q5_1 block: [8 f16 d][8 f16 m][4
    nibble vectors][bit plane]; Q5_0 is packed as the Q5_1 weight it equals (`kernel_qtype`). Q6_K superblock:
    [8 f16 d][16 halves x 8 int8 scales][8 x: sub-block j's 4 nibble vectors, its two 2-bit planes]; Q3_K is
    packed as the Q6_K weight it equals (1.9x its size: one kernel fewer, for a type rarely used). IQ4_XS
    superblock: [8 f16 d][8 sub-blocks x 8 int8 scales ls - 32][8 x: sub-block j's 4 vectors of index nibbles].
    IQ4_NL block: [8 f16 d][4 vectors of index nibbles]."""
    if qtype == Q5_0:
        qtype, data = Q5_1, int8dot.with_m(data, 22, 16)
    n_blocks = data.shape[1] // FILE_BYTES[qtype]
    n_groups = -(-data.shape[0] // LANES)
    packed = np.zeros((n_groups, n_blocks * GROUP[kernel_qtype(qtype)]), np.uint8)
    if qtype == Q3_K:
        _pack_q3_k(data, packed, n_blocks)
    elif qtype == IQ4_XS:
        _pack_iq4_xs(data, packed, n_blocks)
    elif qtype == IQ4_NL:
        _pack_iq4_nl(data, packed, n_blocks)
    elif qtype == Q5_1:
        _pack_q5_1(data, packed, n_blocks)
    elif qtype == Q6_K:
        _pack_q6_k(data, packed, n_blocks)
    else:
        _pack_k(qtype, data, packed, n_blocks)
    packed.flags.writeable = False
    return packed


# --- matmul ----------------------------------------------------------------------------------------------


@numba.njit(**_KERNEL)
def _wide_span(qtype, packed, g_lo, g_hi, xq, xd, xs, out, col0, rows):
    """Activation rows 0 .. rows - 1 (a multiple of 8) against the pairs of weight groups g_lo .. g_hi - 1 (an even
    count), on the 16-lane kernels, 8 rows a call; kept bare for the reason `int8dot._wide_span` gives."""
    for g in range(g_lo, g_hi, 2):
        for b in range(0, rows, 8):
            _wide_8(qtype, packed, g, xq, xd, xs, b, out, col0 + g * LANES)


@numba.njit(**_KERNEL)
def _narrow_span(qtype, packed, g_lo, g_hi, xq, xd, xs, out, col0, b_lo):
    """Activation rows b_lo .. against weight groups g_lo .. g_hi - 1 on the 8-lane kernels, 8 rows a call while
    there are 8, then 4, then one (`int8dot._narrow_span`)."""
    batch = xq.shape[0]
    for g in range(g_lo, g_hi):
        n0 = col0 + g * LANES
        b = b_lo
        while b + 8 <= batch:
            _dot_8(qtype, packed, g, xq, xd, xs, b, out, n0)
            b += 8
        while b + 4 <= batch:
            _dot_4(qtype, packed, g, xq, xd, xs, b, out, n0)
            b += 4
        while b < batch:
            _dot_1(qtype, packed, g, xq, xd, xs, b, out, n0)
            b += 1


@numba.njit(**_KERNEL)
def _gemm_groups(qtype, packed, xq, xd, xs, out, g_lo, g_hi, col0):
    """Every activation row against weight groups g_lo .. g_hi - 1, their outputs from column col0 of out, as
    `int8dot._gemm_groups` splits them: the pairs of groups on the 16-lane kernels (with `int8dot.INT8_WIDE` and at
    least `int8dot.WIDE_MIN_ROWS` rows), the rest on the 8-lane ones.

    This and the two spans repeat int8dot's with this module's kernels. One factory making both sets would make
    them closures, and numba's disk cache misses closures: a probe (a factory's two drivers over two intrinsics,
    `cache=True`, 2026-12-06) saved its entries and recompiled in every new process."""
    batch = xq.shape[0]
    g = g_lo
    if int8dot.INT8_WIDE and batch >= int8dot.WIDE_MIN_ROWS:
        g = g_lo + (g_hi - g_lo) // 2 * 2
        rows = batch // 8 * 8
        _wide_span(qtype, packed, g_lo, g, xq, xd, xs, out, col0, rows)
        if rows < batch:
            _narrow_span(qtype, packed, g_lo, g, xq, xd, xs, out, col0, rows)
    _narrow_span(qtype, packed, g, g_hi, xq, xd, xs, out, col0, 0)


def _any_groups_c(  # type: ignore[no-untyped-def]
        qtype, packed, n_groups, group_bytes, xq, n_rows, width, xd, xd_cols, xs, xs_cols, out, out_rows, out_cols,
        g_lo, g_hi, col0):
    """`_gemm_groups`, or int8dot's for its types (Q4_1, Q8_0), over raw pointers and shapes (`gemm_call._GEMM`),
    compiled as a C function."""
    w, a, ad, s, o = gemm_call.as_arrays(packed, n_groups, group_bytes, xq, n_rows, width, xd, xd_cols, xs, xs_cols,
                                         out, out_rows, out_cols)
    if qtype == int8dot.Q4_1 or qtype == int8dot.Q8_0:
        int8dot._gemm_groups(qtype, w, a, ad, s, o, g_lo, g_hi, col0)
    else:
        _gemm_groups(qtype, w, a, ad, s, o, g_lo, g_hi, col0)


@functools.cache
def gemm_address() -> int:
    """The address of the gemm of every int8 kernel type (`kernel_qtype`, and int8dot's) as a C function, compiled
    (or loaded from the kernel cache) on first use (`int8dot.gemm_address`)."""
    return gemm_call.compile_gemm(_any_groups_c)


@numba.njit(inline="always", **_KERNEL)
def xs_kind(qtype, unsigned):
    """What the kernels of kernel type `qtype` read in the xs slot of the quantized activations
    (`int8dot.XS_SCALED` ..): the halves' sums for Q6_K and IQ4 where the weights are the unsigned operand
    (`unsigned`: `_unsigned_weights` of the instruction set, `_UNSIGNED` for this CPU's), int8dot's choice for
    its types (offset Q8_0's corrections; `_offset_q8_0` is the same test). The one place that says it for every
    type: the matmuls (`_activations`) and the decode step (`decode_layers`) both ask here."""
    if unsigned and (qtype == Q6_K or qtype == IQ4_NL or qtype == IQ4_XS):
        return int8dot.XS_HALVES
    return int8dot.xs_kind(qtype, unsigned)


@numba.njit(**_KERNEL)
def _activations(qtype, x, unsigned):
    """x quantized for the kernels of `qtype`: (xq, xd, xs), xs what they read there (`xs_kind`)."""
    return int8dot._quantize(x, xs_kind(qtype, unsigned))


@numba.njit(**_KERNEL)
def _matmul(gemm, qtype, packed, x, out, n_chunks):
    xq, xd, xs = _activations(qtype, x, _UNSIGNED)
    int8dot.gemm_chunks(gemm, qtype, packed, xq, xd, xs, out, n_chunks)


def matmul(qtype: int, packed: np.ndarray, x: np.ndarray, out: np.ndarray, threads: int | None = None) -> None:
    """out = x @ W.T with x quantized to int8 blocks first; W of a type of `TYPES`, its rows as `pack_weight` left
    them."""
    _matmul(gemm_address(), kernel_qtype(qtype), packed, x, out, 4 * (threads or numba.get_num_threads()))


@functools.cache
def _serial_gemm(isa: str) -> Any:
    """A one-row-at-a-time gemm on the kernels of another instruction set (not cached on disk), for tests."""
    return int8dot.serial_gemm(_make_rows_dot(1, isa))


def matmul_with_isa(isa: str, qtype: int, packed: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """`matmul` on the kernels of `isa` ("vnni" or "avx2"; the CPU must have it), serially; for tests."""
    qtype = kernel_qtype(qtype)
    _serial_gemm(isa)(qtype, packed, *_activations(qtype, x, _unsigned_weights(isa)), out)
