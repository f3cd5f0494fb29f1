"""Accuracy-drop reports (design.md section 6, `qdeploy report`): the int8 program on the simulator against the
float model, per model (agreement, accuracy, logits SQNR, cosine), per layer (SQNR cumulative and isolated) and
per tensor (calibration histograms), written as report.md, report.json and PNG figures.

  metrics.py    the formulas, as functions of arrays
  evaluate.py   the streaming walk: float, cumulative int8 and isolated int8, batch by batch
  inputs.py     labels, peer logits, and the check that the program was compiled from the model
  plots.py      the figures (matplotlib, Agg canvas)
  markdown.py   report.md
  build.py      build_report: checks, walk, files

This package's own module holds only DEFAULT_BATCH_SIZE, so that the CLI can read it without importing the
simulator; `build_report` and `ReportResult` are in qdeploy.reports.build."""

DEFAULT_BATCH_SIZE = 16  # samples per walk; EfficientNet-Lite0 runs fastest per sample on the simulator at 8-16


__all__ = ["DEFAULT_BATCH_SIZE"]
