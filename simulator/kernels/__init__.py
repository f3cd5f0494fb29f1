"""Numba kernels of the accelerator's datapath (simulator/README.md), one module per stage, each with its
public entry point of the same name:

    from simulator.kernels.im2col import im2col            # eq. 9
    from simulator.kernels.gemm import gemm                # eq. 1
    from simulator.kernels.requantize import requantize    # eq. 2-8
    from simulator.kernels.window_max import window_max    # eq. 10

Each kernel has a Python-int twin in simulator/reference.py and equals it bit for bit (tests/test_sim_*.py).
The functions are not re-exported here, so `simulator.kernels.gemm` stays the module."""
