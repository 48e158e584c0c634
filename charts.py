"""A run's curves, drawn from its metrics history (metrics.jsonl's records, one per step):

    plot_curves   curves.png, a grid of panels that matplotlib draws at every run's end
                  (session.close_run; recipes/plot_stages.py for a staged run)
    svg_lines     the same panels as SVG, drawn here for report.html (report.py): the page
                  needs no plotting library and fetches nothing

Only finite numbers draw (`points`): NaN, inf, a bool or an integer past the largest float is
left out of the pictures, never out of the metrics; every axis spans what it draws, whatever
the values (`y_range`).
"""

import html
import math
import os
import sys
from pathlib import Path

from data import printable

# The grid's panels after the first (the algorithm's own: its reward or loss and held-out
# figures): a title and the metrics drawn in it, where the run logged them.
PANELS = [
    ("loss and KL", ("loss", "kl", "value_loss", "reverse_kl")),
    ("entropy (nats per token)", ("entropy_trained",)),
    ("completion length (tokens)", ("completion_len", "eval_completion_len")),
    ("truncated, clipped (fraction)", ("truncated_frac", "clip_low", "clip_high")),
    ("seconds per phase", ("gen_seconds", "reward_seconds", "train_seconds", "sync_seconds",
                           "eval_seconds")),
]
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")


def points(history: list[dict], key: str) -> list[tuple[float, float]]:
    """(step, value) wherever both are finite numbers (NaN, inf and anything else are left out
    of the pictures: the metrics and rollouts keep them)."""
    return every_point(history, (key,)).get(key, [])


def every_point(history: list[dict], keys=None) -> dict[str, list[tuple[float, float]]]:
    """points() of each of `keys` (None: every key but the step), in one pass over the history."""
    found = {}
    for r in history:
        x = finite(r.get("step"))
        if x is None:
            continue
        for key in r if keys is None else (k for k in keys if k in r):
            y = finite(r[key])
            if y is not None and key != "step":
                found.setdefault(key, []).append((x, y))
    return found


def finite(x) -> float | None:
    """x as a float where it is a finite number (not a bool, nor an integer past the largest
    float), else None."""
    if type(x) not in (int, float):  # (type: True is no number here)
        return None
    try:
        x = float(x)
    except OverflowError:
        return None
    return x if x - x == 0 else None  # (finite: inf - inf and NaN - NaN are NaN)


def y_range(ys, margin: float = 0.0) -> tuple[float, float]:
    """Limits that hold every value (finite ones) and lie apart, whatever they are: a constant
    -- also one where a step of 0.5 is below its rounding, 5e37 -- gets a band around it; a range
    wider than the largest float stays finite. margin: the share of the range added each side."""
    lo, hi = min(ys), max(ys)
    half = hi / 2 - lo / 2  # (hi - lo itself may overflow)
    if half <= max(abs(lo), abs(hi)) * 1e-12 or half < 5e-13:
        pad = max(abs(lo), abs(hi)) * 0.05 or 0.5
    else:
        pad = half * (2 * margin)
    return max(lo - pad, -sys.float_info.max), min(hi + pad, sys.float_info.max)


# ---------------------------------------------------------------------------------------------
# curves.png


def plot_curves(history: list[dict], path, title: str = "",
                train_keys=("reward", "accuracy"), eval_keys=("eval_accuracy",),
                stage_bounds=(), loss_keys=()) -> None:
    """The run's curves in one PNG: first train_keys per step and the held-out eval_keys (a
    dashed line where each stage of a staged run ends; loss_keys, no fraction of 1, on a second
    axis on the right), then a panel for each group of PANELS the run logged. Every axis spans
    what it draws (the first 0-1 where all of it is a fraction)."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    shown = set(train_keys) | set(eval_keys) | set(loss_keys)
    panels = [(name, [k for k in keys if k not in shown and points(history, k)])
              for name, keys in PANELS]
    panels = [(name, keys) for name, keys in panels if keys]
    cols = 1 if not panels else 2
    rows = -(-(1 + len(panels)) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 if cols == 1 else 11, 4 if rows == 1
                                                  else 2.9 * rows), squeeze=False)
    ax = axes[0][0]
    unit, series = _scaled(history, (*train_keys, *eval_keys))
    for key in train_keys:
        if key in series:
            ax.plot(*series[key], label=printable(f"train {key}"), alpha=0.6)
    for key, color in zip(eval_keys, ("black", "tab:red", "tab:green")):
        if key in series:
            ax.plot(*series[key], "o-", color=color,
                    label=printable(f"held-out {key.removeprefix('eval_')}"))
    for bound in stage_bounds:
        ax.axvline(bound, color="gray", linestyle="--", linewidth=1)
    _fit(ax, series, unit, fraction=True)
    handles = ax.get_legend_handles_labels()
    if loss_keys:
        right = ax.twinx()
        right.set_ylabel("loss (nats per token)")
        unit, series = _scaled(history, loss_keys)
        for key, style in zip(loss_keys, ("-", "s--")):
            if key in series:
                right.plot(*series[key], style, color="tab:purple", alpha=0.7,
                           label=printable(key))
        _fit(right, series, unit, from_zero=True)
        handles = [a + b for a, b in zip(handles, right.get_legend_handles_labels())]
    ax.legend(*handles, fontsize=8)
    ax.set_title(printable(title), fontsize=9)
    for i, (name, keys) in enumerate(panels, 1):
        ax = axes[i // cols][i % cols]
        unit, series = _scaled(history, keys)
        for key, color in zip(keys, COLOURS):
            ax.plot(*series[key], ".-", color=color, label=printable(key), alpha=0.8)
        _fit(ax, series, unit)
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
    for i in range(1 + len(panels), rows * cols):
        axes[i // cols][i % cols].axis("off")
    for row in axes:
        for ax in row:
            ax.grid(alpha=0.3)
            ax.set_xlabel("step", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}")  # (its suffix kept: savefig's format)
    tmp.unlink(missing_ok=True)
    try:
        with open(tmp, "xb") as f:  # (a new file: no link there is followed)
            fig.savefig(f, dpi=110, format=path.suffix[1:] or "png")
        os.replace(tmp, path)  # (a file there hard-linked to a backup's keeps its bytes)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def _scaled(history: list[dict], keys) -> tuple[float, dict]:
    """The unit an axis draws `keys` in, and each logged key's (steps, values / unit): 1, or
    1e300 where a value is past it (matplotlib's ticks overflow near the largest float)."""
    series = {k: p for k in keys if (p := points(history, k))}
    unit = 1e300 if any(abs(y) > 1e300 for p in series.values() for _, y in p) else 1.0
    return unit, {k: ([x for x, _ in p], [y / unit for _, y in p]) for k, p in series.items()}


def _fit(ax, series: dict, unit: float, fraction: bool = False, from_zero: bool = False):
    """An axis' y limits from what it draws: 0-1 for a `fraction` axis whose values all lie in
    it; from 0 for a `from_zero` one whose values never go below; else the values' range."""
    ys = [y for _, values in series.values() for y in values]
    if not ys:
        return
    if fraction and unit == 1 and 0 <= min(ys) and max(ys) <= 1:
        ax.set_ylim(-0.02, 1.02)
    else:
        lo, hi = y_range(ys, margin=0.05)
        ax.set_ylim(0 if from_zero and min(ys) >= 0 else lo, hi)
    if unit != 1:
        ax.set_ylabel(f"{ax.get_ylabel()} (x {unit:g})".strip())


# ---------------------------------------------------------------------------------------------
# report.html: the curves, as SVG.


def svg_chart(history: list[dict], keys, title: str) -> str:
    """One panel: a line per key (escaped names), the y range from the data (y_range: any
    finite values draw), min and max labelled."""
    return svg_lines([(k, points(history, k)) for k in keys], title)


def svg_lines(series: list[tuple[str, list]], title: str, width=330, height=190) -> str:
    """svg_chart's panel from each key's points."""
    series = [(k, thinned(p)) for k, p in series if p]
    if not series:
        return ""
    xs = [x for _, p in series for x, _ in p]
    x0, x1 = min(xs), max(xs)
    y0, y1 = y_range([y for _, p in series for _, y in p])
    # (one step: a step's room; past 2**53, where x0 + 1 == x0, a band around it as for y)
    x0, x1 = (x0, x1) if x1 > x0 else (x0, x0 + 1) if x0 + 1 > x0 else y_range([x0])
    left, top, right, bottom = 42, 22, width - 8, height - 40
    half = y1 / 2 - y0 / 2  # (halves: y1 - y0 may overflow)
    wide = x1 - x0 == math.inf  # (steps -1e308 to 1e308: halves; a tiny span's halves round to 0)
    sx = lambda x: left + ((x / 2 - x0 / 2) / (x1 / 2 - x0 / 2) if wide else  # noqa: E731
                           (x - x0) / (x1 - x0)) * (right - left)
    sy = lambda y: bottom - (y / 2 - y0 / 2) / half * (bottom - top)  # noqa: E731
    parts = [f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="{html.escape(title)}">',
             f'<text x="{left}" y="14" class="title">{html.escape(title)}</text>',
             f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" '
             f'class="frame"/>',
             f'<text x="{left - 4}" y="{top + 4}" class="tick" text-anchor="end">{y1:.3g}</text>',
             f'<text x="{left - 4}" y="{bottom}" class="tick" text-anchor="end">{y0:.3g}</text>',
             f'<text x="{left}" y="{bottom + 12}" class="tick">{x0:g}</text>',
             f'<text x="{right}" y="{bottom + 12}" class="tick" text-anchor="end">step {x1:g}'
             f'</text>']
    for i, (key, p) in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in p)
        parts.append(f'<polyline points="{line}" fill="none" stroke="{colour}" '
                     f'stroke-width="1.6"><title>{html.escape(key)}</title></polyline>')
        if len(p) == 1:
            parts.append(f'<circle cx="{sx(p[0][0]):.1f}" cy="{sy(p[0][1]):.1f}" r="2.5" '
                         f'fill="{colour}"/>')
        parts.append(f'<text x="{left + 4 + 160 * (i % 2)}" y="{bottom + 26 + 11 * (i // 2)}" '
                     f'class="key" fill="{colour}">{html.escape(key)} '
                     f'({p[-1][1]:.3g})</text>')
    return "".join(parts) + "</svg>"


def thinned(p: list[tuple[float, float]], most: int = 600) -> list[tuple[float, float]]:
    """At most `most` points, what a chart ~300 pixels wide can show: of each run of steps, its
    lowest and its highest point (a spike stays), in step order."""
    if len(p) <= most:
        return p
    size = -(-len(p) // (most // 2))
    out = []
    for i in range(0, len(p), size):
        run = p[i:i + size]
        out += sorted({min(run, key=lambda q: q[1]), max(run, key=lambda q: q[1])})
    return out
