"""A transformer's token layout on the GEMM unit (design.md section 4, "Token layout"): a Transpose of token
tensors is an AxisPermute, a Gather of one index along an axis past the batch a ChannelSlice along that axis, a
constant class token concatenated to the activations (batch_one.py: Pad + Add) a padding read and a per-element
constant, a constant that is not per channel a per-element affine GEMM, and attention's operand scales a product's
multiplier. Each small graph lowers with no host op, its lowered float graph equals ONNX Runtime, its int8
program runs on the simulator equal to the Python-int twins instruction by instruction, round-trips through the
program file and exports to ONNX bit-exactly; torchvision's ViT and a DeiT-style model (both exporters, and the
legacy one with a dynamic batch) lower with no host op (LayerNormalization and Softmax on the integer unit too:
tests/test_layernorm.py, tests/test_integer_softmax.py)."""

import warnings

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

from builders import make_model, max_calibration, rng_weights, run_onnxruntime, save
from isa.kinds import Kind
from isa.target import Arithmetic, Target
from qdeploy import api
from qdeploy.export_onnx import export_program
from qdeploy.program import Program, read_program, write_program
from simulator import twins
from simulator.machine import Machine

EXACT = Target(arithmetic=Arithmetic(rounding="float32_rne", act_min=-128))
TOKENS, FEATURES = 5, 8


def tokens(n: int, seed: int = 3) -> np.ndarray:
    return rng_weights(seed, n, TOKENS, FEATURES, scale=1.0)


def transposed_tokens(tmp_path):
    """(N, T, F) -> Linear -> Transpose (N, F, T) -> Linear over the tokens -> Transpose back (N, T', F)."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"], name="linear1"),
             helper.make_node("Transpose", ["m1"], ["t1"], name="to_features", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["t1", "w2"], ["m2"], name="token_mix"),
             helper.make_node("Transpose", ["m2"], ["y"], name="to_tokens", perm=[0, 2, 1])]
    model = make_model(nodes, [("x", ["N", TOKENS, FEATURES])], [("y", ["N", 3, FEATURES])],
                       {"w1": rng_weights(0, FEATURES, FEATURES), "w2": rng_weights(1, TOKENS, 3)})
    return save(model, tmp_path / "transposed.onnx")


def gathered_token(tmp_path):
    """(N, T, F) -> Linear -> x[:, 0] (Gather of index 0 along the tokens) and x[:, [[-2, -1]]] (indices counting
    up, negative, of shape (1, 2)) -> Linear heads."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"], name="linear1"),
             helper.make_node("Gather", ["m1", "first"], ["cls"], name="class_token", axis=1),
             helper.make_node("Gather", ["m1", "last"], ["dist"], name="last_token", axis=-2),
             helper.make_node("Gemm", ["cls", "w2"], ["y"], name="head", transB=1),
             helper.make_node("MatMul", ["dist", "w3"], ["z"], name="dist_head")]
    model = make_model(nodes, [("x", ["N", TOKENS, FEATURES])], [("y", ["N", 3]), ("z", ["N", 1, 2, 2])],
                       {"w1": rng_weights(0, FEATURES, FEATURES), "first": np.array(0, np.int64),
                        "last": np.array([[-2, -1]], np.int64), "w2": rng_weights(1, 3, FEATURES),
                        "w3": rng_weights(2, FEATURES, 2)})
    return save(model, tmp_path / "gathered.onnx")


def sliced_tokens(tmp_path):
    """(N, T, F) -> Linear -> the patch tokens x[:, 1:] (Slice along the tokens) -> Split of the features in two
    (a fused projection's halves) -> Linear on one half."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"], name="linear1"),
             helper.make_node("Slice", ["m1", "starts", "ends", "axes"], ["patches"], name="patch_tokens"),
             helper.make_node("Split", ["patches", "halves"], ["a", "b"], name="halves", axis=2),
             helper.make_node("MatMul", ["b", "w2"], ["y"], name="linear2")]
    model = make_model(nodes, [("x", ["N", TOKENS, FEATURES])], [("y", ["N", TOKENS - 1, 3]),
                                                                   ("a", ["N", TOKENS - 1, FEATURES // 2])],
                       {"w1": rng_weights(0, FEATURES, FEATURES), "starts": np.array([1], np.int64),
                        "ends": np.array([TOKENS], np.int64), "axes": np.array([1], np.int64),
                        "halves": np.array([FEATURES // 2] * 2, np.int64), "w2": rng_weights(1, FEATURES // 2, 3)})
    return save(model, tmp_path / "sliced.onnx")


def class_token(tmp_path):
    """A ViT's stem at batch 1: (1, T, F) -> Linear -> Concat(class token, x) + position embedding -> Linear
    (batch_one.py maps it over the batch: Pad + Add of the token; the two constants join)."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"], name="patches"),
             helper.make_node("Concat", ["cls", "m1"], ["cat"], name="with_class_token", axis=1),
             helper.make_node("Add", ["cat", "pos"], ["a"], name="position"),
             helper.make_node("MatMul", ["a", "w2"], ["y"], name="linear2")]
    model = make_model(nodes, [("x", [1, TOKENS, FEATURES])], [("y", [1, TOKENS + 1, 4])],
                       {"w1": rng_weights(0, FEATURES, FEATURES), "cls": rng_weights(1, 1, 1, FEATURES),
                        "pos": rng_weights(2, 1, TOKENS + 1, FEATURES), "w2": rng_weights(3, FEATURES, 4)})
    return save(model, tmp_path / "class_token.onnx")


def element_constants(tmp_path):
    """(N, T, F) -> Linear -> + c (T, F) -> * s (T, 1) (per token, not per channel) -> Relu."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"], name="linear1"),
             helper.make_node("Add", ["m1", "c"], ["a"], name="add_table"),
             helper.make_node("Mul", ["s", "a"], ["b"], name="scale_tokens"),
             helper.make_node("Relu", ["b"], ["y"], name="relu")]
    model = make_model(nodes, [("x", ["N", TOKENS, FEATURES])], [("y", ["N", TOKENS, FEATURES])],
                       {"w1": rng_weights(0, FEATURES, FEATURES), "c": rng_weights(1, TOKENS, FEATURES),
                        "s": np.abs(rng_weights(2, TOKENS, 1)) + 0.5})
    return save(model, tmp_path / "element_constants.onnx")


def scaled_attention(tmp_path):
    """torchvision's attention scaling: q * d^-1/4 and k^T * d^-1/4 (two scalar Muls on the product's operands)."""
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="q"),
             helper.make_node("MatMul", ["x", "wk"], ["k"], name="k"),
             helper.make_node("Transpose", ["k"], ["kt"], name="k_transposed", perm=[0, 2, 1]),
             helper.make_node("Mul", ["q", "c"], ["qs"], name="q_scaled"),
             helper.make_node("Mul", ["kt", "c"], ["ks"], name="k_scaled"),
             helper.make_node("MatMul", ["qs", "ks"], ["y"], name="scores")]
    model = make_model(nodes, [("x", ["N", TOKENS, FEATURES])], [("y", ["N", TOKENS, TOKENS])],
                       {"wq": rng_weights(0, FEATURES, FEATURES), "wk": rng_weights(1, FEATURES, FEATURES),
                        "c": np.array(FEATURES ** -0.25, np.float32)})
    return save(model, tmp_path / "scaled_attention.onnx")


def strided_tokens(tmp_path):
    """LeViT's attention-subsample q: (N, T, F) -> Linear -> view (N, T, 2, 4) -> x[:, ::2] (every other token,
    Slice with step 2) -> x[..., 1::2] (from an offset: a window of the span, then the strided read) -> Linear."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"], name="linear1"),
             helper.make_node("Reshape", ["m1", "grid"], ["g"], name="to_grid"),
             helper.make_node("Slice", ["g", "zero", "end", "one", "two"], ["rows"], name="every_other_token"),
             helper.make_node("Slice", ["rows", "one", "end", "three", "two"], ["cols"], name="odd_columns"),
             helper.make_node("Reshape", ["cols", "flat"], ["f"], name="to_tokens"),
             helper.make_node("MatMul", ["f", "w2"], ["y"], name="linear2")]
    model = make_model(nodes, [("x", ["N", TOKENS, FEATURES])], [("y", ["N", 3, 3])],
                       {"w1": rng_weights(0, FEATURES, FEATURES), "grid": np.array([0, TOKENS, 2, 4], np.int64),
                        "zero": np.array([0], np.int64), "one": np.array([1], np.int64),
                        "end": np.array([2 ** 62], np.int64), "two": np.array([2], np.int64),
                        "three": np.array([3], np.int64), "flat": np.array([0, 3, 4], np.int64),
                        "w2": rng_weights(1, 4, 3)})
    return save(model, tmp_path / "strided.onnx")


def window_pad(tmp_path):
    """Swin's window padding: (N, T, F) -> Linear -> view (N, 1, T, 3, 4) -> zeros after axis 2 and before axis 3
    (two adjacent axes of a 5-D view) -> view (N, 24, 4) -> Linear."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"], name="linear1"),
             helper.make_node("Reshape", ["m1", "windows"], ["w"], name="to_windows"),
             helper.make_node("Pad", ["w", "pads"], ["p"], name="window_pad"),
             helper.make_node("Reshape", ["p", "flat"], ["f"], name="to_tokens"),
             helper.make_node("MatMul", ["f", "w2"], ["y"], name="linear2")]
    model = make_model(nodes, [("x", ["N", TOKENS, FEATURES])], [("y", ["N", 24, 3])],
                       {"w1": rng_weights(0, FEATURES, 12), "windows": np.array([0, 1, TOKENS, 3, 4], np.int64),
                        "pads": np.array([0, 0, 0, 1, 0, 0, 0, 1, 0, 0], np.int64),
                        "flat": np.array([0, 24, 4], np.int64), "w2": rng_weights(1, 4, 3)})
    return save(model, tmp_path / "window_pad.onnx")


def token_means(tmp_path):
    """The heads' reductions over tokens: LeViT's mean over T of (N, 1, T, F) (axes attribute, keepdims 0) and a
    sum over (H, W) of a channels-last (N, H, W, C) view (axes input, keepdims 1) -> Linear."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"], name="linear1"),
             helper.make_node("Reshape", ["m1", "heads"], ["h"], name="to_heads"),
             helper.make_node("ReduceMean", ["h"], ["mean"], name="token_mean", axes=[2], keepdims=0),
             helper.make_node("MatMul", ["mean", "w2"], ["y"], name="head"),
             helper.make_node("Reshape", ["m1", "grid"], ["g"], name="to_grid"),
             helper.make_node("ReduceSum", ["g", "spatial"], ["z"], name="grid_sum", keepdims=1)]
    model = make_model(nodes, [("x", ["N", TOKENS, FEATURES])], [("y", ["N", 1, 3]), ("z", ["N", 1, 1, 2])],
                       {"w1": rng_weights(0, FEATURES, FEATURES), "heads": np.array([0, 1, TOKENS, FEATURES], np.int64),
                        "w2": rng_weights(1, FEATURES, 3), "grid": np.array([0, TOKENS, 4, 2], np.int64),
                        "spatial": np.array([1, 2], np.int64)})
    return save(model, tmp_path / "token_means.onnx")


CASES = {  # builder, batch of the file's input, the layout kinds it must use, its GEMM kinds' count
    "transpose": (transposed_tokens, None, {Kind.AXIS_PERMUTE: 2}),
    "gather": (gathered_token, None, {Kind.CHANNEL_SLICE: 2}),
    "slice": (sliced_tokens, None, {Kind.CHANNEL_SLICE: 3}),
    "class_token": (class_token, 1, {Kind.CONV_GEMM: 2}),  # the padding read, the per-element constant
    # + c, * s (one per-element GEMM each) and the Relu's identity GEMM (it reads a view: no producer to fuse into)
    "element_constants": (element_constants, None, {Kind.CONV_GEMM: 3}),
    "scaled_attention": (scaled_attention, None, {Kind.CONV_GEMM: 0, Kind.MATMUL_GEMM: 1}),
    # the offset slice's window of its span, each Slice's strided identity GEMM
    "strided": (strided_tokens, None, {Kind.CHANNEL_SLICE: 1, Kind.CONV_GEMM: 2}),
    "window_pad": (window_pad, None, {Kind.CONV_GEMM: 1}),  # both axes padded by one identity GEMM's read
    "token_means": (token_means, None, {Kind.CONV_GEMM: 2}),  # one pooling GEMM each
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_token_layout_runs_on_the_gemm_unit_equal_to_onnxruntime_and_the_twins(tmp_path, case):
    build, file_batch, kinds = CASES[case]
    path = build(tmp_path)
    lowering = api.lower_model(path)
    assert lowering.host_ops == [], [(h.op, h.reason) for h in lowering.host_ops]
    x = tokens(3)
    feeds_per_image = [x[i:i + 1] for i in range(3)] if file_batch == 1 else [x]
    expected = [np.concatenate(parts) for parts in zip(*(run_onnxruntime(path, {"x": f}) for f in feeds_per_image))]
    got = list(api.run(path, x, lowered=True).values())
    imported = list(api.run(path, x).values())  # the same executor: the lowering alone
    for g, e, i in zip(got, expected, imported, strict=True):
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-5 * float(np.max(np.abs(e))))
        np.testing.assert_allclose(g, i, rtol=0, atol=1e-6 * float(np.max(np.abs(i))))

    program = api.compile(path, max_calibration(path, {"x": x}), EXACT).program
    counts = {kind: [i["kind"] for i in program.instructions].count(kind) for kind in kinds}
    assert counts == kinds
    run = Machine(program).run({"x": x}, dump=True)
    for instr in program.instructions:  # the simulator's kernels equal the Python-int twins
        args = [run.tensors[name] for name in instr["inputs"]]
        np.testing.assert_array_equal(run.tensors[instr["output"]], twins.run_instruction(
            instr, args, program.arrays, EXACT.arithmetic, program.tensors[instr["output"]]["dtype"]),
            err_msg=instr["name"])
    outputs = list(api.run(program, x, dequantize=True).values())
    for y, e in zip(outputs, expected, strict=True):
        assert 10 * np.log10(np.sum(e ** 2) / np.sum((e - y) ** 2)) > 30  # int8 of a few small GEMMs

    write_program(program, tmp_path / "p.qdp")  # the layout fields round-trip through the file and its checks
    loaded = read_program(tmp_path / "p.qdp")
    assert loaded.instructions == program.instructions
    exported = export_program(loaded, tensor_outputs=True)  # bit-exact with ONNX Runtime in float32_rne
    session = ort.InferenceSession(exported.model.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})))
    for tensor, onnx_name in exported.tensor_names.items():
        np.testing.assert_array_equal(run.tensors[tensor], theirs[onnx_name], err_msg=tensor)


def test_bad_layout_fields_are_refused_by_the_program_checks(tmp_path):
    """A ChannelSlice along the batch or past its axis, an AxisPermute that moves the batch or repeats an axis: one
    line each on reading the file, naming the instruction."""
    from qdeploy_base.errors import BadInput

    x = tokens(2)
    programs = {kind: api.compile(path, max_calibration(path, {"x": x}), EXACT).program
                for kind, path in ((Kind.CHANNEL_SLICE, gathered_token(tmp_path)),
                                   (Kind.AXIS_PERMUTE, transposed_tokens(tmp_path)))}
    for kind, change, message in (
            (Kind.CHANNEL_SLICE, {"axis": 0}, r"expected an axis in \[1, 2\] \(not the batch\)"),
            (Kind.CHANNEL_SLICE, {"start": 5}, r"start = \[5\] is out of range \[0, 4\]"),
            (Kind.AXIS_PERMUTE, {"perm": [1, 0, 2]}, "keeps the batch first"),
            (Kind.AXIS_PERMUTE, {"perm": [0, 1, 1]}, "keeps the batch first")):
        source = programs[kind]
        (first,) = [i["name"] for i in source.instructions if i["kind"] == kind][:1]
        manifest = {**source.manifest, "instructions": [
            {**i, **change} if i["name"] == first else i for i in source.manifest["instructions"]]}
        write_program(Program(manifest, source.arrays), tmp_path / "bad.qdp")
        with pytest.raises(BadInput, match=message) as error:
            read_program(tmp_path / "bad.qdp")
        assert f"'{first}'" in str(error.value) and "\n" not in str(error.value)


def legacy_dynamic_batch_export(name: str, folder) -> object:
    """torch.onnx.export(dynamo=False) with a dynamic batch (dynamic_axes on the input and the output)."""
    import torch

    from examples import zoo

    build, size = zoo.HOST_FALLBACK[name]
    path = folder / f"{name}_dynamic_batch.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(build(), (torch.zeros(1, 3, size, size),), str(path), dynamo=False,
                          input_names=["input"], output_names=["output"],
                          dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
    return path


@pytest.mark.parametrize("name", ["vit", "deit_style"])
def test_vision_transformers_lower_with_no_host_op(tmp_path, name):
    """torchvision's ViT (nn.MultiheadAttention's (tokens, batch, features), head split and merge, q/k/v
    selection, class token) and a DeiT-style model (class and distillation tokens), from the dynamo exporter, the
    legacy one at batch 1 and the legacy one with a dynamic batch: every Transpose, Gather, token Pad and constant
    Add and the attention scaling lower, and so do LayerNormalization and Softmax: no host op."""
    from examples import zoo

    paths = [zoo.export_user_model(name, tmp_path, exporter) for exporter in ("dynamo", "torchscript")]
    for path in [*paths, legacy_dynamic_batch_export(name, tmp_path)]:
        lowering = api.lower_model(path)
        assert not lowering.host_ops, \
            (path.name, [(h.op, h.reason) for h in lowering.host_ops])
        kinds = [n.op for n in lowering.graph.nodes]
        assert Kind.AXIS_PERMUTE in kinds and Kind.CHANNEL_SLICE in kinds


def test_what_is_not_a_window_or_keeps_the_batch_moving_stays_on_the_host(tmp_path):
    """A Gather of indices out of order and a Transpose that moves the batch: host ops, each with its reason."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"], name="linear1"),
             helper.make_node("Gather", ["m1", "shuffled"], ["g"], name="shuffled_tokens", axis=1),
             helper.make_node("Transpose", ["g"], ["y"], name="batch_last", perm=[1, 2, 0])]
    model = make_model(nodes, [("x", ["N", TOKENS, FEATURES])], [("y", [2, FEATURES, "N"])],
                       {"w1": rng_weights(0, FEATURES, FEATURES), "shuffled": np.array([2, 0], np.int64)})
    lowering = api.lower_model(save(model, tmp_path / "not_windows.onnx"))
    reasons = {h.op: h.reason for h in lowering.host_ops}
    assert "indices counting up by one" in reasons["Gather"] and "(2,)" in reasons["Gather"]
    assert "perm [1, 2, 0] moves the batch" in reasons["Transpose"]
