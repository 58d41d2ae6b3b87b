"""Checkpoint integrity: damage named by file, resume from the newest intact checkpoint, pruning that
never passes damage, old checkpoints without checksums, and a full disk mid-save."""

from __future__ import annotations

import errno
import hashlib
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save

import laden.engine.integrity as integrity
import laden.engine.rundir as rundir
from laden.config import load_config
from laden.engine.checkpoint import read_meta
from laden.engine.integrity import CheckpointDiskFullError, DamagedCheckpointError, safetensors_chunks
from laden.engine.rundir import RunDirectory
from laden.sft.trainer import run_sft

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = (
    "train_dataset.batch_size=8", "checkpoint.export_hf=false", "checkpoint.save_freq_steps=2",
    "checkpoint.keep_last=3", "checkpoint.save_every_minutes=null",
)  # fmt: skip


def _cfg(root: Path, trial: str, *extra: str, steps: int = 6):
    return load_config(
        "examples/sft_tiny.yaml",
        [f"cluster.fileroot={root}", f"trial_name={trial}", f"total_train_steps={steps}", *BASE, *extra],
    )


@pytest.fixture(scope="module")
def straight(tmp_path_factory, one_thread) -> Path:
    """An uninterrupted run of 6 steps with checkpoints at steps 2, 4 and 6."""
    root = tmp_path_factory.mktemp("integrity")
    run_sft(_cfg(root, "straight"), progress=False)
    return root / "sft-tiny" / "straight"


def _copy(straight: Path, root: Path, trial: str, *, drop: tuple[int, ...] = (6,)) -> Path:
    """The straight run as run `trial` under `root`, without the checkpoints of the steps in `drop`
    (as if it had stopped after the newest one kept)."""
    run = root / "sft-tiny" / trial
    shutil.copytree(straight, run)
    for step in drop:
        shutil.rmtree(run / "checkpoints" / f"step_{step}")
    return run


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step_{step}" / "model.safetensors")


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _digests(path: Path) -> dict[str, str]:
    return {
        str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in path.rglob("*")
        if f.is_file()
    }


# ------------------------------------------------------------------------------- the damage


def _flip(file: Path) -> None:
    """64 bytes of tensor data inverted (the file keeps its size)."""
    data = bytearray(file.read_bytes())
    data[-1000:-936] = bytes(b ^ 0xFF for b in data[-1000:-936])
    file.write_bytes(data)


def _half(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _garble_header(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[8:40] = b"#" * 32
    file.write_bytes(data)


DAMAGES: dict[str, tuple[str, Callable[[Path], object], str, str | None]] = {
    # case: (file, damage, problem with a manifest, problem without one (None: undetectable without checksums))
    "bit flip": ("model.safetensors", _flip, "does not match its checksum", None),
    "truncated model": ("model.safetensors", _half, "is cut off at byte 176", "is cut off at byte 176"),
    "empty model": ("model.safetensors", lambda f: f.write_bytes(b""), "is empty", "is empty"),
    "bad optimizer header": ("optimizer.safetensors", _garble_header, "does not match its checksum",
                             "has a damaged header"),
    "truncated rng": ("rng_rank0.pt", _half, "is cut off at byte", "cannot be read"),
    "garbage config.yaml": ("config.yaml", lambda f: f.write_bytes(b"model: [unclosed\n\x00\xff\n"),
                            "is cut off at byte", "is not a valid YAML config"),
    "truncated trainer.json": ("trainer.json", lambda f: f.write_bytes(f.read_bytes()[:123]),
                               "is cut off at byte 123", "is cut off at byte 123"),
    "truncated scheduler.json": ("scheduler.json", _half, "is cut off at byte", "is cut off at byte"),
    "missing meta.json": ("meta.json", Path.unlink, "is missing", "is missing"),
    "missing version.json": ("version.json", Path.unlink, "is missing", "is missing"),
    "missing optimizer_groups.json": ("optimizer_groups.json", Path.unlink, "is missing", "is missing"),
}  # fmt: skip


CASES = [
    pytest.param(case, checksums, id=f"{case}-{'manifest' if checksums else 'no-manifest'}")
    for case in DAMAGES
    for checksums in (True, False)
    if checksums or DAMAGES[case][3] is not None  # a changed byte shows only against a checksum
]


@pytest.mark.parametrize("case,checksums", CASES)
def test_damage_is_named_and_the_previous_intact_checkpoint_is_chosen(
    straight, tmp_path, caplog, case, checksums
):
    name, damage, with_manifest, without = DAMAGES[case]
    problem = with_manifest if checksums else without
    run = _copy(straight, tmp_path, "damaged")
    if not checksums:  # as written before checkpoints carried manifests
        for manifest in run.glob("checkpoints/*/manifest.json"):
            manifest.unlink()
    damage(run / "checkpoints" / "step_4" / name)
    named = f"checkpoints/step_4/{name} {problem}"

    caplog.set_level(logging.WARNING, logger="laden.rundir")
    history = RunDirectory(run, is_main=True).history(on_damage="previous")
    assert history.checkpoint == run / "checkpoints" / "step_2" and history.checkpoint_step == 2
    assert named in caplog.text and "steps 3..4 run again" in caplog.text

    with pytest.raises(DamagedCheckpointError) as info:
        RunDirectory(run, is_main=True).history(on_damage="stop")
    message = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in message
    assert named in message and f"Delete {run / 'checkpoints' / 'step_4'}" in message
    assert "checkpoint.on_damage=previous" in message
    assert (run / "checkpoints" / "step_4").is_dir()  # never deleted by laden


def test_a_damaged_newest_checkpoint_is_skipped_and_the_rerun_equals_uninterrupted(
    straight, tmp_path, caplog
):
    """Problem 1: a bit flip in the newest checkpoint's weights was trained on. Now the run resumes from the
    intact step 2, keeps the damaged directory, and ends bitwise where an uninterrupted run ends."""
    run = _copy(straight, tmp_path, "flipped")
    damaged = run / "checkpoints" / "step_4"
    _flip(damaged / "model.safetensors")
    before = _digests(damaged)
    caplog.set_level(logging.WARNING)
    run_sft(_cfg(tmp_path, "flipped", "checkpoint.keep_last=2"), progress=False)
    assert "checkpoints/step_4/model.safetensors does not match its checksum" in caplog.text
    assert "resuming from step_2 instead: steps 3..4 run again" in caplog.text
    _assert_same_weights(_weights(run, 6), _weights(straight, 6))
    assert _digests(run / "checkpoints" / "step_4.replaced") == before  # set aside, byte for byte
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_4", "step_4.replaced", "step_6"]

    from_two = _copy(straight, tmp_path, "from_two", drop=(4, 6))  # the same checkpoint, nothing damaged
    run_sft(_cfg(tmp_path, "from_two"), progress=False)
    _assert_same_weights(_weights(run, 6), _weights(from_two, 6))


def test_pruning_keeps_the_intact_checkpoint_while_the_newest_is_damaged(straight, tmp_path):
    run = _copy(straight, tmp_path, "pruned")
    damaged = run / "checkpoints" / "step_4"
    _flip(damaged / "model.safetensors")
    before = _digests(damaged)
    run_sft(_cfg(tmp_path, "pruned", "checkpoint.keep_last=2", steps=3), progress=False)
    # keep_last=2 counts step_3 (just written) and step_2; the damaged step_4 is neither counted nor deleted
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_3", "step_4"]
    assert _digests(damaged) == before


def test_no_intact_checkpoint_says_so_and_how_to_start_over(straight, tmp_path):
    run = _copy(straight, tmp_path, "ruined")
    _flip(run / "checkpoints" / "step_4" / "model.safetensors")
    (run / "checkpoints" / "step_2" / "meta.json").unlink()
    with pytest.raises(
        DamagedCheckpointError, match="no intact checkpoint in .*step_4: .*step_2: .*meta.json is missing"
    ) as info:
        RunDirectory(run, is_main=True).history()
    assert "trial_name to a new name and checkpoint.resume=never" in str(info.value)
    assert (run / "checkpoints" / "step_4").is_dir() and (run / "checkpoints" / "step_2").is_dir()


def test_a_missing_meta_json_is_missing_not_an_older_laden(straight, tmp_path):
    run = _copy(straight, tmp_path, "meta")
    (run / "checkpoints" / "step_4" / "meta.json").unlink()
    with pytest.raises(
        DamagedCheckpointError, match=r"checkpoints/step_4/meta.json is missing; delete .*step_4"
    ):
        read_meta(run / "checkpoints" / "step_4")


def test_a_checkpoint_without_a_manifest_resumes_bitwise(straight, tmp_path, caplog):
    run = _copy(straight, tmp_path, "old")
    for manifest in run.glob("checkpoints/*/manifest.json"):
        manifest.unlink()
    caplog.set_level(logging.INFO, logger="laden.rundir")
    run_sft(_cfg(tmp_path, "old"), progress=False)
    assert "step_4 was written before checkpoints carried checksums" in caplog.text
    _assert_same_weights(_weights(run, 6), _weights(straight, 6))
    assert (run / "checkpoints" / "step_6" / "manifest.json").exists()


@pytest.mark.parametrize(
    "name,damage,problem",
    [
        ("rng_rank0.pt", _half, "cannot be read"),
        ("optimizer.safetensors", _garble_header, "cannot be read"),
        ("scheduler.json", _half, "is cut off at byte"),
    ],
)
def test_a_read_error_on_load_names_the_file(straight, tmp_path, monkeypatch, name, damage, problem):
    """What slips past the check (here: the check skipped) fails on load as a ValueError naming the file."""
    run = _copy(straight, tmp_path, "load")
    damage(run / "checkpoints" / "step_4" / name)
    monkeypatch.setattr(rundir, "find_damage", lambda path: [])
    with pytest.raises(
        DamagedCheckpointError, match=rf"checkpoints/step_4/{name} {problem}.*; delete .*step_4"
    ):
        run_sft(_cfg(tmp_path, "load"), progress=False)


def test_a_full_disk_mid_save_leaves_the_earlier_checkpoints_and_resumes_bitwise(
    straight, tmp_path, monkeypatch
):
    run = _copy(straight, tmp_path, "full")
    before = {step: _digests(run / "checkpoints" / f"step_{step}") for step in (2, 4)}
    original = integrity._write_all
    written = {"bytes": 0}

    def fills_at_200_kib(out, view):
        if ".tmp_step_6" in out.name:
            if written["bytes"] + view.nbytes > 200 * 2**10:
                raise OSError(errno.ENOSPC, "No space left on device")
            written["bytes"] += view.nbytes
        original(out, view)

    monkeypatch.setattr(integrity, "_write_all", fills_at_200_kib)
    with pytest.raises(CheckpointDiskFullError) as info:
        run_sft(_cfg(tmp_path, "full"), progress=False)
    message = str(info.value)
    assert f"while writing checkpoint {run / 'checkpoints' / 'step_6'} (No space left on device)" in message
    assert f"{written['bytes']} bytes) were written before the disk filled" in message
    assert "free the space, then rerun the same command to resume from step_4" in message
    assert (
        not (run / "checkpoints" / ".tmp_step_6").exists() and not (run / "checkpoints" / "step_6").exists()
    )
    assert {step: _digests(run / "checkpoints" / f"step_{step}") for step in (2, 4)} == before

    monkeypatch.undo()
    run_sft(_cfg(tmp_path, "full"), progress=False)
    _assert_same_weights(_weights(run, 6), _weights(straight, 6))
    needed = sum(f.stat().st_size for f in (run / "checkpoints" / "step_6").rglob("*"))
    assert f"({needed} bytes) free" in message


def test_the_safetensors_writer_writes_what_safetensors_writes():
    tensors = {
        "w": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "step": torch.tensor(4, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]), "empty": torch.zeros(0, 4),
    }  # fmt: skip
    ours = b"".join(bytes(chunk) for chunk in safetensors_chunks(tensors, {"format": "pt"}))
    assert ours == save(tensors, metadata={"format": "pt"})


class _Engine:
    """What the checkpointer asks of an engine: `state_dict()` (tensors filled in place on load) and
    `load_state_dict()`."""

    def __init__(self, seed: int | None) -> None:
        g = torch.Generator().manual_seed(seed or 0)
        make = (lambda *s: torch.randn(*s, generator=g)) if seed is not None else torch.zeros
        self.state = {
            "model": {"a.weight": make(64, 64), "b.weight": make(64, 64), "b.bias": make(64)},
            "optimizer": {"state": {"a.weight": {"exp_avg": make(64, 64)}}, "param_groups": [{"lr": 0.1}]},
            "scheduler": {"last_epoch": 3}, "version": 3,
        }  # fmt: skip

    def state_dict(self):
        return self.state

    def load_state_dict(self, state) -> None:
        self.state = state


def test_shards_and_a_critic_are_checksummed_and_load_back(tmp_path):
    from laden.engine.checkpoint import load_checkpoint, load_engine, save_checkpoint, save_engine
    from laden.engine.integrity import CheckpointFiles, find_damage

    files = CheckpointFiles(tmp_path / "engine")
    files.mkdir(files.root)
    save_engine(_Engine(1), files.root, max_shard_bytes=20_000, files=files)
    files.write_manifest()
    assert sorted(files.entries) == sorted(p.name for p in files.root.iterdir() if p.name != "manifest.json")
    assert "model-00002-of-00002.safetensors" in files.entries and find_damage(files.root) == []
    loaded = _Engine(None)
    load_engine(loaded, files.root)
    _assert_same_weights(loaded.state["model"], _Engine(1).state["model"])
    _flip(files.root / "model-00002-of-00002.safetensors")
    assert [d.file.name for d in find_damage(files.root)] == ["model-00002-of-00002.safetensors"]

    root = tmp_path / "run" / "checkpoints"
    common = {"trainer_state": {}, "meta": {}, "config_yaml": "seed: 1\n", "keep_last": 1}
    path = save_checkpoint(root, step=1, engine=_Engine(1), others={"critic": _Engine(2)}, **common)
    assert find_damage(path) == []
    critic = _Engine(None)
    load_checkpoint(path, _Engine(None), others={"critic": (critic, None)})
    _assert_same_weights(critic.state["model"], _Engine(2).state["model"])
    (path / "critic" / "version.json").unlink()
    assert [str(d) for d in find_damage(path)] == ["checkpoints/step_1/critic/version.json is missing"]
    save_checkpoint(root, step=2, engine=_Engine(1), others={"critic": _Engine(2)}, **common)
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2"]  # keep_last=1, yet damage is kept


def test_a_full_disk_on_another_rank_publishes_nothing(tmp_path):
    from laden.engine.checkpoint import save_checkpoint

    root = tmp_path / "run" / "checkpoints"
    common = {"trainer_state": {}, "meta": {}, "config_yaml": "seed: 1\n", "keep_last": 1}
    save_checkpoint(root, step=1, engine=_Engine(1), **common)
    with pytest.raises(CheckpointDiskFullError, match=r"step_2 \(on another rank\).*resume from step_1"):
        save_checkpoint(root, step=2, engine=_Engine(1), any_rank=lambda flag: True, **common)
    assert sorted(p.name for p in root.iterdir()) == ["step_1"]
