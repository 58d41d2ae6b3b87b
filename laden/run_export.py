"""`laden export RUN_DIR [--step N] [--out DIR]`: a Hugging Face directory from any checkpoint of a run, on the CPU.

A checkpoint stores every trained parameter under its Hugging Face name, whatever engine wrote it
(`laden.engine.checkpoint`), so no engine, GPU or process group is needed: the model is rebuilt on
the CPU exactly as the run loaded it (`actor.path` in the master dtype, the same seeded
initialisation, the same seeded LoRA adapters with the base cast to the compute dtype), the
checkpoint's tensors are copied in, and `laden.model.hf.export.export_hf` writes the
`save_pretrained` layout in the compute dtype (`actor.dtype`), as the run's own export does. A LoRA
run's export is the merged model plus its adapters in `adapter/` (peft's layout).

Where exports go: the run's final export is `hf/`; the periodic ones
(`checkpoint.export_hf_freq_steps`) and this command's default are `hf_steps/step_N/`, one directory
per step, kept, as Hugging Face Trainer keeps `checkpoint-N/` (without the optimizer state, which
stays in `checkpoints/`). Cost: the whole model in host memory in the master dtype, plus one shard.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

STEP_EXPORTS = "hf_steps"
"""The run directory's folder of periodic exports, `hf_steps/step_N/`."""


def step_export_dir(run_dir: str | Path, step: int) -> Path:
    """Where the export of step `step` goes: `RUN_DIR/hf_steps/step_N`."""
    return Path(run_dir) / STEP_EXPORTS / f"step_{step}"


def export_run(run_dir: str | Path, *, step: int | None = None, out_dir: str | Path | None = None) -> Path:
    """Export checkpoint `step` (default: the newest) of the run in `run_dir` to `out_dir` (default
    `step_export_dir`); returns where it was written."""
    from laden.engine.checkpoint import read_run_config
    from laden.model.hf.export import export_hf

    checkpoint = find_checkpoint(Path(run_dir), step)
    cfg = _run_config(read_run_config(checkpoint), checkpoint)
    model, trained = model_from_checkpoint(cfg, checkpoint)
    out = Path(out_dir) if out_dir is not None else step_export_dir(run_dir, _step_of(checkpoint))
    dtype = _dtype(cfg.actor.dtype)
    weights, adapter = export_views(model, trained, dtype)
    log.info("exporting %s to %s (%s)", checkpoint, out, dtype)
    tokenizer = _tokenizer(cfg.actor.path)
    if cfg.train_dataset.type == "rw":  # a reward model: a sequence classifier (`laden.align.reward_model`)
        from laden.align.reward_model import as_classifier

        shim, renamed = as_classifier(model.config, weights, tokenizer)
        return export_hf(shim, out, dtype=dtype, tokenizer=tokenizer, weights=renamed)
    return export_hf(model, out, dtype=dtype, tokenizer=tokenizer, weights=weights, adapter=adapter)


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """Checkpoint `step` of the run in `run_dir` (the newest when None); a ValueError naming the steps there."""
    from laden.engine.checkpoint import list_checkpoints

    found = list_checkpoints(run_dir / "checkpoints")
    if not found:
        raise ValueError(
            f"{str(run_dir)!r} holds no checkpoints (no checkpoints/step_N); give the directory of a laden run"
        )
    if step is None:
        return found[-1]
    chosen = [p for p in found if _step_of(p) == step]
    if not chosen:
        steps = ", ".join(str(_step_of(p)) for p in found)
        raise ValueError(f"{str(run_dir)!r} has no checkpoint of step {step}; its checkpoints: {steps}")
    return chosen[0]


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step_"))


def _run_config(data: dict[str, Any], checkpoint: Path) -> Any:
    from laden.config.loader import config_from_dict

    return config_from_dict(data, job="any")


def _dtype(name: str) -> torch.dtype:
    from laden.model.dtypes import torch_dtype

    return torch_dtype(name)


def model_from_checkpoint(cfg: Any, checkpoint: Path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The run's model on the CPU with the checkpoint's weights, and its trained parameters by name."""
    from laden.model.hf.loading import load_causal_lm
    from laden.model.lora import LoraSettings, apply_lora
    from laden.optim import OptimSettings

    actor = cfg.actor
    master = OptimSettings(type=actor.optimizer.type).master_dtype(_dtype(actor.optimizer_dtype))
    model = load_causal_lm(actor.path, dtype=master, init_from_config=actor.init_from_config, seed=cfg.seed)
    if cfg.train_dataset.type == "rw":  # `laden rw` trains the causal LM with a one-row head
        from laden.model.value_head import to_value_model

        to_value_model(model)
    lora = LoraSettings.from_actor(actor)
    if lora is not None:
        apply_lora(model, LoraSettings(rank=lora.rank, alpha=lora.alpha, target_modules=lora.target_modules),
                   seed=cfg.seed)  # fmt: skip  # the adapters come from the checkpoint, not actor.lora_path
        for p in model.parameters():  # the engines keep the frozen base in the compute dtype
            if not p.requires_grad:
                p.data = p.data.to(_dtype(actor.dtype))
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    _copy_in(checkpoint, trained)
    return model, trained


def _copy_in(checkpoint: Path, trained: dict[str, torch.Tensor]) -> None:
    from laden.engine.checkpoint import checkpoint_tensors

    found = set()
    with torch.no_grad():
        for name, tensor in checkpoint_tensors(checkpoint):
            if name not in trained or tuple(tensor.shape) != tuple(trained[name].shape):
                raise ValueError(
                    f"checkpoint {checkpoint}: weight {name!r} {tuple(tensor.shape)} is no trained parameter of the "
                    "model its config.yaml describes; was actor.path changed since? export with the model it trained"
                )
            trained[name].copy_(tensor)
            found.add(name)
    missing = sorted(set(trained) - found)
    if missing:
        raise ValueError(
            f"checkpoint {checkpoint} has no weight for {len(missing)} trained parameter(s) (e.g. {missing[0]!r}); "
            "was actor.path changed since? export with the model it trained"
        )


def export_views(
    model: torch.nn.Module, trained: dict[str, torch.Tensor], dtype: torch.dtype
) -> tuple[Any, Any]:
    """The merged weights in `dtype` and, for a LoRA model, its adapters in peft's names (what
    the engines' `export_hf` hand `export_hf`)."""
    from laden.model.hf.export import hf_state_names
    from laden.model.lora import adapted_modules, merged_weights, peft_adapter_state

    state = model.state_dict()

    def fetch(name: str, want: torch.dtype, device: Any) -> torch.Tensor:
        return state[name].to(want)

    weights = merged_weights(model, hf_state_names(model), fetch, dtype, "cpu")
    adapter = (
        peft_adapter_state({n: p.detach() for n, p in trained.items()}) if adapted_modules(model) else None
    )
    return weights, adapter


def _tokenizer(path: str) -> Any:
    """`path`'s tokenizer, or None (with a warning) when it has none: the export is the model alone then."""
    from laden.model.hf.loading import load_tokenizer

    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as exc:
        log.warning("no tokenizer in %s (%s): the export holds the model alone", path, exc)
        return None
