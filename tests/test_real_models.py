"""Real exported models: simplification, the float reference executor and the lowered float graph, each
against ONNX Runtime on the original file, on real photographs.

Tolerance: max |ours - ORT| <= 1e-4 * max |ORT| (the issue's "1e-4 relative max error"). Both sides compute
in float32 with different summation orders (and, lowered, BN folded into the weights); over ~50 layers
that accumulates to ~1e-6 relative, so 1e-4 leaves a wide margin and still fails on any wrong tap or
scale (those give errors of order 1e-2 and up)."""

import numpy as np
import pytest

from builders import run_onnxruntime
from qdeploy.lowering import lower
from qdeploy.onnx_import import import_onnx
from qdeploy.reference import run_graph

REL = 1e-4
EFFICIENTNET_OPS = {"Conv", "BatchNormalization", "Clip", "Add", "GlobalAveragePool", "Reshape", "Flatten", "Gemm"}


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def small_images(n: int, seed: int) -> np.ndarray:
    from examples import images

    return images.image_batch(n, seed=seed, split="eval", size=64)


@pytest.fixture(scope="module", params=["efficientnet_lite0_onnx", "efficientnet_lite0_nofold_onnx"])
def efficientnet(request):
    path = request.getfixturevalue(request.param)
    return path, import_onnx(path)


def test_efficientnet_simplifies_to_the_network_arithmetic(efficientnet):
    _, imported = efficientnet
    ops = imported.graph.op_counts()
    assert set(ops) <= EFFICIENTNET_OPS, ops
    assert ops["Conv"] == 49 and ops["BatchNormalization"] == 49 and ops["Add"] == 9
    assert "Pad" in imported.original.op_counts()  # the TF-style padding was there and folded into the Convs
    assert imported.graph.tensors[imported.graph.inputs[0]].shape == (None, 3, 224, 224)


def test_efficientnet_reference_and_lowered_match_onnxruntime(efficientnet, real_images):
    path, imported = efficientnet
    lowered = lower(imported.graph)
    assert lowered.host_ops == [] and lowered.gemm_mac_fraction == 1.0
    assert len(lowered.instructions) == 49 + 9 + 2  # convs, residual adds, average pool, classifier
    for batch in (real_images[:1], real_images[:8]):
        (want,) = run_onnxruntime(path, {"input": np.ascontiguousarray(batch)})
        name = imported.graph.outputs[0]
        assert relative_error(run_graph(imported.graph, {"input": batch})[name], want) <= REL
        assert relative_error(run_graph(lowered.graph, {"input": batch})[name], want) <= REL


@pytest.mark.parametrize("fixture", ["resnet_style_onnx", "mobilenetv2_style_onnx"])
def test_small_cnns_reference_and_lowered_match_onnxruntime(fixture, request):
    path = request.getfixturevalue(fixture)
    imported = import_onnx(path)
    lowered = lower(imported.graph)
    assert lowered.host_ops == [] and lowered.gemm_mac_fraction == 1.0
    assert "BatchNormalization" in imported.graph.op_counts()
    assert "BatchNormalization" not in lowered.graph.op_counts()  # folded into the GEMMs
    name = imported.graph.outputs[0]
    for n, seed in ((1, 0), (6, 1)):
        x = small_images(n, seed)
        (want,) = run_onnxruntime(path, {imported.graph.inputs[0]: x})
        assert relative_error(run_graph(imported.graph, {imported.graph.inputs[0]: x})[name], want) <= REL
        assert relative_error(run_graph(lowered.graph, {imported.graph.inputs[0]: x})[name], want) <= REL


def test_resnet_maxpool_fuses_into_the_stem(resnet_style_onnx):
    lowered = lower(import_onnx(resnet_style_onnx).graph)
    stem = lowered.instructions[0]
    assert "window_max" in stem.output_stage and stem.output_stage["clamp"] == [0.0, float("inf")]
    assert "MaxPool" not in lowered.graph.op_counts()
    adds = [i for i in lowered.instructions if i.kind == "AddGemm"]
    assert len(adds) == 3 and all(a.output_stage.get("clamp") == [0.0, float("inf")] for a in adds)


def test_mobilenet_depthwise_is_grouped_gemm_with_relu6(mobilenetv2_style_onnx):
    lowered = lower(import_onnx(mobilenetv2_style_onnx).graph)
    depthwise = [i for i in lowered.instructions if i.kind == "ConvGemm" and i.groups > 1 and i.k == 9]
    assert depthwise and all(i.n == 1 and i.output_stage["clamp"] == [0.0, 6.0] for i in depthwise)
