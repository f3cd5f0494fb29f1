"""Output-size formulas of the windowed instructions (ONNX Conv and MaxPool semantics), shared by the compiler,
the program checks, the tiler and the simulator."""

from __future__ import annotations


def conv_output_size(size: int, kernel: int, stride: int, pad_begin: int, pad_end: int, dilation: int) -> int:
    """ONNX Conv: floor((size + pads - dilation*(kernel-1) - 1) / stride) + 1."""
    return (size + pad_begin + pad_end - dilation * (kernel - 1) - 1) // stride + 1


def pool_output_size(size: int, kernel: int, stride: int, pad_begin: int, pad_end: int, dilation: int,
                     ceil_mode: bool) -> int:
    """ONNX MaxPool: as Conv, but with ceil_mode the division rounds up, and a last window that would start
    beyond the input and its leading padding is dropped (onnx reference op_pool_common, ONNX Runtime)."""
    span = size + pad_begin + pad_end - dilation * (kernel - 1) - 1
    if not ceil_mode:
        return span // stride + 1
    out = -(-span // stride) + 1
    if (out - 1) * stride >= size + pad_begin:
        out -= 1
    return out
