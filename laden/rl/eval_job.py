"""`laden eval`: the held-out evaluation of `laden rl` (`laden.rl.evaluate`) outside a run.

The policy is `actor.path`, another model directory (`model_dir`, e.g. a run's `hf/` export), or a
checkpoint of a run (`checkpoint`, `RUN_DIR/checkpoints/step_N`: its weights over `actor.path`'s model);
the data is `valid_dataset`, the reward and workflow the config's, the sampling `eval_gconfig`'s (greedy
by default), the engine a native one on this machine's GPU (else the CPU), as in the run. So the
accuracy a run logs at a step equals this command's on that step's checkpoint. The overlap of the
held-out prompts with `train_dataset` is reported beside the metrics. One process (no torchrun).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

log = logging.getLogger("laden.rl")


def run_eval(cfg: Any, *, model_dir: str | None = None, checkpoint: str | None = None) -> dict[str, Any]:
    """The evaluation's JSON record (see the module docstring); `ValueError` for unusable input."""
    if model_dir is not None and checkpoint is not None:
        raise ValueError("laden eval: give --model or --checkpoint, not both")
    if cfg.valid_dataset is None or not cfg.valid_dataset.path:
        raise ValueError(
            "laden eval needs held-out data: set valid_dataset.path (in the config, or as the override "
            "valid_dataset.path=FILE)"
        )
    if model_dir is not None:
        _require_dir(model_dir, "--model", "a Hugging Face model directory (config.json and weights)")
        cfg = replace(cfg, actor=replace(cfg.actor, path=model_dir, init_from_config=False))
    return asyncio.run(_evaluate(cfg, checkpoint))


async def _evaluate(cfg: Any, checkpoint: str | None) -> dict[str, Any]:
    from laden.data.overlap import prompt_overlap
    from laden.model.hf.loading import load_tokenizer
    from laden.rl.agent.loading import build_workflow, check_workflow_imports
    from laden.rl.evaluate import eval_sampling, evaluate
    from laden.rl.producer import read_prompt_rows
    from laden.rl.reward_setup import start_rewards
    from laden.rl.workflow import render_prompt

    tokenizer = load_tokenizer(cfg.actor.path)
    records = read_prompt_rows(cfg, cfg.valid_dataset, "valid_dataset")
    train = _train_records(cfg)
    overlap = prompt_overlap(train, records) if train is not None else None
    if overlap is not None and overlap.num_shared:
        log.warning("valid_dataset %s: %s", cfg.valid_dataset.path, overlap.summary())
    limit = cfg.train_dataset.max_length
    rows = [r for r in records if _prompt_tokens(render_prompt, r, tokenizer) <= limit]
    if not rows:
        raise ValueError(
            f"valid_dataset.path={cfg.valid_dataset.path!r}: every prompt is longer than train_dataset.max_length="
            f"{limit} tokens (the engine's context is that plus gconfig.max_new_tokens); raise it"
        )
    pool: Any = None
    if check_workflow_imports(cfg):  # an agent's run returns its rewards: no reward pool then
        pool, _ = await start_rewards(cfg, [records], tokenizer)
    try:
        import torch

        from laden.rollout.factory import native_engine_from_weights

        weights, version = _policy(cfg, checkpoint)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        native = replace(cfg, rollout=replace(cfg.rollout, backend="native:d1"))
        # built as `laden rl` builds its engine: a skeleton filled with the weights, tagged with their step
        engine: Any = native_engine_from_weights(
            native, weights, device=device, tokenizer=tokenizer, version=version
        )
        del weights
        sampling, n = eval_sampling(cfg.gconfig, cfg.eval_gconfig)
        workflow = build_workflow(
            cfg, tokenizer=tokenizer, sampling=sampling, n_samples=n, reward=pool, evaluation=True
        )
        try:
            result = await evaluate(engine, rows, workflow)
        finally:
            if hasattr(workflow, "aclose"):  # an agent workflow's endpoint
                await workflow.aclose()
            await engine.close()
    finally:
        if pool is not None:
            pool.close()
    out: dict[str, Any] = {
        "model": checkpoint or cfg.actor.path,
        "version": version,
        "data": cfg.valid_dataset.path,
        "skipped_longer_than_max_length": len(records) - len(rows),
        "shared_with_train": None if overlap is None else overlap.num_shared,
        **{name: round(value, 6) for name, value in result.metrics.items()},
    }
    if result.metrics["eval/reward_errors"] > cfg.reward_error_tolerance * len(result.samples):
        from laden.errors import RunFailedError

        raise RunFailedError(
            f"laden eval: {int(result.metrics['eval/reward_errors'])} of {len(result.samples)} rewards failed, more "
            f"than reward_error_tolerance={cfg.reward_error_tolerance:g}; the first error:\n{result.first_error}\n"
            f"{json.dumps(out)}"
        )
    return out


def _prompt_tokens(render: Any, row: dict[str, Any], tokenizer: Any) -> int:
    try:
        return len(render(row, tokenizer).ids)
    except (ValueError, KeyError, TypeError):
        return 0  # a custom workflow's rows: kept, as `laden rl` keeps them


def _train_records(cfg: Any) -> Any:
    """The training prompts for the overlap check, or None when there are none to read."""
    from laden.rl.producer import read_prompt_rows

    path = cfg.train_dataset.path
    if not path or (not path.startswith("hf:") and not Path(path).expanduser().exists()):
        log.warning(
            "train_dataset.path=%r cannot be read: the overlap with the training prompts is not checked", path
        )
        return None
    return read_prompt_rows(cfg, cfg.train_dataset, "train_dataset")


def _policy(cfg: Any, checkpoint: str | None) -> tuple[Any, int]:
    """The weights to evaluate by Hugging Face name, in `actor.dtype` on the CPU, and their version (a
    checkpoint's step): `actor.path`'s, or a checkpoint's read as `laden export` reads it (a LoRA run's
    adapters merged into the base)."""
    import torch

    from laden.model.dtypes import torch_dtype
    from laden.model.hf.loading import load_causal_lm
    from laden.run_export import export_views, model_from_checkpoint

    dtype = torch_dtype(cfg.actor.dtype)
    if checkpoint is None:
        model = load_causal_lm(
            cfg.actor.path, dtype=dtype, init_from_config=cfg.actor.init_from_config, seed=cfg.seed
        )
        return list(model.named_parameters()), 0
    path = Path(checkpoint)
    _require_dir(str(path), "--checkpoint", "a run's checkpoints/step_N directory")
    step = _checkpoint_step(path)
    _check_lora(cfg, path)
    model, trained = model_from_checkpoint(cfg, path)
    weights, _ = export_views(model, trained, dtype)
    return [(name, tensor.to(torch.device("cpu"))) for name, tensor in weights], step


def _check_lora(cfg: Any, path: Path) -> None:
    """A LoRA run's checkpoint holds its adapters, a full run's every weight: `actor.use_lora` must say which."""
    from laden.engine.checkpoint import checkpoint_tensor_names

    lora = any("lora_" in name for name in checkpoint_tensor_names(path))
    if lora != bool(cfg.actor.use_lora):
        what = "a LoRA run (it holds the adapters)" if lora else "a full-weight run, not a LoRA one"
        raise ValueError(
            f"checkpoint {path} was written by {what}, but actor.use_lora={cfg.actor.use_lora}; evaluate it with "
            f"actor.use_lora={str(lora).lower()} (and the run's lora_rank, lora_alpha, target_modules), or with "
            "the config of the run that wrote it"
        )


def _checkpoint_step(path: Path) -> int:
    name = path.name
    if not name.startswith("step_") or not name[5:].isdigit():
        raise ValueError(
            f"--checkpoint {str(path)!r} is not a checkpoint directory; give RUN_DIR/checkpoints/step_N"
        )
    return int(name[5:])


def _require_dir(path: str, option: str, what: str) -> None:
    if not Path(path).is_dir():
        raise ValueError(f"{option} {path!r} is not a directory; give {what}")
