"""`curves.png`: drawn from metrics.jsonl (cut-off rows skipped), written atomically, optional matplotlib."""

from __future__ import annotations

import json
import logging
import math
import struct
import sys

import pytest

import laden.plots
from laden.plots import draw_curves, read_metrics, write_curves

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _rl_rows(with_eval: bool) -> list[dict]:
    rows = [{"step": 0, "elapsed_s": 0.0, "eval/accuracy": 0.1, "eval/reward_mean": 0.2}] if with_eval else []
    for step in range(1, 11):
        row = {"step": step, "reward_mean": 0.1 + 0.05 * step, "reward_std": 0.1, "elapsed_s": 2.5 * step}
        if with_eval and step % 5 == 0:
            row.update({"eval/accuracy": 0.1 + 0.05 * step, "eval/reward_mean": 0.2 + 0.05 * step})
        rows.append(row)
    return rows


def _write_metrics(run_dir, rows: list[dict], tail: str = "") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_rl_curves_with_held_out_rows_get_a_second_row_of_panels(tmp_path):
    _write_metrics(tmp_path / "with", _rl_rows(True), tail='\n{"step": 11, "reward_me')  # cut off by a kill
    _write_metrics(tmp_path / "without", _rl_rows(False))
    with_eval = write_curves(tmp_path / "with", "rl")
    without = write_curves(tmp_path / "without", "rl")
    assert with_eval == tmp_path / "with" / "curves.png"
    assert without == tmp_path / "without" / "curves.png"
    (w1, h1), (w2, h2) = _png_size(with_eval), _png_size(without)
    assert w1 == w2 and h1 > 1.5 * h2  # both have the step and the wall-clock column; eval adds a row
    assert sorted(p.name for p in (tmp_path / "with").iterdir()) == ["curves.png", "metrics.jsonl"]  # no temp


def test_rl_figure_annotates_the_last_held_out_accuracy():
    fig = draw_curves(_rl_rows(True), "rl")
    assert fig is not None
    axes = fig.axes
    assert [ax.get_xlabel() for ax in axes] == ["step", "wall-clock seconds"] * 2
    accuracy_by_step = axes[2]
    assert [t.get_text() for t in accuracy_by_step.texts] == ["0.6"]
    xs, ys = accuracy_by_step.lines[0].get_data()
    assert list(xs) == [0, 5, 10] and list(ys) == pytest.approx([0.1, 0.35, 0.6])  # step 0: before training
    assert list(axes[3].lines[0].get_xdata()) == [0.0, 12.5, 25.0]
    assert len(accuracy_by_step.lines) == 2  # eval/reward_mean as the second line


def test_sft_curves_have_a_wall_clock_column_only_when_rows_have_elapsed_s(tmp_path):
    rows = [
        {"step": s, "loss": 3.0 / s, **({"eval_loss": 3.2 / s} if s % 4 == 0 else {})} for s in range(1, 13)
    ]
    _write_metrics(tmp_path / "step_only", rows)
    _write_metrics(tmp_path / "timed", [{**r, "elapsed_s": 0.5 * r["step"]} for r in rows])
    (w1, h1), (w2, h2) = (_png_size(write_curves(tmp_path / d, "sft")) for d in ("step_only", "timed"))
    assert h1 == h2 and w2 > 1.5 * w1
    fig = draw_curves(rows, "sft")
    assert [line.get_label() for line in fig.axes[0].lines] == ["training loss", "validation loss"]
    assert list(fig.axes[0].lines[1].get_xdata()) == [4, 8, 12]


def test_nothing_to_draw_gives_none(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    assert write_curves(tmp_path, "rl") is None
    (tmp_path / "metrics.jsonl").write_text('\n[1, 2]\n"text"\n{"step": 1, "loss": NaN}\n{"step": 2, "lo')
    (row,) = read_metrics(tmp_path / "metrics.jsonl")  # the blank, non-object and cut-off lines are skipped
    assert row["step"] == 1 and math.isnan(row["loss"])
    assert write_curves(tmp_path, "sft") is None  # a NaN loss is no point to draw
    assert write_curves(tmp_path / "missing", "sft") is None
    assert not (tmp_path / "curves.png").exists()


def test_pyplot_state_is_left_alone(tmp_path):
    import matplotlib
    import matplotlib.pyplot as plt

    backend = matplotlib.rcParams["backend"]
    figures = plt.get_fignums()
    _write_metrics(tmp_path, _rl_rows(True))
    assert write_curves(tmp_path, "rl") is not None
    assert plt.get_fignums() == figures and matplotlib.rcParams["backend"] == backend


def test_without_matplotlib_warns_once_and_draws_nothing(tmp_path, monkeypatch, caplog):
    _write_metrics(tmp_path, _rl_rows(True))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(laden.plots, "_warned_no_matplotlib", False)
    with caplog.at_level(logging.WARNING, logger="laden"):
        assert write_curves(tmp_path, "rl") is None
        assert write_curves(tmp_path, "rl") is None
    warnings = [r.getMessage() for r in caplog.records if "matplotlib" in r.getMessage()]
    assert warnings == [
        "curves.png is not written: matplotlib is not installed; pip install 'laden[plots]' for the training curves"
    ]
    assert not (tmp_path / "curves.png").exists()
