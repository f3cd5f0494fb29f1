"""Activations: Relu, Clip, LeakyRelu, Sigmoid, HardSigmoid, HardSwish, Tanh, Elu, Softmax, LogSoftmax.

Python-float attributes (alpha, beta) combine with float32 tensors in float32 (NumPy's weak scalars)."""

from __future__ import annotations

import numpy as np

from qdeploy.reference.ops._common import normalize_axis
from qdeploy.reference.ops.elementwise import Exp


def Relu(X: np.ndarray) -> np.ndarray:
    """Y = max(X, 0). Spec: Relu-14 (https://onnx.ai/onnx/operators/onnx__Relu.html)."""
    return np.maximum(X, X.dtype.type(0))


def Clip(input: np.ndarray, min: np.ndarray | None = None, max: np.ndarray | None = None) -> np.ndarray:
    """Y = min(max(input, min), max), an omitted bound being no bound; when min > max every element
    becomes max. Spec: Clip-11 / Clip-13 (https://onnx.ai/onnx/operators/onnx__Clip.html)."""
    if min is None and max is None:
        return input
    Y = np.array(input) if min is None else np.maximum(input, np.asarray(min, dtype=input.dtype))
    if max is not None:
        np.minimum(Y, np.asarray(max, dtype=input.dtype), out=Y)  # in place: one new array, not two
    return Y


def Clip_6(input: np.ndarray, *, min: float = -3.4028234663852886e38, max: float = 3.4028234663852886e38,
           ) -> np.ndarray:
    """Opsets 6-10: Y = min(max(input, min), max) with the bounds as attributes (defaults: the float32
    range). Spec: Clip-6 (https://onnx.ai/onnx/operators/onnx__Clip.html)."""
    return np.minimum(np.maximum(input, input.dtype.type(min)), input.dtype.type(max))


def LeakyRelu(X: np.ndarray, *, alpha: float = 0.01) -> np.ndarray:
    """Y = alpha * X for X < 0, X otherwise.
    Spec: LeakyRelu-16 (https://onnx.ai/onnx/operators/onnx__LeakyRelu.html)."""
    return np.where(X < 0, alpha * X, X).astype(X.dtype, copy=False)


def Sigmoid(X: np.ndarray) -> np.ndarray:
    """Y = 1 / (1 + exp(-X)), evaluated as 1 / (1 + e) for X >= 0 and e / (1 + e) for X < 0 with
    e = exp(-|X|), which never overflows. Spec: Sigmoid-13 (https://onnx.ai/onnx/operators/onnx__Sigmoid.html)."""
    e = np.exp(-np.abs(X))
    return np.where(X >= 0, 1 / (1 + e), e / (1 + e)).astype(X.dtype, copy=False)


def HardSigmoid(X: np.ndarray, *, alpha: float = 0.2, beta: float = 0.5) -> np.ndarray:
    """Y = max(0, min(1, alpha * X + beta)). Spec: HardSigmoid-6 / -22
    (https://onnx.ai/onnx/operators/onnx__HardSigmoid.html)."""
    return np.clip(alpha * X + beta, 0, 1).astype(X.dtype, copy=False)


def HardSwish(X: np.ndarray) -> np.ndarray:
    """Y = X * max(0, min(1, X / 6 + 1/2)) (HardSigmoid with alpha = 1/6, beta = 0.5).
    Spec: HardSwish-14 / -22 (https://onnx.ai/onnx/operators/onnx__HardSwish.html)."""
    return (X * np.clip(X * (1 / 6) + 0.5, 0, 1)).astype(X.dtype, copy=False)


def Tanh(input: np.ndarray) -> np.ndarray:
    """Y = tanh(input). Spec: Tanh-13 (https://onnx.ai/onnx/operators/onnx__Tanh.html)."""
    return np.tanh(input)


def Elu(X: np.ndarray, *, alpha: float = 1.0) -> np.ndarray:
    """Y = alpha * (exp(X) - 1) for X < 0, X otherwise.
    Spec: Elu-6 / -22 (https://onnx.ai/onnx/operators/onnx__Elu.html)."""
    negative = alpha * (np.exp(np.minimum(X, 0)) - 1)
    return np.where(X < 0, negative, X).astype(X.dtype, copy=False)


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=axis, keepdims=True)


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def _coerced_2d(function, input: np.ndarray, axis: int) -> np.ndarray:
    """Opsets 1-12: the input is viewed as a matrix (prod(shape[:axis]), prod(shape[axis:])) and the
    function applies along its rows."""
    axis = normalize_axis(axis, input.ndim)
    rows = int(np.prod(input.shape[:axis], dtype=np.int64))
    return function(input.reshape(rows, -1), 1).reshape(input.shape)


def Softmax(input: np.ndarray, *, axis: int = -1) -> np.ndarray:
    """Y = exp(x - max_axis x) / sum_axis exp(x - max_axis x) along the one axis `axis`.
    Spec: Softmax-13 (https://onnx.ai/onnx/operators/onnx__Softmax.html)."""
    return _softmax(input, normalize_axis(axis, input.ndim))


def Softmax_1(input: np.ndarray, *, axis: int = 1) -> np.ndarray:
    """Opsets 1-12: softmax over the flattened dimensions [axis, rank) (input coerced to 2-D at `axis`).
    Spec: Softmax-11 (https://onnx.ai/onnx/operators/onnx__Softmax.html#softmax-11)."""
    return _coerced_2d(_softmax, input, axis)


def LogSoftmax(input: np.ndarray, *, axis: int = -1) -> np.ndarray:
    """Y = (x - max) - log(sum_axis exp(x - max)) along the one axis `axis`.
    Spec: LogSoftmax-13 (https://onnx.ai/onnx/operators/onnx__LogSoftmax.html)."""
    return _log_softmax(input, normalize_axis(axis, input.ndim))


def LogSoftmax_1(input: np.ndarray, *, axis: int = 1) -> np.ndarray:
    """Opsets 1-12: log-softmax over the flattened dimensions [axis, rank).
    Spec: LogSoftmax-11 (https://onnx.ai/onnx/operators/onnx__LogSoftmax.html#logsoftmax-11)."""
    return _coerced_2d(_log_softmax, input, axis)


def Erf(input: np.ndarray) -> np.ndarray:
    """output = erf(input), the Gauss error function. Spec: Erf-13 (https://onnx.ai/onnx/operators/onnx__Erf.html)."""
    from scipy.special import erf

    return erf(input).astype(input.dtype, copy=False)


def Gelu(X: np.ndarray, *, approximate: str = "none") -> np.ndarray:
    """Y = 0.5 X (1 + erf(X / sqrt(2))); with approximate = "tanh", 0.5 X (1 + tanh(sqrt(2/pi) (X + 0.044715
    X^3))). Spec: Gelu-20 (https://onnx.ai/onnx/operators/onnx__Gelu.html)."""
    compute = np.float64  # the float32 result rounded once
    x = X.astype(compute)
    if approximate == "none":
        from scipy.special import erf

        y = 0.5 * x * (1 + erf(x / np.sqrt(2)))
    elif approximate == "tanh":
        y = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    else:
        raise ValueError(f"approximate '{approximate}' is not one of none, tanh")
    return y.astype(X.dtype)


def Softplus(X: np.ndarray) -> np.ndarray:
    """Y = ln(exp(X) + 1), computed without overflow. Spec: Softplus-1
    (https://onnx.ai/onnx/operators/onnx__Softplus.html)."""
    return np.logaddexp(X.dtype.type(0), X).astype(X.dtype, copy=False)


def Mish(X: np.ndarray) -> np.ndarray:
    """Y = X tanh(softplus(X)). Spec: Mish-18 (https://onnx.ai/onnx/operators/onnx__Mish.html)."""
    x = X.astype(np.float64)
    return (x * np.tanh(np.logaddexp(0, x))).astype(X.dtype)


def Swish(X: np.ndarray, *, alpha: float = 1.0) -> np.ndarray:
    """Y = X * Sigmoid(alpha * X) (SiLU when alpha = 1). Spec: Swish-24
    (https://onnx.ai/onnx/operators/onnx__Swish.html)."""
    return (X * Sigmoid(X * X.dtype.type(alpha))).astype(X.dtype, copy=False)


def PRelu(X: np.ndarray, slope: np.ndarray) -> np.ndarray:
    """Y = slope * X for X < 0, X otherwise; slope broadcasts to X (unidirectionally).
    Spec: PRelu-16 (https://onnx.ai/onnx/operators/onnx__PRelu.html)."""
    slope = np.asarray(slope, X.dtype)
    if np.broadcast_shapes(X.shape, slope.shape) != X.shape:
        raise ValueError(f"slope of shape {slope.shape} does not broadcast to X of shape {X.shape}")
    return np.where(X < 0, slope * X, X).astype(X.dtype, copy=False)


# The unary activations with one form at every opset, by ONNX op name (the executor's table, ops.OPS, takes them
# from here). An output-stage lookup table tabulates one of them (qdeploy/lowering/lookup.py FUNCTIONS).
UNARY = {"Relu": Relu, "LeakyRelu": LeakyRelu, "Sigmoid": Sigmoid, "HardSigmoid": HardSigmoid,
         "HardSwish": HardSwish, "Tanh": Tanh, "Elu": Elu, "Erf": Erf, "Gelu": Gelu, "Softplus": Softplus,
         "Mish": Mish, "Swish": Swish, "Exp": Exp}  # Exp: an integer softmax's table (qdeploy/lowering/softmax.py)


def evaluate(function: str, params: dict, x: np.ndarray) -> np.ndarray:
    """f(x) for the unary activation `function` (its ONNX op name) with attributes `params`, in x's dtype: the
    float meaning of an output-stage lookup table."""
    return np.asarray(UNARY[function](x, **params))
