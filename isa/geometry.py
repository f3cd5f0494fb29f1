"""Output-size formulas of the windowed instructions (ONNX Conv and MaxPool semantics), shared by the compiler,
the program checks, the tiler and the simulator."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


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


# ---------------------------------------------------------------------------------------------------------
# The im2col read of a ConvGemm (docs/design.md section 4, "Upsampling in the read"): the input is read as if
# upsampled by an integer factor f per axis, then padded, before the window slides over it. No arithmetic:
# addresses only. With fill `zero` (ConvTranspose) input row i is read at row i*f and the f-1 rows between
# are zeros (size (H-1)*f + 1); with fill `nearest` (Resize nearest; bilinear's first half) every input row is
# read f times (size H*f). The padding is zeros (`zero`, ONNX Conv), the nearest border row of the upsampled
# input (`edge`, the clamped coordinates of a half-pixel bilinear Resize; Pad mode edge) or its mirror image
# without the border row (`reflect`, Pad mode reflect: position -1 reads row 1).


class ReadFill(StrEnum):
    """What the read supplies where the input has no row of its own (a StrEnum: manifests keep the plain
    strings `zero`, `nearest`, `edge`, `reflect`)."""

    ZERO = "zero"  # an inserted zero (upsample) or zero padding
    NEAREST = "nearest"  # upsample: every input row read f times
    EDGE = "edge"  # padding: the nearest border row
    REFLECT = "reflect"  # padding: the mirror image without the border row


UPSAMPLE_FILLS = (ReadFill.ZERO, ReadFill.NEAREST)  # how the rows between two input rows are read
PAD_FILLS = (ReadFill.ZERO, ReadFill.EDGE, ReadFill.REFLECT)  # what the padding reads
BORDER_FILLS = (ReadFill.EDGE, ReadFill.REFLECT)  # padding read from the input's border, not zeros


def upsampled_size(size: int, factor: int = 1, fill: str | None = None) -> int:
    """The length of one axis as the window sees it before padding: (size-1)*f + 1 with zeros inserted,
    size*f with every row repeated, size when f = 1."""
    if factor == 1:
        return size
    return (size - 1) * factor + 1 if fill == ReadFill.ZERO else size * factor


def read_source(position: int, size: int, factor: int, fill: str | None, pad_begin: int, pad_fill: str | None
                ) -> int:
    """The input row that position `position` of the padded, upsampled axis reads, or -1 where it reads a zero
    (zero padding, an inserted zero). The one definition every stage's read follows (twins, kernels, export).
    `reflect` needs pads shorter than the upsampled axis (ONNX Pad's own condition)."""
    up = upsampled_size(size, factor, fill)
    p = position - pad_begin
    if p < 0 or p >= up:
        if pad_fill == ReadFill.EDGE:
            p = min(max(p, 0), up - 1)
        elif pad_fill == ReadFill.REFLECT and up > 1:
            p = -p if p < 0 else 2 * (up - 1) - p
        else:
            return -1
    if factor == 1:
        return p
    if fill == ReadFill.ZERO:
        return p // factor if p % factor == 0 else -1
    return p // factor


def real_taps(size: int, kernel: int, stride: int, pad_begin: int, pad_end: int, dilation: int,
              factor: int = 1, fill: str | None = None, pad_fill: str | None = None) -> tuple[list[int], int]:
    """(for each tap of a 1-D window, at how many output positions it reads an input element rather than a
    zero (the zero padding, an inserted zero); the number of output positions)."""
    up = upsampled_size(size, factor, fill)
    out = conv_output_size(up, kernel, stride, pad_begin, pad_end, dilation)
    counts = [0] * kernel
    for o in range(out):
        for t in range(kernel):
            if read_source(o * stride + t * dilation, size, factor, fill, pad_begin, pad_fill) >= 0:
                counts[t] += 1
    return counts, out


def real_tap_fraction(size: int, kernel: int, stride: int, pad_begin: int, pad_end: int, dilation: int,
                      factor: int = 1, fill: str | None = None, pad_fill: str | None = None) -> list[float]:
    """For each tap, the fraction of output positions at which it reads an input element: the bias
    correction's E[x] per tap (qdeploy/quantize.py eq. 2b)."""
    counts, out = real_taps(size, kernel, stride, pad_begin, pad_end, dilation, factor, fill, pad_fill)
    return [c / out for c in counts]


def zero_read_macs(height: int, width: int, kernel: tuple, strides: tuple, pads: tuple, dilations: tuple,
                   upsample: tuple | None, fill: str | None, pad_fill: str | None, macs_per_tap: int) -> int:
    """The MACs of one image's ConvGemm whose input operand is a zero of the read (an inserted zero or the zero
    padding): they run on the array and change nothing. `macs_per_tap` = M * C/group (every output channel
    reads every tap of its group's channels). The taps are separable, so the count is
    macs_per_tap * (kh*kw*OH*OW - sum_i rows_i * sum_j cols_j)."""
    fh, fw = upsample or (1, 1)
    rows, oh = real_taps(height, kernel[0], strides[0], pads[0], pads[2], dilations[0], fh, fill, pad_fill)
    cols, ow = real_taps(width, kernel[1], strides[1], pads[1], pads[3], dilations[1], fw, fill, pad_fill)
    return macs_per_tap * (kernel[0] * kernel[1] * oh * ow - sum(rows) * sum(cols))


@dataclass(frozen=True)
class GemmShape:
    """One instruction as the array runs it: `groups` GEMMs (m x k) . (k x n) for a batch, and the bytes its
    output stage stores (after window-max)."""

    groups: int
    m: int
    n: int
    k: int
    stored_bytes: int
    table_bytes: int = 0  # the output stage's lookup table (256 bytes), read once with the parameters
    zero_macs: int = 0  # MACs whose input is a zero of an upsampled read (isa/geometry.py zero_read_macs)

    @property
    def macs(self) -> int:
        return self.groups * self.m * self.n * self.k

    @property
    def out_bytes(self) -> int:
        """int8 bytes of the GEMM's result before window-max."""
        return self.groups * self.m * self.n
