"""Calibration: streaming |x| histograms, threshold selection (KL, max, percentile, MSE), max-abs weight
quantization, calibration tables and data loading (design.md section 5)."""
