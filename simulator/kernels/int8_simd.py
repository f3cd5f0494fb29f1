"""The int8 GEMM of a group-1 convolution on the CPU's own integer dot-product instructions: `conv` for the
machine (im2col, GEMM and the Requantize step in one kernel), `planar_gemm` for gemm_planar (kernels/gemm.py).

    acc[n, m, s] = sum_k w[m, k] * cols[n, k, s]     (w int8, cols uint8 or int8; exact in int32, see below)

cols are the im2col rows of eq. 9 (simulator/README.md), never materialised: `pack_columns` packs each image's
rows straight from x into the words below, the padding as the real 0.

Two SIMD extensions of the CPU's instruction set (`SimdExtension`), picked once per process from the features
Numba compiles for (the CPU's own, or NUMBA_CPU_NAME / NUMBA_CPU_FEATURES):
- AVX-512 VNNI, VPDPBUSD: in each of 16 int32 lanes, adds four products of an unsigned byte and a signed byte
  to the lane, wrapping (Intel SDM, VPDPBUSD: "no saturation"; VPDPBUSDS is the saturating form): 64
  multiply-adds per instruction, four times the lanes of a float32 FMA. cols are packed as 4-byte groups along
  k (one 32-bit word per column s holds cols[4 kq + j, s], j = 0..3); a signed x is offset to unsigned, x + 128,
  which adds 128 * sum_k w[m, k] to every sum, subtracted at the end.
- AVX2, VPMADDWD: in each of 8 int32 lanes, the sum of two products of signed 16-bit halves (exact: |2 * 255 *
  128| < 2^31), then VPADDD: 16 multiply-adds per instruction pair, twice the lanes of a float32 FMA. cols are
  packed as 16-bit pairs along k (int8 and uint8 both fit int16: no offset).
w is packed the same way, one row's word broadcast to every lane; a register tile of 4 rows m x (vectors x lanes)
columns s runs over k. Every step is modulo 2^32, so the result is sum + bias modulo 2^32, which is the exact
sum whenever the caller's worst-case bound puts |sum + bias| <= 2^31 - 1 (gemm.channels_in_range); gemm_planar
and the machine use it only then.

The tile is LLVM IR written here (Numba's @intrinsic) because no compiler pattern turns a Python loop into these
instructions (measured: Numba's own vectorisation of the same loop ran at 6.7 GOP/s, the VNNI tile at ~10x
that). An intrinsic whose instructions the compile target lacks compiles to nothing: it is never called
(`EXTENSION` picks), and Numba's cache is keyed by the target's CPU name and features. `EXTENSION` is None on
other targets (another CPU, or NUMBA_CPU_NAME=generic for a portable cache): gemm_planar keeps the float32 BLAS
path.
QDEPLOY_INT8_SIMD=avx2 or =off in the environment picks the AVX2 kernel or none on a CPU that has more.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, config
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic

from simulator.kernels.requantize import PlaneParameters, output_dtype, requantize_plane
from simulator.kernels.scratch import scratch_array

TILE_ROWS = 4  # rows m per register tile


@dataclass(frozen=True)
class SimdExtension:
    """One SIMD extension's tile geometry: `code` is what the Numba driver dispatches on."""

    name: str
    code: int
    lanes: int  # int32 lanes per vector register
    vectors: int  # vectors per full register tile (TILE_ROWS x vectors accumulators, plus loads, fit the file)
    k_per_word: int  # k values packed in one 32-bit word (4 bytes or 2 halves)
    features: tuple[str, ...]

    @property
    def strip(self) -> int:
        """Columns of a full register tile."""
        return self.lanes * self.vectors


AVX512_VNNI = SimdExtension("avx512vnni", 0, 16, 4, 4, ("avx512f", "avx512vnni"))  # 16 of 32 zmm accumulate
AVX2 = SimdExtension("avx2", 1, 8, 3, 2, ("avx2",))  # 12 of 16 ymm accumulate, 3 hold x, 1 the weights


def _compile_features() -> dict[str, bool]:
    """The instruction-set features Numba compiles for (numba.core.codegen's JIT target): NUMBA_CPU_FEATURES when
    set; none when NUMBA_CPU_NAME is set without them (Numba then compiles for that CPU model's baseline, e.g.
    `generic` for a portable cache); else the host's (which honours NUMBA_ENABLE_AVX=0)."""
    if config.CPU_FEATURES is not None:
        features = config.CPU_FEATURES
    elif config.CPU_NAME is not None:
        return {}
    else:
        features = get_host_cpu_features()
    return {name[1:]: name[0] == "+" for name in features.split(",") if name[:1] in "+-" and len(name) > 1}


_COMPILE_FEATURES = _compile_features()


def compiles_for(extension: SimdExtension) -> bool:
    """Whether the code Numba compiles in this process may use `extension`'s instructions."""
    return all(_COMPILE_FEATURES.get(feature, False) for feature in extension.features)


def _pick_extension() -> SimdExtension | None:
    choice = os.environ.get("QDEPLOY_INT8_SIMD", "").lower()
    candidates = {"": (AVX512_VNNI, AVX2), "avx512vnni": (AVX512_VNNI,), "avx2": (AVX2,), "off": ()}.get(choice, ())
    return next((extension for extension in candidates if compiles_for(extension)), None)


EXTENSION = _pick_extension()


def _emit_vnni(builder, acc, x, w):
    vec = acc.type
    dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec, vec]),
                                         "llvm.x86.avx512.vpdpbusd.512")
    return builder.call(dot, [acc, x, w])


def _emit_avx2(builder, acc, x, w):
    halves = ir.VectorType(ir.IntType(16), 16)
    madd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(acc.type, [halves, halves]),
                                          "llvm.x86.avx2.pmadd.wd")
    return builder.add(acc, builder.call(madd, [builder.bitcast(x, halves), builder.bitcast(w, halves)]))


_EMIT = {AVX512_VNNI.code: _emit_vnni, AVX2.code: _emit_avx2}


def _make_tile(extension: SimdExtension, vectors: int):
    """An intrinsic tile(x4, w4, tile, kq_count, tile_col, col0, w_row): for r < TILE_ROWS and c < vectors,
    tile[r, tile_col + lanes c + l] = sum_{kq < kq_count} dot(x4[kq, col0 + lanes c + l], w4[w_row + r, kq]), the
    dot product of the k values packed in the two words (extension.k_per_word of them); x4 a 2-D uint32 array
    (KQ, S_pad), w4 a 2-D int32 array (M_pad, KQ), tile a 2-D int32 array (TILE_ROWS, >= tile_col + lanes
    vectors). On a CPU without the instruction set the body is empty (never called)."""
    vec = ir.VectorType(ir.IntType(32), extension.lanes)
    vector_bytes = 4 * extension.lanes

    @intrinsic
    def tile_kernel(typingctx, x4, w4, tile, kq_count, tile_col, col0, w_row):
        sig = types.void(x4, w4, tile, types.intp, types.intp, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            if not compiles_for(extension):
                return context.get_dummy_value()
            x_arg, w_arg, tile_arg, kq_count_v, tile_col_v, col0_v, w_row_v = args
            x_array = context.make_array(signature.args[0])(context, builder, x_arg)
            w_array = context.make_array(signature.args[1])(context, builder, w_arg)
            tile_array = context.make_array(signature.args[2])(context, builder, tile_arg)
            i8p = ir.PointerType(ir.IntType(8))
            x_base = builder.bitcast(x_array.data, i8p)
            w_base = builder.bitcast(w_array.data, i8p)
            x_stride = cgutils.unpack_tuple(builder, x_array.strides, 2)[0]  # bytes per kq row
            w_stride = cgutils.unpack_tuple(builder, w_array.strides, 2)[0]  # bytes per weight row
            intp = x_stride.type
            slots = [[cgutils.alloca_once_value(builder, ir.Constant(vec, None)) for _ in range(vectors)]
                     for _ in range(TILE_ROWS)]
            x_start = builder.mul(col0_v, ir.Constant(intp, 4))
            splat_mask = ir.Constant(ir.VectorType(ir.IntType(32), extension.lanes), [0] * extension.lanes)
            with cgutils.for_range(builder, kq_count_v) as loop:
                kq = loop.index
                x_row_ptr = builder.gep(x_base, [builder.add(x_start, builder.mul(kq, x_stride))])
                xs = [builder.load(builder.bitcast(builder.gep(x_row_ptr, [ir.Constant(intp, vector_bytes * c)]),
                                                   vec.as_pointer()), align=1) for c in range(vectors)]
                for r in range(TILE_ROWS):
                    w_offset = builder.add(builder.mul(builder.add(w_row_v, ir.Constant(intp, r)), w_stride),
                                           builder.mul(kq, ir.Constant(intp, 4)))
                    word = builder.load(builder.bitcast(builder.gep(w_base, [w_offset]),
                                                        ir.PointerType(ir.IntType(32))), align=4)
                    splat = builder.shuffle_vector(
                        builder.insert_element(ir.Constant(vec, ir.Undefined), word, ir.Constant(ir.IntType(32), 0)),
                        ir.Constant(vec, ir.Undefined), splat_mask)
                    for c in range(vectors):
                        accumulated = _EMIT[extension.code](builder, builder.load(slots[r][c]), xs[c], splat)
                        builder.store(accumulated, slots[r][c])
            t_base = builder.bitcast(tile_array.data, i8p)
            t_stride = cgutils.unpack_tuple(builder, tile_array.strides, 2)[0]
            for r in range(TILE_ROWS):
                for c in range(vectors):
                    offset = builder.add(builder.mul(ir.Constant(intp, r), t_stride),
                                         builder.add(builder.mul(tile_col_v, ir.Constant(intp, 4)),
                                                     ir.Constant(intp, vector_bytes * c)))
                    builder.store(builder.load(slots[r][c]),
                                  builder.bitcast(builder.gep(t_base, [offset]), vec.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile_kernel


_vnni_full, _vnni_one = _make_tile(AVX512_VNNI, AVX512_VNNI.vectors), _make_tile(AVX512_VNNI, 1)
_avx2_full, _avx2_one = _make_tile(AVX2, AVX2.vectors), _make_tile(AVX2, 1)


@njit(cache=True, nogil=True)
def _tile(extension_code, full, x4, w4, tile, kq_count, tile_col, col0, w_row):
    if extension_code == 0:
        if full:
            _vnni_full(x4, w4, tile, kq_count, tile_col, col0, w_row)
        else:
            _vnni_one(x4, w4, tile, kq_count, tile_col, col0, w_row)
    elif full:
        _avx2_full(x4, w4, tile, kq_count, tile_col, col0, w_row)
    else:
        _avx2_one(x4, w4, tile, kq_count, tile_col, col0, w_row)


_NO_REQUANT = PlaneParameters(-1, np.zeros(1, np.bool_), np.zeros(1, np.int64), np.zeros(1, np.int64),
                              np.zeros(1, np.float32))


def padded_columns(s: int, extension: SimdExtension) -> int:
    return -(-s // extension.lanes) * extension.lanes


def _offset(dtype: np.dtype, extension: SimdExtension) -> int:
    """What pack_columns adds to x: 128 turns int8 into the unsigned bytes VPDPBUSD multiplies; 16-bit halves
    hold int8 and uint8 as they are."""
    return 128 if dtype == np.int8 and extension.k_per_word == 4 else 0


@dataclass(frozen=True)
class PackedWeights:
    """A convolution's weights as gemm_int8 reads them for one instruction set (pack)."""

    extension: SimdExtension
    words: np.ndarray  # (G * Mg_pad, KQ) int32: extension.k_per_word consecutive k of a row per word (zeros beyond K)
    row_sums: np.ndarray  # (M,) int64, sum_k w[m, k], for the offset of a signed x
    groups: int  # G: group g's Mg = M / G rows are words[g * Mg_pad : g * Mg_pad + Mg]


def pack(w: np.ndarray, extension: SimdExtension, groups: int = 1) -> PackedWeights:
    """w (M, K) int8 (K = C / G * kh * kw) in words of extension.k_per_word consecutive k (bytes, or int16 halves); the
    rows of each group padded to a multiple of TILE_ROWS, so a register tile never mixes groups."""
    m, k = w.shape
    per_word, m_group = extension.k_per_word, m // groups
    kq = -(-k // per_word)
    m_group_pad = -(-m_group // TILE_ROWS) * TILE_ROWS
    packed = np.zeros((groups, m_group_pad, kq * per_word), np.int8 if per_word == 4 else np.int16)
    packed[:, :m_group, :k] = w.reshape(groups, m_group, k)
    return PackedWeights(extension, packed.reshape(groups * m_group_pad, -1).view(np.int32),
                         w.astype(np.int64).sum(axis=1), groups)


@njit(cache=True, nogil=True)
def pack_columns(x, kh, kw, sh, sw, pt, pl, dh, dw, oh_dim, ow_dim, offset, k_per_word, out):
    """The im2col rows of one image packed into words (eq. 9 of simulator/README.md, read straight from x): with
    k = (c kh + i) kw + j and s = oh OW + ow, value p of out[kq, s] is x[c, oh sh - pt + i dh, ow sw - pl + j dw]
    + offset for k = k_per_word kq + p (0 + offset at padding: the real 0), each value in its 32 / k_per_word
    bits of the little-endian word (two's complement, modulo 2^bits), and 0 for k >= K.
    x (C, H, W) int8/uint8, out (KQ, S_pad) uint32; the columns from OH*OW to S_pad are 0."""
    c_dim, h_dim, w_dim = x.shape
    k_dim = c_dim * kh * kw
    bits = 32 // k_per_word
    mask = (1 << bits) - 1
    for kq in range(out.shape[0]):
        row = out[kq]
        row[:] = 0
        for p in range(min(k_per_word, k_dim - k_per_word * kq)):
            k = k_per_word * kq + p
            c, i, j = k // (kh * kw), k // kw % kh, k % kw
            shift = bits * p
            pad = np.uint32(offset & mask) << shift
            col_offset = j * dw - pl  # iw = ow * sw + col_offset
            first = min(max(-(col_offset // sw), 0), ow_dim)  # the first ow whose iw >= 0
            last = min(max(-((col_offset - w_dim) // sw), first), ow_dim)  # past the last ow whose iw < W
            for oh in range(oh_dim):
                dst = row[oh * ow_dim:(oh + 1) * ow_dim]
                ih = oh * sh - pt + i * dh
                if ih < 0 or ih >= h_dim:
                    if pad:
                        for ow in range(ow_dim):
                            dst[ow] |= pad
                    continue
                if pad:
                    for ow in range(first):
                        dst[ow] |= pad
                    for ow in range(last, ow_dim):
                        dst[ow] |= pad
                src = x[c, ih]
                if sw == 1:  # a contiguous run of the input row: a loop the compiler vectorises
                    run = src[first + col_offset:last + col_offset]
                    out_run = dst[first:last]
                    for t in range(last - first):
                        out_run[t] |= np.uint32((np.int32(run[t]) + offset) & mask) << shift
                else:
                    for ow in range(first, last):
                        dst[ow] |= np.uint32((np.int32(src[ow * sw + col_offset]) + offset) & mask) << shift


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


def block_columns(kq_dim: int, extension: SimdExtension) -> int:
    """Columns per block: BLOCK_BYTES of x4 (KQ words per column), whole strips, at most about BLOCK_COLUMNS."""
    strips = max(1, min(BLOCK_COLUMNS, BLOCK_BYTES // (4 * max(kq_dim, 1))) // extension.strip)
    return strips * extension.strip


@njit(cache=True, nogil=True)
def gemm_int8(extension_code, lanes, strip, k_per_word, w4, groups, x, kh, kw, sh, sw, pt, pl, dh, dw, oh_dim, ow_dim,
              offset, correction, x4, tile, out, mode, fast, mult, shift, scale, lo, hi):
    """out[n, m, s] = sum_k w[m, k] * cols[n, k, s] + correction[m], modulo 2^32, stored as int32 (mode -1) or
    requantized (requantize_plane: mode as requantize._MODE_CODES with fast, mult, shift, scale, lo, hi per
    channel, out of requantize.output_dtype(lo, hi)). The instruction set's code, lanes, strip and k_per_word as
    SimdExtension; cols the im2col rows of x (N, C, H, W) int8/uint8 for the window (kh, kw, strides, top and left pads,
    dilations; output OH x OW), packed per image and group by pack_columns (group g: input channels
    g C/G .. (g+1) C/G - 1, output channels g M/G ..; offset as _offset; correction[m] then includes
    -offset * sum_k w[m, k]); correction (M,) int32;
    w4 from pack; x4 a scratch (KQ, padded_columns(S)) uint32; tile a scratch (TILE_ROWS, block_columns) int32;
    out (N, M, S).
    Blocks of columns outside, rows inside them, register tiles along the block into the tile buffer, then one
    store of each row of the block: every row of w4 passes over a block of x4 while it is in cache, and the
    store's fixed cost is paid once per block row."""
    n_dim, s_dim = x.shape[0], oh_dim * ow_dim
    c_group, m_group = x.shape[1] // groups, out.shape[1] // groups
    m_group_pad, kq_dim = w4.shape[0] // groups, w4.shape[1]
    block = tile.shape[1]
    for n in range(n_dim):
        dst = out[n]
        for g in range(groups):
            pack_columns(x[n, g * c_group:(g + 1) * c_group], kh, kw, sh, sw, pt, pl, dh, dw, oh_dim, ow_dim, offset,
                         k_per_word, x4)
            for block0 in range(0, s_dim, block):
                block_end = min(s_dim, block0 + block)
                full_end = block0 + (block_end - block0) // strip * strip
                for m0 in range(0, m_group_pad, TILE_ROWS):
                    w_row = g * m_group_pad + m0
                    for col0 in range(block0, full_end, strip):
                        _tile(extension_code, True, x4, w4, tile, kq_dim, col0 - block0, col0, w_row)
                    for col0 in range(full_end, block_end, lanes):
                        _tile(extension_code, False, x4, w4, tile, kq_dim, col0 - block0, col0, w_row)
                    _store_rows(tile, min(TILE_ROWS, m_group - m0), block_end - block0, correction, dst,
                                g * m_group + m0, block0, mode, fast, mult, shift, scale, lo, hi)


ONE_BY_ONE = ((1, 1), (1, 1), (0, 0, 0, 0), (1, 1))


def conv(packed: PackedWeights, x: np.ndarray, window: tuple, output_size: tuple[int, int], bias: np.ndarray,
         scratch: dict, requant: PlaneParameters | None = None, lo: int = 0, hi: int = 0) -> np.ndarray:
    """acc[n, m, s] = sum_k w[m, k] * cols[n, k, s] + bias[m] with cols the im2col rows (eq. 9) of x (N, C, H, W)
    int8/uint8 for window = (kernel, strides, pads, dilations) and output_size (OH, OW), of the group of channel m
    (packed.groups), never written out: each image's rows are packed straight from x. Int32 (N, M, OH*OW; the
    caller has checked that every exact value fits int32), or, with requant, acc requantized and clamped to
    [lo, hi] (requantize's output_dtype: int8, uint8, or int32 for an output left wide), never stored as an
    accumulator. scratch: the caller's reusable buffers (kernels/scratch.py)."""
    window = tuple(tuple(int(v) for v in part) for part in window)
    (kh, kw), (sh, sw), (pt, pl, _, _), (dh, dw) = window
    oh_dim, ow_dim = output_size
    if window == ONE_BY_ONE:  # each im2col row is a whole plane: pack it as one run
        x = x.reshape(x.shape[0], x.shape[1], 1, -1)
        oh_dim, ow_dim = 1, oh_dim * ow_dim
    extension = packed.extension
    n_dim, s_dim = x.shape[0], oh_dim * ow_dim
    m_dim, kq_dim = packed.row_sums.shape[0], packed.words.shape[1]
    offset = _offset(x.dtype, extension)
    correction = (bias.astype(np.int64) - offset * packed.row_sums).astype(np.int32)  # modulo 2^32
    x4 = scratch_array(scratch, "int8_simd_x4", (kq_dim, padded_columns(s_dim, extension)), np.uint32)
    tile = scratch_array(scratch, "int8_simd_tile", (TILE_ROWS, block_columns(kq_dim, extension)), np.int32)
    if requant is None:
        out = scratch_array(scratch, "int8_simd_acc", (n_dim, m_dim, s_dim), np.int32)
        params = _NO_REQUANT
    else:
        out = np.empty((n_dim, m_dim, s_dim), output_dtype(lo, hi))
        params = requant
    gemm_int8(extension.code, extension.lanes, extension.strip, extension.k_per_word, packed.words, packed.groups,
              np.ascontiguousarray(x), kh, kw, sh, sw, pt, pl, dh, dw, oh_dim, ow_dim, offset, correction, x4, tile,
              out, params.mode, params.fast, params.mult, params.shift, params.scale, np.int64(lo), np.int64(hi))
    return out


def planar_gemm(packed: PackedWeights, cols: np.ndarray, bias: np.ndarray, scratch: dict) -> np.ndarray:
    """acc[n, m, s] = sum_k w[m, k] * cols[n, k, s] + bias[m], int32 (N, M, S), for cols (N, K, S) int8/uint8
    (gemm_planar's operands; the caller has checked that every exact value fits int32): `conv` with cols as a
    1 x S image of K channels and a 1x1 window."""
    n_dim, k_dim, s_dim = cols.shape
    return conv(packed, cols.reshape(n_dim, k_dim, 1, s_dim), ONE_BY_ONE, (1, s_dim), bias, scratch)


def activation_operands(a_dtype: np.dtype, b_dtype: np.dtype, extension: SimdExtension) -> str | None:
    """Which operand of a @ b `matmul` packs as the weights (the signed byte of VPDPBUSD, the first half of
    VPMADDWD): "a" when a is int8, else "b" when b is int8 (then acc^T = b^T a^T); with the 16-bit halves of AVX2
    also a uint8 a. None when neither fits (two uint8 operands on AVX-512 VNNI)."""
    if a_dtype == np.int8 or (extension.k_per_word == 2 and a_dtype == np.uint8):
        return "a"
    return "b" if b_dtype == np.int8 else None


def matmul(a: np.ndarray, b: np.ndarray, extension: SimdExtension, scratch: dict) -> np.ndarray:
    """acc[g] = a[g] @ b[g], int32 (G, M, P), for two activations a (G, M, K) and b (G, K, P), int8/uint8 (a
    MatMulGemm; the caller has checked that every exact sum fits int32 and that activation_operands is not None):
    the grouped 1x1 `conv` of a G-group image, group g's K channels b[g] of P pixels, with group g's weights
    a[g] (or, with b as the weights, b[g]^T against the image a[g]^T, transposed back). The weights are packed
    per call: both operands change with every image."""
    groups = a.shape[0]
    if activation_operands(a.dtype, b.dtype, extension) == "a":
        w, x = a, b
    else:
        w, x = b.transpose(0, 2, 1), a.transpose(0, 2, 1)
    rows, k_dim, cols = w.shape[1], w.shape[2], x.shape[2]
    packed = pack(np.ascontiguousarray(w).reshape(groups * rows, k_dim), extension, groups)
    image = np.ascontiguousarray(x).reshape(1, groups * k_dim, 1, cols)
    acc = conv(packed, image, ONE_BY_ONE, (1, cols), np.zeros(groups * rows, np.int64), scratch)
    acc = acc.reshape(groups, rows, cols)  # a view of the scratch: copied below
    return np.array(acc) if w is a else np.ascontiguousarray(acc.transpose(0, 2, 1))
