"""Golden test vectors (docs/hardware.md): exported from a compiled real network on real photographs, read back
with a hex reader written here (not simulator.vectors), every layer recomputed from the hex files alone with the
Python-int twins to the same bits; `vectors compare` finds planted mismatches at their exact (layer, tile, row,
col) and classifies them; `vectors stress` hits ties, clamps, accumulator limits and extreme multipliers."""

from __future__ import annotations

import json
import math
import shutil
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from builders import read_hex
from qdeploy import api
from qdeploy.calibration import calibrate
from qdeploy.cli import app
from simulator import twins
from isa.target import target_from_dict
from simulator.kernels.gemm import gemm
from simulator.kernels.requantize import requantize
from isa.row_scale import row_reciprocal_words, row_scaled_float32, row_scaled_multipliers

runner = CliRunner()




def wrap(values: np.ndarray, bits: int) -> np.ndarray:
    half = 1 << (bits - 1)
    return (values + half) % (1 << bits) - half


def im2col(x: np.ndarray, kernel, strides, pads, dilations, group) -> np.ndarray:
    """NCHW -> (G, N*OH*OW, C/G*kh*kw) with numpy slicing (ONNX Conv; zero padding)."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (pt, pl, pb, pr), (dh, dw) = kernel, strides, pads, dilations
    padded = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    oh = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
    ow = (w + pl + pr - dw * (kw - 1) - 1) // sw + 1
    taps = np.stack([padded[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw]
                     for i in range(kh) for j in range(kw)], axis=2)  # (N, C, kh*kw, OH, OW)
    taps = taps.reshape(n, group, c // group, kh * kw, oh, ow).transpose(1, 0, 4, 5, 2, 3)
    return taps.reshape(group, n * oh * ow, c // group * kh * kw)


# --- the exported network -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(resnet_style_onnx, tmp_path_factory):
    """resnet_style calibrated (KL) on 16 real photographs, compiled, run on 2 other photographs, exported."""
    from examples import images

    root = tmp_path_factory.mktemp("vectors")
    table = calibrate(resnet_style_onnx, images.image_batch(16, seed=0, split="calib", size=64), "kl",
                      num_samples=16, batch_size=8).table
    api.compile(resnet_style_onnx, table, output=root / "resnet.qdp")
    x = images.image_batch(2, seed=1, split="eval", size=64)
    np.save(root / "x.npy", x)
    result = runner.invoke(app, ["vectors", "export", str(root / "resnet.qdp"), "--input", str(root / "x.npy"),
                                 "-o", str(root / "vec")])
    assert result.exit_code == 0, result.output
    return root, json.loads((root / "vec" / "manifest.json").read_text())


def test_every_layer_recomputes_from_the_hex_files_alone(exported):
    root, manifest = exported
    vec = root / "vec"
    target = target_from_dict(manifest["target"])
    assert manifest["source"]["batch"] == 2 and len(manifest["layers"]) == 13
    assert [s["kind"] for s in manifest["skipped"]] == ["Flatten"]
    produced = {}  # tensor name -> stored int8 tensor, channels last (rows, C), from the hex files
    for name, record in manifest["inputs"].items():
        produced[name] = read_hex(vec / record["hex"], record)
    kinds = set()
    for layer in manifest["layers"]:
        files = layer["files"]
        kinds.add(layer["kind"])
        read = {key: read_hex(vec / record["hex"], record) for key, record in files.items()}
        g, m, n, k = layer["groups"], layer["m"], layer["n"], layer["k"]
        x = read["input"].reshape(g, m, k)
        w = read["weight"].reshape(g, k, n)
        bias = read["bias"].reshape(-1)
        # (1) acc = x . w + bias per group, wrapped to acc_bits (overflow = wrap in this target)
        acc = np.concatenate([x[i] @ w[i] + bias[i * n:(i + 1) * n] for i in range(g)], axis=1)
        acc = wrap(acc, layer["acc_bits"])
        assert np.array_equal(acc, read["acc"]), layer["name"]
        # (2)-(8) requantize and clamp with the twins, from the hex multipliers and shifts
        lo, hi = layer["clamp"]
        mult, shift = read["mult"].reshape(-1), read["shift"].reshape(-1)
        out = np.array([[twins.requantize(int(a), int(mult[c]), int(shift[c]), layer["rounding"], lo, hi)
                         for c, a in enumerate(row)] for row in acc])
        assert np.array_equal(out, read["out"]), layer["name"]
        # float32 scales are the float32 of M = mult * 2^-shift to within the multiplier's precision
        scale = read["scale_f32"].reshape(-1).astype(np.uint32).view(np.float32).astype(np.float64)
        assert np.allclose(scale, mult * np.exp2(-shift.astype(np.float64)), rtol=2 ** -22)
        stored = out
        if layer["window_max"]:  # (10) window-max on store, over the NCHW view of the output
            batch, _, height, width = layer["input_shape"]
            (kh, kw), (sh, sw), pads, (dh, dw) = (layer["conv"][key] for key in ("kernel", "strides", "pads",
                                                                                  "dilations"))
            oh = twins.conv_output_size(height, kh, sh, pads[0], pads[2], dh)
            ow = twins.conv_output_size(width, kw, sw, pads[1], pads[3], dw)
            window = layer["window_max"]
            nchw = out.reshape(batch, oh, ow, -1).transpose(0, 3, 1, 2).astype(
                np.int8 if files["out"]["signed"] else np.uint8)  # uint8 below a ReLU on the default target
            pooled = twins.window_max(nchw, window["kernel"], window["strides"], window["pads"],
                                          window["dilations"], window["ceil_mode"])
            stored = pooled.transpose(0, 2, 3, 1).reshape(-1, pooled.shape[1])
            assert np.array_equal(stored, read["stored"]), layer["name"]
        # The input the array saw is built from the tensors the producing layers stored (im2col of them).
        sources = [produced.get(name) for name in layer["input_tensors"]]
        if all(s is not None for s in sources):
            if layer["kind"] == "ConvGemm":
                batch, channels, height, width = layer["input_shape"]
                nchw = sources[0].reshape(batch, height, width, channels).transpose(0, 3, 1, 2)
                conv = layer["conv"]
                expected = im2col(nchw, conv["kernel"], conv["strides"], conv["pads"], conv["dilations"],
                                  conv["group"])
                assert np.array_equal(expected, x), layer["name"]
            elif layer["kind"] == "AddGemm":
                assert np.array_equal(np.stack([sources[0].T, sources[1].T], axis=2), x), layer["name"]
                assert np.array_equal(w[:, :, 0], np.tile(layer["add_weights"], (g, 1)))
        produced[layer["output_tensor"]] = stored
    assert kinds == {"ConvGemm", "AddGemm", "DenseGemm"}
    # The .npy twins hold the same values as the hex files.
    layer = manifest["layers"][0]
    for key, record in layer["files"].items():
        twin = np.load(vec / record["npy"])
        matrix = twin.reshape(record["matrix"]) if key != "stored" else \
            twin.transpose(0, 2, 3, 1).reshape(record["matrix"])
        if key == "scale_f32":
            matrix = matrix.view(np.uint32)
        assert np.array_equal(matrix, read_hex(vec / record["hex"], record)), key
    # Tiles recorded for the batch of the vectors fit the target's buffers.
    for layer in manifest["layers"]:
        tiles = layer["tiles"]
        assert tiles["k"] % target.array.rows == 0 and tiles["n"] % target.array.cols == 0
        assert tiles["scratchpad_bytes"] <= target.array.scratchpad_buffer_bytes
        assert tiles["grid"][1] == -(-layer["m"] // tiles["m"])


def test_per_tile_files_reassemble_the_layer(exported, tmp_path):
    root, _ = exported
    result = runner.invoke(app, ["vectors", "export", str(root / "resnet.qdp"), "--input", str(root / "x.npy"),
                                 "-o", str(tmp_path / "vec"), "--per-tile", "--json"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "vec" / "manifest.json").read_text())
    layer = next(layer for layer in manifest["layers"] if layer["tiles"]["grid"][3] > 1 and
                 layer["tiles"]["grid"][1] > 1)  # several m-tiles and k-tiles
    vec = tmp_path / "vec"
    acc = read_hex(vec / layer["files"]["acc"]["hex"], layer["files"]["acc"])
    x = read_hex(vec / layer["files"]["input"]["hex"], layer["files"]["input"])
    tk = layer["tiles"]["k"]
    seen = np.zeros(acc.shape, bool)
    for tile in layer["tile_files"]:
        m0, m1, c0, c1 = tile["m0"], tile["m1"], tile["c0"], tile["c1"]
        tile_acc = read_hex(vec / tile["files"]["acc"]["hex"], tile["files"]["acc"])
        assert np.array_equal(tile_acc, acc[m0:m1, c0:c1])
        seen[m0:m1, c0:c1] = True
        # The input hex is in array order: k-tile by k-tile, each k-tile padded to tk.
        x_tile = read_hex(vec / tile["files"]["input"]["hex"], tile["files"]["input"])
        rows = m1 - m0
        for index, (k0, k1) in enumerate(tile["k_tiles"]):
            block = x_tile[index * rows:(index + 1) * rows]
            assert np.array_equal(block[:, :k1 - k0], x[layer["m"] * tile["g"] + m0:layer["m"] * tile["g"] + m1, k0:k1])
            assert not block[:, k1 - k0:].any() and block.shape[1] == tk
    assert seen.all()


# --- compare ---------------------------------------------------------------------------------------------------

def dump_of(vec: Path, dump: Path, manifest: dict) -> None:
    """What an RTL run would dump: the acc, out and stored files of every layer (copied: a perfect RTL)."""
    for layer in manifest["layers"]:
        for key in ("acc", "out", "stored"):
            if key in layer["files"]:
                target = dump / layer["files"][key]["hex"]
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(vec / layer["files"][key]["hex"], target)


def write_hex(path: Path, matrix: np.ndarray, record: dict) -> None:
    """Write a matrix in the documented format (by hand, as an RTL testbench would with $writememh)."""
    bits, per_line = record["bits"], record["per_line"]
    rows, cols = matrix.shape
    per_row = -(-cols // per_line)
    lines = []
    for r in range(rows):
        for chunk in range(per_row):
            word = 0
            for j in range(per_line):
                c = chunk * per_line + j
                value = int(matrix[r, c]) if c < cols else 0
                word |= (value & ((1 << bits) - 1)) << (bits * j)
            lines.append(f"{word:0{per_line * bits // 4}x}")
    path.write_text("\n".join(lines) + "\n")


def tie_distance(acc: int, mult: int, shift: int) -> Fraction:
    value = Fraction(acc * mult, 2 ** shift)
    return abs(value - math.floor(value) - Fraction(1, 2))


def test_compare_finds_and_classifies_planted_mismatches(exported, tmp_path):
    root, manifest = exported
    vec, dump = root / "vec", tmp_path / "dump"
    dump_of(vec, dump, manifest)
    clean = runner.invoke(app, ["vectors", "compare", str(vec), str(dump)])
    assert clean.exit_code == 0 and "all match" in clean.output, clean.output

    layers = manifest["layers"]
    planted = {}

    def load(layer, key):
        record = layer["files"][key]
        return read_hex(vec / record["hex"], record), record

    # 1. an off-by-one where acc * M is a rounding tie (within 2^-10 LSB): the other rounding direction
    for layer in layers[1:]:
        acc, _ = load(layer, "acc")
        out, record = load(layer, "out")
        mult = read_hex(vec / layer["files"]["mult"]["hex"], layer["files"]["mult"]).reshape(-1)
        shift = read_hex(vec / layer["files"]["shift"]["hex"], layer["files"]["shift"]).reshape(-1)
        lo, hi = layer["clamp"]
        found = [(r, c) for (r, c), a in np.ndenumerate(acc) if lo < out[r, c] < hi
                 and tie_distance(int(a), int(mult[c]), int(shift[c])) <= Fraction(1, 1024)]
        if found:
            r, c = found[len(found) // 2]
            value = Fraction(int(acc[r, c]) * int(mult[c]), 2 ** int(shift[c]))
            wrong = out[r, c] - 1 if value - math.floor(value) >= Fraction(1, 2) else out[r, c] + 1
            planted["rounding"] = (layer, "out", r, c, int(out[r, c]), int(wrong))
            break
    # 2. a saturation error: an output clamped at the top written as if it had wrapped
    for layer in layers:
        if "rounding" in planted and layer is planted["rounding"][0]:
            continue
        out, _ = load(layer, "out")
        hits = np.argwhere(out == layer["clamp"][1])
        if len(hits):
            r, c = (int(v) for v in hits[-1])
            wrapped = -128 if layer["files"]["out"]["signed"] else 0  # int8 127 + 1, uint8 255 + 1
            planted["saturation"] = (layer, "out", r, c, int(out[r, c]), wrapped)
            break
    # 3. a plain data error in an accumulator, and 4. an unknown (x) output digit
    data_layer = next(layer for layer in layers if all(layer is not p[0] for p in planted.values()))
    acc, _ = load(data_layer, "acc")
    planted["data"] = (data_layer, "acc", 5, 3, int(acc[5, 3]), int(acc[5, 3]) + 12345)
    assert {"rounding", "saturation"} <= set(planted), "no tie or clamp in the real data"

    for layer, key, r, c, _, wrong in planted.values():
        matrix, record = load(layer, key)
        matrix[r, c] = wrong
        write_hex(dump / record["hex"], matrix, record)
    result = runner.invoke(app, ["vectors", "compare", str(vec), str(dump), "--json"])
    assert result.exit_code == 3, result.output
    report = json.loads(result.output)
    assert not report["ok"] and report["mismatches"] == 3
    by_name = {layer["name"]: layer for layer in report["layers"]}
    classes = {"rounding": "rounding-mode mismatch?", "saturation": "saturation mismatch?", "data": "data mismatch"}
    for label, (layer, key, r, c, expected, wrong) in planted.items():
        files = {f["file"]: f for f in by_name[layer["name"]]["files"]}
        assert files[key]["mismatches"] == 1 and files[key]["matches"] == files[key]["elements"] - 1
        first = files[key]["first_mismatch"]
        assert (first["row"], first["col"], first["expected"], first["actual"]) == (r, c, expected, wrong), label
        assert first["class"] == classes[label], (label, first)
        # The tile holding (r, c): group c // n, m-tile r // tm, n-tile (c % n) // tn.
        tiles = layer["tiles"]
        _, nm, nn, _ = tiles["grid"]
        g, j = divmod(c, layer["n"])
        assert first["tile"]["index"] == (g * nm + r // tiles["m"]) * nn + j // tiles["n"]
        assert first["layer"] == layer["name"]
    untouched = [layer for layer in report["layers"] if layer["name"] not in
                 {p[0]["name"] for p in planted.values()}]
    assert all(layer["status"] == "match" for layer in untouched)
    # The text report names the layer, the tile, the position and the class.
    text = runner.invoke(app, ["vectors", "compare", str(vec), str(dump)])
    assert text.exit_code == 3 and "rounding-mode mismatch?" in text.output and "saturation mismatch?" in text.output


def test_compare_input_errors_exit_2_and_x_digits_mismatch(exported, tmp_path):
    root, manifest = exported
    vec, dump = root / "vec", tmp_path / "dump"
    empty = runner.invoke(app, ["vectors", "compare", str(vec), str(tmp_path)])
    assert empty.exit_code == 2 and "no dump files" in empty.output
    not_vectors = runner.invoke(app, ["vectors", "compare", str(tmp_path), str(vec)])
    assert not_vectors.exit_code == 2 and "manifest" in not_vectors.output
    dump_of(vec, dump, manifest)
    layer = manifest["layers"][2]
    path = dump / layer["files"]["out"]["hex"]
    lines = path.read_text().split("\n")
    lines[4] = "x" + lines[4][1:]  # the highest element of word 4 unknown
    path.write_text("\n".join(lines))
    result = runner.invoke(app, ["vectors", "compare", str(vec), str(dump), "--json"])
    assert result.exit_code == 3
    first = next(f for f in json.loads(result.output)["layers"][2]["files"] if f["file"] == "out")["first_mismatch"]
    per_line, cols = layer["files"]["out"]["per_line"], layer["files"]["out"]["matrix"][1]
    per_row = -(-cols // per_line)
    assert first["class"] == "unknown value (x/z)" and first["row"] == 4 // per_row
    assert first["col"] == (4 % per_row) * per_line + per_line - 1
    lines[4] = "123"  # too short is fine ($readmemh zero-extends); a non-hex digit is not
    lines[5] = "g" * len(lines[6])
    path.write_text("\n".join(lines))
    bad = runner.invoke(app, ["vectors", "compare", str(vec), str(dump)])
    assert bad.exit_code == 2 and f":{6}:" in bad.output


def test_export_is_atomic_and_refuses_foreign_directories(exported, tmp_path):
    root, _ = exported
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    result = runner.invoke(app, ["vectors", "export", str(root / "resnet.qdp"), "--input", str(root / "x.npy"),
                                 "-o", str(foreign)])
    assert result.exit_code == 2 and (foreign / "keep.txt").read_text() == "mine"
    bad_input = runner.invoke(app, ["vectors", "export", str(root / "resnet.qdp"), "--input", str(root / "x.npy"),
                                    "-o", str(tmp_path / "nothere" / "vec")])
    assert bad_input.exit_code == 2
    np.save(tmp_path / "wrong.npy", np.zeros((1, 3, 32, 32), np.float32))
    wrong = runner.invoke(app, ["vectors", "export", str(root / "resnet.qdp"), "--input", str(tmp_path / "wrong.npy"),
                                "-o", str(tmp_path / "vec")])
    assert wrong.exit_code == 2 and "shape" in wrong.output and not (tmp_path / "vec").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


# --- stress ----------------------------------------------------------------------------------------------------

STRESS_TARGETS = {
    "default": "",
    "narrow_saturate_tflite": '[arithmetic]\nacc_bits = 20\noverflow = "saturate"\nrounding = "tflite"\n'
                              "[array]\nrows = 8\ncols = 4\n",
    "float32_rne_int8_full": '[arithmetic]\nrounding = "float32_rne"\nact_min = -128\n',
    "half_even_16bit_mult": '[arithmetic]\nrounding = "half_even"\nmult_bits = 16\nacc_bits = 24\n',
}


@pytest.mark.parametrize("name", sorted(STRESS_TARGETS))
def test_stress_vectors_hit_the_edges_and_match_the_kernels(tmp_path, name):
    (tmp_path / "target.toml").write_text(STRESS_TARGETS[name])
    result = runner.invoke(app, ["vectors", "stress", "--target", str(tmp_path / "target.toml"), "-o",
                                 str(tmp_path / "vec"), "--json"])
    assert result.exit_code == 0, result.output
    vec = tmp_path / "vec"
    manifest = json.loads((vec / "manifest.json").read_text())
    target = target_from_dict(manifest["target"])
    a = target.arithmetic
    cases = {layer["name"]: layer for layer in manifest["layers"]}
    assert {"rounding_ties", "clamp_act_range", "clamp_relu6", "accumulator_limits", "extreme_multipliers_high",
            "extreme_multipliers_low", "row_reciprocal_edges", "row_rsqrt_edges", "row_scale_words"} <= set(cases)
    for case in cases.values():
        read = {key: read_hex(vec / record["hex"], record) for key, record in case["files"].items()}
        x, w = read["input"], read["weight"]
        bias, mult, shift = (read[key].reshape(-1) for key in ("bias", "mult", "shift"))
        scale = read["scale_f32"].reshape(-1).astype(np.uint32).view(np.float32)
        lo, hi = case["clamp"]
        # The simulator's kernels (not the twins the generator used) give the expected files.
        acc = gemm(x.astype(np.int8), w.astype(np.int8), a.acc_bits, a.overflow, bias=bias).acc
        assert np.array_equal(acc, read["acc"]), case["name"]
        if "row_reciprocal" in case:  # the store: the simulator's words of the sums, every power of two +-1
            assert np.array_equal(row_reciprocal_words(acc, case["row_reciprocal"]), read["out"]), case["name"]
            powers = [(1 << k) + d for k in range(1, min(a.acc_bits, 32) - 1) for d in (-1, 0, 1)]
            assert set(powers) <= set(acc.reshape(-1).tolist())
            continue
        # one multiplier per element: the column's, scaled by the row's word under a row scale (isa/row_scale.py)
        mult, shift, scale = (np.broadcast_to(v, acc.shape).reshape(-1) for v in (mult, shift, scale))
        if "row_scale" in read:
            words = np.broadcast_to(read["row_scale"], acc.shape).reshape(-1)
            (mult, shift), scale = row_scaled_multipliers(mult, shift, words), row_scaled_float32(scale, words)
        flat = acc.reshape(1, -1)
        out = requantize(flat, mult, shift, a.rounding, lo, hi, scale=scale) if a.rounding != "float32_rne" else \
            requantize(flat, mode=a.rounding, lo=lo, hi=hi, scale=scale)
        assert np.array_equal(out.reshape(acc.shape), read["out"]), case["name"]
        if case["name"] in ("rounding_ties", "row_scale_words"):  # exact ties of both signs
            value = [Fraction(int(v)) * (Fraction(float(scale[i])) if a.rounding == "float32_rne" else
                                         Fraction(int(mult[i]), 2 ** int(shift[i])))
                     for i, v in enumerate(acc.reshape(-1))]
            ties = [v for v in value if v.denominator == 2]
            assert any(v > 0 for v in ties) and any(v < 0 for v in ties), case["name"]
        if case["name"].startswith("clamp_"):
            assert (read["out"] == hi).any() and (read["out"] == lo).any()
        if case["name"] == "accumulator_limits":
            exact = x @ w + bias
            assert (exact > a.acc_max).any() and (exact < a.acc_min).any()  # the sums leave the register
            if a.overflow == "saturate":
                assert (read["acc"] == a.acc_max).any() and (read["acc"] == a.acc_min).any()
            else:
                assert np.array_equal(read["acc"], wrap(exact, a.acc_bits))
        if case["name"].startswith("extreme_"):
            assert mult.min() == 1 << (a.mult_bits - 2) and mult.max() == (1 << (a.mult_bits - 1)) - 1
            assert shift.max() == 62
    if "accumulator_order" in cases:  # rows 1 and 2 cross a limit and come back: exact sum 0
        record = cases["accumulator_order"]["files"]["acc"]
        acc = read_hex(vec / record["hex"], record)
        half = cases["accumulator_order"]["k"] // 2 * 127 * 127
        saturated = [a.acc_max - half, a.acc_min + half]  # clamped at the limit, then the way back
        assert acc[1:3, 0].tolist() == (saturated if a.overflow == "saturate" else [0, 0])
    # The stress directory is a vectors directory: compare accepts a perfect dump.
    dump = tmp_path / "dump"
    dump_of(vec, dump, manifest)
    assert runner.invoke(app, ["vectors", "compare", str(vec), str(dump)]).exit_code == 0


def test_an_add_of_a_signed_and_an_unsigned_tensor_exports_16_bit_inputs(tmp_path):
    """With unsigned activations a residual add may read an int8 tensor and a uint8 one (a ReLU'd branch): its
    input rows [a, b] need 16-bit elements (the export failed: 'values -123..255 do not fit 8-bit signed')."""
    import sys

    import onnx

    sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
    import programs
    from simulator.vectors import export_vectors

    (tmp_path / "t.toml").write_text('[arithmetic]\nunsigned_activations = true\n')
    onnx.save(programs.residual_net(), str(tmp_path / "net.onnx"))
    table = calibrate(tmp_path / "net.onnx", programs.calibration_images((3, 12, 11)), "kl", num_samples=16).table
    program = api.compile(tmp_path / "net.onnx", table, tmp_path / "t.toml").program
    (add,) = [i for i in program.instructions if i["kind"] == "AddGemm"]
    assert {program.tensors[name]["dtype"] for name in add["inputs"]} == {"int8", "uint8"}
    manifest = export_vectors(program, {"x": programs.evaluation_images((3, 12, 11))}, tmp_path / "vec").manifest
    (layer,) = [layer for layer in manifest["layers"] if layer["kind"] == "AddGemm"]
    record = layer["files"]["input"]
    assert (record["bits"], record["signed"]) == (16, True)
    values = read_hex(tmp_path / "vec" / record["hex"], record)
    assert values.min() < 0 and values.max() > 127  # both tensors' ranges, exactly
    np.testing.assert_array_equal(values.reshape(np.load(tmp_path / "vec" / record["npy"]).shape),
                                  np.load(tmp_path / "vec" / record["npy"]))


def test_layer_filter_writes_only_the_chosen_layers(exported, tmp_path):
    """`vectors export --layer NAME --layer INDEX`: the chosen layers' files equal the full export's byte for
    byte; the others are listed as not selected; an unknown layer is a one-line error and writes nothing."""
    root, manifest = exported
    first, last = manifest["layers"][0], manifest["layers"][-1]
    result = runner.invoke(app, ["vectors", "export", str(root / "resnet.qdp"), "--input", str(root / "x.npy"),
                                 "-o", str(tmp_path / "vec"), "--layer", first["name"], "--layer",
                                 str(last["index"])])
    assert result.exit_code == 0, result.output
    chosen = json.loads((tmp_path / "vec" / "manifest.json").read_text())
    assert [layer["name"] for layer in chosen["layers"]] == [first["name"], last["name"]]
    for mine, full in zip(chosen["layers"], (first, last)):
        for key, record in full["files"].items():
            assert (tmp_path / "vec" / mine["files"][key]["hex"]).read_bytes() == \
                (root / "vec" / record["hex"]).read_bytes()
    reasons = {s["name"]: s["reason"] for s in chosen["skipped"]}
    assert reasons[manifest["layers"][1]["name"]] == "not selected (--layer)"
    result = runner.invoke(app, ["vectors", "export", str(root / "resnet.qdp"), "--input", str(root / "x.npy"),
                                 "-o", str(tmp_path / "none"), "--layer", "no_such_layer"])
    assert result.exit_code == 2 and "--layer no_such_layer: no such instruction" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "none").exists()
    seen = []  # the API's progress callback: once per layer written
    api.export_vectors(root / "resnet.qdp", root / "x.npy", tmp_path / "api", layers=[first["name"]],
                       progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 1)]
