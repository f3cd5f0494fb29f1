"""The int8 GEMM on the CPU's own 8-bit dot-product instruction, for gemm_planar (kernels/gemm.py).

    acc[n, m, s] = sum_k w[m, k] * x[n, k, s]        (w int8, x uint8 or int8; exact in int32, see below)

AVX-512 VNNI's VPDPBUSD adds, in each of 16 int32 lanes, four products of an unsigned byte and a signed byte to
the lane, wrapping (Intel SDM, VPDPBUSD: "no saturation"; VPDPBUSDS is the saturating form). So one instruction
is 64 multiply-adds, four times the lanes of a float32 FMA, and its arithmetic is the ring of integers modulo
2^32. The kernel:
- packs x as 4-byte groups along k, x4[kq, s, j] = x[4 kq + j, s] (j = 0..3, zeros beyond K), so one 64-byte load
  holds 16 output columns s times 4 k; a signed x is offset to unsigned, x + 128, which adds 128 * sum_k w[m, k]
  to every sum, subtracted at the end (its int32 value, modulo 2^32);
- packs w the same way, four bytes of a row per int32 word, broadcast to all lanes;
- runs a register tile of 4 rows m x 64 columns s (16 zmm accumulators) over k.
Every step is modulo 2^32, so the result is sum + bias modulo 2^32, which is the exact sum whenever the caller's
worst-case bound puts |sum + bias| <= 2^31 - 1 (gemm.channels_in_range); gemm_planar uses it only then.

The tile is LLVM IR written here (Numba's @intrinsic) because no compiler pattern turns a Python loop into
VPDPBUSD (measured: Numba's own vectorisation of the same loop ran at 6.7 GOP/s, this tile at ~10x that).
`AVAILABLE` says whether this CPU has the instruction; without it gemm_planar keeps the float32 BLAS path.
"""

from __future__ import annotations

from dataclasses import dataclass

import llvmlite.binding as llvm_binding
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from simulator.kernels.requantize import PlaneParameters, requantize_plane

LANES = 16  # int32 lanes of a zmm register
TILE_ROWS = 4  # rows m per register tile
TILE_VECTORS = 4  # vectors of LANES columns per full register tile: 4 x 4 = 16 accumulators of the 32 zmm


def _host_has_vnni() -> bool:
    features = llvm_binding.get_host_cpu_features()
    return bool(features.get("avx512f") and features.get("avx512vnni"))


AVAILABLE = _host_has_vnni()


def _make_tile(vectors: int):
    """An intrinsic tile(x4, w4, tile, kq_count, tile_col, col0, w_row): for r < TILE_ROWS and c < vectors,
    tile[r, tile_col + 16 c + l] = sum_{kq < kq_count} dot4(x4[kq, col0 + 16 c + l], w4[w_row + r, kq]), the
    dot product of the four bytes of each word; x4 a 2-D uint32 array (KQ, S_pad), w4 a 2-D int32 array
    (M_pad, KQ) of packed int8 quadruples, tile a 2-D int32 array (TILE_ROWS, >= tile_col + 16 vectors)."""
    vec = ir.VectorType(ir.IntType(32), LANES)

    @intrinsic
    def tile_kernel(typingctx, x4, w4, tile, kq_count, tile_col, col0, w_row):
        sig = types.void(x4, w4, tile, types.intp, types.intp, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            x_arg, w_arg, tile_arg, kq_count_v, tile_col_v, col0_v, w_row_v = args
            x_array = context.make_array(signature.args[0])(context, builder, x_arg)
            w_array = context.make_array(signature.args[1])(context, builder, w_arg)
            tile_array = context.make_array(signature.args[2])(context, builder, tile_arg)
            i8p = ir.PointerType(ir.IntType(8))
            x_base = builder.bitcast(x_array.data, i8p)
            w_base = builder.bitcast(w_array.data, i8p)
            x_stride = cgutils.unpack_tuple(builder, x_array.strides, 2)[0]  # bytes per kq row
            w_stride = cgutils.unpack_tuple(builder, w_array.strides, 2)[0]  # bytes per weight row
            dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec, vec]),
                                                 "llvm.x86.avx512.vpdpbusd.512")
            zero = ir.Constant(vec, None)
            slots = [[cgutils.alloca_once_value(builder, zero) for _ in range(vectors)] for _ in range(TILE_ROWS)]
            x_start = builder.mul(col0_v, ir.Constant(col0_v.type, 4))
            with cgutils.for_range(builder, kq_count_v) as loop:
                kq = loop.index
                x_row_ptr = builder.gep(x_base, [builder.add(x_start, builder.mul(kq, x_stride))])
                xs = [builder.load(builder.bitcast(builder.gep(x_row_ptr, [ir.Constant(kq.type, 64 * c)]),
                                                   vec.as_pointer()), align=1) for c in range(vectors)]
                for r in range(TILE_ROWS):
                    w_offset = builder.add(builder.mul(builder.add(w_row_v, ir.Constant(kq.type, r)), w_stride),
                                           builder.mul(kq, ir.Constant(kq.type, 4)))
                    word = builder.load(builder.bitcast(builder.gep(w_base, [w_offset]),
                                                        ir.PointerType(ir.IntType(32))), align=4)
                    splat = builder.shuffle_vector(builder.insert_element(ir.Constant(vec, ir.Undefined), word,
                                                                          ir.Constant(ir.IntType(32), 0)),
                                                   ir.Constant(vec, ir.Undefined),
                                                   ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))
                    for c in range(vectors):
                        builder.store(builder.call(dot, [builder.load(slots[r][c]), xs[c], splat]), slots[r][c])
            t_base = builder.bitcast(tile_array.data, i8p)
            t_stride = cgutils.unpack_tuple(builder, tile_array.strides, 2)[0]
            for r in range(TILE_ROWS):
                for c in range(vectors):
                    offset = builder.add(builder.mul(ir.Constant(t_stride.type, r), t_stride),
                                         builder.add(builder.mul(tile_col_v, ir.Constant(t_stride.type, 4)),
                                                     ir.Constant(t_stride.type, 64 * c)))
                    builder.store(builder.load(slots[r][c]),
                                  builder.bitcast(builder.gep(t_base, [offset]), vec.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile_kernel


_tile_full = _make_tile(TILE_VECTORS)
_tile_one = _make_tile(1)


_NO_REQUANT = PlaneParameters(-1, np.zeros(1, np.bool_), np.zeros(1, np.int64), np.zeros(1, np.int64),
                              np.zeros(1, np.float32))


def padded_columns(s: int) -> int:
    return -(-s // LANES) * LANES


def pack_weights(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(w4, row_sums): w (M, K) int8 as (M_pad, KQ) int32 words of four consecutive k (zeros beyond K and M;
    M_pad a multiple of TILE_ROWS), and sum_k w[m, k] (int64, for the offset of a signed x)."""
    m, k = w.shape
    kq = -(-k // 4)
    m_pad = -(-m // TILE_ROWS) * TILE_ROWS
    packed = np.zeros((m_pad, kq * 4), np.int8)
    packed[:m, :k] = w
    return packed.view(np.int32), w.astype(np.int64).sum(axis=1)


@njit(cache=True, nogil=True)
def pack_columns(x, offset, out):
    """out[kq, s] = the four bytes x[4 kq + j, s] + offset (modulo 256) for j = 0..3, little-endian in one word
    (byte j of the word; zeros for k >= K and s >= S); offset 128 turns an int8 value v into the uint8 v + 128.
    x (K, S) int8/uint8, out (KQ, S_pad) uint32."""
    k_dim, s_dim = x.shape
    kq_dim, width = out.shape
    for kq in range(kq_dim):
        row = out[kq]
        row[:] = 0
        for j in range(min(4, k_dim - 4 * kq)):
            src, shift = x[4 * kq + j], 8 * j
            for s in range(s_dim):
                row[s] |= np.uint32((np.int32(src[s]) + offset) & 255) << shift


@njit(cache=True, nogil=True)
def _store_rows(tile, rows, width, correction, dst, m0, col0, mode, fast, mult, shift, scale, lo, hi):
    """tile[r, :width] plus correction[m] (m = m0 + r < m0 + rows, int32 wrapping) to dst[m, col0 : col0 + width]:
    as it is (mode -1, dst int32) or requantized by requantize_plane with channel m's parameters."""
    for r in range(rows):
        m = m0 + r
        values = tile[r, :width]
        values += correction[m]
        if mode < 0:
            dst[m, col0:col0 + width] = values
        else:
            requantize_plane(values, mode, fast[m], mult[m], shift[m], scale[m], lo, hi, dst[m, col0:col0 + width])


BLOCK_BYTES = 1 << 17  # bytes of packed columns per block: a block of x4 stays in L2 while every row passes
BLOCK_COLUMNS = 1024  # at most: the tile buffer (TILE_ROWS x BLOCK_COLUMNS int32, 16 KiB) stays in L1


def block_columns(kq_dim: int) -> int:
    """Columns per block: BLOCK_BYTES of x4 (KQ words per column), a whole number of strips, at most BLOCK_COLUMNS."""
    strip = TILE_VECTORS * LANES
    return min(BLOCK_COLUMNS, max(strip, BLOCK_BYTES // (4 * kq_dim) // strip * strip))


@njit(cache=True, nogil=True)
def gemm_vnni(w4, cols, offset, correction, x4, tile, out, mode, fast, mult, shift, scale, lo, hi):
    """out[n, m, s] = sum_k w[m, k] * cols[n, k, s] + correction[m], modulo 2^32, stored as int32 (mode -1) or
    requantized (requantize_plane: mode as requantize._MODE_CODES with fast, mult, shift, scale, lo, hi per
    channel, out int8/uint8). cols (N, K, S) int8/uint8 (offset 128 for int8, else 0; correction[m] then includes
    -128 * sum_k w[m, k]), correction (M,) int32; w4 from pack_weights; x4 a scratch (KQ, padded_columns(S))
    uint32; tile a scratch (TILE_ROWS, block_columns(KQ)) int32; out (N, M, S).
    Blocks of columns outside, rows inside them, register tiles along the block into the tile buffer, then one
    store of each row of the block: every row of w4 passes over a block of x4 while it is in cache, and the
    store's fixed cost is paid once per block row."""
    n_dim, _, s_dim = cols.shape
    m_dim = out.shape[1]
    m_pad, kq_dim = w4.shape
    strip = TILE_VECTORS * LANES
    block = tile.shape[1]
    for n in range(n_dim):
        pack_columns(cols[n], offset, x4)
        dst = out[n]
        for block0 in range(0, s_dim, block):
            block_end = min(s_dim, block0 + block)
            full_end = block0 + (block_end - block0) // strip * strip
            for m0 in range(0, m_pad, TILE_ROWS):
                for col0 in range(block0, full_end, strip):
                    _tile_full(x4, w4, tile, kq_dim, col0 - block0, col0, m0)
                for col0 in range(full_end, block_end, LANES):
                    _tile_one(x4, w4, tile, kq_dim, col0 - block0, col0, m0)
                _store_rows(tile, min(TILE_ROWS, m_dim - m0), block_end - block0, correction, dst, m0, block0, mode,
                            fast, mult, shift, scale, lo, hi)


@dataclass(frozen=True)
class PackedWeights:
    """A planar GEMM's weights as gemm_vnni reads them (pack_weights)."""

    words: np.ndarray  # (M_pad, KQ) int32
    row_sums: np.ndarray  # (M,) int64, sum_k w[m, k]


def pack(w: np.ndarray) -> PackedWeights:
    return PackedWeights(*pack_weights(w))


def planar_gemm(packed: PackedWeights, cols: np.ndarray, bias: np.ndarray, scratch: dict,
                requant: PlaneParameters | None = None, lo: int = 0, hi: int = 0) -> np.ndarray:
    """acc[n, m, s] = sum_k w[m, k] * cols[n, k, s] + bias[m] (int32, (N, M, S); the caller has checked that every
    exact value fits int32), or, with requant, that acc requantized and clamped to [lo, hi] (int8/uint8), never
    stored as int32. scratch: the caller's reusable buffers (kernels.gemm._scratch)."""
    from simulator.kernels.gemm import _scratch  # one scratch mechanism (gemm imports this module)

    n_dim, _, s_dim = cols.shape
    m_dim = packed.row_sums.shape[0]
    offset = 128 if cols.dtype == np.int8 else 0
    correction = (bias.astype(np.int64) - offset * packed.row_sums).astype(np.int32)  # modulo 2^32
    x4 = _scratch(scratch, "int8_simd_x4", (packed.words.shape[1], padded_columns(s_dim)), np.uint32)
    tile = _scratch(scratch, "int8_simd_tile", (TILE_ROWS, block_columns(packed.words.shape[1])), np.int32)
    if requant is None:
        out = _scratch(scratch, "int8_simd_acc", (n_dim, m_dim, s_dim), np.int32)
        params = _NO_REQUANT
    else:
        out = np.empty((n_dim, m_dim, s_dim), np.uint8 if lo >= 0 and hi > 127 else np.int8)
        params = requant
    gemm_vnni(packed.words, np.ascontiguousarray(cols), offset, correction, x4, tile, out, params.mode,
              params.fast, params.mult, params.shift, params.scale, np.int64(lo), np.int64(hi))
    return out
