"""The int8 dot-product GEMM (simulator/kernels/int8_simd.py) equals the K-ordered integer GEMM bit for bit, with
its requantizing store equal to requantize() of its int32 result; it is used exactly where every exact sum fits
the register. Each instruction set runs where this CPU has it (AVX-512 VNNI and AVX2 on a VNNI machine); on a CPU
with neither the float32 path runs, tested in tests/test_sim_planar.py."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from simulator.kernels import int8_simd
from isa.geometry import conv_output_size
from simulator.kernels.gemm import gemm, gemm_planar
from simulator.kernels.im2col import im2col_planar
from simulator.kernels.requantize import plane_parameters, requantize

EXTENSIONS = [pytest.param(extension, id=extension.name, marks=pytest.mark.skipif(not int8_simd.compiles_for(extension),
                                                                reason=f"this CPU has no {extension.name}"))
        for extension in (int8_simd.AVX512_VNNI, int8_simd.AVX2)]

ROUNDINGS = ["half_up", "half_away", "half_even", "tflite", "float32_rne"]


def ordered(w, cols, bias):
    n, k, s = cols.shape
    rows = np.ascontiguousarray(cols.transpose(0, 2, 1)).reshape(n * s, k)
    acc = gemm(rows, np.ascontiguousarray(w.T), 32, "wrap", bias=bias, method="ordered").acc
    return acc.reshape(n, s, -1).transpose(0, 2, 1)


@pytest.mark.parametrize("extension", EXTENSIONS)
def test_hand_worked_dot_products(extension):
    """One output row: 1*255 + 2*0 + 3*1 + 4*2 + 5*3 + bias 7 = 288; int8 input -128..: the +128 offset cancels."""
    w = np.array([[1, 2, 3, 4, 5]], np.int8)
    x = np.array([255, 0, 1, 2, 3], np.uint8).reshape(1, 5, 1)
    got = gemm_planar(w, x, bias=np.array([7]), packed=int8_simd.pack(w, extension))
    assert got.method == "int8_simd" and got.acc.tolist() == [[[288]]]
    x8 = np.array([-128, 127, -1, 0, 1], np.int8).reshape(1, 5, 1)  # -128 + 254 - 3 + 0 + 5 - 2 = 126
    got8 = gemm_planar(w, x8, bias=np.array([-2]), packed=int8_simd.pack(w, extension))
    assert got8.acc.tolist() == [[[126]]]


@pytest.mark.parametrize("extension", EXTENSIONS)
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_equals_the_ordered_gemm_on_every_tile_edge(dtype, extension):
    """M, K and S around the register tile (4 rows, 16-lane vectors, 64-column strips, 4-byte groups of k) and
    the column blocks, random and extreme operands (every product at its largest magnitude)."""
    rng = np.random.default_rng(3 if dtype == np.uint8 else 4)
    info = np.iinfo(dtype)
    scratch: dict = {}
    shapes = [(1, 1, 1), (3, 5, 17), (4, 4, 64), (5, 7, 65), (9, 13, 130), (8, 33, 200), (12, 256, 80),
              (3, 1200, 21), (64, 16, 2200)]
    for trial, (m, k, s) in enumerate(shapes):
        n = 2
        cols = rng.integers(info.min, info.max + 1, (n, k, s), dtype=dtype)
        w = rng.integers(-128, 128, (m, k), dtype=np.int8)
        if trial % 3 == 1:
            cols[...] = info.min if dtype == np.int8 else info.max
            w[...] = -128
        bias = rng.integers(-(1 << 20), 1 << 20, m)
        got = gemm_planar(w, cols, bias=bias, packed=int8_simd.pack(w, extension), scratch=scratch)
        assert got.method == "int8_simd" and got.events == 0
        assert_array_equal(got.acc, ordered(w, cols, bias), err_msg=f"m={m} k={k} s={s}")


WINDOWS = [((3, 3), (1, 1), (1, 1, 1, 1), (1, 1)), ((3, 3), (2, 2), (0, 1, 1, 0), (1, 1)),
           ((5, 5), (2, 1), (2, 2, 2, 2), (1, 1)), ((3, 3), (1, 1), (2, 2, 2, 2), (2, 2)),
           ((1, 7), (1, 3), (0, 3, 0, 3), (1, 1)), ((2, 2), (2, 2), (0, 0, 0, 0), (1, 1))]


@pytest.mark.parametrize("extension", EXTENSIONS)
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("window", WINDOWS,
                         ids=lambda w: "k{}x{}_s{}x{}_p{}{}{}{}_d{}x{}".format(*w[0], *w[1], *w[2], *w[3]))
def test_conv_reads_the_im2col_rows_straight_from_the_image(window, dtype, extension):
    """conv packs each image's im2col rows (eq. 9) from x itself: equal to the ordered GEMM of im2col_planar's
    rows, padding included (the real 0, which a signed x carries as the offset byte 128)."""
    kernel, strides, pads, dilations = window
    rng = np.random.default_rng(sum(kernel) + strides[0])
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max + 1, (2, 5, 11, 13), dtype=dtype)
    x[1] = info.min  # an image at the end of the range: padding must still read as 0
    m = 7
    w = rng.integers(-128, 128, (m, 5 * kernel[0] * kernel[1]), dtype=np.int8)
    bias = rng.integers(-1000, 1000, m)
    cols = im2col_planar(x, kernel, strides, pads, dilations)
    oh = conv_output_size(11, kernel[0], strides[0], pads[0], pads[2], dilations[0])
    ow = conv_output_size(13, kernel[1], strides[1], pads[1], pads[3], dilations[1])
    got = int8_simd.conv(int8_simd.pack(w, extension), x, window, (oh, ow), bias, {})
    assert_array_equal(got, ordered(w, cols, bias))


@pytest.mark.parametrize("extension", EXTENSIONS)
@pytest.mark.parametrize("groups, m", [(3, 9), (2, 16), (6, 6)])
def test_grouped_conv_reads_each_groups_channels_with_its_weights(groups, m, extension):
    """A grouped convolution: group g's output channels g M/G .. read input channels g C/G .. only (ONNX Conv
    `group`); 3 rows per group pad to a 4-row tile that must not reach the next group's weights."""
    rng = np.random.default_rng(groups + m)
    x = rng.integers(-128, 128, (2, 6, 9, 9), dtype=np.int8)
    c_group, m_group = 6 // groups, m // groups
    w = rng.integers(-128, 128, (m, c_group * 9), dtype=np.int8)
    bias = rng.integers(-1000, 1000, m)
    window = ((3, 3), (1, 1), (1, 1, 1, 1), (1, 1))
    want = np.concatenate([ordered(w[g * m_group:(g + 1) * m_group],
                                   im2col_planar(x[:, g * c_group:(g + 1) * c_group], *window),
                                   bias[g * m_group:(g + 1) * m_group]) for g in range(groups)], axis=1)
    got = int8_simd.conv(int8_simd.pack(w, extension, groups), x, window, (9, 9), bias, {})
    assert_array_equal(got, want)


@pytest.mark.parametrize("extension", EXTENSIONS)
def test_only_where_every_sum_fits_the_register(extension):
    """A bias that could carry a sum past 2^31 - 1 (or a 16-bit register) keeps the checked float32 path."""
    rng = np.random.default_rng(5)
    w = rng.integers(-128, 128, (6, 40), dtype=np.int8)
    cols = rng.integers(0, 256, (1, 40, 9), dtype=np.uint8)
    packed = int8_simd.pack(w, extension)
    near_limit = np.full(6, (1 << 31) - 100)
    assert gemm_planar(w, cols, bias=near_limit, packed=packed).method == "fast"
    assert gemm_planar(w, cols, 16, bias=np.zeros(6, np.int64), packed=packed).method == "fast"
    assert gemm_planar(w, cols, 32, "saturate", bias=np.zeros(6, np.int64), packed=packed).method == "int8_simd"


@pytest.mark.parametrize("extension", EXTENSIONS)
@pytest.mark.parametrize("mode", ROUNDINGS)
def test_requantizing_store_equals_requantize(mode, extension):
    """planar_gemm with the output stage in its store equals requantize() of its int32 result, for int8 and uint8
    outputs and an int32 one (an output the model leaves wide); channel multipliers span the fast and the general
    formulas (a zero multiplier has shift 0)."""
    rng = np.random.default_rng(len(mode))
    m, k, s = 11, 37, 150
    w = rng.integers(-128, 128, (m, k), dtype=np.int8)
    cols = rng.integers(0, 256, (3, k, s), dtype=np.uint8)
    bias = rng.integers(-5000, 5000, m)
    packed = int8_simd.pack(w, extension)
    acc = int8_simd.planar_gemm(packed, cols, bias, {}).copy()
    image = cols.reshape(3, k, 1, s)
    if mode == "float32_rne":
        scale = rng.uniform(1e-5, 1e-3, m).astype(np.float32)
        kwargs, params = {"scale": scale}, plane_parameters(m, mode, scale=scale)
    else:
        mult = rng.integers(1 << 29, 1 << 31, m)
        shift = rng.integers(36, 44, m)
        mult[0], shift[0] = 0, 0
        kwargs, params = {"mult": mult, "shift": shift}, plane_parameters(m, mode, mult, shift)
    assert params.mode == 4 or not params.fast.all()  # both kinds of channel are exercised
    for lo, hi in ((-128, 127), (0, 255), (-(1 << 31), (1 << 31) - 1)):  # int8, uint8, an int32 output
        want = requantize(acc.transpose(0, 2, 1), mode=mode, lo=lo, hi=hi, **kwargs).transpose(0, 2, 1)
        got = int8_simd.conv(packed, image, int8_simd.ONE_BY_ONE, (1, s), bias, {}, params, lo, hi)
        assert got.dtype == want.dtype
        assert_array_equal(got, want)
        assert len(np.unique(got)) > 20  # not all clamped


def test_the_instruction_set_follows_what_numba_compiles_for(monkeypatch):
    """NUMBA_CPU_NAME=generic (a portable cache) compiles for no extension: no int8 kernel, or LLVM would abort on
    an instruction the target lacks (seen before this rule); NUMBA_CPU_FEATURES names the features of another
    CPU; without either, the host's."""
    from numba.core import config

    monkeypatch.setattr(config, "CPU_NAME", "generic")
    monkeypatch.setattr(config, "CPU_FEATURES", None)
    assert int8_simd._compile_features() == {}
    monkeypatch.setattr(config, "CPU_NAME", "haswell")
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+fma,-avx512f")
    assert int8_simd._compile_features() == {"avx2": True, "fma": True, "avx512f": False}
    monkeypatch.setattr(config, "CPU_NAME", None)
    monkeypatch.setattr(config, "CPU_FEATURES", None)
    host = int8_simd._compile_features()
    assert host and all(isinstance(value, bool) for value in host.values())


OPERAND_TYPES = [(np.int8, np.int8), (np.uint8, np.int8), (np.int8, np.uint8), (np.uint8, np.uint8)]


@pytest.mark.parametrize("extension", EXTENSIONS)
@pytest.mark.parametrize("a_dtype,b_dtype", OPERAND_TYPES, ids=lambda t: np.dtype(t).name)
def test_matmul_of_two_activations_equals_the_ordered_gemm(a_dtype, b_dtype, extension):
    """A MatMulGemm's a[g] @ b[g] (G, M, K) x (G, K, P), either operand packed as the weights (the int8 one; AVX2's
    16-bit halves also take a uint8 a), equals the K-ordered GEMM on the tile edges and at the operands' extremes
    (every product at its largest magnitude); two uint8 operands on VNNI have no signed byte: refused."""
    if int8_simd.activation_operands(np.dtype(a_dtype), np.dtype(b_dtype), extension) is None:
        assert extension is int8_simd.AVX512_VNNI and a_dtype == b_dtype == np.uint8
        return
    rng = np.random.default_rng(5)
    scratch: dict = {}
    for trial, (g, m, k, p) in enumerate([(1, 1, 1, 1), (3, 5, 4, 5), (2, 17, 64, 17), (4, 4, 7, 65),
                                          (2, 65, 33, 130), (1, 197, 64, 197)]):
        a = rng.integers(np.iinfo(a_dtype).min, np.iinfo(a_dtype).max + 1, (g, m, k), dtype=a_dtype)
        b = rng.integers(np.iinfo(b_dtype).min, np.iinfo(b_dtype).max + 1, (g, k, p), dtype=b_dtype)
        if trial % 3 == 1:
            a[...] = np.iinfo(a_dtype).min if a_dtype == np.int8 else 255
            b[...] = np.iinfo(b_dtype).min if b_dtype == np.int8 else 255
        expected = gemm(a, b, 32, "wrap", method="ordered")
        assert expected.events == 0
        got = int8_simd.matmul(a, b, extension, scratch)
        assert got.dtype == np.int32
        assert_array_equal(got, expected.acc, err_msg=f"g={g} m={m} k={k} p={p}")
