"""Training throughput on the reference workload: tokens/s, MFU/HFU, GPU and host peaks.

One JSON object per result on stdout. Systems:
- `laden`: `RoundPipeEngine` (CPU-resident model, stages streamed through the GPU), under
  `--gpu-mem-cap-gib` (default 24, as if on a 24 GB card); `--optim-step sync` with `--clip 1`
  is the `laden sft` default (exact synchronous step with clipping), `--optim-step async --clip
  0` the one-step-stale step without clipping;
- `fsdp`: `actor.backend: fsdp:d1` in one process, built the way `laden sft` builds it: a
  `LadenConfig`, the runtime's model patches (lean activations, fused elementwise kernels) and
  `laden.engine.factory.build_engine`; the model resident on the uncapped GPU, fp32 masters +
  bf16 autocast, the exact synchronous step with clipping (the only step it has);
  `--gradient-checkpointing` per decoder layer (off by default, as in `laden sft`);
- `plain`: plain PyTorch as BENCHMARKS.md defines it (`plain_hf.py`): stock Hugging Face
  transformers, no laden code, fp32 masters + bf16 autocast, `torch.optim.AdamW(fused=True)`,
  unpacked rows of `--seq-len` tokens, causal SDPA, on the uncapped GPU;
  `--gradient-checkpointing` is Hugging Face's own (off by default). (Up to RESULTS' seventh
  round `plain` was laden's former `LocalEngine` with checkpointing forced on.)

On a machine with several GPUs the `laden` system pools every visible one (the roundpipe pool;
`gpus_visible` in the result); `CUDA_VISIBLE_DEVICES=0` gives the one-GPU figure of the same work.
The resident systems (`fsdp`, `plain`) are not capped unless `--cap-plain`. `laden` and
`fsdp` train on the same random packed micro-batches: `--num-seqs` sequences of `--seq-len`
tokens per optimizer step, packed `--num-seqs / --num-microbatch` sequences per row; `plain`
on the same tokens as `--num-microbatch` batches of unpacked rows.
MFU = 6 N tokens/s / 989e12 (H200 dense bf16 peak, N = parameters, embeddings included, tied
ones once); `mfu_attn` adds causal attention as BENCHMARKS.md defines MFU. HFU counts the
forward recomputed in backward by the plan that ran (bench_common.utilisation): laden's
roundpipe engine recomputes the layers of every backward stage but the fused one (`fused_layers`
of the pipeline's layers skip it: all of them when the model fits the limit whole, and then
HFU = MFU); gradient checkpointing recomputes every decoder layer; `hfu_8n` is the former count
(8 N for every run).

A result is only valid if every step's loss and gradient norm are finite (and, for laden on
a GPU with `--pin-model alloc|register`, the upload copies are page-locked; for `plain`, no
laden module was imported): otherwise the JSON is still printed, with `"valid": false` and the
reason, and the script exits non-zero. A GPU out-of-memory error is caught and printed the same
way, with `"error_kind": "gpu_oom"` (gradient checkpointing off may not fit).

Host memory (laden): before anything is allocated the script prints one JSON line
`{"predicted_host_gib": ...}` (model state by kind, exact; parked activations, estimated;
plus `--host-overhead-gib` for the process itself) and refuses to start when that exceeds
`--host-mem-gib` (default 128, the H200 machine; /proc/meminfo's MemAvailable is reported
but not trusted, since that machine's memory may show up late), naming the knobs that
would fit. The Qwen3 shapes are built on the meta device and materialised straight into
the engine's host store (`--build`), so building never holds a second copy of the model.

    python benchmarks/train_throughput.py --system laden --model qwen3-1.7b --steps 6 --warmup 2
    python benchmarks/train_throughput.py --system laden --model qwen3-8b --optimizer adam_bf16 --optim-step sync
    python benchmarks/train_throughput.py --system fsdp --model qwen3-1.7b --gradient-checkpointing
    python benchmarks/train_throughput.py --system plain --model qwen3-1.7b --no-gradient-checkpointing
    python benchmarks/train_throughput.py --system laden --model tiny --steps 2   # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, cast

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests" / "support"))  # the tiny test model
from bench_common import (  # noqa: E402
    attention_forward_flops,
    git_commit,
    layer_forward_params,
    recomputed_layers,
    shapes,
    utilisation,
)

GIB = 1 << 30
HEADROOM_GIB = 2.0  # GPU memory the default plan leaves to CUDA workspaces and allocator slack
SHAPES = shapes("qwen3-1.7b", "qwen3-8b")  # random init
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
SYSTEMS = ("laden", "fsdp", "plain")
RESIDENT = ("fsdp", "plain")  # the model on the GPU, not capped unless --cap-plain


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", choices=SYSTEMS, default="laden")
    p.add_argument("--model", choices=[*SHAPES, "tiny"], default="qwen3-1.7b")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--num-seqs", type=int, default=16, help="sequences per optimizer step")
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gpu-mem-cap-gib", type=float, default=24.0)
    p.add_argument("--cap-plain", action="store_true",
                   help="apply the GPU cap to the resident systems (fsdp, plain) too")  # fmt: skip
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="fsdp, plain: recompute every decoder layer in backward (fsdp: "
                        "actor.gradient_checkpointing; plain: Hugging Face's; default off; laden: its plan "
                        "decides)")  # fmt: skip
    p.add_argument("--num-microbatch", type=int, default=4)
    p.add_argument("--recompute-grain", choices=["stage", "layer"], default="stage")
    p.add_argument("--model-memory-limit", type=float, default=None,
                   help=f"GiB; default the cap less {HEADROOM_GIB} GiB (CUDA workspaces, allocator slack)")  # fmt: skip
    p.add_argument("--fused-elementwise", action=argparse.BooleanOptionalAction, default=None,
                   help="laden: the lean modules' elementwise math and the rotary embeddings as compiled fused "
                        "kernels (actor.fused_elementwise; default as in `laden sft`: on for laden with a GPU)")  # fmt: skip
    p.add_argument("--lean-activations", action=argparse.BooleanOptionalAction, default=None,
                   help="lean RMSNorms and gated MLPs (actor.lean_activations; default: on for laden, off for "
                        "plain, which runs Hugging Face's modules as they are)")  # fmt: skip
    p.add_argument("--min-stages", type=int, default=None, help="auto plan: at least this many stages")
    p.add_argument("--stage-layers", type=int, default=None, help="uniform plan: layers per backward stage")
    p.add_argument("--fused-layers", type=int, default=None, help="uniform plan: layers of the fused stage")
    p.add_argument(
        "--fwd-stage-layers", type=int, default=None, help="uniform plan: layers per forward stage"
    )
    p.add_argument("--pin-model", choices=["alloc", "register", "off"], default="alloc")
    p.add_argument("--optim-step", choices=["sync", "async"], default="async")
    p.add_argument("--optimizer-dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--optimizer", choices=["adam", "adam_bf16"], default="adam")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="compute dtype (default bf16 on GPU)")
    p.add_argument("--attn", choices=["auto", "sdpa", "eager"], default="auto")
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping (0 = off)")
    p.add_argument("--lr", type=float, default=1e-5, help="peak learning rate")
    p.add_argument(
        "--loss-chunk-size",
        type=int,
        default=1024,
        help="tokens per chunk of the chunked loss (actor.loss_chunk_size)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--joint-projections", action="store_true",
                   help="laden: q/k/v and gate/up as one GEMM each where the upload stacks their weights "
                        "(laden.model.patches.stacked; off by default, under measurement)")  # fmt: skip
    p.add_argument("--static-last-dims", action=argparse.BooleanOptionalAction, default=True,
                   help="laden: compile the fused elementwise functions with static last dimensions "
                        "(PatchOptions.static_last_dims in laden.model.patches.options, the default; "
                        "--no-static-last-dims: fully dynamic shapes)")  # fmt: skip
    p.add_argument("--tiny-layers", type=int, default=None,
                   help="--model tiny with this many decoder layers: with the reference plan's shape "
                        "(--fwd-stage-layers, --stage-layers 1, --fused-layers), a CPU measure of the host "
                        "work per step that feeds the GPU (Python, dispatch) at negligible compute")  # fmt: skip
    p.add_argument("--compile", action="store_true",
                   help="laden: torch.compile each decoder layer (actor.roundpipe.compile)")  # fmt: skip
    p.add_argument("--gc-freeze", action="store_true",
                   help="before the timed steps: collect, freeze what exists and stop the cyclic garbage "
                        "collector (does a collection pause stall the GPU's feed?)")  # fmt: skip
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for the whole run, seconds (Python's default 0.005): how long a "
                        "thread running Python may keep the GIL from the thread that feeds the GPU")  # fmt: skip
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, profile one more step: GPU kernel and copy busy time, top kernels")  # fmt: skip
    p.add_argument("--profile-cpu", action="store_true",
                   help="with --profile: also record host calls, and list those during the longest GPU gaps")  # fmt: skip
    p.add_argument(
        "--tiled-mlp-tokens", type=int, default=0, help="run each MLP over sequence tiles (0 = off)"
    )
    p.add_argument(
        "--host-mem-gib",
        type=float,
        default=128.0,
        help="laden: refuse to start when the predicted host memory exceeds this",
    )
    p.add_argument(
        "--host-overhead-gib",
        type=float,
        default=4.0,
        help="added to the prediction for the process itself (CUDA context, libraries)",
    )
    p.add_argument("--build", choices=["auto", "meta", "eager"], default="auto",
                   help="laden: build the model on the meta device and materialise it into the host store "
                        "(auto: for the Qwen3 shapes), or build it whole first (eager)")  # fmt: skip
    args = p.parse_args(argv)
    args.profile = args.profile or args.profile_cpu
    if args.gradient_checkpointing is not None and args.system == "laden":
        p.error("--gradient-checkpointing: the laden (roundpipe) engine recomputes what its plan says "
                "(--recompute-grain, --fused-layers); drop the flag")  # fmt: skip
    laden_only = args.lean_activations or args.fused_elementwise or args.tiled_mlp_tokens or args.compile
    if args.system == "plain" and (
        laden_only or args.optimizer != "adam" or args.optimizer_dtype != "float32"
    ):
        p.error("--system plain runs stock Hugging Face modules with fp32 torch.optim.AdamW: no --lean-activations, "
                "--fused-elementwise, --tiled-mlp-tokens, --compile, --optimizer or --optimizer-dtype")  # fmt: skip
    return args


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The model, random init; on the meta device (real buffers) when `on_meta(args)`: the laden
    engine then initialises it layer by layer straight into its host store. `plain`: the stock
    Hugging Face model (`build_hf_model`, no laden module imported)."""
    if args.system == "plain":
        return build_hf_model(args)
    from tiny import tiny_qwen3_config
    from transformers import AutoModelForCausalLM, Qwen3Config

    from laden.engine.roundpipe.host.memory import meta_params
    from laden.model.attention import set_attention

    torch.manual_seed(args.seed)
    if args.model == "tiny":
        layers = {} if args.tiny_layers is None else {"num_hidden_layers": args.tiny_layers}
        config = tiny_qwen3_config(vocab_size=128, **layers)
    else:
        config = Qwen3Config(**SHAPES[args.model])
    # fsdp: fp32 from the start, as `laden sft` loads a model (in actor.optimizer_dtype)
    dtype = torch.float32 if args.model == "tiny" or args.system == "fsdp" else torch.bfloat16
    if on_meta(args):
        where: Any = meta_params()
    elif args.system in RESIDENT and torch.cuda.is_available():
        where = torch.device("cuda", torch.cuda.current_device())  # random init on the CPU is one core
    else:
        where = contextlib.nullcontext()
    with where:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    set_attention(model, args.attn)
    if args.system == "fsdp":  # as the runtime patches it
        args.patches_api = apply_runtime_patches(model, args)
        return model
    from laden.model.patches.options import PatchOptions

    options = PatchOptions(  # this model's: actor.fused_elementwise and the two compile/GEMM choices
        fused=fused_elementwise(args),
        static_last_dims=args.static_last_dims,
        joint_projections=args.joint_projections,
    )
    if lean_activations(args):
        from laden.model.patches.lean_mlp import enable_lean_mlp
        from laden.model.patches.lean_norm import enable_lean_rmsnorm
        from laden.model.patches.sink_linear import enable_sink_linears

        enable_lean_rmsnorm(model, options=options)  # actor.lean_activations, as in `laden sft`
        enable_lean_mlp(model, options=options)
        enable_sink_linears(model, options=options)
    if fused_elementwise(args):  # actor.fused_elementwise
        from laden.model.patches.fused_rotary import enable_fused_rotary

        if not lean_activations(args):
            raise SystemExit(
                "train_throughput: --fused-elementwise needs the lean modules (drop --no-lean-activations)"
            )
        enable_fused_rotary(model, options=options)
    if args.tiled_mlp_tokens:
        from laden.model.patches.lean_norm import enable_lean_rmsnorm
        from laden.model.patches.tiled import enable_tiled_mlp

        enable_tiled_mlp(model, tile_tokens=args.tiled_mlp_tokens)  # actor.tiled_mlp_tokens:
        enable_lean_rmsnorm(model, options=options)  # both, as in `laden sft`
    return model


def apply_runtime_patches(model: torch.nn.Module, args: argparse.Namespace) -> str:
    """The model patches `laden sft`'s runtime applies (actor.lean_activations, actor.fused_elementwise,
    actor.tiled_mlp_tokens), through its own entry point; returns which one ran.

    `laden.model.patches.apply.apply_patches` where it exists (with this run's static last dims
    and joint projections where it takes them), else the trainer's former `apply_activation_knobs`
    (the same patches, then process-wide switches).
    """
    import importlib.util
    import inspect

    knobs: dict[str, Any] = dict(lean_activations=lean_activations(args), fused_elementwise=fused_elementwise(args),
                                 tiled_mlp_tokens=args.tiled_mlp_tokens or None)  # fmt: skip
    if importlib.util.find_spec("laden.model.patches.apply") is not None:
        from laden.model.patches.apply import apply_patches

        taken = inspect.signature(apply_patches).parameters
        extra = {"static_last_dims": args.static_last_dims, "joint_projections": args.joint_projections}
        apply_patches(model, **knobs, **{k: v for k, v in extra.items() if k in taken})
        return "laden.model.patches.apply.apply_patches"
    from types import SimpleNamespace

    from laden.sft.trainer import apply_activation_knobs  # the layout before laden.model.patches.apply

    apply_activation_knobs(model, SimpleNamespace(**knobs))
    return "laden.sft.trainer.apply_activation_knobs"


def lean_activations(args: argparse.Namespace) -> bool:
    """As `actor.lean_activations` resolves: on for laden's engines (roundpipe, fsdp), off for plain."""
    if args.lean_activations is not None:
        return args.lean_activations
    return args.system in ("laden", "fsdp")


def fused_elementwise(args: argparse.Namespace) -> bool:
    """As `actor.fused_elementwise` resolves: unset means on for laden's lean modules with a GPU."""
    if args.fused_elementwise is not None:
        return args.fused_elementwise
    return args.system in ("laden", "fsdp") and lean_activations(args) and torch.cuda.is_available()


def gradient_checkpointing(args: argparse.Namespace) -> bool | None:
    """Whether every decoder layer is recomputed (fsdp, plain: as asked, default off); None for laden,
    whose plan decides."""
    return None if args.system == "laden" else bool(args.gradient_checkpointing)


def on_meta(args: argparse.Namespace) -> bool:
    if args.system != "laden" or args.build == "eager":
        return False
    return args.build == "meta" or args.model != "tiny"


def make_steps(args: argparse.Namespace, vocab_size: int, num_steps: int) -> list[list]:
    """Random packed micro-batches: `num_seqs / num_microbatch` sequences per row."""
    from laden.data.batch import pack_samples

    gen = torch.Generator().manual_seed(args.seed)
    per_row = max(1, args.num_seqs // args.num_microbatch)
    steps = []
    for _ in range(num_steps):
        rows = []
        for start in range(0, args.num_seqs, per_row):
            samples = []
            for _ in range(min(per_row, args.num_seqs - start)):
                ids = torch.randint(0, vocab_size, (args.seq_len,), generator=gen).tolist()
                samples.append((ids, [1] * len(ids)))
            rows.append(pack_samples(samples))
        steps.append(rows)
    return steps


def optim_settings(args: argparse.Namespace):
    from laden.optim import OptimSettings

    return OptimSettings(type=args.optimizer, lr=args.lr, weight_decay=0.01, gradient_clipping=args.clip,
                         total_steps=args.steps + args.warmup)  # fmt: skip


def compute_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    return DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)


def laden_settings(args: argparse.Namespace, model: torch.nn.Module, device: torch.device) -> dict:
    """The `RoundPipeEngine` arguments of this run (also what the host-memory prediction reads)."""
    from laden.engine.roundpipe import ModelExecutePlan

    limit = args.model_memory_limit
    if limit is None and device.type == "cuda":
        limit = args.gpu_mem_cap_gib - HEADROOM_GIB
    plan = None
    if args.stage_layers is not None:  # pipeline layers: embedding + decoder layers + head
        plan = ModelExecutePlan.uniform(
            int(cast(Any, model).config.num_hidden_layers) + 2, stage_layers=args.stage_layers,
            fused_layers=args.fused_layers, fwd_stage_layers=args.fwd_stage_layers,
        )  # fmt: skip
    return dict(
        optim=optim_settings(args), compute_dtype=compute_dtype(args, device),
        optimizer_dtype=DTYPES[args.optimizer_dtype], recompute_grain=args.recompute_grain,
        model_memory_limit=limit, pin_model=args.pin_model, optim_step=args.optim_step, execute_plan=plan,
        min_stages=args.min_stages, loss_chunk_size=args.loss_chunk_size,
        max_tokens_per_mb=args.seq_len * max(1, args.num_seqs // args.num_microbatch),
    )  # fmt: skip


def fsdp_config(args: argparse.Namespace, device: torch.device):
    """The `LadenConfig` of an `actor.backend: fsdp:d1` run with this run's knobs (the rest: defaults)."""
    from laden.config import config_from_dict

    dtype = {v: k for k, v in DTYPES.items()}[compute_dtype(args, device)]
    actor = {
        "backend": "fsdp:d1", "dtype": dtype, "optimizer_dtype": args.optimizer_dtype,
        "gradient_checkpointing": bool(args.gradient_checkpointing), "attn_impl": args.attn,
        "chunked_loss": True, "loss_chunk_size": args.loss_chunk_size,
        "lean_activations": lean_activations(args), "fused_elementwise": fused_elementwise(args),
        "tiled_mlp_tokens": args.tiled_mlp_tokens or None,
        "optimizer": {"type": args.optimizer, "lr": args.lr, "weight_decay": 0.01, "gradient_clipping": args.clip},
    }  # fmt: skip
    return config_from_dict({"seed": args.seed, "actor": actor})


def build_engine(args: argparse.Namespace, model: torch.nn.Module, device: torch.device):
    if args.system == "plain":
        from plain_hf import PlainHF

        return PlainHF(
            model, device=device, compute_dtype=compute_dtype(args, device), lr=args.lr, weight_decay=0.01,
            clip=args.clip, gradient_checkpointing=bool(args.gradient_checkpointing),
        )  # fmt: skip
    if args.system == "fsdp":  # as `laden sft` builds it
        from laden.engine.factory import build_engine as build_laden_engine

        total_steps = args.warmup + args.steps + args.profile
        return build_laden_engine(fsdp_config(args, device), model, total_steps=total_steps, device=device)
    from laden.engine.roundpipe import RoundPipeEngine

    return RoundPipeEngine(
        model, num_microbatch=args.num_microbatch, devices=[device] if device.type == "cpu" else None,
        compile_backend="inductor" if args.compile else None, **laden_settings(args, model, device),
    )  # fmt: skip


def predict_host(args: argparse.Namespace, model: torch.nn.Module, device: torch.device, *,
                 pinned: bool | None = None, **overrides: Any) -> dict:  # fmt: skip
    """Predicted peak host memory of the laden run, by kind (nothing is allocated).

    `pinned`: whether buffers are page-locked (default: a GPU is present); `overrides` replace
    engine settings (`optimizer=`, `optim_step=`, `pin_model=`: what-if for the refusal message).
    """
    from laden.engine.roundpipe.host.memory import bytes_per_param, predict_engine_host_bytes

    args = argparse.Namespace(**{**vars(args), **overrides})
    settings = laden_settings(args, model, device)
    by_kind = predict_engine_host_bytes(
        model, pinned=device.type == "cuda" if pinned is None else pinned,
        num_microbatches=args.num_microbatch, **settings,
    )  # fmt: skip
    total = sum(by_kind.values()) + args.host_overhead_gib * GIB
    num_params = sum(p.numel() for p in model.parameters())
    return {
        "predicted_host_gib": round(total / GIB, 2),
        "host_mem_gib": args.host_mem_gib,
        "mem_available_gib": mem_available_gib(),
        "bytes_per_param": round(bytes_per_param(by_kind, num_params), 3),
        "by_kind_gib": {k: round(v / GIB, 2) for k, v in by_kind.items() if v >= GIB / 200},
        "by_kind_bytes": {k: v for k, v in by_kind.items() if v},
        "host_overhead_gib": args.host_overhead_gib,
        "setting": {"optimizer": args.optimizer, "optim_step": args.optim_step, "pin_model": args.pin_model},
    }


KNOBS = (  # what lowers host memory, the biggest saving first (tried cumulatively)
    ("--optimizer", "optimizer", "adam_bf16"),  # 10 B/param instead of 18 (fp32 master + fp32 Adam)
    ("--optim-step", "optim_step", "sync"),  # no second weight buffer and gradient inbox
    ("--pin-model", "pin_model", "register"),  # no power-of-two rounding of the pinned weights
    ("--pin-model", "pin_model", "off"),  # nothing page-locked (slowest uploads)
)


def check_host_memory(args: argparse.Namespace, model: torch.nn.Module, device: torch.device) -> dict:
    """Print the prediction as one JSON line; exit (SystemExit) naming the knobs to turn if it does not fit."""
    pred = predict_host(args, model, device)
    print(json.dumps(pred), flush=True)
    available = pred["mem_available_gib"]
    if available is not None and available < pred["predicted_host_gib"] <= args.host_mem_gib:
        print(f"train_throughput: MemAvailable is {available} GiB now, below the predicted "
              f"{pred['predicted_host_gib']} GiB; going on with --host-mem-gib {args.host_mem_gib} "
              "(memory on the GPU machine can show up late)", file=sys.stderr, flush=True)  # fmt: skip
    if pred["predicted_host_gib"] <= args.host_mem_gib:
        return pred
    fixes: list[str] = []
    changed: dict[str, Any] = {}
    for _, key, value in KNOBS:
        if getattr(args, key) == value:
            continue
        changed[key] = value
        gib = predict_host(args, model, device, **changed)["predicted_host_gib"]
        flags = " ".join(f"{f} {changed[k]}" for f, k, v in KNOBS if changed.get(k) == v)
        fixes.append(f"{flags}: {gib} GiB")
    raise SystemExit(
        f"train_throughput: {args.model} with --optimizer {args.optimizer} --optim-step {args.optim_step} "
        f"--pin-model {args.pin_model} needs about {pred['predicted_host_gib']} GiB of host memory "
        f"(by kind: {pred['by_kind_gib']}), more than --host-mem-gib {args.host_mem_gib}: the OOM killer would "
        f"end it. Predicted with other settings: {'; '.join(fixes) or 'none left to turn'}"
    )


def mem_available_gib() -> float | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return round(int(line.split()[1]) * 1024 / GIB, 2)
    except OSError:
        pass
    return None


def is_capped(args: argparse.Namespace) -> bool:
    """Whether the GPU cap applies: always to laden's offloading engine, to resident ones with --cap-plain."""
    return args.system not in RESIDENT or args.cap_plain


def cap_gpu(args: argparse.Namespace, device: torch.device) -> None:
    if device.type != "cuda" or not is_capped(args):
        return
    for i in range(torch.cuda.device_count()):
        total = torch.cuda.get_device_properties(i).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_mem_cap_gib * GIB / total), i)


def finish(engine) -> None:
    """Wait for everything a step queued (the async engine's optimizer thread, the GPU)."""
    pipe = getattr(engine, "pipe", None)
    if pipe is not None:
        pipe.jobs.drain()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def progress(t0: float, what: str) -> None:
    """One timestamped line on stderr per phase and step: a run cut by a timeout still shows where it was."""
    print(f"[train_throughput +{time.perf_counter() - t0:.1f}s] {what}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    cap_gpu(args, device)
    model = build_model(args)
    num_params = sum(p.numel() for p in model.parameters())  # tied weights once
    layer_params = layer_forward_params(model)  # before an engine takes the parameters over
    progress(t0, f"model built ({num_params / 1e9:.2f}B parameters)")
    prediction = check_host_memory(args, model, device) if args.system == "laden" else None
    steps = make_all_steps(
        args, int(cast(Any, model).config.vocab_size), args.warmup + args.steps + args.profile
    )
    if args.system in RESIDENT:  # resident engines take batches on their device (laden sft moves them too)
        steps = [[mb.to(device) for mb in mbs] for mbs in steps]
    engine = build_engine(args, model, device)
    progress(t0, f"engine built: {type(engine).__name__}, {getattr(engine, 'plan', 'resident')}")
    history = []  # every step's metrics, read after the timing (device tensors for resident engines)
    for i, mbs in enumerate(steps[: args.warmup]):
        history.append(engine.train_batch(mbs, global_num_loss_tokens=sum(mb.num_loss_tokens for mb in mbs)))
        progress(t0, f"warm-up step {i + 1}/{args.warmup} queued")
    finish(engine)
    progress(t0, "warm-up done")
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    jobs = getattr(getattr(engine, "pipe", None), "jobs", None)
    busy_before = dict(jobs.busy_s) if jobs is not None else {}
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
        gc.disable()
    start = time.perf_counter()
    marks = [start]  # when each step's call returned (laden's call ends at a device synchronisation)
    for i, mbs in enumerate(steps[args.warmup : args.warmup + args.steps]):
        history.append(engine.train_batch(mbs, global_num_loss_tokens=sum(mb.num_loss_tokens for mb in mbs)))
        marks.append(time.perf_counter())
        progress(t0, f"step {i + 1}/{args.steps} queued")
    finish(engine)
    seconds = time.perf_counter() - start
    progress(t0, f"timed steps done: {seconds / max(args.steps, 1):.3f} s/step")
    host_busy = (
        {f"{k}_s_per_step": round((v - busy_before[k]) / args.steps, 3) for k, v in jobs.busy_s.items()}
        if jobs
        else None
    )
    profile = profile_step(engine, steps[-1], with_cpu=args.profile_cpu) if args.profile else None
    tokens = sum(mb.num_tokens for mbs in steps[args.warmup : args.warmup + args.steps] for mb in mbs)
    tok_s = tokens / seconds
    losses = [float(m["loss"]) for m in history]
    grad_norms = [float(m["grad_norm"]) for m in history if "grad_norm" in m]
    uploads_pinned = _uploads_pinned(engine)
    problems = _problems(losses, grad_norms, uploads_pinned, args.pin_model)
    recomputed, checkpointing_problem = recompute_of(args, engine, model)
    problems += [checkpointing_problem] if checkpointing_problem else []
    return {
        "name": f"train_throughput/{args.system}",
        "model": args.model,
        "system": args.system,
        "engine": type(engine).__name__,
        "mode": step_mode(args),
        "shape": {
            "seq_len": args.seq_len,
            "num_seqs": args.num_seqs,
            "num_microbatch": args.num_microbatch,
            "recompute_grain": args.recompute_grain if args.system == "laden" else None,
            "gradient_checkpointing": gradient_checkpointing(args),
            "optim_step": args.optim_step if args.system == "laden" else "sync",
            "clip": args.clip,
            "pin_model": args.pin_model,
            "optimizer": args.optimizer if args.system != "plain" else "torch.optim.AdamW(fused=True)",
            "optimizer_dtype": args.optimizer_dtype if args.system != "plain" else "float32",
            "attn": args.attn if args.system != "plain" else "sdpa",
            "loss_chunk_size": args.loss_chunk_size if args.system != "plain" else None,
            "compile": args.compile,
            "lean_activations": lean_activations(args),
            "fused_elementwise": fused_elementwise(args),
            "gc_freeze": args.gc_freeze,
            "joint_projections": args.joint_projections,
            "static_last_dims": args.static_last_dims,
            "switch_interval": sys.getswitchinterval(),
            "model_memory_limit": (
                laden_settings(args, model, device)["model_memory_limit"] if args.system == "laden" else None
            ),
        },  # fmt: skip
        "plan": repr(getattr(engine, "plan", None)),
        "patches_api": getattr(args, "patches_api", None),
        **patch_counts(args, model),
        "fused_layers": _fused_layers(engine),
        "step_call_s": [round(b - a, 3) for a, b in zip(marks, marks[1:])],
        "valid": not problems,
        "problems": problems,
        "tokens_per_s": round(tok_s, 1),
        "step_s": round(seconds / args.steps, 4),
        "num_params": num_params,
        **utilisation(tokens_per_s=tok_s, num_params=num_params, layer_params=layer_params,
                      recomputed=[recomputed], attn_fwd_flops=attention_forward_flops(model.config, args.seq_len)),
        "last_loss": losses[-1],
        "losses": losses,
        "grad_norms": grad_norms,
        "uploads_pinned": uploads_pinned,
        "host_thread_busy": host_busy,
        "profile": profile,
        "predicted_host_gib": prediction["predicted_host_gib"] if prediction else None,
        "host_bytes_by_kind": _host_bytes_by_kind(engine),
        **memory_peaks(engine),
        **run_facts(args, device),
    }  # fmt: skip


def run_facts(args: argparse.Namespace, device: torch.device) -> dict:
    """What every result records about where it ran (also a failed run's)."""
    return {
        "git_commit": git_commit(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        # the laden system's pool (roundpipe streams its stages through every visible GPU)
        "gpus_visible": torch.cuda.device_count() if device.type == "cuda" else 0,
        "gpu_mem_cap_gib": args.gpu_mem_cap_gib if device.type == "cuda" and is_capped(args) else None,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "torch": torch.__version__,
        "transformers": _transformers_version(),
    }


def build_hf_model(args: argparse.Namespace) -> torch.nn.Module:
    """The stock Hugging Face model of `--system plain` (no laden module involved)."""
    from plain_hf import build_model as build_stock
    from tiny import tiny_qwen3_config
    from transformers import Qwen3Config

    if args.model == "tiny":
        layers = {} if args.tiny_layers is None else {"num_hidden_layers": args.tiny_layers}
        config = tiny_qwen3_config(vocab_size=128, **layers)
    else:
        config = Qwen3Config(**SHAPES[args.model])
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    return build_stock(config, device=device, seed=args.seed)


def make_all_steps(args: argparse.Namespace, vocab_size: int, num_steps: int) -> list[list]:
    """The micro-batches of every step: unpacked rows for plain, packed rows for laden's engines."""
    if args.system != "plain":
        return make_steps(args, vocab_size, num_steps)
    from plain_hf import make_steps as make_rows

    return make_rows(vocab_size=vocab_size, seq_len=args.seq_len, num_seqs=args.num_seqs,
                     num_microbatch=args.num_microbatch, num_steps=num_steps, seed=args.seed)  # fmt: skip


def step_mode(args: argparse.Namespace) -> str:
    """The optimizer step of this run, in words (RESULTS names it next to every figure)."""
    step = "sync"
    if args.system == "laden" and args.optim_step == "async":
        step = "async (one-step-stale)"
    return f"{step} step, " + (f"clip {args.clip:g}" if args.clip > 0 else "no clip")


def recompute_of(args: argparse.Namespace, engine, model: torch.nn.Module) -> tuple[list[int], str | None]:
    """Pipeline layers recomputed in backward (0 = embedding, 1..L decoder layers, L + 1 = head), and
    a problem when the model's own checkpointing state contradicts what the run asked for.

    laden's roundpipe engine: from its plan. Otherwise every decoder layer when gradient
    checkpointing is on (Hugging Face's `is_gradient_checkpointing`, where the model reports it).
    """
    plan = getattr(engine, "plan", None)
    if plan is not None:
        return recomputed_layers(plan.bwd_plan, fused_stage_recomputes=args.recompute_grain == "layer"), None
    asked = bool(gradient_checkpointing(args))
    on = asked
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers >= 5.2x, before
        if hasattr(type(model), name):
            on = bool(getattr(model, name))
            break
    problem = None
    if on != asked:
        problem = f"gradient checkpointing asked {asked} but the model reports is_gradient_checkpointing={on}"
    num_layers = int(cast(Any, model).config.num_hidden_layers)
    return (list(range(1, num_layers + 1)) if on else []), problem


def patch_counts(args: argparse.Namespace, model: torch.nn.Module) -> dict:
    """How many modules each laden patch changed (None for plain, which must not import laden)."""
    keys = ("tiled_mlps", "lean_rmsnorms", "lean_mlps", "sink_linears", "fused_rotary_attentions")
    if args.system == "plain":
        return dict.fromkeys(keys)
    from laden.model.patches import fused_rotary, lean_mlp, lean_norm, sink_linear, tiled

    modules = list(model.modules())
    return dict(zip(keys, (
        sum(tiled.class_swap().applied(m) for m in modules),
        sum(lean_norm.class_swap().applied(m) for m in modules),
        sum(lean_mlp.is_lean_mlp(m) for m in modules),
        sum(sink_linear.is_sink_linear(m) for m in modules),
        sum(fused_rotary.is_fused_rotary(m) for m in modules),
    )))  # fmt: skip


def _fused_layers(engine) -> int | None:
    """Pipeline layers of the fused stage (no backward recompute); None for a resident engine."""
    plan = getattr(engine, "plan", None)
    return len(plan.bwd_plan[0]) if plan is not None else None


def attention_flops_per_token(config: Any, seq_len: int, factor: int) -> float:
    """Causal attention FLOPs per token over all layers: `factor` S q / token / layer (see the docstring)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return factor * seq_len * heads * head_dim * config.num_hidden_layers


def profile_step(engine, mbs: list, *, with_cpu: bool = False) -> dict:
    """One more step under the CUDA profiler: how much of its wall time the GPU computed or copied.

    Busy times are unions of the intervals of kernels (compute), host-to-device and
    device-to-host copies over all streams. A step whose kernel busy time is close to its wall
    time is compute-bound; a large gap is time the GPU waited (for uploads, the host optimizer
    or the Python thread feeding it). `with_cpu` also records host calls (slower: the launch-bound
    gaps grow) to say what happened during the longest gaps.
    """
    if not torch.cuda.is_available():
        return {"skipped": "no GPU"}
    from torch.profiler import ProfilerActivity, profile

    try:
        finish(engine)
        start = time.perf_counter()
        activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if with_cpu else [])
        with profile(activities=activities) as prof:
            engine.train_batch(mbs, global_num_loss_tokens=sum(mb.num_loss_tokens for mb in mbs))
            finish(engine)
        wall = time.perf_counter() - start
        spans: dict[str, list[tuple[float, float]]] = {"kernel": [], "h2d": [], "d2h": [], "other_copy": []}
        totals: dict[str, float] = {}
        counts: dict[str, int] = {}  # launches per kernel name
        named: list[tuple[float, float, str]] = []  # kernels, for the idle gaps between them
        copies: list[tuple[float, float, str]] = []
        host: list[tuple[float, float, str, int]] = []  # host calls (--profile-cpu)
        for ev in prof.events():
            name, t_start, t_end = ev.name, ev.time_range.start / 1e6, ev.time_range.end / 1e6
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                host.append((t_start, t_end, name, ev.thread))
                continue
            low = name.lower()
            kind = ("h2d" if "htod" in low else "d2h" if "dtoh" in low else "other_copy") if (
                "memcpy" in low or "memset" in low) else "kernel"  # fmt: skip
            spans[kind].append((t_start, t_end))
            if kind == "kernel":
                totals[name] = totals.get(name, 0.0) + (t_end - t_start)
                counts[name] = counts.get(name, 0) + 1
                named.append((t_start, t_end, name))
            else:
                copies.append((t_start, t_end, name))
        top = sorted(totals.items(), key=lambda kv: -kv[1])[:10]
        by_category: dict[str, float] = {}
        for name, sec in totals.items():
            category = kernel_category(name)
            by_category[category] = by_category.get(category, 0.0) + sec
        return {
            "wall_s": round(wall, 3),
            **{f"{k}_busy_s": round(_union_seconds(v), 3) for k, v in spans.items()},
            "kernel_sum_s": round(sum(totals.values()), 3),
            "kernel_s_by_category": {
                k: round(v, 3) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])
            },
            "top_kernels": [[name[:80], round(sec, 3)] for name, sec in top],
            "top_kernels_by_category": top_by_category(totals),
            "kernels": len(named),
            "most_launched": [
                [name[:80], n, round(totals[name] / n * 1e6, 1)]
                for name, n in sorted(counts.items(), key=lambda kv: -kv[1])[:20]
            ],  # [kernel, launches, mean us]
            "kernel_gaps": kernel_gaps(named),
            **({"gaps_explained": explain_gaps(named, copies, host)} if with_cpu else {}),
        }
    except Exception as error:  # the timed result stands without the profile
        return {"error": f"{type(error).__name__}: {error}"[:500]}


KERNEL_CATEGORIES = (  # (category, name fragments), first match wins; names are lower-cased
    ("attention", ("flash", "fmha", "attention", "varlen")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul")),
    ("reduction", ("reduce", "norm", "softmax", "cross_entropy", "nll_loss", "sum_kernel")),
    ("copy_cast", ("copy", "cat_", "index", "gather", "scatter", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise", "triton")),
)


def kernel_category(name: str) -> str:
    """Coarse kind of a CUDA kernel by its name (what share of the step each kind of work takes)."""
    low = name.lower()
    for category, fragments in KERNEL_CATEGORIES:
        if any(f in low for f in fragments):
            return category
    return "other"


def top_by_category(totals: dict[str, float], top: int = 4) -> dict[str, list]:
    """The `top` kernels of each category by total seconds: which casts, copies or elementwise
    kernels the category's time is made of."""
    grouped: dict[str, list[tuple[str, float]]] = {}
    for name, sec in totals.items():
        grouped.setdefault(kernel_category(name), []).append((name, sec))
    return {
        category: [[name[:100], round(sec, 4)] for name, sec in sorted(kernels, key=lambda kv: -kv[1])[:top]]
        for category, kernels in grouped.items()
    }


GAP_BUCKETS_US = (10, 50, 200, 1000, 10000)


def kernel_gaps(kernels: list[tuple[float, float, str]], top: int = 8) -> dict:
    """Where the GPU computed nothing between its first and last kernel: idle seconds by gap
    length (short gaps, many of them, mean the launching thread is the bound; long ones mean a
    wait: an upload, a host result, a synchronisation), and the longest gaps with the kernels on
    either side and their place in the step (0 = its first kernel, 1 = its last)."""
    if not kernels:
        return {}
    first, last = min(kernels)[0], max(end for _, end, _ in kernels)
    gaps = _gaps(kernels)
    buckets = {f"<{b}us": 0.0 for b in GAP_BUCKETS_US} | {f">={GAP_BUCKETS_US[-1]}us": 0.0}
    counts = dict.fromkeys(buckets, 0)
    for gap, *_ in gaps:
        key = next((f"<{b}us" for b in GAP_BUCKETS_US if gap * 1e6 < b), f">={GAP_BUCKETS_US[-1]}us")
        buckets[key] += gap
        counts[key] += 1
    span = max(last - first, 1e-9)
    return {
        "idle_s": round(sum(g for g, *_ in gaps), 4),
        "idle_s_by_length": {k: round(v, 4) for k, v in buckets.items()},
        "gaps_by_length": counts,
        "longest": [
            {"ms": round(g * 1e3, 2), "at": round((t - first) / span, 3), "after": a[:60], "before": b[:60]}
            for g, t, a, b in sorted(gaps, reverse=True)[:top]
        ],
    }


def _gaps(kernels: list[tuple[float, float, str]]) -> list[tuple[float, float, str, str]]:
    """(length, start, kernel before, kernel after) of every interval in which no kernel ran."""
    kernels = sorted(kernels)
    gaps: list[tuple[float, float, str, str]] = []
    end, before = kernels[0][1], kernels[0][2]
    for start, stop, name in kernels[1:]:
        if start > end:
            gaps.append((start - end, end, before, name))
        if stop > end:
            end, before = stop, name
    return gaps


def explain_gaps(
    kernels: list[tuple[float, float, str]],
    copies: list[tuple[float, float, str]],
    host: list[tuple[float, float, str, int]],
    top: int = 6,
    min_host_ms: float = 0.3,
) -> list[dict]:
    """What else happened during the longest idle gaps between kernels (`--profile-cpu`): the copies
    in flight (a GPU waiting for a transfer) and the host calls of at least `min_host_ms` that
    overlapped it, on which thread (a host thread blocked in a call stops feeding the GPU).
    Times are milliseconds from the gap's start."""

    def rel(a: float, b: float, t0: float) -> list[float]:
        return [round((a - t0) * 1e3, 2), round((b - t0) * 1e3, 2)]

    out = []
    for gap, t0, before, after in sorted(_gaps(kernels), reverse=True)[:top]:
        t1 = t0 + gap
        overlapping = [c for c in copies if c[0] < t1 and c[1] > t0]
        calls = sorted(
            (h for h in host if h[0] < t1 and h[1] > t0 and (h[1] - h[0]) * 1e3 >= min_host_ms),
            key=lambda h: h[0] - h[1],
        )[:8]
        out.append({
            "ms": round(gap * 1e3, 2), "after": before[:50], "before": after[:50],
            "copies": [[name[:40], *rel(a, b, t0)] for a, b, name in overlapping[:6]],
            "host_calls": [[name[:50], thread, *rel(a, b, t0)] for a, b, name, thread in calls],
        })  # fmt: skip
    return out


def _union_seconds(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _problems(
    losses: list[float], grad_norms: list[float], uploads_pinned: bool | None, pin_model: str
) -> list[str]:
    """Why a result is not valid (empty when it is)."""
    problems = []
    for name, values in (("loss", losses), ("grad_norm", grad_norms)):
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            problems.append(f"{name} is not finite from step {bad[0]} on (warm-up included): {values}")
    if uploads_pinned is False and pin_model != "off":
        problems.append(f"pin_model={pin_model!r} but the weights are uploaded from pageable host memory")
    return problems


def _host_bytes_by_kind(engine) -> dict | None:
    """What the laden engine holds in host memory after the run, by kind (None for `plain`)."""
    measure = getattr(engine, "host_bytes_by_kind", None)
    return {k: v for k, v in measure().items() if v} if measure else None


def _uploads_pinned(engine) -> bool | None:
    """Whether every upload copy of the laden engine is page-locked (None: no GPU, or not laden)."""
    pipe = getattr(engine, "pipe", None)
    if pipe is None or not torch.cuda.is_available():
        return None
    return all(pipe.store.page_locked(view) for hp in pipe.store.params for view in hp.uploads)


def memory_peaks(engine=None) -> dict:
    """GPU peaks, host RSS peak and page-locked host memory.

    Page-locked memory comes two ways: through PyTorch's pinned allocator (laden's upload copies
    with pin_model=alloc, activations parked between stages), reported by
    `torch.cuda.host_memory_stats()` with each block rounded up to a power of two; and page-locked
    in place (`cudaHostRegister`: gradient inboxes, pin_model=register), which only the engine
    knows about. The second kind is ordinary process memory, already in the RSS; the first is
    added to the RSS for `peak_host_gib` (an upper bound if the driver's pages also show in RSS).
    """
    rss_gib = _peak_rss_gib()
    allocator_gib = registered_gib = 0.0
    out = {}
    if torch.cuda.is_available():
        out["peak_gpu_allocated_gib"] = round(max(torch.cuda.max_memory_allocated(i) for i in
                                                  range(torch.cuda.device_count())) / GIB, 3)  # fmt: skip
        out["peak_gpu_reserved_gib"] = round(max(torch.cuda.max_memory_reserved(i) for i in
                                                 range(torch.cuda.device_count())) / GIB, 3)  # fmt: skip
        # Allocations that found no free block under the cap: each retry frees the cache and
        # synchronises the device, stalls a memory-tight plan shows here first.
        out["cuda_alloc_retries"] = sum(
            torch.cuda.memory_stats(i).get("num_alloc_retries", 0) for i in range(torch.cuda.device_count())
        )
        allocator_gib = pinned_allocator_bytes(torch.cuda.host_memory_stats()) / GIB
        store = getattr(getattr(engine, "pipe", None), "store", None)
        registered_gib = getattr(store, "registered_bytes", 0) / GIB
    pinned_gib = allocator_gib + registered_gib
    out.update(peak_rss_gib=round(rss_gib, 3), pinned_gib=round(pinned_gib, 3),
               pinned_allocator_gib=round(allocator_gib, 3), pinned_registered_gib=round(registered_gib, 3),
               peak_host_gib=round(rss_gib + allocator_gib, 3))  # fmt: skip
    return out


def pinned_allocator_bytes(stats: dict) -> int:
    """Peak bytes held by PyTorch's pinned host allocator, from `torch.cuda.host_memory_stats()`.

    Its keys are `allocated_bytes.{current,peak,...}` (flattened); there is no `reserved_bytes`
    key, which is why an earlier version of this script always reported 0.
    """
    for key in ("allocated_bytes.peak", "allocated_bytes.current"):
        if key in stats:
            return int(stats[key])
    nested = stats.get("allocated_bytes")
    if isinstance(nested, dict):
        return int(nested.get("peak") or nested.get("current") or 0)
    return 0


def _peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / GIB
    return 0.0


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def main(argv: list[str] | None = None) -> dict:
    """Print the result as one JSON line; exit non-zero (SystemExit) if it is not valid."""
    args = parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    laden_preloaded = _laden_modules() > 0
    try:
        result = run(args)
    except (torch.OutOfMemoryError, RuntimeError) as error:
        kind = oom_kind(error)
        if kind is None:
            raise
        result = failed_result(args, kind, error)
    if args.system == "plain":  # plain PyTorch must not run laden code; unknown if laden was loaded before
        result["laden_imported"] = None if laden_preloaded else _laden_modules() > 0
        if result["laden_imported"]:
            result["problems"].append("--system plain imported laden modules: not plain PyTorch")
            result["valid"] = False
    print(json.dumps(result), flush=True)
    if not result["valid"]:
        raise SystemExit("train_throughput: INVALID RESULT: " + "; ".join(result["problems"]))
    return result


def _laden_modules() -> int:
    return sum(1 for name in sys.modules if name == "laden" or name.startswith("laden."))


def oom_kind(error: BaseException) -> str | None:
    """'gpu_oom' or 'host_oom' for an allocator's out-of-memory error, None for anything else."""
    text = f"{type(error).__name__}: {error}".lower()
    if (
        isinstance(error, torch.OutOfMemoryError)
        or "cuda out of memory" in text
        or "cuda error: out of memory" in text
    ):
        return "gpu_oom"
    if "defaultcpuallocator" in text or "can't allocate memory" in text:
        return "host_oom"
    return None


def failed_result(args: argparse.Namespace, kind: str, error: BaseException) -> dict:
    """The JSON object of a run that stopped on an out-of-memory error: what ran, where, and the peaks."""
    message = f"{type(error).__name__}: {error}"[:2000]
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    return {
        "name": f"train_throughput/{args.system}", "model": args.model, "system": args.system,
        "mode": step_mode(args),
        "shape": {"seq_len": args.seq_len, "num_seqs": args.num_seqs, "num_microbatch": args.num_microbatch,
                  "gradient_checkpointing": gradient_checkpointing(args),
                  "recompute_grain": args.recompute_grain if args.system == "laden" else None},
        "valid": False, "problems": [f"{kind}: {message}"], "error": message, "error_kind": kind,
        "tokens_per_s": None, "mfu": None, "hfu": None,
        **memory_peaks(), **run_facts(args, device),
    }  # fmt: skip


if __name__ == "__main__":
    main()
