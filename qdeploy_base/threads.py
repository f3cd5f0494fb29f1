"""Threads of our own instead of BLAS's: the simulator, calibration and the reports run slices of a batch side by
side and hold BLAS to one thread meanwhile. Measured on 2 shared cores, OpenBLAS's threads spinning against each
other and other processes made calibration's 1x1 convolutions 12x slower (34 s against 2.9 s for 128
EfficientNet-Lite0 images, load average 4.6). Imports nothing of the simulator's kernels, so the float side
(qdeploy/calibration.py, qdeploy/reports) uses it without loading Numba."""

from __future__ import annotations

import os
from contextlib import nullcontext

try:  # optional, speed only: without it BLAS keeps its own threads and batches run in one thread
    from threadpoolctl import ThreadpoolController
except ImportError:  # pragma: no cover
    ThreadpoolController = None
_blas_controller = None


def one_blas_thread():
    """Context that limits BLAS to one thread (threadpoolctl), or does nothing without threadpoolctl."""
    global _blas_controller
    if ThreadpoolController is None:
        return nullcontext()
    if _blas_controller is None:
        _blas_controller = ThreadpoolController()  # scans the loaded libraries once (~2 ms)
    return _blas_controller.limit(limits=1, user_api="blas")


def blas_threads_limitable() -> bool:
    """Whether one_blas_thread can hold BLAS to one thread (threadpoolctl is installed)."""
    return ThreadpoolController is not None


def usable_cpus() -> int:
    """The CPUs this process may use: the default number of worker threads."""
    return max(1, len(os.sched_getaffinity(0)))
