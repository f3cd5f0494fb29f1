"""The report's PNG figures, drawn with matplotlib's object API on the Agg canvas (no pyplot, so the caller's
backend and global state are left alone). Each figure is written atomically; PNG metadata is dropped so that
the same numbers give the same bytes."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from qdeploy_base.fileio import atomic_write

PALETTE_COLORS = 64
HISTOGRAM_COLUMNS = 6
HISTOGRAM_PLOT_BINS = 256  # the 2048 calibration bins summed in groups of 8 for drawing


def short_name(name: str, parts: int = 3, width: int = 40) -> str:
    """The last `parts` path components of an ONNX name, at most `width` characters ('/_blocks.3/_project_conv/Conv'
    -> '_blocks.3/_project_conv/Conv'): enough to tell layers apart in a small label."""
    pieces = [p for p in name.split("/") if p]
    text = "/".join(pieces[-parts:]) if pieces else name
    return text if len(text) <= width else "..." + text[-(width - 3):]


def _save(figure, path: Path) -> Path:
    """Render on the Agg canvas, reduce to a PALETTE_COLORS palette (the figures use a few flat colours, so
    this loses nothing visible and makes the files about 3x smaller) and write atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    image = Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba()).convert("RGB")
    image = image.quantize(colors=PALETTE_COLORS, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    return atomic_write(path, lambda tmp: image.save(tmp, format="PNG", optimize=True))


def sqnr_bars(layers: list[dict], path: str | os.PathLike) -> Path:
    """Horizontal bars, two per layer in program order: SQNR cumulative and isolated (dB). An exact layer
    (infinite SQNR) is drawn to the right edge and labelled 'exact'."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MultipleLocator

    count = len(layers)
    finite = [v for layer in layers for v in (layer["sqnr_cumulative_db"], layer["sqnr_isolated_db"])
              if v is not None and math.isfinite(v)]
    right = max(finite + [10.0]) * 1.08
    height = 1.3 + 0.2 * count
    figure = Figure(figsize=(9.0, height))
    figure.subplots_adjust(left=0.3, right=0.97, bottom=0.7 / height, top=1 - 0.6 / height)
    axes = figure.add_subplot()
    y = np.arange(count)
    for offset, key, label, color in ((-0.2, "sqnr_cumulative_db", "cumulative (errors propagate)", "#1f77b4"),
                                      (0.2, "sqnr_isolated_db", "isolated (this layer alone)", "#ff7f0e")):
        values = np.array([right if layer[key] is None else max(layer[key], 0.0) for layer in layers], float)
        axes.barh(y + offset, values, height=0.4, color=color, label=label)
        for i, layer in enumerate(layers):
            if layer[key] is None:
                axes.text(right, i + offset, " exact", va="center", fontsize=6)
    axes.set_yticks(y, [f"{i} {short_name(layer['name'])}" for i, layer in enumerate(layers)], fontsize=7)
    axes.set_ylim(count - 0.5, -0.5)
    axes.set_xlim(0, right * 1.06)
    axes.xaxis.set_major_locator(MultipleLocator(5 if right < 80 else 10))
    axes.set_xlabel("SQNR of the layer's output vs float (dB, higher is better)", fontsize=8)
    axes.tick_params(axis="x", labelsize=7)
    axes.grid(axis="x", alpha=0.3)
    axes.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=2, fontsize=8, frameon=False)
    return _save(figure, Path(path))


def _rebinned(counts: np.ndarray, bins: int) -> np.ndarray:
    if len(counts) % bins:
        return counts
    return counts.reshape(bins, -1).sum(axis=1)


def histogram_grid(tensors: list[dict], path: str | os.PathLike) -> Path:
    """One small plot per calibrated tensor: the |x| histogram over [0, amax] (log counts) with the chosen |T|
    (red) and amax (grey dashed) marked, TensorRT's calibration picture. `tensors` are dicts with name, counts,
    amax, threshold and optionally why_short (a line under the name: why it is shown). (Fixed margins and few ticks: matplotlib's tight
    layout takes seconds per dozen plots.)"""
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogLocator, MaxNLocator, NullLocator

    columns = min(HISTOGRAM_COLUMNS, max(1, len(tensors)))
    rows = max(1, math.ceil(len(tensors) / columns))
    height = 1.95 * rows + 0.6
    figure = Figure(figsize=(2.6 * columns, height))
    figure.subplots_adjust(left=0.04, right=0.99, bottom=0.25 / height, top=1 - 0.75 / height,
                           wspace=0.28, hspace=0.85)
    for i, tensor in enumerate(tensors):
        axes = figure.add_subplot(rows, columns, i + 1)
        counts = _rebinned(np.asarray(tensor["counts"], np.float64), HISTOGRAM_PLOT_BINS)
        amax, threshold = float(tensor["amax"]), float(tensor["threshold"])
        edges = np.linspace(0.0, amax, len(counts) + 1)
        if np.any(counts > 0):
            axes.stairs(np.where(counts > 0, counts, np.nan), edges, fill=True, color="#4c72b0", linewidth=0)
            axes.set_yscale("log")
            axes.yaxis.set_major_locator(LogLocator(numticks=4))
            axes.yaxis.set_minor_locator(NullLocator())
        axes.xaxis.set_major_locator(MaxNLocator(4))
        axes.axvline(threshold, color="#d62728", linewidth=1.2)
        axes.axvline(amax, color="0.4", linewidth=1.0, linestyle="--")
        axes.set_xlim(0, max(amax, threshold) * 1.04 or 1.0)
        ratio = f"{threshold / amax:.2f}" if amax > 0 else "-"
        why = f"\n{tensor['why_short']}" if tensor.get("why_short") else ""
        axes.set_title(f"{i} {short_name(tensor['name'])}{why}\n|T| {threshold:.3g}  amax {amax:.3g}  ({ratio})",
                       fontsize=6.5)
        axes.tick_params(labelsize=5.5, pad=1)
    figure.suptitle("Calibration histograms of |x| (log counts): red |T| chosen threshold, dashed grey amax",
                    fontsize=10, y=1 - 0.12 / height)
    return _save(figure, Path(path))
