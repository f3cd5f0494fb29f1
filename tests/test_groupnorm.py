"""GroupNorm (torch's export: Reshape -> InstanceNormalization -> Reshape -> per-channel Mul/Add) on the integer
unit (lowering/groupnorm.py): no host op, the lowered float graph equals ONNX Runtime, the int8 program follows
it; a row too long for the 32-bit sum of squares is refused in one line."""

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from builders import run_onnxruntime  # noqa: E402


class _Block(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.GroupNorm(groups, 8)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)
        self.head = torch.nn.Conv2d(8, 4, 1)

    def forward(self, x):
        c = self.conv(x)
        return self.head(self.norm(c) + c)


def _export(path: Path, groups: int, dynamo: bool, size: int = 8) -> Path:
    torch.onnx.export(_Block(groups).eval(), (torch.randn(1, 3, size, size),), str(path), input_names=["x"],
                      output_names=["y"], dynamo=dynamo, opset_version=18 if dynamo else 17)
    return path


def _sqnr(reference: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(reference ** 2) / np.sum((reference - got) ** 2)))


@pytest.mark.parametrize("groups, dynamo", [(1, False), (2, False), (2, True)])
def test_a_groupnorm_runs_on_the_unit_and_follows_onnx_runtime(tmp_path, groups, dynamo):
    """No host op; lowered float graph within 1e-5 of ONNX Runtime; int8 SQNR >= 25 dB against it (measured
    in the comment below per case)."""
    from qdeploy import api
    from qdeploy.calibration import calibrate

    path = _export(tmp_path / "gn.onnx", groups, dynamo)
    lowering = api.lower_model(path)
    assert lowering.host_ops == []
    assert any(i.name.endswith("/sqrt_length") for i in lowering.instructions)
    x = np.random.default_rng(2).standard_normal((8, 3, 8, 8)).astype(np.float32)
    expected = np.concatenate([run_onnxruntime(path, {"x": x[i:i + 1]})[0] for i in range(len(x))])
    lowered = api.run(path, x, lowered=True)["y"]
    np.testing.assert_allclose(lowered, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    calibration = np.random.default_rng(1).standard_normal((32, 3, 8, 8)).astype(np.float32)
    table = calibrate(path, calibration, "kl", num_samples=32, batch_size=32).table
    program = api.compile(path, table, None, allow_host_fallback=False).program
    assert not any(r.kind == "Host" for r in program.records)
    sqnr = _sqnr(expected, api.run(program, x, dequantize=True)["y"])
    print(f"groups {groups} dynamo {dynamo}: int8 SQNR {sqnr:.1f} dB")
    assert sqnr >= 25.0, sqnr


def test_a_sum_of_squares_past_32_bits_is_refused_in_one_line(tmp_path):
    """L eps in the sum of squares' accumulator units, with eps = 1e6, does not fit the 32-bit register of the
    row-reciprocal store: the compiler refuses, naming the GroupNorm's node, instead of a wrong program."""
    from qdeploy import api
    from qdeploy.calibration import calibrate
    from qdeploy_base.errors import Unsupported

    path = tmp_path / "eps.onnx"
    block = _Block(2).eval()
    block.norm.eps = 1e6
    torch.onnx.export(block, (torch.randn(1, 3, 8, 8),), str(path), input_names=["x"], output_names=["y"],
                      dynamo=False, opset_version=17)
    calibration = np.random.default_rng(1).standard_normal((8, 3, 8, 8)).astype(np.float32)
    table = calibrate(path, calibration, "kl", num_samples=8, batch_size=8).table
    with pytest.raises(Unsupported, match=r"node '[^']*/sum_of_squares' \(MatMulGemm\): .* more than the 32-bit "
                                          r"accumulator holds"):
        api.compile(path, table, None, allow_host_fallback=False)


def test_an_instance_norm_with_its_own_affine_stays_on_the_host_with_the_reason(tmp_path):
    """InstanceNorm1d(affine=True) exports its scale and bias inside the InstanceNormalization: not lowered (only
    GroupNorm's form, scale 1 and bias 0, is), and the host op says why."""
    from qdeploy import api

    path = tmp_path / "in.onnx"
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.Flatten(2),
                                torch.nn.InstanceNorm1d(4, affine=True)).eval()
    with torch.no_grad():
        model[2].weight.fill_(2.0)
    torch.onnx.export(model, (torch.randn(1, 3, 4, 4),), str(path), input_names=["x"], output_names=["y"],
                      dynamo=False, opset_version=17)
    lowering = api.lower_model(path)
    assert [op.op for op in lowering.host_ops] == ["InstanceNormalization"]
    assert "(InstanceNormalization): only scale 1 and bias 0" in lowering.host_ops[0].reason


def test_float_softmax_layernorm_keeps_the_groupnorm_in_float_on_the_host(tmp_path):
    """`calibrate --float-softmax-layernorm` keeps the normalizations (InstanceNormalization, torch's GroupNorm, with
    them) in float: the program a user falls back to where the integer GroupNorm loses (FPN, docs/library_models.md)."""
    from qdeploy import api
    from qdeploy.calibration import calibrate

    path = _export(tmp_path / "gn.onnx", 2, False)
    calibration = np.random.default_rng(1).standard_normal((16, 3, 8, 8)).astype(np.float32)
    table = calibrate(path, calibration, "kl", num_samples=16, batch_size=16, float_softmax_layernorm=True).table
    compiled = api.compile(path, table, None, allow_host_fallback=True)
    hosts = [r for r in compiled.program.records if r.kind == "Host"]
    assert [r.op for r in hosts] == ["InstanceNormalization"], hosts
