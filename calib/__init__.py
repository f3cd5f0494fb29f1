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
