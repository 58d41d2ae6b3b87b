"""Supervised fine-tuning: the loop that turns a config into optimizer steps.

One optimizer step = one global batch of `train_dataset.batch_size` sequences, split
into token-budget micro-batches (`actor.mb_spec`), handed to the engine together with the
global loss-token count. The loop itself does little on purpose: everything that decides
memory lives in the data path (budget, packing) and the engine. It syncs with the device
once per logged step, to read the metrics.

Nothing is lost on failure: checkpoints are atomic and resume restores the data position
and every RNG, and the run directory receives the resolved config, the data statistics
(how many samples the length policy filtered or truncated) and one JSON line of metrics
per logged step.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from laden.config import (
    AllocationMode,
    ConfigError,
    DatasetConfig,
    LadenConfig,
    dump_config,
    run_dir,
    validate_against_model,
)
from laden.data import (
    GlobalBatchIterator,
    PackedBatch,
    build_sft_samples,
    load_records,
    pack_samples,
    partition_microbatches,
)
from laden.engine.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from laden.engine.factory import DTYPES, build_engine, launched_world_size
from laden.engine.local import default_device
from laden.memory.oom import TrainingOOMError, is_oom, release_cached_memory
from laden.model.hf.loading import load_causal_lm, load_tokenizer

log = logging.getLogger("laden.sft")


@dataclass(kw_only=True, slots=True)
class SFTResult:
    """What a finished run reports."""

    run_dir: Path
    """Directory with config, metrics, checkpoints and the exported model."""
    num_steps: int
    """Optimizer steps taken in total (including those before a resume)."""
    first_loss: float | None
    """Loss of the first step this process ran."""
    last_loss: float | None
    """Loss of the last step."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def budget(cfg: LadenConfig) -> int:
    """Tokens per micro-batch: `actor.mb_spec.max_tokens_per_mb` or, unset, `train_dataset.max_length`."""
    return cfg.actor.mb_spec.max_tokens_per_mb or cfg.train_dataset.max_length


def prepare_data(ds: DatasetConfig, tokenizer: Any, out_dir: Path, name: str, *, write: bool = True):
    """Tokenize a dataset, apply its length policy and (if `write`) save the counts to `<name>_data_stats.json`."""
    records = load_records(ds.path, split=ds.split)
    samples, stats = build_sft_samples(
        records,
        tokenizer,
        max_length=ds.max_length,
        length_policy=ds.length_policy,
        prompt_key=ds.prompt_key,
        completion_key=ds.completion_key,
        messages_key=ds.messages_key,
    )
    stats_path = out_dir / f"{name}_data_stats.json"
    if write:
        stats_path.write_text(json.dumps(stats.to_dict(), indent=2))
    log.info("%s_dataset: %s", name, stats.to_dict())
    if stats.num_filtered or stats.num_truncated:
        log.warning(
            "%s_dataset.max_length=%d: %d samples filtered, %d truncated (policy %r); see %s",
            name,
            ds.max_length,
            stats.num_filtered,
            stats.num_truncated,
            ds.length_policy,
            stats_path,
        )
    if len(samples) < ds.batch_size:
        raise ValueError(
            f"{name}_dataset.batch_size={ds.batch_size} but only {len(samples)} samples remain after the "
            f"length policy; lower {name}_dataset.batch_size or raise {name}_dataset.max_length"
        )
    return samples


def loss_tokens(samples, indices: list[int]) -> int:
    """Tokens that carry a loss (a label) in these samples: the global normaliser of a step."""
    return sum(sum(samples[i][1][1:]) for i in indices)


def shard_for_rank(samples, indices: list[int], dp_rank: int, dp_size: int) -> list[int]:
    """This data-parallel rank's share of a global batch, balanced by tokens (longest first, to the lightest rank)."""
    if dp_size == 1:
        return indices
    loads = [0] * dp_size
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(indices, key=lambda i: (-len(samples[i][0]), i)):
        r = min(range(dp_size), key=lambda r: (loads[r], r))
        loads[r] += len(samples[i][0])
        shares[r].append(i)
    return sorted(shares[dp_rank])


def step_micro_batches(
    cfg: LadenConfig, samples, indices: list[int], device: torch.device, tokens_per_mb: int
) -> list[PackedBatch]:
    """Pack the given samples into token-budget micro-batches on `device`."""
    seqlens = [len(samples[i][0]) for i in indices]
    bins = partition_microbatches(
        seqlens,
        max_tokens_per_mb=tokens_per_mb,
        n_mbs=cfg.actor.mb_spec.n_mbs,
        algorithm=cfg.actor.mb_spec.packing_algorithm,
    )
    packed = [pack_samples([samples[indices[j]] for j in b]) for b in bins]
    return [p.to(device, non_blocking=True) for p in packed]


def train_step(cfg: LadenConfig, engine, samples, indices: list[int], device: torch.device, *, step: int):
    """One optimizer step; under `oom_policy: auto` an OOM halves the micro-batch budget and retries.

    Each data-parallel rank packs its share of the global batch; the loss is normalised by
    the loss tokens of the whole global batch, which every rank computes from host data.
    The retry uses the same samples, so nothing is dropped, and the engine zeroes gradients
    at the start of every attempt, so a retried step equals one that never failed.
    """
    global_loss_tokens = loss_tokens(samples, indices)
    mine = shard_for_rank(samples, indices, getattr(engine, "dp_rank", 0), getattr(engine, "dp_size", 1))
    tokens_per_mb = budget(cfg)
    longest = max(len(samples[i][0]) for i in mine)
    while True:
        try:
            mbs = step_micro_batches(cfg, samples, mine, device, tokens_per_mb)
            out = engine.train_batch(mbs, global_num_loss_tokens=global_loss_tokens)
            return out, len(mbs), sum(len(samples[i][0]) for i in indices)
        except Exception as exc:
            if not is_oom(exc):
                raise
            mbs = None  # drop the failed attempt's tensors before retrying
            release_cached_memory()
            # Under torch.distributed the ranks would have to agree on a retry; there the OOM is reported.
            if cfg.oom_policy != "auto" or tokens_per_mb <= longest or launched_world_size() > 1:
                raise TrainingOOMError(
                    cfg, step=step, tokens_per_mb=tokens_per_mb, longest_seq=longest, cause=exc
                ) from exc
            tokens_per_mb = max(longest, tokens_per_mb // 2)
            log.warning(
                "step %d ran out of memory; retrying with %d tokens per micro-batch", step, tokens_per_mb
            )


def evaluate(cfg: LadenConfig, engine, valid, device: torch.device) -> torch.Tensor:
    """Token-mean loss over the whole validation set, `valid_dataset.batch_size` samples at a time."""
    assert cfg.valid_dataset is not None
    size = cfg.valid_dataset.batch_size
    total_loss_tokens = loss_tokens(valid, list(range(len(valid))))
    dp_rank, dp_size = getattr(engine, "dp_rank", 0), getattr(engine, "dp_size", 1)
    loss = torch.zeros((), device=device)
    for start in range(0, len(valid), size):
        indices = shard_for_rank(valid, list(range(start, min(start + size, len(valid)))), dp_rank, dp_size)
        mbs = step_micro_batches(cfg, valid, indices, device, budget(cfg))
        loss += engine.eval_batch(mbs, global_num_loss_tokens=total_loss_tokens)["loss"].to(device)
    return loss


@dataclass(kw_only=True, slots=True)
class Runtime:
    """Where this process runs: its rank under torchrun (0 of 1 otherwise) and its device."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of processes."""
    device: torch.device
    """This process's device."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()


def start_runtime() -> Runtime:
    """Join torchrun's process group when launched by it; otherwise a single process."""
    if launched_world_size() == 1:
        return Runtime(rank=0, world_size=1, device=default_device())
    from laden.engine.fsdp.launch import init_distributed

    rank, world_size, _, device = init_distributed()
    return Runtime(rank=rank, world_size=world_size, device=device)


def check_world_size(cfg: LadenConfig, rt: Runtime) -> None:
    """`actor.backend` names one process per data/tensor/context rank: the launch must match it."""
    num_procs = AllocationMode.parse(cfg.actor.backend).num_gpus
    if num_procs != rt.world_size:
        fix = (
            f"torchrun --nproc_per_node {num_procs} -m laden.cli sft ..."
            if num_procs > 1
            else "plain `laden sft`"
        )
        raise ValueError(
            f"actor.backend={cfg.actor.backend!r} needs {num_procs} process(es) but {rt.world_size} were "
            f"launched; start it with {fix}, or change actor.backend to match the launch"
        )


def load_model(cfg: LadenConfig, rt: Runtime):
    """The model this rank hands its engine (a meta-device skeleton on ranks > 0 with memory_efficient_load)."""
    dtype = DTYPES[cfg.actor.optimizer_dtype]
    if rt.world_size > 1:
        from laden.engine.fsdp.load import load_model_for_rank

        model = load_model_for_rank(
            cfg.actor.path,
            dtype=dtype,
            memory_efficient_load=cfg.actor.fsdp.memory_efficient_load,
            init_from_config=cfg.actor.init_from_config,
            seed=cfg.seed,
            attn_impl=cfg.actor.attn_impl,
        )
    else:
        model = load_causal_lm(
            cfg.actor.path,
            dtype=dtype,
            init_from_config=cfg.actor.init_from_config,
            seed=cfg.seed,
            attn_impl=cfg.actor.attn_impl,
        )
    apply_activation_knobs(model, cfg.actor)
    mc: Any = model.config
    num_heads = int(mc.num_attention_heads)
    num_kv_heads = int(getattr(mc, "num_key_value_heads", None) or num_heads)
    errors = validate_against_model(cfg, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads)
    if errors:
        raise ConfigError(errors)
    return model


def run_sft(cfg: LadenConfig, *, progress: bool = True) -> SFTResult:
    """Train `cfg.actor.path` on `cfg.train_dataset` and return where everything was written."""
    rt = start_runtime()
    check_world_size(cfg, rt)
    out_dir = run_dir(cfg)
    if rt.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, out_dir / "config.yaml")
    rt.barrier()
    seed_everything(cfg.seed)
    tokenizer = load_tokenizer(cfg.actor.path)
    samples = prepare_data(cfg.train_dataset, tokenizer, out_dir, "train", write=rt.is_main)
    valid = None
    if cfg.valid_dataset:
        valid = prepare_data(cfg.valid_dataset, tokenizer, out_dir, "valid", write=rt.is_main)
    model = load_model(cfg, rt)
    batches = GlobalBatchIterator(
        len(samples),
        batch_size=cfg.train_dataset.batch_size,
        shuffle=cfg.train_dataset.shuffle,
        seed=cfg.seed,
    )
    total_steps = min(
        cfg.total_train_steps or batches.steps_per_epoch * cfg.total_train_epochs,
        batches.steps_per_epoch * cfg.total_train_epochs,
    )
    engine = build_engine(cfg, model, total_steps=total_steps, device=rt.device)
    log.info(
        "model: %.1fM parameters, engine %s on %s", engine.num_params / 1e6, type(engine).__name__, rt.device
    )

    start_step = _maybe_resume(cfg, engine, batches, out_dir / "checkpoints", rt)
    losses = _train_loop(cfg, engine, samples, valid, batches, rt, start_step, total_steps, progress)
    if cfg.checkpoint.save_freq_steps and start_step < total_steps:
        _save(cfg, engine, batches, out_dir / "checkpoints", total_steps, rt)
    if cfg.checkpoint.export_hf:
        engine.export_hf(out_dir / "hf", tokenizer=tokenizer)
    rt.barrier()
    return SFTResult(run_dir=out_dir, num_steps=total_steps, first_loss=losses[0], last_loss=losses[1])


def _train_loop(cfg, engine, samples, valid, batches, rt: Runtime, start_step, total_steps, progress):
    """The optimizer steps; rank 0 logs metrics and drives the progress bar. Returns (first, last) loss."""
    out_dir = run_dir(cfg)
    if start_step >= total_steps:
        log.warning(
            "run directory %s already holds a finished run (step %d of %d); nothing to train. "
            "Set trial_name to a new name, or checkpoint.resume=never to start over",
            out_dir,
            start_step,
            total_steps,
        )
    first_loss = last_loss = None
    bar = tqdm(
        total=total_steps, initial=start_step, disable=not (progress and rt.is_main), desc="sft", unit="step"
    )
    window_tokens, window_start = 0, time.perf_counter()
    metrics_file = (out_dir / "metrics.jsonl").open("a") if rt.is_main else None
    try:
        for step in range(start_step, total_steps):
            indices = next(batches)
            out, num_mbs, num_tokens = train_step(cfg, engine, samples, indices, rt.device, step=step + 1)
            window_tokens += num_tokens
            done = step + 1
            if valid is not None and (done % batches.steps_per_epoch == 0 or done == total_steps):
                out["eval_loss"] = evaluate(cfg, engine, valid, rt.device)
            if done % cfg.log_freq_steps == 0 or done == total_steps:
                record = _log_record(out, done, num_mbs, num_tokens, window_tokens, window_start, rt.device)
                window_tokens, window_start = 0, time.perf_counter()
                if metrics_file is not None:
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
                first_loss = record["loss"] if first_loss is None else first_loss
                last_loss = record["loss"]
                bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
            bar.update(1)
            freq = cfg.checkpoint.save_freq_steps
            if freq and done % freq == 0 and done < total_steps:
                _save(cfg, engine, batches, out_dir / "checkpoints", done, rt)
    finally:
        bar.close()
        if metrics_file is not None:
            metrics_file.close()
    return first_loss, last_loss


def _log_record(out, step, num_mbs, num_tokens, window_tokens, window_start, device) -> dict[str, Any]:
    # The one deliberate host sync per logged step: read the metric tensors.
    values = {k: float(v) for k, v in out.items()}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = max(time.perf_counter() - window_start, 1e-9)
    record = {"step": step, **values, "num_mbs": num_mbs, "num_tokens": num_tokens}
    record["tokens_per_s"] = window_tokens / elapsed
    if device.type == "cuda":
        record["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    record["peak_host_gib"] = peak_rss_bytes() / 2**30
    if not math.isfinite(record["loss"]):
        raise RuntimeError(f"loss became {record['loss']} at step {step}; lower actor.optimizer.lr")
    return record


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _save(
    cfg: LadenConfig, engine, batches: GlobalBatchIterator, ckpt_root: Path, step: int, rt: Runtime
) -> None:
    save_checkpoint(
        ckpt_root,
        step=step,
        engine=engine,
        trainer_state={"data": batches.state_dict()},
        keep_last=cfg.checkpoint.keep_last,
        rank=rt.rank,
        barrier=rt.barrier,
    )


def _maybe_resume(
    cfg: LadenConfig, engine, batches: GlobalBatchIterator, ckpt_root: Path, rt: Runtime
) -> int:
    found = list_checkpoints(ckpt_root)
    if cfg.checkpoint.resume == "never" or not found:
        return 0
    trainer_state = load_checkpoint(found[-1], engine, rank=rt.rank)
    batches.load_state_dict(trainer_state["data"])
    log.info("resumed from %s", found[-1])
    return int(trainer_state["step"])


def fused_elementwise(actor: Any) -> bool:
    """`actor.fused_elementwise` resolved: null means on with lean activations on a CUDA machine."""
    if actor.fused_elementwise is None:
        return bool(actor.lean_activations) and torch.cuda.is_available()
    return bool(actor.fused_elementwise)


def apply_activation_knobs(model: Any, actor: Any) -> None:
    """`actor.lean_activations` (lean RMSNorms and gated MLPs), `actor.fused_elementwise` (their math
    and the attention layers' rotary embeddings compiled) and `actor.tiled_mlp_tokens` (tiled MLPs,
    with lean RMSNorms) on a Hugging Face causal LM, before an engine wraps it."""
    from laden.model.patches.fused import use_fused_kernels
    from laden.model.patches.fused_rotary import enable_fused_rotary
    from laden.model.patches.lean_mlp import enable_lean_mlp
    from laden.model.patches.lean_norm import enable_lean_rmsnorm
    from laden.model.patches.sink_linear import enable_sink_linears
    from laden.model.patches.tiled import enable_tiled_mlp

    if actor.lean_activations:
        log.info("actor.lean_activations: %d RMSNorms and %d gated MLPs lean, %d attention projections "
                 "able to add their weight gradients into the roundpipe engine's fp32 accumulators",
                 enable_lean_rmsnorm(model), enable_lean_mlp(model), enable_sink_linears(model))  # fmt: skip
    fused = fused_elementwise(actor)
    use_fused_kernels(fused)  # process-wide: set (or reset) by every run
    if fused:
        log.info("actor.fused_elementwise: the lean modules' elementwise math and %d attention layers' "
                 "rotary embeddings run compiled", enable_fused_rotary(model))  # fmt: skip
    if actor.tiled_mlp_tokens:
        num_tiled = enable_tiled_mlp(model, tile_tokens=actor.tiled_mlp_tokens)
        num_norms = enable_lean_rmsnorm(model)
        log.info("actor.tiled_mlp_tokens=%d: %d decoder MLPs tiled, %d RMSNorms lean",
                 actor.tiled_mlp_tokens, num_tiled, num_norms)  # fmt: skip
