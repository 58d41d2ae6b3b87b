"""stats_logger: each tracker's files read back, AReaL's names in them, the AReaL section parsed, both jobs."""

from __future__ import annotations

import importlib.util
import json
import logging
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from repo_paths import ROOT
from rl_runs import tiny_rl_config

from laden.config import LadenConfig, load_config
from laden.trackers import AREAL_NAMES, Trackers, check_trackers, tracker_row

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = ROOT
AREAL = REPO / "tests" / "support" / "areal_configs"
ROWS = [
    {"step": 0, "eval_loss": 2.5, "elapsed_s": 0.0},
    {
        "step": 1,
        "loss": 2.0,
        "grad_norm": 1.5,
        "lr": 1e-3,
        "num_tokens": 100,
        "peak_host_gib_ranks": [1.0, 2.0],
    },
    {"step": 2, "loss": 1.0, "grad_norm": 0.5, "lr": 1e-3, "num_tokens": 90},
]


def _config(**sections) -> LadenConfig:
    cfg = LadenConfig(experiment_name="exp", trial_name="trial")
    for dotted, value in sections.items():
        section, name = dotted.split("__")
        setattr(getattr(cfg.stats_logger, section), name, value)
    return cfg


def _tensorboard_scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(path))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _wandb_history(run_dir: Path) -> list[dict[str, str]]:
    """The history rows of an offline W&B run, once its service wrote the run's end (it writes after
    `finish` returns)."""
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 60
    while (records := _wandb_records(path.read_bytes()))[-1:] != ["exit"] and time.monotonic() < deadline:
        time.sleep(0.2)
    return [row for row in records if isinstance(row, dict)]


def _wandb_records(data: bytes) -> list[dict[str, str] | str]:
    """A `.wandb` file: a LevelDB-style log (32 KiB blocks of records with a 7-byte header) of `Record`
    protobufs after a 7-byte file header, as history rows (dicts) and the other records' types."""
    from wandb.proto import wandb_internal_pb2

    block, pos, payload, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # the block's padding
            pos += left
            continue
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            payload = b""
            kind_name = record.WhichOneof("record_type")
            history = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
            rows.append(history if kind_name == "history" else str(kind_name))
    return rows


def test_tracker_rows_take_arealss_names_and_keep_ladens_elsewhere():
    assert tracker_row(ROWS[1], "sft") == {"sft/loss/avg": 2.0, "sft/grad_norm": 1.5, "sft/lr": 1e-3,
                                            "sft/n_tokens": 100.0}  # fmt: skip
    row = tracker_row({"step": 3, "reward_mean": 0.5, "accuracy": 0.25, "eval/pass@4": 1.0, "ok": True}, "rl")
    assert row == {"ppo_actor/task_reward/avg": 0.5, "accuracy": 0.25, "eval/pass@4": 1.0}


def test_docs_list_every_name():
    text = (REPO / "docs" / "metrics.md").read_text()
    for names in AREAL_NAMES.values():
        for laden, areal in names.items():
            assert f"| `{laden}` | `{areal}` |" in text, laden


def test_tensorboard_event_files_read_back(tmp_path):
    trackers = Trackers.open(_config(tensorboard__path="tb"), tmp_path, job="sft", main=True)
    for row in ROWS:
        trackers.log(row)
    trackers.close()
    scalars = _tensorboard_scalars(tmp_path / "tb")
    assert scalars["sft/loss/avg"] == [(1, 2.0), (2, 1.0)]
    assert scalars["sft-eval/loss/avg"] == [(0, 2.5)]
    assert "peak_host_gib_ranks" not in scalars and "step" not in scalars


def test_only_the_main_process_opens_trackers(tmp_path):
    trackers = Trackers.open(_config(tensorboard__path="tb"), tmp_path, job="sft", main=False)
    trackers.log(ROWS[1])
    trackers.close()
    assert trackers.backends == [] and not (tmp_path / "tb").exists()


def test_wandb_offline_run_holds_the_rows(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _config(wandb__mode="offline", wandb__tags=["t"], wandb__config={"note": 1})
    trackers = Trackers.open(cfg, tmp_path, job="sft", main=True)
    for row in ROWS:
        trackers.log(row)
    trackers.close()
    rows = _wandb_history(tmp_path)
    losses = [(int(r["_step"]), float(r.get("sft/loss/avg", "nan"))) for r in rows]
    assert losses[1:] == [(1, 2.0), (2, 1.0)] and losses[0][0] == 0
    assert float(rows[0]["sft-eval/loss/avg"]) == 2.5
    assert (tmp_path / "wandb" / "latest-run").exists()


def test_swanlab_offline_run_holds_the_rows(tmp_path):
    pytest.importorskip("swanlab")
    trackers = Trackers.open(_config(swanlab__mode="offline"), tmp_path, job="rl", main=True)
    trackers.log({"step": 1, "reward_mean": 0.5, "eval/pass@4": 1.0})
    trackers.close()
    (path,) = (tmp_path / "swanlab").glob("run-*/run-*.swanlab")
    data = path.read_bytes()
    assert b"ppo_actor/task_reward/avg" in data and b"eval/pass@4" in data


def test_trackio_local_run_holds_the_rows(tmp_path):
    pytest.importorskip("trackio")
    script = (
        "import sys; from pathlib import Path; from laden.config import LadenConfig; "
        "from laden.trackers import Trackers; cfg = LadenConfig(experiment_name='exp', trial_name='trial'); "
        "cfg.stats_logger.trackio.mode = 'local'; t = Trackers.open(cfg, Path(sys.argv[1]), job='rl', main=True); "
        "t.log({'step': 1, 'reward_mean': 0.5}); t.close()"
    )  # its own process: Trackio reads TRACKIO_DIR when imported
    env = {**__import__("os").environ, "TRACKIO_DIR": str(tmp_path / "trackio")}
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, env=env, cwd=REPO, timeout=120)
    import sqlite3

    with sqlite3.connect(tmp_path / "trackio" / "exp.db") as db:
        rows = db.execute("select step, metrics from metrics").fetchall()
    assert [(step, json.loads(m)["ppo_actor/task_reward/avg"]) for step, m in rows] == [(1, 0.5)]


def test_a_missing_library_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"stats_logger.wandb .*pip install 'laden\[trackers\]'"):
        check_trackers(_config(wandb__mode="offline"))
    check_trackers(_config())  # nothing configured: nothing needed


def test_settings_of_a_disabled_tracker_are_reported(caplog):
    with caplog.at_level(logging.WARNING, logger="laden.trackers"):
        check_trackers(_config(wandb__project="p"))
    assert any("stats_logger.wandb.{project} set, but stats_logger.wandb.mode=disabled" in r.getMessage()
               for r in caplog.records)  # fmt: skip


class _Broken:
    name = "broken"

    def __init__(self):
        self.closed: list[bool] = []

    def log(self, metrics, step):
        raise ConnectionError("server gone")

    def close(self, *, failed):
        self.closed.append(failed)


def test_a_failing_tracker_is_dropped_and_the_run_goes_on(caplog):
    broken = _Broken()
    trackers = Trackers([broken], "sft")
    with caplog.at_level(logging.WARNING, logger="laden.trackers"):
        trackers.log(ROWS[1])
        trackers.log(ROWS[2])
    assert trackers.backends == [] and broken.closed == [True]
    assert sum("stats_logger.broken failed at step 1" in r.getMessage() for r in caplog.records) == 1


def test_arealss_stats_logger_section_is_parsed_not_warned(caplog):
    paths = [
        f"actor.path={REPO / 'laden' / 'assets' / 'tiny'}",
        "train_dataset.path=x.jsonl",
        "valid_dataset.path=v.jsonl",
    ]
    with caplog.at_level(logging.WARNING, logger="laden.config.areal"):
        cfg = load_config(
            AREAL / "gsm8k_sft.yaml",
            [*paths, "stats_logger.wandb.mode=offline", "+stats_logger.tensorboard.path=/tmp/tb"],
            job="sft",
        )
    assert cfg.stats_logger.wandb.mode == "offline" and cfg.stats_logger.tensorboard.path == "/tmp/tb"
    assert not any("stats_logger" in r.getMessage() for r in caplog.records)
    with pytest.raises(Exception, match=r"stats_logger.trial_name='other' differs from trial_name"):
        load_config(AREAL / "gsm8k_sft.yaml", [*paths, "stats_logger.trial_name=other"], job="sft")


def test_laden_sft_logs_to_the_trackers(tmp_path, monkeypatch):
    from laden.cli import main

    has_wandb = importlib.util.find_spec("wandb") is not None
    monkeypatch.setenv("WANDB_SILENT", "true")
    code = main(["sft", "--no-progress", f"cluster.fileroot={tmp_path}", "total_train_steps=2",
                 "checkpoint.export_hf=false", "stats_logger.tensorboard.path=tb",
                 *(["stats_logger.wandb.mode=offline"] if has_wandb else [])])  # fmt: skip
    assert code == 0
    (run_dir,) = [p.parent for p in tmp_path.glob("*/*/metrics.jsonl")]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]  # the default job's step-0 row holds its held-out evaluation only
    scalars = _tensorboard_scalars(run_dir / "tb")
    assert scalars["sft/loss/avg"] == [(r["step"], pytest.approx(r["loss"])) for r in rows]
    assert [s for s, _ in scalars["sft/grad_norm"]] == [1, 2]
    if has_wandb:
        history = _wandb_history(run_dir)
        losses = [float(h["sft/loss/avg"]) for h in history if "sft/loss/avg" in h]
        assert losses == pytest.approx([r["loss"] for r in rows])


def test_laden_rl_logs_to_the_trackers_and_writes_no_tensorboard_unasked(tmp_path):
    from laden.rl.trainer import run_rl

    cfg = tiny_rl_config(tmp_path, "total_train_steps=2", "stats_logger.tensorboard.path=tb")
    result = run_rl(cfg, progress=False)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    scalars = _tensorboard_scalars(result.run_dir / "tb")
    trained = [r for r in rows if "reward_mean" in r]
    assert scalars["ppo_actor/task_reward/avg"] == [
        (r["step"], pytest.approx(r["reward_mean"])) for r in trained
    ]
    assert [s for s, _ in scalars["eval-rollout/reward"]] == [
        r["step"] for r in rows if "eval/reward_mean" in r
    ]
    assert "eval/accuracy" in scalars and "reward_mean" not in scalars
    assert not (result.run_dir / "tensorboard").exists()
