"""What per-channel scales on depthwise-only tensors could give (docs/design.md, per-channel activation scales).

For every tensor of a float ONNX model read only by depthwise Convs (as their data input), over the first N samples
of a preprocessed NCHW .npy: r[c] = max|x_c| / max_c max|x_c|, and the quantization-noise gain of one step per
channel over one per tensor, -10 log10(mean_c r[c]^2) (uniform noise of power step^2 / 12 in every element; max
thresholds both ways, so it ignores the KL clipping the per-tensor scale gets today).

    python bench/depthwise_channel_ranges.py MODEL.onnx SAMPLES.npy N
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper


def depthwise_only_tensors(model: onnx.ModelProto) -> list[str]:
    """Tensors every reader of which is a grouped Conv reading them as its data input."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)

    def grouped_data_read(node: onnx.NodeProto, name: str) -> bool:
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        return node.op_type == "Conv" and group > 1 and node.input[0] == name

    return [name for name, nodes in readers.items() if all(grouped_data_read(n, name) for n in nodes)]


def channel_maxima(path: str, samples: np.ndarray, batch: int = 8) -> dict[str, np.ndarray]:
    model = onnx.load(path)
    tensors = depthwise_only_tensors(model)
    for name in tensors:
        model.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = session.get_inputs()[0].name
    maxima = {name: np.zeros(0) for name in tensors}
    for start in range(0, len(samples), batch):
        for name, value in zip(tensors, session.run(tensors, {feed: samples[start:start + batch]})):
            channel = np.abs(value).max(axis=(0, 2, 3))
            maxima[name] = channel if maxima[name].size == 0 else np.maximum(maxima[name], channel)
    return maxima


def main(path: str, samples_path: str, count: int) -> None:
    samples = np.load(samples_path, mmap_mode="r")[:count].astype(np.float32)
    gains = []
    for name, maxima in channel_maxima(path, samples).items():
        ratio = maxima / maxima.max()
        gains.append(-10 * np.log10(np.mean(ratio ** 2)))
        print(f"{name:44s} C={ratio.size:5d} median r={np.median(ratio):.3f} gain={gains[-1]:5.1f} dB")
    print(f"{len(gains)} depthwise-only tensors; noise gain median {np.median(gains):.1f} dB, "
          f"min {min(gains):.1f}, max {max(gains):.1f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
