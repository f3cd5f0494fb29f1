"""Numba kernels of the accelerator's datapath (simulator/README.md), one module per stage, each with its
public entry point of the same name:

    from simulator.kernels.im2col import im2col            # eq. 9 (im2col_planar: per image, transposed)
    from simulator.kernels.gemm import gemm                # eq. 1 (gemm_planar: weights left, NCHW result)
    from simulator.kernels.depthwise import depthwise_conv # eq. 1 + 9 for group = channels, without im2col
    from simulator.kernels.requantize import requantize    # eq. 2-8 (rows x channels, or channel-planar views)
    from simulator.kernels.window_max import window_max    # eq. 10

Each kernel has a Python-int twin in simulator/twins.py and equals it bit for bit (tests/test_sim_*.py); the
fast layouts (planar GEMM, depthwise, planar requantize) also equal the paths they replace
(tests/test_sim_planar.py, tests/test_sim_depthwise.py).
The functions are not re-exported here, so `simulator.kernels.gemm` stays the module."""
