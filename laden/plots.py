"""Training curves a person looks at: `curves.png` in the run directory, drawn from `metrics.jsonl`.

One figure per run, redrawn whole at each checkpoint (at most once a minute) and at the end (a few
hundred milliseconds;
the rows are re-read rather than kept, so the figure is always what `metrics.jsonl` says, also
after a resume). Two columns when the rows carry `elapsed_s`: x = step and x = wall-clock
seconds, the axis on which runs of different speed (synchronous against asynchronous RL) are
compared. `rl`: training reward (mean, band of one standard deviation) above held-out accuracy;
`sft`: training and validation loss.

matplotlib is optional (`pip install 'laden[plots]'`) and imported only here, when drawing. The
figure is a bare `Figure` on an Agg canvas, never pyplot: no backend is chosen and no figure is
registered for the process, so a user's own pyplot session is left as it was.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

log = logging.getLogger("laden")

CHECKPOINT_INTERVAL_S = 60.0
"""A checkpoint redraws `curves.png` when the figure on disk is older than this; the end of a run always does."""

_warned_no_matplotlib = False  # the missing-matplotlib warning is said once per process


@dataclass(frozen=True, slots=True)
class _Line:
    """One metric drawn against x."""

    key: str
    """The metric's name in `metrics.jsonl`."""
    label: str
    """Its name in the legend."""
    band: str | None = None
    """A metric drawn as a shaded band of +- it around the line (the rows that have both)."""
    markers: bool = False
    """Mark every point (sparse metrics: evaluations)."""
    annotate: bool = False
    """Write the last value next to the last point."""


@dataclass(frozen=True, slots=True)
class _Panel:
    """A row of the figure; drawn when some row has its first line's metric."""

    title: str
    ylabel: str
    lines: tuple[_Line, ...]


_PANELS: dict[str, tuple[_Panel, ...]] = {
    "rl": (
        _Panel(title="training reward", ylabel="reward",
               lines=(_Line(key="reward_mean", label="reward (mean ± std)", band="reward_std"),)),
        _Panel(title="held-out evaluation", ylabel="accuracy",
               lines=(_Line(key="eval/accuracy", label="held-out accuracy", markers=True, annotate=True),
                      _Line(key="eval/reward_mean", label="held-out reward", markers=True))),
    ),
    "sft": (
        _Panel(title="loss", ylabel="loss",
               lines=(_Line(key="loss", label="training loss"),
                      _Line(key="eval_loss", label="validation loss", markers=True, annotate=True))),
    ),
    **{
        job: (
            _Panel(title="pair loss", ylabel="loss",
                   lines=(_Line(key="loss", label="training loss"),
                          _Line(key="eval/loss", label="validation loss", markers=True, annotate=True))),
            _Panel(title="pair accuracy (chosen > rejected)", ylabel="accuracy",
                   lines=(_Line(key="accuracy", label="training pairs"),
                          _Line(key="eval/accuracy", label="held-out pairs", markers=True, annotate=True))),
        )
        for job in ("dpo", "rw")
    },
}  # fmt: skip

_X_LABELS = {"step": "step", "elapsed_s": "wall-clock seconds"}


def write_curves(
    run_dir: Path, job: Literal["rl", "sft", "dpo", "rw"] | str, *, min_interval_s: float = 0.0
) -> Path | None:
    """Draw `run_dir/metrics.jsonl` into `run_dir/curves.png` (replaced atomically); its path, or
    None when nothing was drawn (matplotlib is not installed, no row has the job's metrics, or the
    figure on disk is younger than `min_interval_s`: checkpoints of short runs redraw at most that often,
    the end of a run always)."""
    run_dir = Path(run_dir)
    out = run_dir / "curves.png"
    if min_interval_s > 0 and out.exists() and time.time() - out.stat().st_mtime < min_interval_s:
        return None
    fig = draw_curves(
        read_metrics(run_dir / "metrics.jsonl"), job, title=f"{job}: {run_dir.parent.name}/{run_dir.name}"
    )
    if fig is None:
        return None
    import io

    from laden.safe_io import atomic_write_bytes

    buffer = io.BytesIO()  # drawn in memory, then written atomically without following a link
    fig.savefig(buffer, format="png", dpi=100)
    atomic_write_bytes(out, buffer.getvalue())
    return out


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a `metrics.jsonl`; blank lines, and lines that are not a JSON object (a row cut
    off by a kill), are skipped. No file: no rows."""
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line) if line.strip() else None
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def draw_curves(
    rows: list[dict[str, Any]], job: Literal["rl", "sft", "dpo", "rw"] | str, *, title: str = ""
) -> Figure | None:
    """The figure of `write_curves` for these metrics rows, not written anywhere; None when matplotlib
    is not installed or no row has the job's metrics."""
    if job not in _PANELS:
        raise ValueError(f"job={job!r} has no curves; use 'rl', 'sft', 'dpo' or 'rw'")
    panels = [p for p in _PANELS[job] if _series(rows, "step", p.lines[0].key)[0]]
    if not panels:
        return None
    classes = _matplotlib()
    if classes is None:
        return None
    figure_cls, canvas_cls = classes
    xs = ["step"] + (["elapsed_s"] if any(_number(r.get("elapsed_s")) is not None for r in rows) else [])
    width_in, height_in = 6.4 * len(xs), 3.6 * len(panels) + 0.4
    fig = figure_cls(figsize=(width_in, height_in))
    canvas_cls(fig)  # attaches itself as fig.canvas: Agg, whatever backend the process uses
    # margins fixed in inches: constrained layout fits them to the labels, but doubles the drawing time
    margins = {"left": 0.75 / width_in, "right": 1 - 0.25 / width_in, "bottom": 0.55 / height_in,
               "top": 1 - 0.7 / height_in, "wspace": 0.2, "hspace": 0.35}  # fmt: skip
    axes = fig.subplots(len(panels), len(xs), squeeze=False, gridspec_kw=margins)
    for i, panel in enumerate(panels):
        for j, x in enumerate(xs):
            _draw_panel(axes[i][j], rows, x, panel)
    if title:
        fig.suptitle(title)
    return fig


def _matplotlib() -> tuple[type, type] | None:
    """(Figure, FigureCanvasAgg), or None (warned once per process) without matplotlib."""
    global _warned_no_matplotlib
    try:
        import matplotlib  # noqa: F401 - first, so a blocked matplotlib is not bypassed by cached submodules
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        if not _warned_no_matplotlib:
            _warned_no_matplotlib = True
            log.warning(
                "curves.png is not written: matplotlib is not installed; "
                "pip install 'laden[plots]' for the training curves"
            )
        return None
    return Figure, FigureCanvasAgg


def _draw_panel(ax: Axes, rows: list[dict[str, Any]], x: str, panel: _Panel) -> None:
    for line in panel.lines:
        xs, ys = _series(rows, x, line.key)
        if not xs:
            continue
        marker = "o" if line.markers or len(xs) == 1 else None
        (drawn,) = ax.plot(xs, ys, marker=marker, markersize=4, label=line.label)
        if line.band is not None:
            bx, lo, hi = _band(rows, x, line.key, line.band)
            ax.fill_between(bx, lo, hi, color=drawn.get_color(), alpha=0.2, linewidth=0)
        if line.annotate:
            ax.annotate(f"{ys[-1]:.4g}", (xs[-1], ys[-1]), textcoords="offset points", xytext=(-6, -6),
                        ha="right", va="top", color=drawn.get_color(),
                        bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": drawn.get_color()})  # fmt: skip
    ax.set_title(f"{panel.title} by {_X_LABELS[x]}")
    ax.set_xlabel(_X_LABELS[x])
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    if len(panel.lines) > 1 or panel.lines[0].band is not None:
        ax.legend(loc="best", fontsize="small")


def _series(rows: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    """(x, y) of the rows with finite numbers for both."""
    pairs = [(_number(r.get(x)), _number(r.get(y))) for r in rows]
    kept = [(a, b) for a, b in pairs if a is not None and b is not None]
    return [a for a, _ in kept], [b for _, b in kept]


def _band(rows: list[dict[str, Any]], x: str, y: str, spread: str) -> tuple[list[float], ...]:
    """(x, y - spread, y + spread) of the rows with finite numbers for all three."""
    triples = [(_number(r.get(x)), _number(r.get(y)), _number(r.get(spread))) for r in rows]
    kept = [(a, b, c) for a, b, c in triples if a is not None and b is not None and c is not None]
    return [a for a, _, _ in kept], [b - c for _, b, c in kept], [b + c for _, b, c in kept]


def _number(value: Any) -> float | None:
    """`value` as a finite float, or None (missing, text, bool, NaN, inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)
