"""ConvTranspose and Resize on the GEMM unit: a ConvGemm whose im2col read upsamples its input (zeros inserted, or
rows repeated) and pads with zeros or edge rows (isa/geometry.py; design.md section 4, "Upsampling in the read").

References nobody here wrote: ONNX Runtime on the float model (the lowered float graph), ONNX's own node tests
for ConvTranspose and Resize (which cases lower, and their expected outputs), ONNX Runtime on the exported
program (bit for bit in float32_rne). Kernels equal their Python-int twins on signed and unsigned targets."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import helper, numpy_helper

from builders import make_model, max_calibration, rng_weights, run_onnxruntime, save
from calib.table import CalibrationTable, TensorRecord
from isa.geometry import zero_read_macs
from isa.target import Arithmetic, Target
from qdeploy import api
from qdeploy_base.errors import QdeployError
from simulator import twins
from simulator.machine import Machine
from qdeploy.perf import estimate_program

ort = pytest.importorskip("onnxruntime")


def dense_model(tmp_path):
    """ConvTranspose (stride 2, 3x3, pads 1, output_padding 1) -> Relu -> Resize nearest x2 (asymmetric, floor)
    + Resize linear x2 (half-pixel) -> Add -> grouped ConvTranspose (group 3, strides (1, 2), dilations (2, 1));
    and Resize linear x3 (half-pixel: two instructions, along W then H) -> Conv 3x3 stride 3."""
    scales2 = np.array([1, 1, 2, 2], np.float32)
    nodes = [
        helper.make_node("ConvTranspose", ["x", "Wt", "Bt"], ["ct"], name="ct", strides=[2, 2], pads=[1, 1, 1, 1],
                         output_padding=[1, 1]),
        helper.make_node("Relu", ["ct"], ["r"], name="relu"),
        helper.make_node("Resize", ["r", "", "scales2"], ["rn"], name="nearest", mode="nearest",
                         coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
        helper.make_node("Resize", ["ct", "", "scales2"], ["rl"], name="bilinear", mode="linear",
                         coordinate_transformation_mode="half_pixel"),
        helper.make_node("Add", ["rn", "rl"], ["a"], name="add"),
        helper.make_node("ConvTranspose", ["a", "Wg", "Bg"], ["y1"], name="ctg", group=3, strides=[1, 2],
                         dilations=[2, 1]),
        helper.make_node("Resize", ["x", "", "scales3"], ["r3"], name="bilinear3", mode="linear",
                         coordinate_transformation_mode="half_pixel"),
        helper.make_node("Conv", ["r3", "Wc", "Bc"], ["y2"], name="conv", strides=[3, 3], pads=[1, 1, 1, 1]),
    ]
    initializers = {"Wt": rng_weights(0, 2, 3, 3, 3), "Bt": rng_weights(1, 3), "scales2": scales2,
                    "Wg": rng_weights(2, 3, 1, 2, 2), "Bg": rng_weights(3, 3),
                    "scales3": np.array([1, 1, 3, 3], np.float32), "Wc": rng_weights(4, 4, 2, 3, 3),
                    "Bc": rng_weights(5, 4)}
    model = make_model(nodes, [("x", ["N", 2, 3, 4])], [("y1", ["N", 3, 14, 32]), ("y2", ["N", 4, 3, 4])],
                       initializers)
    return save(model, tmp_path / "dense.onnx")


def max_table(path, x: np.ndarray) -> CalibrationTable:
    return max_calibration(path, {"x": x})


X = np.random.default_rng(7).standard_normal((2, 2, 3, 4)).astype(np.float32)


def test_the_lowered_float_graph_equals_onnxruntime_with_no_host_op(tmp_path):
    path = dense_model(tmp_path)
    lowering = api.lower_model(path)
    assert lowering.host_ops == []
    reads = [(i.name, i.geometry.get("upsample"), i.geometry.get("upsample_fill"), i.geometry.get("pad_fill"))
             for i in lowering.instructions if "upsample" in i.geometry]
    assert reads == [("ct", [2, 2], "zero", "zero"), ("nearest", [2, 2], "nearest", "zero"),
                     ("bilinear", [2, 2], "nearest", "edge"), ("ctg", [1, 2], "zero", "zero"),
                     ("bilinear3/width", [1, 3], "nearest", "edge"), ("bilinear3", [3, 1], "nearest", "edge")]
    expected = run_onnxruntime(path, {"x": X})
    got = api.run(path, X, lowered=True)
    for name, want in zip(("y1", "y2"), expected):
        # float32 sums of at most 27 products in another order (and exact interpolation taps): a few ulps of
        # the largest value
        np.testing.assert_allclose(got[name], want, rtol=0, atol=1e-5 * np.max(np.abs(want)))


@pytest.mark.parametrize("rounding", ["half_up", "float32_rne"])
@pytest.mark.parametrize("unsigned", [False, True])
def test_every_kernel_equals_its_twin_signed_and_unsigned(tmp_path, rounding, unsigned):
    path = dense_model(tmp_path)
    target = Target(arithmetic=Arithmetic(rounding=rounding, unsigned_activations=unsigned))
    program = api.compile(path, max_table(path, X), target).program
    assert program.tensors["r"]["dtype"] == ("uint8" if unsigned else "int8")  # the Relu's, read repeated
    run = Machine(program).run({"x": X}, dump=True)
    for instr in program.instructions:
        args = [run.tensors[name] for name in instr["inputs"]]
        expected = twins.run_instruction(instr, args, program.arrays, target.arithmetic,
                                             program.tensors[instr["output"]]["dtype"])
        np.testing.assert_array_equal(run.tensors[instr["output"]], expected, err_msg=instr["name"])
    y = api.run(program, X, dequantize=True)
    reference_y = run_onnxruntime(path, {"x": X})[0]
    sqnr = 10 * np.log10(np.sum(reference_y ** 2) / np.sum((reference_y - y["y1"]) ** 2))
    assert sqnr > 25, sqnr  # int8 through five GEMMs, no clipping: measured 35-38 dB


def test_export_is_bit_exact_with_onnxruntime(tmp_path):
    from qdeploy.export_onnx import export_program

    path = dense_model(tmp_path)
    program = api.compile(path, max_table(path, X), Target(arithmetic=Arithmetic(rounding="float32_rne",
                                                                                 act_min=-128))).program
    exported = export_program(program, tensor_outputs=True)
    assert {"Expand", "Pad", "Slice"} <= {node.op_type for node in exported.model.graph.node}
    assert not {"Resize", "ConvTranspose"} & {node.op_type for node in exported.model.graph.node}
    session = ort.InferenceSession(exported.model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": X})))
    simulated = Machine(program).run({"x": X}, dump=True).tensors
    for tensor, onnx_name in exported.tensor_names.items():
        np.testing.assert_array_equal(simulated[tensor], got[onnx_name], err_msg=tensor)


def test_golden_vectors_hold_the_read_as_the_array_sees_it(tmp_path):
    """The ConvTranspose's im2col rows are those of the input with zeros inserted, built here with numpy
    slicing (not the simulator's read); acc = input . weight + bias."""
    from simulator.kernels.im2col import im2col
    from simulator.vectors import export_vectors

    path = dense_model(tmp_path)
    program = api.compile(path, max_table(path, X), Target()).program
    manifest = export_vectors(program, {"x": X[:1]}, tmp_path / "vec").manifest
    (layer,) = [entry for entry in manifest["layers"] if entry["name"] == "ct"]
    assert layer["conv"]["upsample"] == [2, 2] and layer["conv"]["upsample_fill"] == "zero"
    folder = tmp_path / "vec" / layer["dir"]
    q = Machine(program).run({"x": X[:1]}, dump=True).tensors["x"]
    inserted = np.zeros((1, 2, 5, 7), q.dtype)
    inserted[:, :, ::2, ::2] = q
    expected = im2col(inserted, (3, 3), (1, 1), (1, 1, 2, 2), (1, 1))  # pads k-1-p, + output_padding at the end
    np.testing.assert_array_equal(np.load(folder / "input.npy"), expected)
    acc = np.load(folder / "input.npy")[0].astype(np.int64) @ np.load(folder / "weight.npy")[0] + \
        np.load(folder / "bias.npy")
    np.testing.assert_array_equal(np.load(folder / "acc.npy"), acc)


def test_zero_insertion_wastes_three_macs_in_four_for_a_2x2_stride_2_transpose(tmp_path):
    """ConvTranspose 2x2 stride 2, no pads: the read is (2H-1) wide with one zero pad on each side, and each
    output reads exactly one input element of its four taps (sub-pixel decomposition would run that one)."""
    nodes = [helper.make_node("ConvTranspose", ["x", "W"], ["y"], name="up", strides=[2, 2])]
    model = make_model(nodes, [("x", ["N", 4, 5, 6])], [("y", ["N", 3, 10, 12])], {"W": rng_weights(0, 4, 3, 2, 2)})
    path = save(model, tmp_path / "up.onnx")
    (instr,) = api.lower_model(path).instructions
    assert instr.macs == 3 * 4 * 4 * 10 * 12 and instr.geometry["zero_macs"] == instr.macs * 3 // 4
    assert zero_read_macs(5, 6, (2, 2), (1, 1), (1, 1, 1, 1), (1, 1), (2, 2), "zero", None, 12) == 12 * 3 * 10 * 12
    table = CalibrationTable({"x": TensorRecord("x", "max", 3.0), "y": TensorRecord("y", "max", 3.0)}, "max", 0)
    program = api.compile(path, table).program
    perf = estimate_program(program.manifest, program.arrays, batch=2)
    assert perf.layers[0].zero_macs == 2 * instr.macs * 3 // 4 and perf.totals["zero_macs"] == perf.layers[0].zero_macs


# --- ONNX's own node tests --------------------------------------------------------------------------------------

# The 2-D cases that run on the GEMM unit (bilinear align_corners as two GEMMs of its interpolation matrices); every
# other 2-D case stays on the host with its reason (a non-integer scale, a nearest mode that does not repeat rows, cubic, downsampling, crop-and-resize; a Pad with
# a nonzero constant, of the channels, with explicit axes, or wrapping around).
ON_THE_ARRAY = {
    "test_convtranspose", "test_convtranspose_output_shape", "test_convtranspose_pad",
    "test_convtranspose_kernel_shape", "test_convtranspose_pads", "test_convtranspose_dilations",
    "test_convtranspose_autopad_same", "test_convtranspose_group_2", "test_convtranspose_group_2_image_3",
    "test_resize_upsample_scales_nearest", "test_resize_upsample_scales_linear",
    "test_resize_upsample_scales_nearest_axes_2_3", "test_resize_upsample_scales_nearest_axes_3_2",
    "test_resize_upsample_sizes_nearest_not_smaller", "test_resize_upsample_scales_linear_align_corners",
    "test_edge_pad", "test_reflect_pad",
}

# Refused at import (before lowering), with the reason: the importer frees the batch dimension, and a
# crop-and-resize roi over every axis includes the batch; antialiased downsampling has no float meaning here.
IMPORT_REFUSED = {**{f"test_resize_tf_crop_and_resize{suffix}": "tf_crop_and_resize needs a roi"
                     for suffix in ("", "_extrapolation_value")},
                  **{f"test_resize_downsample_{kind}_{mode}_antialias": "antialias=1 is not supported"
                     for kind in ("scales", "sizes") for mode in ("linear", "cubic")}}


def _node_cases():
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = {}
        for case in collect_testcases():
            ops = [node.op_type for node in case.model.graph.node]
            if ops in (["ConvTranspose"], ["Resize"], ["Pad"]) and case.data_sets[0][0][0].ndim == 4:
                cases.setdefault(case.name, case)
    return cases


def test_onnx_node_tests_lower_where_the_read_can_and_match_their_outputs(tmp_path):
    """Each 2-D case with its operands after the first made initializers (the lowering needs constant weights,
    scales and sizes), at opset 21 (ConvTranspose-22 and Resize-19 mean the same for float32 as at 21)."""
    lowered = set()
    for name, case in _node_cases().items():
        inputs, outputs = case.data_sets[0]
        graph = case.model.graph
        constants = [numpy_helper.from_array(value, info.name) for info, value in zip(graph.input[1:], inputs[1:])]
        model = helper.make_model(helper.make_graph(list(graph.node), name, [graph.input[0]], list(graph.output),
                                                    constants), opset_imports=[helper.make_opsetid("", 21)])
        model.ir_version = 8
        path = save(model, tmp_path / f"{name}.onnx")
        try:
            result = api.lower_model(path)
        except QdeployError as error:
            assert name in IMPORT_REFUSED and IMPORT_REFUSED[name] in str(error), (name, str(error))
            continue
        if result.host_ops:
            assert all(f"node '{graph.node[0].name}" in h.reason or h.op == graph.node[0].op_type
                       for h in result.host_ops), name
            continue
        lowered.add(name)
        got = api.run(path, inputs[0], lowered=True)
        (value,) = got.values()
        np.testing.assert_allclose(value, outputs[0], rtol=1e-5, atol=1e-5, err_msg=name)
    assert lowered == ON_THE_ARRAY


@pytest.mark.parametrize("mode", ["edge", "reflect"])
def test_an_edge_or_reflect_pad_folds_into_the_next_convs_read_and_stands_alone_elsewhere(tmp_path, mode):
    """Pad (H and W) -> Conv: one ConvGemm whose read pads; the same Pad feeding an Add: an identity GEMM whose
    read pads. Lowered float = ONNX Runtime; kernels = twins; the export is bit-exact with ONNX Runtime."""
    from qdeploy.export_onnx import export_program

    pads = np.array([0, 0, 1, 2, 0, 0, 2, 1], np.int64)
    nodes = [helper.make_node("Pad", ["x", "pads"], ["p"], name="pad", mode=mode),
             helper.make_node("Conv", ["p", "W", "B"], ["c"], name="conv"),
             helper.make_node("Pad", ["x", "pads"], ["q"], name="pad2", mode=mode),
             helper.make_node("Conv", ["x", "W2"], ["d"], name="conv2", pads=[1, 2, 2, 1]),
             helper.make_node("Add", ["q", "d"], ["y2"], name="add")]
    model = make_model(nodes, [("x", ["N", 2, 3, 4])], [("c", ["N", 3, 4, 5]), ("y2", ["N", 2, 6, 7])],
                       {"pads": pads, "W": rng_weights(0, 3, 2, 3, 3), "B": rng_weights(1, 3),
                        "W2": rng_weights(2, 2, 2, 1, 1)})
    path = save(model, tmp_path / "pad.onnx")
    lowering = api.lower_model(path)
    assert lowering.host_ops == []
    reads = {i.name: (i.geometry.get("pad_fill"), i.geometry["pads"]) for i in lowering.instructions
             if "pad_fill" in i.geometry}
    assert reads == {"conv": (mode, [1, 2, 2, 1]), "pad2": (mode, [1, 2, 2, 1])}
    for got, want in zip(api.run(path, X, lowered=True).values(), run_onnxruntime(path, {"x": X})):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.max(np.abs(want)))
    target = Target(arithmetic=Arithmetic(rounding="float32_rne", act_min=-128))
    program = api.compile(path, max_table(path, X), target).program
    run = Machine(program).run({"x": X}, dump=True)
    for instr in program.instructions:
        expected = twins.run_instruction(instr, [run.tensors[n] for n in instr["inputs"]], program.arrays,
                                             target.arithmetic, program.tensors[instr["output"]]["dtype"])
        np.testing.assert_array_equal(run.tensors[instr["output"]], expected, err_msg=instr["name"])
    exported = export_program(program, tensor_outputs=True)
    session = ort.InferenceSession(exported.model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": X})))
    for tensor, onnx_name in exported.tensor_names.items():
        np.testing.assert_array_equal(run.tensors[tensor], got[onnx_name], err_msg=tensor)


def test_a_resize_nearest_before_a_conv_folds_into_its_read(tmp_path):
    """Resize nearest x2 (asymmetric, floor: torch's nn.Upsample) -> Conv 3x3 pad 1: one ConvGemm that reads its
    input repeated; the conv's zero padding pads the repeated input, as in the float model."""
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["up"], name="up", mode="nearest",
                              coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
             helper.make_node("Conv", ["up", "W", "B"], ["y"], name="conv", pads=[1, 1, 1, 1])]
    model = make_model(nodes, [("x", ["N", 2, 3, 4])], [("y", ["N", 3, 6, 8])],
                       {"scales": np.array([1, 1, 2, 2], np.float32), "W": rng_weights(0, 3, 2, 3, 3),
                        "B": rng_weights(1, 3)})
    path = save(model, tmp_path / "fold.onnx")
    (instr,) = api.lower_model(path).instructions
    assert (instr.name, instr.geometry["upsample"], instr.geometry["upsample_fill"]) == ("conv", [2, 2], "nearest")
    assert instr.geometry["output"] == [3, 6, 8] and instr.geometry["zero_macs"] > 0  # the zero padding's taps
    want = run_onnxruntime(path, {"x": X})[0]
    np.testing.assert_allclose(api.run(path, X, lowered=True)["y"], want, rtol=0, atol=1e-5 * np.max(np.abs(want)))
    program = api.compile(path, max_table(path, X)).program
    run = Machine(program).run({"x": X}, dump=True)
    (record,) = program.instructions
    expected = twins.run_instruction(record, [run.tensors["x"]], program.arrays, Arithmetic(), "int8")
    np.testing.assert_array_equal(run.tensors["y"], expected)


def test_a_pad_of_nothing_on_tokens_is_an_identity_gemm(tmp_path):
    """Swin's window Pad at a multiple of the window pads nothing on an (N, H, W, C) tensor: y = x on the GEMM
    unit (no host op), the lowered float graph = ONNX Runtime, and the compiled pad's codes = its input's."""
    tokens = np.random.default_rng(3).normal(size=(2, 4, 4, 8)).astype(np.float32)
    nodes = [helper.make_node("Pad", ["x", "pads"], ["p"], name="pad"),
             helper.make_node("Add", ["p", "x"], ["y"], name="add")]
    model = make_model(nodes, [("x", ["N", 4, 4, 8])], [("y", ["N", 4, 4, 8])],
                       {"pads": np.zeros(8, np.int64)})
    path = save(model, tmp_path / "pad_nothing.onnx")
    lowering = api.lower_model(path)
    assert lowering.host_ops == []
    for got, want in zip(api.run(path, tokens, lowered=True).values(), run_onnxruntime(path, {"x": tokens})):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.max(np.abs(want)))
    program = api.compile(path, max_table(path, tokens)).program
    run = Machine(program).run({"x": tokens}, dump=True)
    np.testing.assert_array_equal(run.tensors["p"], run.tensors["x"])
