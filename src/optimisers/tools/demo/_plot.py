"""The demo's plot: both runs' training loss, and how far each run's two places of the embedding
are apart after every step, drawn with matplotlib into a PNG.

The figure is drawn on matplotlib's Agg canvas directly (no pyplot), so it needs no display and
leaves matplotlib's global backend as it was.
"""

from __future__ import annotations

import numpy as np

BLUE = "#1f77b4"  # the tied run (optimisers)
ORANGE = "#ff7f0e"  # the naive run (two copies)
SIZE = (10.0, 4.2)  # inches, at DPI: a 1000 x 420 pixel image
DPI = 100


def smooth(values, window: int) -> np.ndarray:
    """Running mean over the last `window` values (shorter at the start)."""
    v = np.asarray(values, float)
    if len(v) == 0:
        return v
    c = np.cumsum(np.insert(v, 0, 0.0))
    idx = np.arange(1, len(v) + 1)
    start = np.maximum(idx - window, 0)
    return (c[idx] - c[start]) / (idx - start)


def _finite(values) -> np.ndarray:
    """`values` with inf as nan: matplotlib leaves a gap at nan (a diverged run) but not at inf."""
    v = np.asarray(values, float)
    return np.where(np.isfinite(v), v, np.nan)


def _panel(ax, title: str, tied, naive) -> None:
    steps = np.arange(1, len(tied) + 1)
    ax.plot(steps, _finite(naive), color=ORANGE, linewidth=1.5, label="naive (two copies)")
    ax.plot(steps, _finite(tied), color=BLUE, linewidth=1.5, label="tied (optimisers)")
    ax.set_title(title)
    ax.set_xlim(0, len(tied))  # every step, also those where a diverged run has no value
    ax.set_xlabel("step")
    ax.grid(True, color="0.9")


def training_plot(path, tied_loss, naive_loss, tied_drift, naive_drift, title: str) -> None:
    """Write the two panels to `path` (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=SIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, drift_ax = fig.subplots(1, 2)
    window = max(1, len(tied_loss) // 40)
    _panel(loss_ax, "training loss", smooth(tied_loss, window), smooth(naive_loss, window))
    _panel(drift_ax, "max |embed - unembed|", tied_drift, naive_drift)
    top = np.nanmax(_finite(naive_drift), initial=0.0)
    if top > 0:  # from just below 0, so that the tied run's line at 0 shows above the axis
        drift_ax.set_ylim(-0.02 * top, 1.05 * top)
    handles, labels = loss_ax.get_legend_handles_labels()
    fig.legend(handles[::-1], labels[::-1], loc="outside lower center", ncols=2, frameon=False)
    fig.suptitle(title)
    fig.savefig(path, format="png")


# `--state`: one colour per way of keeping the state, the same in every plot
STATE_COLOURS = {"fp32": BLUE, "8bit": ORANGE, "4bit": "#2ca02c", "fp8": "#d62728", "bf16-sr": "#9467bd"}


def states_plot(path, losses: dict, title: str) -> None:
    """Write two panels to `path` (PNG): each run's training loss (`losses`: name -> per-step
    losses, fp32's first), and each low-precision run's loss minus fp32's, which the first panel's
    overlapping curves hide."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=SIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, diff_ax = fig.subplots(1, 2)
    reference = losses["fp32"]
    window = max(1, len(reference) // 40)
    steps = np.arange(1, len(reference) + 1)
    for name, loss in losses.items():
        colour = STATE_COLOURS[name]
        loss_ax.plot(steps, _finite(smooth(loss, window)), color=colour, linewidth=1.5, label=name)
        diff = smooth(np.asarray(loss, float) - np.asarray(reference, float), window)
        diff_ax.plot(steps, _finite(diff), color=colour, linewidth=1.5)
    for ax, panel in ((loss_ax, "training loss"), (diff_ax, "training loss minus fp32's")):
        ax.set_title(panel)
        ax.set_xlim(0, len(reference))
        ax.set_xlabel("step")
        ax.grid(True, color="0.9")
    handles, labels = loss_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), frameon=False)
    fig.suptitle(title)
    fig.savefig(path, format="png")
