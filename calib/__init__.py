"""Calibration: streaming |x| histograms, threshold selection (KL, max, percentile, MSE), max-abs weight
quantization, calibration tables and data loading (design.md section 5).

The defaults below are shared by the Python API (qdeploy.calibration.calibrate) and the CLI; they live here so
that reading them does not import Numba."""

DEFAULT_METHOD = "kl"
DEFAULT_NUM_SAMPLES = 512
DEFAULT_BATCH_SIZE = 32
DEFAULT_PERCENTILE = 99.99
# Image preprocessing (calib.data.Preprocess): (x - mean[c]) / std[c] on 0..255 values, NCHW, RGB.
DEFAULT_MEAN = (0.0,)
DEFAULT_STD = (1.0,)
DEFAULT_LAYOUT = "NCHW"
DEFAULT_CHANNELS = "RGB"
# The steps of a quantizer over [0, T] (design.md sections 3 and 5): int8 with zero point 0 stores |x| <= T in codes
# 0..127, s = T / 127; uint8 with zero point 0 (a non-negative tensor on a target with unsigned activations) stores
# [0, T] in codes 0..255, s = T / 255. The threshold methods judge each tensor at the steps it will get.
INT8_STEPS = 127
UINT8_STEPS = 255
