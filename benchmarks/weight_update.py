"""Weight updates trainer -> rollout engine: time and peak extra memory of disk, xccl and in place.

One JSON line per result, e.g. on the H200 machine:

    python benchmarks/weight_update.py                 # everything below
    python benchmarks/weight_update.py --modes xccl --models qwen3-1.7b --buckets-mb 1024
    python benchmarks/weight_update.py --smoke         # CPU, a tiny model: checks the script runs

- `disk`: the trainer's bf16 weights (Qwen3-0.6B and -1.7B shapes, random init, on the GPU)
  are written as a version (`laden.weights.write_weights`, shards of `bucket_mb`), then read
  back into preallocated GPU tensors (`read_weights` + `fill_in_place`). The read comes from
  the page cache (the version was just written): a cold read from shared storage is slower.
- `xccl`: the same weights broadcast to a second process (`send_weights` / `receive_into`,
  buckets of `bucket_mb`). With two GPUs: NCCL, GPU 0 to GPU 1. With one: NCCL refuses two
  ranks on one device, so the two processes share the GPU through `cuda_ipc` (a staging bucket
  on the trainer's GPU the receiver maps by CUDA IPC) and, with `--one-gpu-backends cuda_ipc
  gloo`, over gloo too (device -> host bucket -> loopback TCP -> host bucket -> device); the
  result says which (`backend`, `note`).
- `inplace`: a colocated update from a roundpipe engine's host store (`named_weights()` in
  bf16 hands out the pinned upload copies) into preallocated GPU tensors (`fill_in_place`),
  waiting per tensor (`overlap=false`) and once (`overlap=true`). Qwen3-1.7B is a real engine
  (bf16 compute, fp32 masters, `pin_model=alloc`); for Qwen3-8B building an engine needs
  about 50 GiB of host memory (pinned upload copies, fp32 masters) and minutes of setup, so by
  default it copies from pinned bf16 host tensors of the 8B shapes instead (what the engine's
  upload copies are) and says so (`source`); `--engine-models qwen3-8b` builds the engine.

Memory: `peak_extra_gpu_bytes` is `torch.cuda.max_memory_allocated()` during the step less
what was allocated before it (this process; the receiver reports its own);
`peak_extra_host_bytes` is the peak RSS during the step less the RSS before it (the peak is
reset through /proc/self/clear_refs; where that is refused, the process's peak so far is used
and `host_peak_reset` is false). The source and destination weights exist before a step
starts and are not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import git_commit, shapes  # noqa: E402

SMOKE_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, vocab_size=2048, tie_word_embeddings=True)  # fmt: skip
SHAPES = shapes("qwen3-0.6b", "qwen3-1.7b", "qwen3-8b", tiny=SMOKE_SHAPE)
DTYPE = torch.bfloat16
MODES = ("disk", "xccl", "inplace")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, KiB-sized buckets: the script runs")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--models", nargs="+", choices=list(SHAPES), default=["qwen3-0.6b", "qwen3-1.7b"],
                   help="disk and xccl")  # fmt: skip
    p.add_argument("--buckets-mb", nargs="+", type=float, default=[256, 512, 1024],
                   help="bucket (xccl) and shard (disk) sizes in MiB")  # fmt: skip
    p.add_argument("--inplace-models", nargs="+", choices=list(SHAPES), default=["qwen3-1.7b", "qwen3-8b"])
    p.add_argument("--engine-models", nargs="+", choices=list(SHAPES), default=["qwen3-1.7b"],
                   help="in-place sources built as a real roundpipe engine; the others: pinned host tensors")  # fmt: skip
    p.add_argument("--disk-root", default=None, help="where versions are written (default: a temp dir)")
    p.add_argument("--repeats", type=int, default=2, help="runs per result; the fastest counts")
    p.add_argument("--one-gpu-backends", nargs="+", choices=["cuda_ipc", "gloo"], default=["cuda_ipc"],
                   help="xccl between two processes on one GPU")  # fmt: skip
    p.add_argument("--role", choices=["main", "receiver"], default="main", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--backend", default="gloo", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.models = args.inplace_models = args.engine_models = ["tiny"]
        args.buckets_mb = [b / 1024 for b in (256, 512, 1024)]  # KiB: several buckets for a tiny model
        args.repeats = 1
    return args


# ---- memory and time ------------------------------------------------------------------------
def rss_bytes(field: str = "VmRSS") -> int:
    """`field` of /proc/self/status (VmRSS now, VmHWM the peak) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_host_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Measure:
    """Wall time, peak extra GPU memory and peak extra host RSS of the block it wraps."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def __enter__(self) -> Measure:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.gpu_before = torch.cuda.memory_allocated(self.device)
        self.host_reset = reset_host_peak()
        self.rss_before = rss_bytes()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)  # deliberate: the copies and collectives have landed
        self.time_s = time.perf_counter() - self.start
        self.host_bytes = rss_bytes("VmHWM") - self.rss_before
        self.gpu_bytes = torch.cuda.max_memory_allocated(self.device) - self.gpu_before if self.cuda else 0

    def result(self, num_bytes: int) -> dict[str, Any]:
        return {
            "time_s": round(self.time_s, 4),
            "gb_s": round(num_bytes / self.time_s / 1e9, 3),
            "peak_extra_gpu_bytes": self.gpu_bytes,
            "peak_extra_host_bytes": self.host_bytes,
            "host_peak_reset": self.host_reset,
        }


def best_of(repeats: int, run: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """The fastest of `repeats` calls of `run(*args)` (each returns a result with `time_s`)."""
    return min((run(*args) for _ in range(repeats)), key=lambda r: r["time_s"])


# ---- models ---------------------------------------------------------------------------------
def qwen3(name: str, where: Any) -> torch.nn.Module:
    """A random-init Qwen3 of shape `name` in bf16, built under `where` (a device or `meta_params()`)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    with where:
        return AutoModelForCausalLM.from_config(Qwen3Config(**SHAPES[name]), dtype=DTYPE)


def trainer_weights(name: str, device: torch.device) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The trainer side: a model on `device` and its Hugging Face state (live tensors, tied once)."""
    from laden.model.hf.export import hf_state_names

    model = qwen3(name, device)
    state = model.state_dict()
    return model, {n: state[n] for n in hf_state_names(model)}


def empty_like_specs(specs: list, device: torch.device) -> dict[str, torch.Tensor]:
    """Uninitialised tensors of `specs` on `device`: an engine's preallocated weights."""
    return {s.name: torch.empty(s.shape, dtype=s.dtype, device=device) for s in specs}


def base(mode: str, model: str, num_bytes: int, device: torch.device, **extra: Any) -> dict[str, Any]:
    """The fields every result line has."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"bench": "weight_update", "mode": mode, "model": model, "dtype": "bfloat16", "num_bytes": num_bytes,
            "device": where, "torch": torch.__version__, "commit": git_commit(), **extra}  # fmt: skip


def emit(result: dict[str, Any]) -> None:
    print(json.dumps(result), flush=True)


# ---- disk -----------------------------------------------------------------------------------
def bench_disk(args: argparse.Namespace, device: torch.device) -> None:
    from laden.weights import fill_in_place, latest_version, read_weights, write_weights

    root = Path(args.disk_root or tempfile.mkdtemp(prefix="laden-weights-"))
    latest = latest_version(root)
    version = 0 if latest is None else latest + 1  # versions are written once
    for name in args.models:
        _, state = trainer_weights(name, device)
        dest = {n: torch.empty_like(t) for n, t in state.items()}
        num_bytes = sum(t.nbytes for t in state.values())
        for bucket_mb in args.buckets_mb:
            writes, reads = [], []
            for _ in range(args.repeats):
                with Measure(device) as w:
                    write_weights(iter(state.items()), root, version, shard_mb=bucket_mb, keep_last=1)
                with Measure(device) as r:
                    fill_in_place(read_weights(root, version, device=device), dest)
                writes.append(w.result(num_bytes))
                reads.append(r.result(num_bytes))
                version += 1
            emit(base("disk", name, num_bytes, device, bucket_mb=bucket_mb, write=min(writes, key=_time),
                      read=min(reads, key=_time), note="read from the page cache (just written)"))  # fmt: skip
            assert all(torch.equal(dest[n], state[n]) for n in state)
        del state, dest
    if args.disk_root is None:
        shutil.rmtree(root, ignore_errors=True)


def _time(result: dict[str, Any]) -> float:
    return result["time_s"]


# ---- xccl -----------------------------------------------------------------------------------
def xccl_layout(
    cpu_only: bool, backend: str = "cuda_ipc"
) -> tuple[str, torch.device, torch.device, str | None]:
    """(backend, sender device, receiver device, note) for this machine; `backend` on one GPU: cuda_ipc
    or gloo."""
    if cpu_only or not torch.cuda.is_available():
        return "gloo", torch.device("cpu"), torch.device("cpu"), None
    if torch.cuda.device_count() >= 2:
        return "nccl", torch.device("cuda", 0), torch.device("cuda", 1), None
    if backend == "gloo":
        note = (
            "one GPU: NCCL refuses two ranks on one device; both processes share it over gloo (host buckets)"
        )
        return "gloo", torch.device("cuda", 0), torch.device("cuda", 0), note
    note = "one GPU: NCCL refuses two ranks on one device; buckets through a CUDA IPC staging buffer"
    return "cuda_ipc", torch.device("cuda", 0), torch.device("cuda", 0), note


def bench_xccl(args: argparse.Namespace) -> None:

    for one_gpu in args.one_gpu_backends:
        _bench_xccl(args, *xccl_layout(args.smoke, one_gpu))
        if args.smoke or torch.cuda.device_count() != 1:
            break  # the layout does not depend on it


def _bench_xccl(args: argparse.Namespace, backend: str, device: torch.device, peer_device: torch.device,
                note: str | None) -> None:  # fmt: skip
    from laden.weights import WeightUpdateMeta, init_weight_group, weight_specs

    for name in args.models:
        model, state = trainer_weights(name, device)
        specs = weight_specs(model, DTYPE)
        num_bytes = sum(t.nbytes for t in state.values())
        meta = WeightUpdateMeta.from_fsdp_xccl(backend=backend, timeout_s=600)
        peer = subprocess.Popen(
            [sys.executable, __file__, "--role", "receiver", "--port", str(meta.master_port), "--backend", backend,
             "--device", str(peer_device), "--models", name, "--repeats", str(args.repeats),
             "--buckets-mb", *map(str, args.buckets_mb)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        group = init_weight_group(meta, rank=0, device=device)
        try:
            for bucket_mb in args.buckets_mb:
                bucket_bytes = max(1, int(bucket_mb * 2**20))
                sent = best_of(args.repeats, timed_send, group, state, specs, bucket_bytes, device)
                received = json.loads(peer.stdout.readline())  # type: ignore[union-attr]
                emit(base("xccl", name, num_bytes, device, bucket_mb=bucket_mb, backend=backend, note=note,
                          send=sent, receive=received))  # fmt: skip
            assert peer.wait(timeout=600) == 0
        finally:
            peer.kill()
            group.close()
        del model, state


def timed_send(
    group: Any, state: dict[str, torch.Tensor], specs: list, bucket_bytes: int, device: torch.device
) -> dict[str, Any]:
    """One measured `send_weights` of `state`, both sides started together."""
    from laden.weights import send_weights

    group.all_reduce(torch.zeros(1, device=group.device))  # the receiver starts its clock here too
    with Measure(device) as m:
        stats = send_weights(group, iter(state.items()), version=0, bucket_bytes=bucket_bytes, specs=specs)
    return {**m.result(sum(t.nbytes for t in state.values())), "num_buckets": stats.num_buckets}


def timed_receive(group: Any, dest: dict[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
    """One measured `receive_into` of `dest` (the other side of `timed_send`)."""
    from laden.weights import receive_into

    group.all_reduce(torch.zeros(1, device=group.device))
    with Measure(device) as m:
        stats = receive_into(group, dest)
    return {**m.result(sum(t.nbytes for t in dest.values())), "num_buckets": stats.num_buckets}


def xccl_receiver(args: argparse.Namespace) -> None:
    """The engine side: receive every update of `bench_xccl` into preallocated tensors."""
    from laden.engine.roundpipe.host.memory import meta_params
    from laden.weights import WeightUpdateMeta, init_weight_group, weight_specs

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    meta = WeightUpdateMeta.from_fsdp_xccl(backend=args.backend, master_port=args.port, timeout_s=600)
    group = init_weight_group(meta, rank=1, device=device)
    dest = empty_like_specs(weight_specs(qwen3(args.models[0], meta_params()), DTYPE), device)
    for _ in args.buckets_mb:
        print(json.dumps(best_of(args.repeats, timed_receive, group, dest, device)), flush=True)
    group.close()


# ---- in place -------------------------------------------------------------------------------
@contextlib.contextmanager
def inplace_source(name: str, as_engine: bool, device: torch.device) -> Iterator[tuple[Any, str]]:
    """(a callable giving `named_weights`, what it is): a roundpipe engine's, or pinned host tensors."""
    from laden.engine.roundpipe.host.memory import meta_params
    from laden.weights import weight_specs

    model = qwen3(name, meta_params())
    if as_engine:
        from laden.engine.roundpipe import RoundPipeEngine
        from laden.optim import OptimSettings

        engine = RoundPipeEngine(
            model, optim=OptimSettings(type="adam", lr=1e-5, total_steps=1), compute_dtype=DTYPE,
            optimizer_dtype=torch.float32, pin_model="alloc", devices=[device] if device.type == "cpu" else None,
        )  # fmt: skip
        yield (
            engine.named_weights,
            "roundpipe engine host store (bf16 upload copies, pin_model=alloc; fp32 masters)",
        )
        return
    host = pinned_views(weight_specs(model, DTYPE))
    what = "pinned bf16 host tensors of the model's shapes (no engine built: see the module docstring)"
    yield (lambda: iter(host.items())), what


def pinned_views(specs: list) -> dict[str, torch.Tensor]:
    """One page-locked flat buffer (plain memory without CUDA) viewed as the tensors of `specs`,
    as the engine's `pin_model=alloc` lays out its upload copies (one rounding to 2^k, not one per tensor)."""
    total = sum(math.prod(s.shape) for s in specs)
    flat = torch.empty(total, dtype=DTYPE, pin_memory=torch.cuda.is_available())
    views, offset = {}, 0
    for i, s in enumerate(specs):
        numel = math.prod(s.shape)
        views[s.name] = (
            flat[offset : offset + numel].view(s.shape).fill_(i % 7 - 3)
        )  # memset speed: values do not matter
        offset += numel
    return views


def timed_fill(
    named_weights: Callable, dest: dict[str, torch.Tensor], overlap: bool, device: torch.device
) -> dict[str, Any]:
    """One measured `fill_in_place` of `dest` from a fresh `named_weights()`."""
    from laden.weights import fill_in_place

    with Measure(device) as m:
        fill_in_place(named_weights(), dest, overlap=overlap)
    return m.result(sum(t.nbytes for t in dest.values()))


def bench_inplace(args: argparse.Namespace, device: torch.device) -> None:
    for name in args.inplace_models:
        kinds = (True, False) if args.smoke else (name in args.engine_models,)  # smoke: both sources
        for as_engine in kinds:
            bench_inplace_one(args, name, as_engine, device)


def bench_inplace_one(args: argparse.Namespace, name: str, as_engine: bool, device: torch.device) -> None:
    """Both `overlap` settings of one in-place source."""
    with inplace_source(name, as_engine, device) as (named_weights, source):
        dest = {n: torch.empty(t.shape, dtype=DTYPE, device=device) for n, t in named_weights()}
        num_bytes = sum(t.nbytes for t in dest.values())
        pinned = all(t.is_pinned() for _, t in named_weights())
        for overlap in (False, True):
            result = best_of(args.repeats, timed_fill, named_weights, dest, overlap, device)
            fields = dict(source=source, pinned=pinned, overlap=overlap, **result)
            emit(base("inplace", name, num_bytes, device, **fields))
        assert all(torch.equal(dest[n].cpu(), t) for n, t in named_weights())
        del dest


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), 8))
    if args.role == "receiver":
        xccl_receiver(args)
        return
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.smoke else torch.device("cpu")
    if "disk" in args.modes:
        bench_disk(args, device)
    if "xccl" in args.modes:
        bench_xccl(args)
    if "inplace" in args.modes:
        bench_inplace(args, device)


if __name__ == "__main__":
    main()
