"""The channel-planar fast paths equal the paths they replace, bit for bit:

- gemm_planar (weights on the left, result in NCHW order) equals the K-ordered gemm on the transposed operands:
  accumulators and event counts, K beyond the float32 chunk, uint8, crafted overflows, every register;
- im2col_planar equals the Python-int im2col twin, transposed per image;
- requantize on a channel-planar view (an NCHW accumulator seen as (N, H*W, C)) equals requantize on the
  contiguous copy and the Python-int twin, every rounding mode;
- the machine: whole programs give the same outputs, accumulators and events with the planar/depthwise
  methods as with im2col + grouped GEMM for every instruction, and with 1 or several threads.
"""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from simulator import twins as ref
from isa.target import Arithmetic, Target
from simulator.kernels import int8_simd
from simulator.kernels.gemm import DESIGN_CHUNK, channels_in_range, gemm, gemm_planar
from simulator.kernels.im2col import im2col_planar
from simulator.kernels.requantize import requantize
from isa.geometry import conv_output_size

ROUNDINGS = ["half_up", "half_away", "half_even", "tflite", "float32_rne"]


def ordered_planar(w, cols, acc_bits, overflow, bias):
    """The K-ordered GEMM of the rows (n, s) of cols with w^T, rearranged to (N, M, S)."""
    n, k, s = cols.shape
    rows = np.ascontiguousarray(cols.transpose(0, 2, 1)).reshape(n * s, k)
    result = gemm(rows, np.ascontiguousarray(w.T), acc_bits, overflow, bias=bias, method="ordered")
    return result.acc.reshape(n, s, -1).transpose(0, 2, 1), result.events


@pytest.mark.parametrize("acc_bits, overflow", [(32, "wrap"), (16, "wrap"), (40, "wrap"), (64, "wrap"),
                                                (32, "saturate"), (20, "saturate")])
def test_gemm_planar_equals_ordered_gemm(acc_bits, overflow):
    rng = np.random.default_rng(acc_bits + len(overflow))
    scratch: dict = {}
    for trial in range(25):
        k = int(rng.integers(DESIGN_CHUNK + 1, 2 * DESIGN_CHUNK + 100)) if trial % 5 == 0 else int(rng.integers(1, 60))
        n, s, m = (int(v) for v in rng.integers(1, 5, 3))
        dtype = np.uint8 if trial % 3 == 0 else np.int8
        info = np.iinfo(dtype)
        cols = rng.integers(info.min, info.max + 1, (n, k, s), dtype=dtype)
        w = rng.integers(-128, 128, (m, k), dtype=np.int8)
        if trial % 4 == 0:  # extreme operands
            cols[...] = info.min if dtype == np.int8 else info.max
            w[...] = -128
        limit = 1 << min(acc_bits - 1, 40)
        bias = rng.integers(-limit, limit, m)
        bias[0] = -limit  # a saturated-looking bias in one channel: that channel takes the checked path
        want, want_events = ordered_planar(w, cols, acc_bits, overflow, bias)
        got = gemm_planar(w, cols, acc_bits, overflow, bias=bias, scratch=scratch if trial % 2 else None)
        assert got.acc.dtype == want.dtype
        assert_array_equal(got.acc, want, err_msg=f"n={n} k={k} s={s} m={m} {dtype}")
        assert got.events == want_events


def test_gemm_planar_32_bit_wrap_hand_worked():
    """K = 1 product 127 * 127 with bias 2^31 - 100: the exact value leaves int32, wraps, one event."""
    cols = np.full((1, 1, 2), 127, np.int8)
    w = np.full((1, 1), 127, np.int8)
    result = gemm_planar(w, cols, bias=np.array([2**31 - 100]))
    assert result.acc.tolist() == [[[ref.wrap(2**31 - 100 + 127 * 127, 32)] * 2]] and result.events == 2


def test_channels_in_range_is_the_worst_case_bound_per_channel():
    w_max = np.array([127, 127, 0, 127])
    bias = np.array([0, 2**31 - 1 - 10 * 128 * 127, -(2**31), 2**31 - 10 * 128 * 127])
    # channel 0: 162560 <= limit; 1: exactly at the limit; 2: no taps, |bias| = 2^31 > limit; 3: one beyond
    assert channels_in_range(10, 128, w_max, bias, 2**31 - 1).tolist() == [True, True, False, False]


def test_im2col_planar_equals_the_twin():
    rng = np.random.default_rng(3)
    for _ in range(80):
        n, c = (int(v) for v in rng.integers(1, 3, 2))
        h, w = (int(v) for v in rng.integers(1, 10, 2))
        kernel = tuple(int(v) for v in rng.integers(1, 5, 2))
        strides = tuple(int(v) for v in rng.integers(1, 4, 2))
        dilations = tuple(int(v) for v in rng.integers(1, 3, 2))
        pads = tuple(int(v) for v in rng.integers(0, 3, 4))
        if (conv_output_size(h, kernel[0], strides[0], pads[0], pads[2], dilations[0]) < 1
                or conv_output_size(w, kernel[1], strides[1], pads[1], pads[3], dilations[1]) < 1):
            continue
        x = rng.integers(-128, 128, (n, c, h, w), dtype=np.int8)
        cols = ref.im2col(x, kernel, strides, pads, dilations, 1)[0]  # (N*OH*OW, K)
        want = cols.reshape(n, -1, cols.shape[1]).transpose(0, 2, 1)
        assert_array_equal(im2col_planar(x, kernel, strides, pads, dilations), want)
    x = rng.integers(-128, 128, (2, 3, 4, 5), dtype=np.int8)
    pointwise = im2col_planar(x, (1, 1))
    assert pointwise.shape == (2, 3, 20) and np.shares_memory(pointwise, x)  # 1x1: a view, no copy


@pytest.mark.parametrize("mode", ROUNDINGS)
def test_requantize_on_a_planar_view_equals_the_contiguous_path_and_the_twin(mode):
    rng = np.random.default_rng(ROUNDINGS.index(mode))
    channels, pixels = 5, 40
    edges = [0, 1, -1, 2**31 - 1, -(2**31), 2**30, -(2**30), 2**16 + 1, -(2**16) - 1, 12345, -12345]
    acc = rng.integers(-(2**31), 2**31, (2, channels, pixels), dtype=np.int64).astype(np.int32)
    acc[1] >>= rng.integers(0, 31, (channels, pixels))  # small values too, so not everything clamps
    acc[0, :, :len(edges)] = edges
    view = acc.transpose(0, 2, 1)  # (N, S, C): channel-planar memory
    mult = rng.integers(2**30, 2**31, channels)
    shift = np.array([31, 33, 40, 50, 62]) if mode == "tflite" else np.array([1, 31, 40, 62, 70])
    scale = (rng.random(channels) * 2.0 ** -12).astype(np.float32)
    for lo, hi in [(-127, 127), (0, 255), (0, 100)]:
        kwargs = dict(mode=mode, lo=lo, hi=hi)
        if mode == "float32_rne":
            got = requantize(view, scale=scale, **kwargs)
            contiguous = requantize(np.ascontiguousarray(view), scale=scale, **kwargs)
        else:
            got = requantize(view, mult, shift, **kwargs)
            contiguous = requantize(np.ascontiguousarray(view), mult, shift, **kwargs)
        assert np.shares_memory(got.transpose(0, 2, 1), got) and got.transpose(0, 2, 1).flags.c_contiguous
        assert_array_equal(got, contiguous)  # the rows path mixes fast and general channels here
        for (n, s, c), value in np.ndenumerate(got):
            a = int(view[n, s, c])
            want = (ref.requantize(a, mode=mode, lo=lo, hi=hi, scale=scale[c]) if mode == "float32_rne" else
                    ref.requantize(a, int(mult[c]), int(shift[c]), mode, lo, hi))
            assert int(value) == want, (n, s, c, a)


# --- the machine ------------------------------------------------------------------------------------------

def small_images(n, seed, split):
    from examples import images

    return images.image_batch(n, seed=seed, split=split, size=64)


def grouped_machine(program, **kwargs):
    """A machine whose every ConvGemm/DenseGemm runs as im2col + grouped GEMM (the path before the planar and
    depthwise methods)."""
    from simulator.machine import Machine, _GemmPlan

    machine = Machine(program, **kwargs)
    for instr in program.instructions:
        if "weight" in instr:
            w = program.arrays[instr["weight"]]
            groups = instr.get("group", 1)
            machine.plans[instr["name"]] = _GemmPlan("grouped", np.ascontiguousarray(
                w.reshape(groups, w.shape[0] // groups, w.shape[1]).transpose(0, 2, 1)))
    return machine


@pytest.fixture(scope="module")
def mobilenet_table(mobilenetv2_style_onnx):
    from qdeploy.calibration import calibrate

    return calibrate(mobilenetv2_style_onnx, small_images(8, 0, "calib"), "max", num_samples=8, batch_size=8).table


@pytest.mark.parametrize("arithmetic", [Arithmetic(), Arithmetic(rounding="float32_rne", act_min=-128),
                                        Arithmetic(acc_bits=16, overflow="saturate", rounding="half_even"),
                                        Arithmetic(acc_bits=16, rounding="tflite")],
                         ids=["default", "float32_rne", "saturate16", "wrap16_tflite"])
def test_machine_methods_and_threads_agree_bit_for_bit(mobilenetv2_style_onnx, mobilenet_table, arithmetic):
    from qdeploy import api
    from simulator.machine import Machine

    program = api.compile(mobilenetv2_style_onnx, mobilenet_table, Target(arithmetic=arithmetic)).program
    plans = Machine(program).plans.values()
    assert {plan.method for plan in plans} == {"planar", "depthwise"}  # the fast methods are really exercised
    if int8_simd.EXTENSION is not None and arithmetic.acc_bits == 32:  # and the int8 dot product with its fused store
        assert any(plan.fused is not None for plan in plans)
    x = small_images(5, 1, "eval")
    name = program.inputs[0]
    fast = Machine(program, threads=2).run({name: x})
    single = Machine(program, threads=1).run({name: x})
    dumped = Machine(program).run({name: x}, dump=True)
    profiled = Machine(program, threads=2).run({name: x}, profile=True)
    assert profiled.seconds.keys() == {instr["name"] for instr in program.instructions}
    old = grouped_machine(program).run({name: x}, dump=True)
    for result in (fast, single, dumped, profiled):
        assert result.overflow_events == old.overflow_events
        for key, value in old.outputs.items():
            assert_array_equal(result.outputs[key], value)
    assert dumped.accumulators.keys() == old.accumulators.keys()
    for key, value in old.accumulators.items():
        assert_array_equal(dumped.accumulators[key], value, err_msg=key)
    for key, value in old.tensors.items():
        assert_array_equal(dumped.tensors[key], value, err_msg=key)
    if arithmetic.acc_bits == 16:
        assert sum(old.overflow_events.values()) > 0  # the crafted register really overflows somewhere


def test_execute_keeps_its_contract(mobilenetv2_style_onnx, mobilenet_table):
    """Machine.execute (used by reports, bias correction, vectors) returns ConvGemm accumulators as
    (N*OH*OW, M), the same as before."""
    from qdeploy import api
    from simulator.machine import Machine, quantize_input

    program = api.compile(mobilenetv2_style_onnx, mobilenet_table).program
    x = quantize_input(program, program.inputs[0], small_images(2, 2, "eval"))
    fast, old = Machine(program), grouped_machine(program)
    env_fast, env_old = {program.inputs[0]: x}, {program.inputs[0]: x}
    for instr in program.instructions:
        y_fast, acc_fast, events_fast = fast.execute(instr, [env_fast[n] for n in instr["inputs"]])
        y_old, acc_old, events_old = old.execute(instr, [env_old[n] for n in instr["inputs"]])
        assert_array_equal(y_fast, y_old)
        assert (acc_fast is None) == (acc_old is None) and events_fast == events_old
        if acc_old is not None:
            assert acc_fast.shape == acc_old.shape
            assert_array_equal(acc_fast, acc_old)
        env_fast[instr["output"]], env_old[instr["output"]] = y_fast, y_old


def test_machine_outputs_do_not_depend_on_threads_or_batch_splits(mobilenetv2_style_onnx, mobilenet_table):
    """Each image's integers are the same whether it runs alone, in a batch of 7 on 1 or 3 threads, or in a
    batch cut into uneven parts (Machine.run cuts a batch into slices that threads run side by side)."""
    from qdeploy import api
    from simulator.machine import Machine

    program = api.compile(mobilenetv2_style_onnx, mobilenet_table).program
    name, out = program.inputs[0], program.outputs[0]
    x = small_images(7, 2, "eval")
    whole = Machine(program, threads=1).run({name: x}).outputs[out]
    assert len(np.unique(whole, axis=0)) == len(x)  # the images really differ
    three = Machine(program, threads=3).run({name: x}).outputs[out]
    alone = np.concatenate([Machine(program, threads=2).run({name: x[i:i + 1]}).outputs[out] for i in range(7)])
    parts = np.concatenate([Machine(program, threads=2).run({name: x[a:b]}).outputs[out]
                            for a, b in ((0, 2), (2, 3), (3, 7))])
    for result in (three, alone, parts):
        assert_array_equal(result, whole)
