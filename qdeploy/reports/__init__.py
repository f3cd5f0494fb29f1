"""Accuracy-drop reports (design.md section 6, `qdeploy report`): the int8 program on the simulator against the
float model, per model (agreement, accuracy, logits SQNR, cosine), per layer (SQNR cumulative and isolated) and
per tensor (calibration histograms), written as report.md, report.json and PNG figures.

  metrics.py    the formulas, as functions of arrays
  evaluate.py   the streaming walk: float, cumulative int8 and isolated int8, batch by batch
  inputs.py     labels, peer logits, and the check that the program was compiled from the model
  plots.py      the figures (matplotlib, Agg canvas)
  markdown.py   report.md
  build.py      build_report: checks, walk, files

`build_report` and `ReportResult` are imported on first use (PEP 562), so that reading DEFAULT_BATCH_SIZE (the
CLI does) does not import the simulator."""

DEFAULT_BATCH_SIZE = 16  # samples per walk; EfficientNet-Lite0 runs fastest per sample on the simulator at 8-16


def __getattr__(name: str):
    if name in ("build_report", "ReportResult"):
        from qdeploy.reports import build

        return getattr(build, name)
    raise AttributeError(f"module 'qdeploy.reports' has no attribute {name!r}")


__all__ = ["DEFAULT_BATCH_SIZE", "ReportResult", "build_report"]
