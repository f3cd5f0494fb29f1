"""The closed vocabulary of instruction kinds (docs/design.md section 4).

Every stage that handles instructions (lowering description, float meaning, compiler, program checks,
simulator and its Python-int twin, ONNX export, golden vectors, performance model, printers) keeps one handler
table keyed by `Kind` and raises `UnknownKind` for a kind it has no entry for; tests/test_isa_coverage.py checks
that every table covers every kind. A kind's name is spelled here and nowhere else: code compares with
`Kind.X` (a `StrEnum`, so `Kind.CONV_GEMM == "ConvGemm"` and manifests stay plain JSON strings). ONNX-facing
code spells the ONNX ops that five layout kinds are named after as strings: there they mean the op.
"""

from __future__ import annotations

from enum import StrEnum


class Kind(StrEnum):
    # On the GEMM array, with the output stage:
    CONV_GEMM = "ConvGemm"  # im2col + GEMM per group: Conv, depthwise, pooling, standalone BN/affine, identity
    DENSE_GEMM = "DenseGemm"  # y = x @ W^T + b on (N, K): Gemm, MatMul with constant weights
    ADD_GEMM = "AddGemm"  # y = a + b of two activations: a GEMM with K = 2 per channel
    MUL_GEMM = "MulGemm"  # y = a * b of two activations (b broadcast): a K = 1 GEMM whose weight is read from b
    MATMUL_GEMM = "MatMulGemm"  # y = a @ b (or a @ b^T) of two activations, batched over the leading axes
    # Layout: no arithmetic, the compiler maps them to addresses. Most are named after the ONNX op they come from.
    CONCAT = "Concat"  # producers write into channel slices of one buffer (shared output scale)
    RESHAPE = "Reshape"
    FLATTEN = "Flatten"
    SQUEEZE = "Squeeze"
    UNSQUEEZE = "Unsqueeze"
    CHANNEL_SLICE = "ChannelSlice"  # a window along one axis, the channels unless `axis` says (Split, Slice, Gather)
    CHANNEL_PERMUTE = "ChannelPermute"  # the input's channels reordered (channel shuffle): strided addressing
    AXIS_PERMUTE = "AxisPermute"  # the input's axes reordered (Transpose, the batch kept first): strided addressing
    # Not an accelerator instruction: an ONNX op run in float on the host (--allow-host-fallback).
    HOST = "Host"


# Named sets, defined once (a name means the same set in every module).
WEIGHTED_GEMM_KINDS = frozenset({Kind.CONV_GEMM, Kind.DENSE_GEMM})  # GEMMs with a constant int8 weight operand
# GEMMs whose second operand is an activation produced earlier in the program (no constant weights, no bias)
ACTIVATION_GEMM_KINDS = frozenset({Kind.MUL_GEMM, Kind.MATMUL_GEMM})
ARRAY_KINDS = WEIGHTED_GEMM_KINDS | {Kind.ADD_GEMM} | ACTIVATION_GEMM_KINDS  # on the array, through the output stage
# Array kinds whose output stage may hold a lookup table (a table after a product runs in an identity GEMM)
LOOKUP_KINDS = WEIGHTED_GEMM_KINDS | {Kind.ADD_GEMM}
RESHAPE_KINDS = frozenset({Kind.RESHAPE, Kind.FLATTEN, Kind.SQUEEZE, Kind.UNSQUEEZE})  # a view with a new shape
VIEW_KINDS = RESHAPE_KINDS | {Kind.CHANNEL_SLICE, Kind.CHANNEL_PERMUTE, Kind.AXIS_PERMUTE}  # one input's data (or part, or reordered), its scale
LAYOUT_KINDS = VIEW_KINDS | {Kind.CONCAT}  # move or relabel data only
# Instructions that act on each image of a batch separately (the host executor may not be thread-safe).
PER_IMAGE_KINDS = ARRAY_KINDS | LAYOUT_KINDS


class UnknownKind(ValueError):
    """A stage met a kind it has no handler for: a kind added to `Kind` without a handler in that stage, or a
    foreign value in a program file."""


def kind_of(value: object, where: str = "instruction") -> Kind:
    """`value` as a Kind, or UnknownKind naming it and `where` it was found."""
    try:
        return Kind(value)
    except ValueError:
        raise UnknownKind(f"{where}: unknown instruction kind {value!r} (known: "
                          f"{', '.join(k.value for k in Kind)})") from None


def handler(table: dict, kind: object, stage: str, where: str = "instruction"):
    """The entry of a stage's handler `table` for `kind`; UnknownKind naming the stage and the kind when there is
    none (no stage falls through to a default kind)."""
    key = kind_of(kind, where)
    try:
        return table[key]
    except KeyError:
        raise UnknownKind(f"{where}: {stage} has no handler for kind {key.value!r}") from None
