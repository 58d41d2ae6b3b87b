"""The bucketed weight broadcast: exact reassembly, lazy pulls, one bucket held, refused mismatches.

Two layers of tests. In one process, the sender broadcasts into a recording group and the
receivers replay what it recorded (the `Collective` seam): the bucket counts, the order in
which the sender pulls tensors and the memory either side holds are checked exactly. Then
the real thing: gloo groups of two processes, the peer being this file run as a script; the
peer takes commands through the group, writes what it received to a file and joins a final
all-reduce, which is the test's only synchronisation (no sleeps).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from memtrack import LiveBytes
from repo_paths import helpers_env

from laden.weights import (
    WeightGroup,
    WeightSpec,
    WeightUpdateMeta,
    init_weight_group,
    receive,
    receive_into,
    send_weights,
    weight_specs,
)

pytestmark = pytest.mark.usefixtures("one_thread")

LARGEST_BYTES = 64 * 48 * 4  # embed.weight in fp32


def tiny_weights(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny random model's state: matrices, vectors, a 0-dim scale, an empty tensor, an int buffer."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype)

    return {
        "embed.weight": rand(64, 48),
        "layers.0.attn.weight": rand(48, 48),
        "layers.0.norm.weight": rand(48),
        "layers.0.mlp.weight": rand(32, 48),
        "scale": rand(),
        "empty": rand(0, 48),
        "position_ids": torch.arange(37, dtype=torch.int64),
        "lm_head.weight": rand(64, 48),
    }


def zeros_like_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(t) for name, t in state.items()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def num_buckets(state: dict[str, torch.Tensor], bucket_bytes: int) -> int:
    return -(-sum(t.nbytes for t in state.values()) // bucket_bytes)


# ---- one process: a recording sender, replaying receivers -------------------------------------
class Recording:
    """Rank 0 of a two-rank group that records what it broadcasts (as bytes, outside torch)."""

    rank, world_size, device = 0, 2, torch.device("cpu")

    def __init__(self, refuse: bool = False) -> None:
        self.sent: list[bytes] = []
        self.refuse = refuse

    def broadcast(self, t: torch.Tensor) -> None:
        self.sent.append(t.numpy().tobytes())

    def all_reduce(self, t: torch.Tensor) -> None:
        if self.refuse:
            t[1] = 1  # what the receiver's flag adds


class Replay:
    """Rank 1 of that group: each broadcast receives the next recorded one."""

    rank, world_size, device = 1, 2, torch.device("cpu")

    def __init__(self, sent: list[bytes]) -> None:
        self.sent = list(sent)

    def broadcast(self, t: torch.Tensor) -> None:
        data = self.sent.pop(0)
        assert len(data) == t.nbytes, (len(data), t.nbytes)
        t.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def all_reduce(self, t: torch.Tensor) -> None:
        pass  # the sender's flag is 0


HEADER_BROADCASTS = 2  # the header's length, then its bytes


class Pulls:
    """`named_weights` that records how many buckets were broadcast when each tensor was pulled."""

    def __init__(self, state: dict[str, torch.Tensor], group: Recording) -> None:
        self.state, self.group = state, group
        self.buckets_sent_at_pull: list[int] = []

    def __iter__(self):
        for name, t in self.state.items():
            self.buckets_sent_at_pull.append(len(self.group.sent) - HEADER_BROADCASTS)
            yield name, t.clone()  # a fresh tensor each time, as a gathering engine makes them


@pytest.mark.parametrize("bucket_bytes", [1000, 4096, LARGEST_BYTES, 10**6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_buckets_reassemble_the_weights_exactly(bucket_bytes, dtype):
    state = tiny_weights(dtype)
    sender = Recording()
    stats = send_weights(sender, state, version=7, bucket_bytes=bucket_bytes)
    assert stats.num_buckets == num_buckets(state, bucket_bytes) == len(sender.sent) - HEADER_BROADCASTS
    assert stats.num_bytes == sum(t.nbytes for t in state.values()) and stats.num_tensors == len(state)
    dest = zeros_like_state(state)
    assert receive_into(Replay(sender.sent), dest) == stats
    assert_same(dest, state)
    incoming = receive(Replay(sender.sent))
    assert incoming.version == 7 and [s.name for s in incoming.specs] == list(state)
    assert_same(dict(incoming), state)


def test_sender_pulls_each_tensor_only_when_the_bucket_needs_it():
    """When tensor i is pulled, exactly the buckets that end before its first byte have gone out."""
    state, bucket_bytes = tiny_weights(), 1000
    sender = Recording()
    pulls = Pulls(state, sender)
    send_weights(sender, pulls, version=0, bucket_bytes=bucket_bytes, specs=weight_specs(state))
    starts = torch.tensor([0] + [t.nbytes for t in state.values()]).cumsum(0)[:-1].tolist()
    assert pulls.buckets_sent_at_pull == [start // bucket_bytes for start in starts]


def test_each_side_holds_one_bucket_beyond_the_weights():
    state, bucket_bytes = tiny_weights(), 1000
    sender = Recording()
    source = Pulls(state, sender)
    specs = weight_specs(state)
    with LiveBytes() as live:
        send_weights(sender, source, version=0, bucket_bytes=bucket_bytes, specs=specs)
    # the tensor being sent (fresh: the source clones it) + one bucket + the header
    assert live.peak_bytes <= LARGEST_BYTES + bucket_bytes + 2048, live.peak_bytes
    dest = zeros_like_state(state)
    with LiveBytes() as live:
        receive_into(Replay(sender.sent), dest)
    assert live.peak_bytes <= bucket_bytes + 2048, live.peak_bytes


def test_a_bucket_inside_one_tensor_goes_straight_into_it():
    """Buckets that lie within one destination tensor are received in place: no bucket is made."""
    state = {"a": torch.randn(1000), "b": torch.randn(1000)}  # 4000 B each, buckets of 2000 B
    sender = Recording()
    send_weights(sender, state, version=0, bucket_bytes=2000)
    dest = zeros_like_state(state)
    with LiveBytes() as live:
        receive_into(Replay(sender.sent), dest)
    assert_same(dest, state)
    assert live.peak_bytes <= 1024, live.peak_bytes  # the header only


def test_mismatches_are_refused_before_anything_is_written():
    state = tiny_weights()
    sender = Recording()
    send_weights(sender, state, version=3, bucket_bytes=1000)
    dest = zeros_like_state(state)
    dest["layers.0.mlp.weight"] = torch.zeros(48, 32)
    dest["scale"] = torch.zeros((), dtype=torch.bfloat16)
    del dest["lm_head.weight"]
    dest["extra.bias"] = torch.zeros(3)
    with pytest.raises(ValueError) as error:
        receive_into(Replay(sender.sent[:HEADER_BROADCASTS]), dest)
    message = str(error.value)
    for part in (
        "version 3 refused (nothing was written)",
        "sent 1 weight(s) this engine does not have: 'lm_head.weight'",
        "has 1 weight(s) the trainer did not send: 'extra.bias'",
        "'layers.0.mlp.weight' sent as [32, 48] torch.float32, held as [48, 32] torch.float32",
        "'scale' sent as [] torch.float32, held as [] torch.bfloat16",
    ):
        assert part in message, message
    assert all(not t.any() for t in dest.values())  # untouched
    with pytest.raises(ValueError, match=r"refused by receiver rank\(s\) \[1\].*nothing was transferred"):
        send_weights(Recording(refuse=True), state, version=3, bucket_bytes=1000)


def test_sender_checks_what_it_is_given():
    state = tiny_weights()
    with pytest.raises(ValueError, match="pass specs=weight_specs"):
        send_weights(Recording(), iter(state.items()), version=0, bucket_bytes=1000)
    with pytest.raises(ValueError, match="bucket_bytes=0 must be a positive integer"):
        send_weights(Recording(), state, version=0, bucket_bytes=0)
    wrong = [WeightSpec("embed.weight", (64, 48), torch.bfloat16), *weight_specs(state)[1:]]
    with pytest.raises(RuntimeError, match="yielded 'embed.weight' .*torch.float32 as tensor 0.*announced"):
        send_weights(Recording(), iter(state.items()), version=0, bucket_bytes=1000, specs=wrong)


def test_weight_specs_of_a_model_are_its_hf_state():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    specs = weight_specs(model, torch.bfloat16)
    assert specs == [
        WeightSpec("0.weight", (3, 4), torch.bfloat16),
        WeightSpec("0.bias", (3,), torch.bfloat16),
        WeightSpec("1.weight", (3,), torch.bfloat16),
        WeightSpec("1.bias", (3,), torch.bfloat16),
    ]


def test_meta_from_fsdp_xccl():
    meta = WeightUpdateMeta.from_fsdp_xccl("sglang:d2t2", backend="gloo", weight_chunked_mem_mb=256)
    assert meta.type == "xccl" and meta.world_size == 5 and meta.backend == "gloo"
    assert 1 <= meta.master_port <= 65535 and meta.bucket_bytes == 256 * 2**20
    assert WeightUpdateMeta.from_fsdp_xccl(master_port=1234).world_size == 2
    with pytest.raises(ValueError, match="training allocation"):
        WeightUpdateMeta.from_fsdp_xccl("fsdp:d2")
    with pytest.raises(ValueError, match=r"weight_chunked_mem_mb=0 .*master_port=0 .*backend='mpi'"):
        WeightUpdateMeta(type="xccl", weight_chunked_mem_mb=0, master_port=0, backend="mpi")


def test_meta_from_config(tmp_path):
    from laden.config.schema import LadenConfig

    cfg = LadenConfig(experiment_name="e", trial_name="t")
    cfg.cluster.fileroot = str(tmp_path)
    cfg.actor.weight_chunked_mem_mb = 512
    meta = WeightUpdateMeta.from_config(cfg)
    assert meta.type == "xccl" and meta.world_size == 2 and meta.weight_chunked_mem_mb == 512
    cfg.actor.weight_update_mode = "disk"
    meta = WeightUpdateMeta.from_config(cfg)
    assert meta.type == "disk" and meta.path == cfg.run_dir / "weight_updates"


# ---- two processes over gloo ------------------------------------------------------------------
def send_command(group: WeightGroup, command: dict) -> None:
    raw = torch.frombuffer(bytearray(json.dumps(command).encode()), dtype=torch.uint8).to(group.device)
    group.broadcast(torch.tensor([raw.numel()], device=group.device))
    group.broadcast(raw)


def recv_command(group: WeightGroup) -> dict:
    length = torch.zeros(1, dtype=torch.int64, device=group.device)
    group.broadcast(length)
    raw = torch.empty(int(length.item()), dtype=torch.uint8, device=group.device)
    group.broadcast(raw)
    return json.loads(raw.cpu().numpy().tobytes())


def finished(group: WeightGroup) -> None:
    """Both ranks meet here once the peer has written its result."""
    group.all_reduce(torch.zeros(1, device=group.device))


@pytest.fixture(scope="module")
def peer():
    """A second process holding rank 1 of a gloo weight group; rank 0 is this one."""
    meta = WeightUpdateMeta.from_fsdp_xccl(backend="gloo", timeout_s=60)
    proc = subprocess.Popen(
        [sys.executable, __file__, "peer", str(meta.master_port), "gloo", "cpu"], env=helpers_env()
    )
    try:
        group = init_weight_group(meta, rank=0)
        yield group
        send_command(group, {"op": "exit"})
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()


def run_on_peer(group: WeightGroup, command: dict, tmp_path: Path, send) -> dict:
    """Have the peer receive (as `command` says) while this process sends; return the peer's result."""
    out = tmp_path / "received.safetensors"
    send_command(group, {**command, "out": str(out)})
    try:
        send()
    finally:
        finished(group)
    result = json.loads(out.with_suffix(".json").read_text())
    if "error" not in result:
        from safetensors.torch import load_file

        loaded = load_file(out)  # sorted by name: back into the sent order
        assert sorted(loaded) == sorted(result["names"])
        result["tensors"] = {name: loaded[name] for name in result["names"]}
    return result


@pytest.mark.parametrize(("dtype", "bucket_bytes"), [(torch.float32, 1000), (torch.bfloat16, 4096)])
def test_gloo_broadcast_reassembles_the_trainers_weights(peer, tmp_path, dtype, bucket_bytes):
    state = tiny_weights(dtype)
    specs = weight_specs(state)
    specs_json = [[s.name, list(s.shape), str(s.dtype).removeprefix("torch.")] for s in specs]
    assert bucket_bytes < max(t.nbytes for t in state.values())

    def send():
        stats = send_weights(peer, iter(state.items()), version=5, bucket_bytes=bucket_bytes, specs=specs)
        assert stats.num_buckets == num_buckets(state, bucket_bytes)

    for op in ("receive_into", "receive"):
        result = run_on_peer(peer, {"op": op, "specs": specs_json}, tmp_path, send)
        assert result["version"] == 5 and result["num_buckets"] == num_buckets(state, bucket_bytes)
        assert_same(result["tensors"], state)


def test_gloo_mismatch_is_refused_on_both_sides(peer, tmp_path):
    state = tiny_weights()
    specs_json = [[n, list(t.shape), "float32"] for n, t in state.items() if n != "lm_head.weight"]

    def send():
        with pytest.raises(ValueError, match=r"refused by receiver rank\(s\) \[1\]"):
            send_weights(peer, state, version=1, bucket_bytes=1000)

    result = run_on_peer(peer, {"op": "receive_into", "specs": specs_json}, tmp_path, send)
    assert "does not have: 'lm_head.weight'" in result["error"], result


def _device_broadcast(tmp_path, backend: str, peer_device: str, bucket_bytes: int, scale: int = 1) -> None:
    """Rank 0 on cuda:0 sends bf16 weights (each `scale` times the tiny ones) to a peer process on
    `peer_device`; both receive paths get exactly them."""
    meta = WeightUpdateMeta.from_fsdp_xccl(backend=backend, timeout_s=60)
    proc = subprocess.Popen(
        [sys.executable, __file__, "peer", str(meta.master_port), backend, peer_device], env=helpers_env()
    )
    try:
        group = init_weight_group(meta, rank=0, device=torch.device("cuda", 0))
        state = {name: t.repeat(scale, 1).to("cuda:0") for name, t in tiny_weights(torch.bfloat16).items()}
        specs = weight_specs(state)
        specs_json = [[s.name, list(s.shape), str(s.dtype).removeprefix("torch.")] for s in specs]

        def send():
            send_weights(group, iter(state.items()), version=2, bucket_bytes=bucket_bytes, specs=specs)

        for op in ("receive_into", "receive"):
            result = run_on_peer(group, {"op": op, "specs": specs_json}, tmp_path, send)
            assert result["num_buckets"] == num_buckets(state, bucket_bytes)
            assert_same(result["tensors"], {name: t.cpu() for name, t in state.items()})
        send_command(group, {"op": "exit"})
        assert proc.wait(timeout=60) == 0
        group.close()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.multigpu
def test_nccl_broadcast_between_two_gpus_reassembles_the_weights(tmp_path):
    _device_broadcast(tmp_path, "nccl", "cuda:1", 4096)


@pytest.mark.gpu
def test_cuda_ipc_broadcast_between_two_processes_on_one_gpu_reassembles_the_weights(tmp_path):
    """Buckets of 1 MiB and more go through the shared staging buffer (smaller ones over gloo): the
    weights are scaled up so that both kinds occur, and buckets smaller than the largest tensor."""
    _device_broadcast(tmp_path, "cuda_ipc", "cuda:0", (1 << 20) + 4096, scale=1024)


def test_cuda_ipc_needs_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    meta = WeightUpdateMeta.from_fsdp_xccl(backend="cuda_ipc", timeout_s=5)
    with pytest.raises(
        ValueError, match="meta.backend='cuda_ipc' but this process has no CUDA; use backend='gloo'"
    ):
        init_weight_group(meta, rank=0)


def _peer(port: int, backend: str, device: str) -> None:
    """Rank 1: run commands until told to exit; each result goes to the command's `out` files."""
    from safetensors.torch import save_file

    where = torch.device(device)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    meta = WeightUpdateMeta.from_fsdp_xccl(backend=backend, master_port=port, timeout_s=60)
    group = init_weight_group(meta, rank=1, device=where)
    while (command := recv_command(group))["op"] != "exit":
        out = Path(command["out"])
        try:
            if command["op"] == "receive_into":
                params = {
                    n: torch.full(s, -1, device=where).to(getattr(torch, d)) for n, s, d in command["specs"]
                }
                stats = receive_into(group, params)
                received = params
            else:
                incoming = receive(group)
                received = dict(incoming)
                stats = incoming.stats
            save_file({n: t.contiguous().cpu() for n, t in received.items()}, out)
            result: dict = {
                "version": stats.version,
                "num_buckets": stats.num_buckets,
                "names": list(received),
            }
        except (ValueError, RuntimeError) as error:
            result = {"error": str(error)}
        out.with_suffix(".json").write_text(json.dumps(result))
        finished(group)


if __name__ == "__main__" and sys.argv[1] == "peer":
    _peer(int(sys.argv[2]), sys.argv[3], sys.argv[4])
