"""The run directory under attack and under failure: links, torn metrics, a `.lock` directory, a lost export, a full disk.

Found by fault injection; each test names the invariant it keeps. No training runs: `RunDirectory`,
`dump_config` and `export_hf` are called directly (the tiny model of `conftest.py`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from laden import safe_io
from laden.config import dump_config, load_config
from laden.engine.rundir import RunDirectory, RunDirectoryError
from laden.model.hf import export as export_module
from laden.model.hf.export import EXPORT_MANIFEST, export_complete, export_hf
from laden.safe_io import DiskFullError, UnsafePathError

SCRIPT = "#!/bin/sh\necho 'a file outside the run directory'\n"


@pytest.fixture
def outside(tmp_path) -> Path:
    """A file outside the run directory that links in it point to."""
    target = tmp_path / "elsewhere" / "script.sh"
    target.parent.mkdir()
    target.write_text(SCRIPT)
    return target


@pytest.fixture
def run(tmp_path) -> RunDirectory:
    (tmp_path / "run").mkdir()
    return RunDirectory(tmp_path / "run", is_main=True)


def _rows(*steps: int) -> str:
    return "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in steps)


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


# ----------------------------------------------------------------------------- links
@pytest.mark.parametrize(
    "name", [".lock", "config.yaml", "train_data_stats.json", "metrics.jsonl.tmp", "metrics.jsonl"]
)
def test_acquire_refuses_a_linked_member_before_writing_anything(run, outside, name):
    (run.path / name).symlink_to(outside)
    with pytest.raises(RunDirectoryError, match=rf"symbolic links \({name} -> {outside}\).*Remove them"):
        run.acquire(command="test")
    assert outside.read_text() == SCRIPT
    assert sorted(p.name for p in run.path.iterdir()) == [name]  # nothing written, not even .lock


def test_acquire_names_every_link_at_once_in_checkpoints_and_hf_too(run, outside):
    for link in (run.path / "config.yaml", run.ckpt_root / "step_2", run.path / "hf" / "config.json"):
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(outside)
    with pytest.raises(RunDirectoryError) as refused:
        run.acquire()
    for name in ("config.yaml", "checkpoints/step_2", "hf/config.json"):
        assert f"{name} -> {outside}" in str(refused.value)
    assert outside.read_text() == SCRIPT


def test_writers_replace_a_link_and_never_write_through_it(run, outside):
    """Behind `acquire`'s check, each writer on its own: the link is replaced, its target unchanged."""
    cfg = load_config("examples/sft_tiny.yaml", [])
    for name in ("config.yaml", "train_data_stats.json", "error.log"):
        (run.path / name).symlink_to(outside)
    dump_config(cfg, run.path / "config.yaml")
    assert outside.read_text() == SCRIPT
    run.record_failure(RuntimeError("boom"))
    assert outside.read_text() == SCRIPT
    run.write_text("train_data_stats.json", json.dumps({"kept": 3}))
    assert outside.read_text() == SCRIPT
    assert load_config(str(run.path / "config.yaml"), []) == cfg
    assert json.loads((run.path / "train_data_stats.json").read_text()) == {"kept": 3}
    assert "RuntimeError: boom" in (run.path / "error.log").read_text()
    assert not any(p.is_symlink() for p in run.path.iterdir())


def test_the_metrics_rewrite_never_follows_a_planted_tmp_link(run, outside):
    run.metrics_path.write_text(_rows(1, 2, 3))
    (run.path / "metrics.jsonl.tmp").symlink_to(outside)  # the name the rewrite used to write through
    run.keep_metrics_through(2)
    assert outside.read_text() == SCRIPT
    assert [r["step"] for r in run.logged_rows()] == [1, 2]


def test_metrics_appends_refuse_a_linked_or_hard_linked_file(run, outside, tmp_path):
    run.metrics_path.symlink_to(outside)
    with pytest.raises(UnsafePathError, match="is a symbolic link.*Remove the link"):
        run.open_metrics()
    run.metrics_path.unlink()
    os.link(outside, run.metrics_path)
    with pytest.raises(UnsafePathError, match="has 2 hard links"):
        run.open_metrics()
    assert outside.read_text() == SCRIPT


def test_lock_replaced_by_a_directory_says_so_and_the_fix(run):
    (run.path / ".lock").mkdir()
    with pytest.raises(
        RunDirectoryError, match=r"\.lock is a directory; laden keeps the run's lock file there.*rm -r"
    ):
        run.acquire()


def test_acquire_removes_temporaries_of_a_killed_writer(run):
    leftover = run.path / f".config.yaml.tmp-{_dead_pid()}-0123abcd"
    leftover.write_text("half a config")
    run.acquire()
    try:
        assert not leftover.exists()
        assert (run.path / ".lock").read_text().startswith(f"pid {os.getpid()} ")
    finally:
        run.release()


# -------------------------------------------------------------------- torn metrics
def test_a_cut_off_last_metrics_line_is_dropped_with_a_warning(run, caplog):
    run.metrics_path.write_text(_rows(1, 2, 3) + '{"step": 4, "lo')  # a disk that filled mid-line
    assert run.last_logged() == {"step": 3, "loss": 1 / 3}  # was: "Unterminated string starting at"
    caplog.set_level(logging.WARNING)
    run.keep_metrics_through(3)
    assert f"line 4 of {run.metrics_path} is cut off" in caplog.text
    assert 'b\'{"step": 4, "lo\'' in caplog.text
    assert run.metrics_path.read_text() == _rows(1, 2, 3)
    with run.open_metrics() as metrics:
        metrics.append_line(json.dumps({"step": 4, "loss": 0.25}))
    assert [r["step"] for r in map(json.loads, run.metrics_path.read_text().splitlines())] == [1, 2, 3, 4]


def test_a_garbage_middle_line_is_dropped_with_a_warning_and_the_rest_kept(run, caplog):
    run.metrics_path.write_text(_rows(1) + "\x00\x00garbage\n" + _rows(2, 3))
    caplog.set_level(logging.WARNING)
    run.keep_metrics_through(2)  # was: "Expecting value: line 1 column 1"
    assert f"line 2 of {run.metrics_path} is not a JSON object: b'\\x00\\x00garbage'" in caplog.text
    assert run.metrics_path.read_text() == _rows(1, 2)


def test_a_whole_last_row_without_its_line_end_is_kept_and_ended(run):
    run.metrics_path.write_text(_rows(1, 2).rstrip("\n"))
    run.keep_metrics_through(5)
    assert run.metrics_path.read_text() == _rows(1, 2)  # the next append starts on a line of its own


# ---------------------------------------------------------------------- the export
def test_export_done_only_once_the_whole_export_is_in_place(run, tiny_model):
    assert not run.export_done()
    export_hf(tiny_model, run.hf_path, dtype=torch.float32)
    assert run.export_done()
    assert set(json.loads((run.hf_path / EXPORT_MANIFEST).read_text())["files"]) >= {
        "config.json",
        "model.safetensors",
    }
    weights = run.hf_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # cut short (a copy, a damaged disk)
    assert not run.export_done()
    (run.hf_path / EXPORT_MANIFEST).unlink()
    assert not export_complete(run.hf_path)


def test_export_removes_temporaries_of_dead_writers_on_this_host(tmp_path, tiny_model, caplog):
    dead, host = _dead_pid(), socket.gethostname()
    stale = [
        tmp_path / f".hf.tmp-{dead}",
        tmp_path / f".hf.tmp-{host}-{dead}",
        tmp_path / f".hf.old-{host}-{dead}",
    ]
    alive = tmp_path / f".hf.tmp-{host}-{os.getppid()}"  # a writer still at work
    other_host = tmp_path / f".hf.tmp-{host}-elsewhere-{dead}"
    for path in [*stale, alive, other_host]:
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"half")
    caplog.set_level(logging.WARNING)
    export_hf(tiny_model, tmp_path / "hf", dtype=torch.float32)
    assert not any(p.exists() for p in stale)
    assert alive.exists() and other_host.exists()
    assert f"{other_host} was left by an export on host {host}-elsewhere" in caplog.text
    assert export_complete(tmp_path / "hf")


def test_an_interrupted_export_leaves_neither_export_nor_temporary(tmp_path, tiny_model, monkeypatch):
    calls = []

    def interrupted(t, dtype=None):
        calls.append(t)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated kill mid-export")
        return t.detach().to(dtype).contiguous()

    monkeypatch.setattr(export_module, "host_copy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_hf(tiny_model, tmp_path / "hf", dtype=torch.float32, max_shard_size_bytes=10_000)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        Exception(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        ),  # safetensors'
    ],
    ids=["oserror", "safetensors"],
)
def test_a_full_disk_during_the_export_leaves_the_previous_export_and_says_how_much(
    tmp_path, tiny_model, monkeypatch, error
):
    out = export_hf(tiny_model, tmp_path / "hf", dtype=torch.float32)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    import safetensors.torch

    def full(*args, **kwargs):
        raise error

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(DiskFullError) as raised:
        export_hf(tiny_model, out, dtype=torch.float32)
    message = str(raised.value)
    num_bytes = sum(p.numel() * 4 for p in tiny_model.parameters())
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(out)
    assert f"no space left on the device holding {out} ({num_bytes / 2**10:.2f} KiB needed)" in message
    assert "the partial export was removed" in message and "rerun the same command" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary left
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and export_complete(out)


# ----------------------------------------------------------------------- full disk
def _full_disk_on(monkeypatch, path: Path, *, short: bool) -> None:
    """`os.write` to `path` writes half (`short`) or nothing, and then the disk is full."""
    real, inode = os.write, path.stat().st_ino

    def write(fd, data):
        if os.fstat(fd).st_ino != inode:
            return real(fd, data)
        if short:
            return real(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safe_io.os, "write", write)


def _no_space(fd, data):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("short", [False, True], ids=["raises", "short-write"])
def test_a_full_disk_on_a_metrics_append_leaves_the_file_exactly_as_it_was(run, monkeypatch, short):
    run.metrics_path.write_text(_rows(1, 2))
    before = run.metrics_path.read_bytes()
    metrics = run.open_metrics()
    _full_disk_on(monkeypatch, run.metrics_path, short=short)
    with pytest.raises(DiskFullError) as raised:
        metrics.append_line(json.dumps({"step": 3, "loss": 0.5}))
    monkeypatch.undo()
    assert run.metrics_path.read_bytes() == before
    assert isinstance(raised.value, OSError) and raised.value.errno == errno.ENOSPC
    assert str(raised.value).startswith(f"no space left on the device holding {run.metrics_path} (")
    assert "the line was not written" in str(raised.value) and "resumes from its last checkpoint" in str(
        raised.value
    )
    metrics.append_line(json.dumps({"step": 3, "loss": 0.5}))  # space again: the run can go on
    metrics.close()
    assert [r["step"] for r in run.logged_rows()] == [1, 2, 3]


def test_a_full_disk_while_replacing_a_file_keeps_the_old_one_and_no_temporary(run, monkeypatch):
    (run.path / "config.yaml").write_text("old: 1\n")
    monkeypatch.setattr(safe_io.os, "write", _no_space)
    with pytest.raises(DiskFullError, match="config.yaml was left as it was"):
        run.write_text("config.yaml", "new: 2\n")
    monkeypatch.undo()
    assert sorted(p.name for p in run.path.iterdir()) == ["config.yaml"]
    assert (run.path / "config.yaml").read_text() == "old: 1\n"
