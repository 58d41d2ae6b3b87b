"""Disk weight versions: a round trip equals the state dict, a killed writer publishes nothing.

The kill is deterministic: the writer subprocess (this file run as a script) pauses after its
first durable shard, reports it on stdout and blocks on stdin; the test kills it (SIGKILL)
right then, mid-version, and checks that neither `latest_version` nor `read_weights` serves
anything of the version it was writing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from memtrack import LiveBytes
from repo_paths import helpers_env

from laden.weights import (
    IncompleteVersionError,
    WeightUpdateMeta,
    latest_version,
    list_versions,
    read_weights,
    version_dir,
    write_weights,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TENSOR_BYTES = 64 * 1024  # every weight below is 64 KiB in fp32
SHARD_MB = 2 * TENSOR_BYTES / 2**20  # two weights per shard


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny model's state: fp32 matrices and vectors, a 0-dim scale, an int buffer."""
    gen = torch.Generator().manual_seed(seed)
    state = {f"layers.{i}.weight": torch.randn(128, 128, generator=gen) for i in range(5)}
    state["norm.weight"] = torch.randn(128 * 128, generator=gen)
    state["scale"] = torch.randn((), generator=gen)
    state["position_ids"] = torch.arange(128 * 64, dtype=torch.int64)  # 64 KiB too
    return state


def reused(state: dict[str, torch.Tensor]):
    """`named_weights` that hands out every tensor in one reused buffer (what the protocol allows)."""
    buffer = torch.empty(max(t.nbytes for t in state.values()), dtype=torch.uint8)

    def handout():
        for name, t in state.items():
            view = buffer[: t.nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            yield name, view

    return handout()


def read_all(root: Path, version: int) -> dict[str, torch.Tensor]:
    return dict(read_weights(root, version))


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_roundtrip_equals_the_state_dict(tmp_path):
    state = weights()
    out = write_weights(reused(state), tmp_path, 3, shard_mb=SHARD_MB)
    assert out == version_dir(tmp_path, 3) == tmp_path / "v00000003"
    manifest = json.loads((out / "manifest.json").read_text())
    # Two 64 KiB weights per shard; the 0-dim scale no longer fits the third and opens the fourth.
    assert [shard["tensors"] for shard in manifest["shards"]] == [
        ["layers.0.weight", "layers.1.weight"],
        ["layers.2.weight", "layers.3.weight"],
        ["layers.4.weight", "norm.weight"],
        ["scale", "position_ids"],
    ]
    assert [t["name"] for t in manifest["tensors"]] == list(state)
    assert manifest["total_bytes"] == sum(t.nbytes for t in state.values())
    assert latest_version(tmp_path) == 3
    assert_same(read_all(tmp_path, 3), state)


def test_dtype_casts_floating_tensors_only(tmp_path):
    state = weights()
    write_weights(state.items(), tmp_path, 0, dtype=torch.bfloat16, shard_mb=SHARD_MB, checksum=True)
    want = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in state.items()}
    assert_same(read_all(tmp_path, 0), want)


def test_writer_holds_one_shard_and_one_tensor(tmp_path):
    """Beyond the source, the writer's peak is one shard plus the tensor that did not fit."""
    source = reused(weights())
    with LiveBytes() as live:
        write_weights(source, tmp_path, 0, shard_mb=SHARD_MB)
    assert live.peak_bytes <= 3 * TENSOR_BYTES, live.peak_bytes


def test_versions_are_written_once_and_pruned(tmp_path):
    for version in range(4):
        write_weights(weights(version).items(), tmp_path, version, keep_last=2)
    assert list_versions(tmp_path) == [2, 3]
    assert_same(read_all(tmp_path, 3), weights(3))
    with pytest.raises(ValueError, match="written once.*version 4"):
        write_weights(weights().items(), tmp_path, 3)
    with pytest.raises(ValueError, match="shard_mb=0.*keep_last=0"):
        write_weights(weights().items(), tmp_path, 5, shard_mb=0, keep_last=0)
    with pytest.raises(FileNotFoundError, match=r"version 1 does not exist.*\[2, 3\]"):
        read_weights(tmp_path, 1)


def test_torn_versions_are_refused(tmp_path):
    write_weights(weights().items(), tmp_path, 1, shard_mb=SHARD_MB, checksum=True)
    shard = version_dir(tmp_path, 1) / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in a weight: only the checksum sees it
    shard.write_bytes(bytes(data))
    with pytest.raises(IncompleteVersionError, match="shard-00001.*sha256"):
        read_weights(tmp_path, 1)
    shard.write_bytes(bytes(data[:-10]))  # truncated
    with pytest.raises(IncompleteVersionError, match=f"shard-00001.*is {len(data) - 10} bytes.*{len(data)}"):
        read_weights(tmp_path, 1)
    (version_dir(tmp_path, 1) / "manifest.json").unlink()
    assert latest_version(tmp_path) is None
    with pytest.raises(IncompleteVersionError, match="manifest.json is missing"):
        read_weights(tmp_path, 1)


def test_killed_writer_publishes_nothing(tmp_path):
    write_weights(weights(1).items(), tmp_path, 1, shard_mb=SHARD_MB)
    writer = subprocess.Popen(
        [sys.executable, __file__, "write", str(tmp_path), "2"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=helpers_env(),
    )  # fmt: skip
    try:
        line = writer.stdout.readline()  # blocks until the first shard is durable
        assert line.startswith("shard 0 "), line
        writer.send_signal(signal.SIGKILL)  # mid-version: three shards and the manifest to go
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode == -signal.SIGKILL
    partial = Path(line.split(" ", 2)[2].strip()).parent
    assert partial.parent == tmp_path and partial.name.startswith(".tmp-v00000002-")
    assert sorted(p.name for p in partial.iterdir()) == ["shard-00000.safetensors"]  # really torn
    assert latest_version(tmp_path) == 1
    with pytest.raises(FileNotFoundError, match="version 2 does not exist"):
        read_weights(tmp_path, 2)
    assert_same(read_all(tmp_path, 1), weights(1))
    write_weights(weights(2).items(), tmp_path, 2, shard_mb=SHARD_MB)  # removes the dead writer's directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000001", "v00000002"]
    assert_same(read_all(tmp_path, 2), weights(2))


def test_meta_from_disk_is_the_run_directory(tmp_path):
    meta = WeightUpdateMeta.from_disk("exp", "trial", tmp_path, weight_chunked_mem_mb=64)
    assert meta.type == "disk" and meta.path == tmp_path / "exp" / "trial" / "weight_updates"
    assert meta.bucket_bytes == 64 * 2**20
    with pytest.raises(ValueError, match="trial_name=''"):
        WeightUpdateMeta.from_disk("exp", "", tmp_path)
    with pytest.raises(ValueError, match="weight_chunked_mem_mb=0 must be an integer of at least 1"):
        WeightUpdateMeta(type="disk", path=tmp_path, weight_chunked_mem_mb=0)
    with pytest.raises(ValueError, match="path=None"):
        WeightUpdateMeta(type="disk")


def _write_and_pause(root: str, version: int) -> None:
    """Subprocess: write `version`, and after the first shard report it and wait to be killed."""

    def pause(index: int, path: Path) -> None:
        print(f"shard {index} {path}", flush=True)
        sys.stdin.read()  # never returns: the test kills this process
        os._exit(1)  # stdin closed without a kill: fail loudly

    write_weights(weights(2).items(), root, version, shard_mb=SHARD_MB, on_shard=pause)


if __name__ == "__main__" and sys.argv[1] == "write":
    _write_and_pause(sys.argv[2], int(sys.argv[3]))
