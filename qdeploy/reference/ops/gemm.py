"""Matrix products: Gemm and MatMul."""

from __future__ import annotations

import numpy as np


def Gemm(A: np.ndarray, B: np.ndarray, C: np.ndarray | None = None, *, alpha: float = 1.0, beta: float = 1.0,
         transA: int = 0, transB: int = 0) -> np.ndarray:
    """Y = alpha * A' @ B' + beta * C, with A' = A^T if transA else A (M x K), B' = B^T if transB else B
    (K x N), and C (optional) unidirectionally broadcast to (M, N).
    Spec: Gemm-13 (https://onnx.ai/onnx/operators/onnx__Gemm.html)."""
    A, B = np.asarray(A), np.asarray(B)
    if A.ndim != 2 or B.ndim != 2:
        raise ValueError(f"A and B must be matrices, got shapes {A.shape} and {B.shape}")
    left = A.T if transA else A
    right = B.T if transB else B
    if left.shape[1] != right.shape[0]:
        raise ValueError(f"A' {left.shape} and B' {right.shape} do not multiply (transA={transA}, "
                         f"transB={transB})")
    Y = left @ right
    if alpha != 1.0:
        Y = alpha * Y
    if C is not None and beta != 0.0:
        bias = np.asarray(C)
        if np.broadcast_shapes(bias.shape, Y.shape) != Y.shape:
            raise ValueError(f"C of shape {bias.shape} does not broadcast to the output shape {Y.shape}")
        Y = Y + (bias if beta == 1.0 else beta * bias)
    return Y.astype(np.result_type(A, B), copy=False)


def MatMul(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """Y = A @ B with numpy.matmul semantics: batched over leading (broadcast) dimensions; a 1-D operand
    gets a dimension of 1 prepended (A) or appended (B) that is removed afterwards.
    Spec: MatMul-13 (https://onnx.ai/onnx/operators/onnx__MatMul.html)."""
    A, B = np.asarray(A), np.asarray(B)
    if A.ndim == 0 or B.ndim == 0:
        raise ValueError(f"MatMul operands must have rank >= 1, got shapes {A.shape} and {B.shape}")
    return np.matmul(A, B)
