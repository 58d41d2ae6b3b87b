"""LoRA fine-tuning of a model larger than the memory the process may use, on memory-mapped weights.

    python benchmarks/lora_mmap.py --model-gib 3.5 --limit-gib 2.0 --steps 4

Writes a random-init Qwen3-shaped fp32 checkpoint (safetensors, streamed tensor by tensor, so the
writer never holds the model), drops it from the page cache, and trains LoRA adapters on it with
the roundpipe engine (`pin_model="off"`, compute dtype fp32 = the file's, so the frozen base
weights stay file-backed views that the kernel pages in on demand) in a child process whose
memory is capped below the model's size. Prints one JSON line: model size, limit, the child's
peak RSS (VmHWM: anonymous and file pages it had mapped at once) and peak anonymous RSS (sampled),
the cgroup's peak charge (page cache included), tokens/s and the loss per step (the same batch
every step, so it falls).

The cap: a child memory cgroup of this process's own (cgroup v1 `memory.limit_in_bytes` or v2
`memory.max`), which charges anonymous memory and page cache alike and reclaims clean file pages
under pressure, the behaviour that matters here. `RLIMIT_AS` / `prlimit` cannot express this: it
caps the address space, and a memory map of the whole checkpoint is address space the size of the
model even when almost none of it is resident. Without a writable cgroup the script says so and
stops. On the CPU the roundpipe "device" is host memory too: each stage's weights are copied for
its residency (`--stage-gib` bounds that), which on a GPU machine would be GPU memory.

On a GPU machine, the same mode on the largest checkpoint its disk holds, against weights read
into memory and page-locked in place (one process per mode; `--no-cap`: the host is larger
than the model there):

    for mode in off register; do
      python benchmarks/lora_mmap.py --shape qwen3-32b --dtype bf16 --model-gib 40 --no-cap \
          --pin-model $mode --rows 4 --seq-len 1024 --stage-gib 8 --steps 3 --dir /tmp/lora_big
    done

`register` reads every base weight into anonymous memory first (file-backed pages cannot be
page-locked: `cudaHostRegister` refuses them), so its host peak is about the model's size.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

SHAPES = {
    "small": dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, vocab_size=32000, tie_word_embeddings=False),
    # Qwen3-32B's layer (its depth follows from --model-gib)
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}  # fmt: skip
SHAPE = SHAPES["small"]
DTYPES = {"fp32": ("F32", 4), "bf16": ("BF16", 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-gib", type=float, default=3.5, help="checkpoint size to aim for (fp32)")
    parser.add_argument("--limit-gib", type=float, default=2.0, help="memory cap of the training process")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rows", type=int, default=2, help="sequences per step (one micro-batch each)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (all linear layers)")
    parser.add_argument("--stage-gib", type=float, default=0.5, help="the plan's model_memory_limit")
    parser.add_argument("--dir", default="/tmp/laden_lora_mmap", help="where the checkpoint is written")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small", help="the layer's shape")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="fp32", help="checkpoint and compute dtype"
    )
    parser.add_argument("--pin-model", choices=("off", "register"), default="off",
                        help="off: memory-mapped base weights; register: read into memory, page-locked")  # fmt: skip
    parser.add_argument("--no-cap", action="store_true", help="train in this process, no memory cap")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global SHAPE
    SHAPE = SHAPES[args.shape]
    if args.child:
        print(json.dumps(train(args)), flush=True)
        return
    directory = Path(args.dir)
    t0 = time.perf_counter()
    num_layers = write_checkpoint(directory, args.model_gib, args.dtype)
    write_s = round(time.perf_counter() - t0, 1)
    model_bytes = (directory / "model.safetensors").stat().st_size
    info = dict(model_gib=round(model_bytes / 2**30, 3), num_layers=num_layers, shape=args.shape, dtype=args.dtype,
                pin_model=args.pin_model, checkpoint_write_s=write_s)  # fmt: skip
    if args.no_cap:
        print(json.dumps({**train(args), **info}), flush=True)
        return
    if args.pin_model != "off":
        raise SystemExit(
            "--pin-model register reads the model into memory: it cannot run under a cap below its size"
        )
    if args.limit_gib * 2**30 >= model_bytes:
        raise SystemExit(
            f"--limit-gib={args.limit_gib} is not below the model's {model_bytes / 2**30:.2f} GiB"
        )
    result = run_capped(args, int(args.limit_gib * 2**30))
    result.update(info, limit_gib=args.limit_gib)
    print(json.dumps(result), flush=True)


# ---- the checkpoint ---------------------------------------------------------------------


def qwen3_tensors(num_layers: int) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    q, kv, d = SHAPE["num_attention_heads"] * SHAPE["head_dim"], SHAPE["num_key_value_heads"] * SHAPE["head_dim"], SHAPE["head_dim"]  # fmt: skip
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for n in range(num_layers):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                (p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]  # fmt: skip
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def write_checkpoint(directory: Path, model_gib: float, dtype: str = "fp32") -> int:
    """Stream a random-init checkpoint to `directory` (reused when its shape matches); return its
    number of layers. Norms are 1, every other weight N(0, 0.02): slices of one random pool of 16M
    values at varying offsets (a fresh draw per tensor would take minutes for tens of GB)."""
    import torch
    from transformers import Qwen3Config

    tag, width = DTYPES[dtype]
    per_layer = sum(width * _numel(s) for _, s in qwen3_tensors(1)) - sum(
        width * _numel(s) for _, s in qwen3_tensors(0)
    )
    num_layers = max(
        1, round((model_gib * 2**30 - sum(width * _numel(s) for _, s in qwen3_tensors(0))) / per_layer)
    )
    config = Qwen3Config(**SHAPE, num_hidden_layers=num_layers, pad_token_id=0, dtype=_torch_dtype(dtype))
    path = directory / "model.safetensors"
    tensors = qwen3_tensors(num_layers)
    header, offset = {}, 0
    for name, shape in tensors:
        header[name] = {
            "dtype": tag,
            "shape": list(shape),
            "data_offsets": [offset, offset + width * _numel(shape)],
        }
        offset += width * _numel(shape)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    if not (path.is_file() and path.stat().st_size == 8 + len(blob) + offset):
        directory.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(directory)
        gen = torch.Generator().manual_seed(0)
        pool = (torch.randn(1 << 24, generator=gen) * 0.02).to(_torch_dtype(dtype))
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for i, (name, shape) in enumerate(tensors):
                n = _numel(shape)
                if name.endswith("norm.weight"):
                    t = torch.ones(n, dtype=pool.dtype)
                else:
                    start = (i * 7919) % pool.numel()
                    t = pool.roll(-start).repeat(-(-n // pool.numel()))[:n]
                f.write(t.view(torch.uint8).numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
    with open(path, "rb") as f:  # start cold: the capped child must page every weight in itself
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return num_layers


def _torch_dtype(dtype: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---- the cap ----------------------------------------------------------------------------


def own_memory_cgroup() -> tuple[Path, int]:
    """(this process's memory cgroup directory, cgroup version), from /proc/self/cgroup."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / rel.lstrip("/"), 1
        if hid == "0" and Path("/sys/fs/cgroup/cgroup.controllers").is_file():
            return Path("/sys/fs/cgroup") / rel.lstrip("/"), 2
    raise SystemExit("no memory cgroup found in /proc/self/cgroup; run under a cgroup-enabled kernel")


def run_capped(args: argparse.Namespace, limit_bytes: int) -> dict:
    """Run `--child` in a fresh child cgroup of our own capped at `limit_bytes`; its JSON + the cgroup's peak."""
    parent, version = own_memory_cgroup()
    group = parent / f"laden-lora-mmap-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as err:
        raise SystemExit(
            f"cannot create the cgroup {group} ({err}); run as root on a host with cgroups"
        ) from err
    try:
        limit_file, peak_file = (
            ("memory.limit_in_bytes", "memory.max_usage_in_bytes")
            if version == 1
            else ("memory.max", "memory.peak")
        )
        (group / limit_file).write_text(str(limit_bytes))
        if version == 2:
            (group / "memory.swap.max").write_text("0")
        procs = group / "cgroup.procs"
        cmd = [sys.executable, __file__, "--child", *sys.argv[1:]]
        join = lambda: procs.write_text(str(os.getpid()))  # noqa: E731 - runs in the child, before exec
        child = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=join)
        if child.returncode != 0:
            oom = " (killed: out of memory under the cap)" if child.returncode in (-9, 137) else ""
            raise SystemExit(f"the capped run failed{oom}, rc={child.returncode}:\n{child.stderr[-3000:]}")
        result = json.loads(child.stdout.strip().splitlines()[-1])
        result["cgroup_peak_gib"] = round(int((group / peak_file).read_text()) / 2**30, 3)
        result["cap"] = f"cgroup v{version} {limit_file}={limit_bytes}"
        return result
    finally:
        group.rmdir()


# ---- the capped training run ------------------------------------------------------------


def train(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from laden.data.batch import pack_samples
    from laden.engine.roundpipe import RoundPipeEngine
    from laden.model.lora import LoraSettings, apply_lora
    from laden.optim import OptimSettings

    sampler = AnonSampler()
    dtype = _torch_dtype(args.dtype)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=dtype)  # memory-mapped views
    if args.pin_model == "register":  # anonymous memory: file-backed pages cannot be page-locked
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.clone()
    apply_lora(model, LoraSettings(rank=args.rank, alpha=2.0 * args.rank), seed=0)
    optim = OptimSettings(
        type="adam", lr=2e-3, weight_decay=0.0, gradient_clipping=1.0, total_steps=args.steps
    )
    engine = RoundPipeEngine(model, optim=optim, compute_dtype=dtype, pin_model=args.pin_model,
                             model_memory_limit=args.stage_gib, max_tokens_per_mb=args.seq_len)  # fmt: skip
    build_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    rows = [
        torch.randint(0, SHAPE["vocab_size"], (args.seq_len,), generator=gen).tolist()
        for _ in range(args.rows)
    ]
    batch = [pack_samples([(r, [1] * len(r))]) for r in rows]
    num_tokens = sum(mb.num_loss_tokens for mb in batch)
    losses, times = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        out = engine.train_batch(batch, global_num_loss_tokens=num_tokens)
        losses.append(round(float(out["loss"]), 4))  # host sync: one figure per step
        times.append(time.perf_counter() - start)
    sampler.stop()
    steady = times[1:] or times
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return dict(
        losses=losses, step_s=[round(t, 2) for t in times], tokens_per_s=round(num_tokens * len(steady) / sum(steady), 1),
        tokens_per_step=num_tokens, trainable_params=trainable, stages=len(engine.plan.bwd_plan),
        peak_rss_gib=round(_status_kib("VmHWM") / 2**20, 3), peak_anon_rss_gib=round(sampler.peak_kib / 2**20, 3),
        torch_threads=torch.get_num_threads(), build_s=round(build_s, 1),
        registered_gib=round(engine.pipe.store.registered_bytes / 2**30, 3) if hasattr(engine, "pipe") else None,
        gpu_peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    )  # fmt: skip


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


class AnonSampler:
    """The largest RssAnon of this process, sampled every 20 ms on a daemon thread."""

    def __init__(self) -> None:
        self.peak_kib = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.02):
            self.peak_kib = max(self.peak_kib, _status_kib("RssAnon"))

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self.peak_kib = max(self.peak_kib, _status_kib("RssAnon"))


if __name__ == "__main__":
    main()
