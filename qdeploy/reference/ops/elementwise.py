"""Elementwise ops with NumPy-style (multidirectional) broadcasting, comparisons, Where and Cast.

Both operands of a binary op have the same type T in ONNX, so NumPy keeps T. Floating-point edge cases
follow IEEE 754 as the spec does (x/0 = inf, log(0) = -inf, sqrt(-1) = nan), without NumPy's warnings."""

from __future__ import annotations

from functools import reduce

import numpy as np

from qdeploy_base.errors import Unsupported


def Add(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """C = A + B (integers wrap around). Spec: Add-14 (https://onnx.ai/onnx/operators/onnx__Add.html)."""
    return np.add(A, B)


def Sub(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """C = A - B (integers wrap around). Spec: Sub-14 (https://onnx.ai/onnx/operators/onnx__Sub.html)."""
    return np.subtract(A, B)


def Mul(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """C = A * B (integers wrap around). Spec: Mul-14 (https://onnx.ai/onnx/operators/onnx__Mul.html)."""
    return np.multiply(A, B)


def Div(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """C = A / B; for integers the quotient is truncated toward zero (C semantics: -7 / 2 = -3), and
    division by zero is an error. Spec: Div-14 (https://onnx.ai/onnx/operators/onnx__Div.html)."""
    A, B = np.asarray(A), np.asarray(B)
    if A.dtype.kind in "iu" and B.dtype.kind in "iu":
        if np.any(B == 0):
            raise ZeroDivisionError("integer division by zero")
        quotient = np.floor_divide(A, B)
        if A.dtype.kind == "i":
            # floor and truncation differ where the division is inexact and the signs differ.
            quotient = quotient + ((np.remainder(A, B) != 0) & ((A < 0) != (B < 0)))
        return quotient.astype(np.result_type(A, B), copy=False)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.divide(A, B)


def Pow(X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """Z = X ** Y, of X's type (the exponent's type may differ). Float bases use Y cast to X's type;
    an integer base with a float exponent is computed in float64 and truncated to X's type.
    Spec: Pow-15 (https://onnx.ai/onnx/operators/onnx__Pow.html)."""
    X, Y = np.asarray(X), np.asarray(Y)
    if X.dtype.kind == "f":
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return np.power(X, Y.astype(X.dtype, copy=False))
    if Y.dtype.kind == "f":
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return np.power(X.astype(np.float64), Y.astype(np.float64)).astype(X.dtype)
    if np.any(Y < 0):
        raise ValueError("an integer base raised to a negative integer exponent is not supported")
    return np.power(X, Y.astype(X.dtype, copy=False))


def Sqrt(X: np.ndarray) -> np.ndarray:
    """Y = sqrt(X) (nan for X < 0). Spec: Sqrt-13 (https://onnx.ai/onnx/operators/onnx__Sqrt.html)."""
    with np.errstate(invalid="ignore"):
        return np.sqrt(X)


def Neg(X: np.ndarray) -> np.ndarray:
    """Y = -X. Spec: Neg-13 (https://onnx.ai/onnx/operators/onnx__Neg.html)."""
    return np.negative(X)


def Abs(X: np.ndarray) -> np.ndarray:
    """Y = |X|. Spec: Abs-13 (https://onnx.ai/onnx/operators/onnx__Abs.html)."""
    return np.abs(X)


def Exp(input: np.ndarray) -> np.ndarray:
    """Y = e^input (inf on overflow). Spec: Exp-13 (https://onnx.ai/onnx/operators/onnx__Exp.html)."""
    with np.errstate(over="ignore"):
        return np.exp(input)


def Log(input: np.ndarray) -> np.ndarray:
    """Y = ln(input) (-inf at 0, nan below). Spec: Log-13 (https://onnx.ai/onnx/operators/onnx__Log.html)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(input)


def Ceil(X: np.ndarray) -> np.ndarray:
    """Y = ceil(X). Spec: Ceil-13 (https://onnx.ai/onnx/operators/onnx__Ceil.html)."""
    return np.ceil(X)


def Floor(X: np.ndarray) -> np.ndarray:
    """Y = floor(X). Spec: Floor-13 (https://onnx.ai/onnx/operators/onnx__Floor.html)."""
    return np.floor(X)


def Reciprocal(X: np.ndarray) -> np.ndarray:
    """Y = 1 / X (inf at 0). Spec: Reciprocal-13 (https://onnx.ai/onnx/operators/onnx__Reciprocal.html)."""
    with np.errstate(divide="ignore"):
        return np.reciprocal(X)


def Max(*data_0: np.ndarray) -> np.ndarray:
    """max = elementwise maximum of all inputs, broadcast together (nan propagates).
    Spec: Max-13 (https://onnx.ai/onnx/operators/onnx__Max.html)."""
    if not data_0:
        raise ValueError("Max needs at least one input")
    return reduce(np.maximum, data_0[1:], np.asarray(data_0[0]))


def Min(*data_0: np.ndarray) -> np.ndarray:
    """min = elementwise minimum of all inputs, broadcast together (nan propagates).
    Spec: Min-13 (https://onnx.ai/onnx/operators/onnx__Min.html)."""
    if not data_0:
        raise ValueError("Min needs at least one input")
    return reduce(np.minimum, data_0[1:], np.asarray(data_0[0]))


def Sum(*data_0: np.ndarray) -> np.ndarray:
    """sum = data_0 + data_1 + ... (left to right, broadcast together).
    Spec: Sum-13 (https://onnx.ai/onnx/operators/onnx__Sum.html)."""
    if not data_0:
        raise ValueError("Sum needs at least one input")
    return reduce(np.add, data_0[1:], np.asarray(data_0[0]))


def Mean(*data_0: np.ndarray) -> np.ndarray:
    """mean = (data_0 + data_1 + ...) / n, the sum as in Sum.
    Spec: Mean-13 (https://onnx.ai/onnx/operators/onnx__Mean.html)."""
    total = Sum(*data_0)
    return (total / len(data_0)).astype(total.dtype, copy=False)


def Equal(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """C = (A == B), bool. Spec: Equal-19 (https://onnx.ai/onnx/operators/onnx__Equal.html)."""
    return np.asarray(np.equal(A, B), dtype=bool)


def Less(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """C = (A < B), bool. Spec: Less-13 (https://onnx.ai/onnx/operators/onnx__Less.html)."""
    return np.less(A, B)


def Greater(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """C = (A > B), bool. Spec: Greater-13 (https://onnx.ai/onnx/operators/onnx__Greater.html)."""
    return np.greater(A, B)


def Not(X: np.ndarray) -> np.ndarray:
    """Y = not X, bool. Spec: Not-1 (https://onnx.ai/onnx/operators/onnx__Not.html)."""
    return np.logical_not(X)


def Where(condition: np.ndarray, X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """output = X where condition else Y, the three broadcast together.
    Spec: Where-16 (https://onnx.ai/onnx/operators/onnx__Where.html)."""
    return np.where(np.asarray(condition, dtype=bool), X, Y)


# TensorProto.DataType -> NumPy dtype, for the types the reference executor handles.
CAST_DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.float32),   # FLOAT
    2: np.dtype(np.uint8),     # UINT8
    3: np.dtype(np.int8),      # INT8
    4: np.dtype(np.uint16),    # UINT16
    5: np.dtype(np.int16),     # INT16
    6: np.dtype(np.int32),     # INT32
    7: np.dtype(np.int64),     # INT64
    9: np.dtype(np.bool_),     # BOOL
    10: np.dtype(np.float16),  # FLOAT16
    11: np.dtype(np.float64),  # DOUBLE
    12: np.dtype(np.uint32),   # UINT32
    13: np.dtype(np.uint64),   # UINT64
}


def Cast(input: np.ndarray, *, to: int, saturate: int = 1, round_mode: str = "up") -> np.ndarray:
    """output = input converted to the type `to` (a TensorProto.DataType): float -> int truncates toward
    zero (out of range is undefined in the spec), int -> int wraps (two's complement), anything -> bool is
    x != 0, float -> narrower float rounds to nearest even. `saturate` and `round_mode` only concern float 8
    types, which (with strings, bfloat16 and the 4-bit types) are not supported.
    Spec: Cast-13 / Cast-19 (https://onnx.ai/onnx/operators/onnx__Cast.html)."""
    dtype = CAST_DTYPES.get(int(to))
    if dtype is None:
        raise Unsupported(f"Cast to TensorProto data type {to} is not supported (supported: "
                          f"{', '.join(str(t) for t in CAST_DTYPES)})")
    input = np.asarray(input)
    if input.dtype.kind not in "biuf":
        raise Unsupported(f"Cast from {input.dtype} is not supported")
    with np.errstate(invalid="ignore", over="ignore"):
        return input.astype(dtype)


def Sign(input: np.ndarray) -> np.ndarray:
    """-1, 0 or 1 by the sign of each element. Spec: Sign-13 (https://onnx.ai/onnx/operators/onnx__Sign.html)."""
    return np.sign(input).astype(input.dtype, copy=False)


def Round(X: np.ndarray) -> np.ndarray:
    """The nearest integer, halves to even. Spec: Round-11 (https://onnx.ai/onnx/operators/onnx__Round.html)."""
    return np.round(X).astype(X.dtype, copy=False)


def Sin(input: np.ndarray) -> np.ndarray:
    """Spec: Sin-7 (https://onnx.ai/onnx/operators/onnx__Sin.html)."""
    return np.sin(input).astype(input.dtype, copy=False)


def Cos(input: np.ndarray) -> np.ndarray:
    """Spec: Cos-7 (https://onnx.ai/onnx/operators/onnx__Cos.html)."""
    return np.cos(input).astype(input.dtype, copy=False)


def LessOrEqual(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """Spec: LessOrEqual-16 (https://onnx.ai/onnx/operators/onnx__LessOrEqual.html)."""
    return np.less_equal(A, B)


def GreaterOrEqual(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """Spec: GreaterOrEqual-16 (https://onnx.ai/onnx/operators/onnx__GreaterOrEqual.html)."""
    return np.greater_equal(A, B)


def And(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """Spec: And-7 (https://onnx.ai/onnx/operators/onnx__And.html)."""
    return np.logical_and(A, B)


def Or(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """Spec: Or-7 (https://onnx.ai/onnx/operators/onnx__Or.html)."""
    return np.logical_or(A, B)


def Mod(A: np.ndarray, B: np.ndarray, *, fmod: int = 0) -> np.ndarray:
    """The remainder with the divisor's sign (fmod = 0, Python's %), or C's fmod, the dividend's sign.
    Spec: Mod-13 (https://onnx.ai/onnx/operators/onnx__Mod.html)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return (np.fmod(A, B) if fmod else np.mod(A, B)).astype(A.dtype, copy=False)
