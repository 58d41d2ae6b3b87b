"""LoRA adapters on a Hugging Face causal LM (`actor.use_lora`), through peft, and their merged view.

`apply_lora` injects peft's LoRA layers into the model in place (`peft.inject_adapter_in_model`,
no `PeftModel` wrapper), before an engine shards or splits it. The model stays the Hugging Face
causal LM that every engine, patch and splitter expects (decoder layers at `model.layers`, the
head read directly by the objective); only the adapted projections change class, to
`peft.tuners.lora.Linear`: the frozen `base_layer` [out, in] plus the trainable `lora_A` [r, in]
and `lora_B` [out, r]. Every other parameter is frozen, so gradients and optimizer states exist
for the adapters alone, and the engines keep the frozen weights in the compute dtype (no master
copy). `lora_B` starts at zero (peft's default), so the adapted model starts equal to the base;
`lora_A` is drawn under the run's seed, so every rank and every rerun starts from the same
adapters. No dropout on the adapters (peft's `lora_dropout` 0): a step stays deterministic and
the merged weights are exactly what was trained.

Targets follow AReaL: `actor.target_modules` lists module names (`q_proj`, `v_proj`, or full
dotted names, as peft matches them); empty or containing `all-linear` means every linear layer
but the output head. Only linear layers can be adapted, and never the output head: the objective
reads the head's weight directly (the chunked loss makes no module call), so an adapter there
would never run.

Merged view (`merged_weights`): weight updates and exports read the model under the base model's
names, each adapted projection as one weight `W + (alpha / r) * B @ A` (computed in fp32 from the
engine's tensors, then cast), so a rollout engine or a Hugging Face loader sees a plain model.
With `trained_only` the view holds the adapted projections alone: the rest of the model never
changes, so a weight update sends only what training changed (for all-linear, the decoder's
projections: everything but the embedding, the head and the norms).

The export (`laden.model.hf.export.export_hf`) writes the merged model and, in its `adapter/`
directory, the adapters as peft saves them (`PeftModel.from_pretrained(base, "<export>/adapter")`
rebuilds the trained model from `actor.path`; a server that serves LoRA adapters can load it).
`actor.lora_path` starts a run's adapters from such a directory (`load_adapter`) instead of B = 0,
to continue training it.

Costs: the lean gated MLP (`laden.model.patches.lean_mlp`) leaves adapted MLPs alone (their
projections are no plain `nn.Linear`), so their activations are Hugging Face's; and every merged
view costs one `[out, r] x [r, in]` product per adapted projection. Tensor parallelism is refused
(its plans shard plain `nn.Linear` projections), checked at load time.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "ALL_LINEAR",
    "LoraSettings",
    "adapted_modules",
    "adapter_config",
    "apply_lora",
    "load_adapter",
    "merged_weights",
    "peft_adapter_state",
]

ALL_LINEAR = "all-linear"
"""AReaL's (and peft's) name for every linear layer but the output head."""
_ADAPTER = "default"
"""The one adapter's name inside peft's layers."""

Fetch = Callable[[str, torch.dtype, "torch.device | str | None"], torch.Tensor]
"""`fetch(state_dict_name, dtype, device)`: the full tensor of one entry of the adapted model's
state dict, as an engine hands it out (gathered from shards, read from a host store); `device`
None = where the engine keeps it."""


@dataclass(kw_only=True, slots=True, frozen=True)
class LoraSettings:
    """LoRA adapters of the trained model (from AReaL's `actor.use_lora` fields)."""

    rank: int = 32
    """Rank r of each adapter pair (`actor.lora_rank`)."""
    alpha: float = 16.0
    """Adapters add `(alpha / rank) * B @ A` to their projection (`actor.lora_alpha`)."""
    target_modules: tuple[str, ...] = ()
    """Module names to adapt (`actor.target_modules`); empty or with `all-linear`: all but the head."""
    adapter_path: str | None = None
    """A peft adapter directory to start from (`actor.lora_path`); None = fresh adapters."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"actor.lora_rank={self.rank} must be at least 1; e.g. 16")
        if not self.alpha > 0:
            raise ValueError(f"actor.lora_alpha={self.alpha} must be greater than 0; e.g. 16")

    @classmethod
    def from_actor(cls, actor: Any) -> LoraSettings | None:
        """The settings of `actor` (an `ActorConfig`), or None without `actor.use_lora`."""
        path = getattr(actor, "lora_path", None)
        if not actor.use_lora:
            if path:
                warnings.warn(f"actor.lora_path={path!r} is ignored: actor.use_lora is false", stacklevel=2)
            return None
        return cls(
            rank=actor.lora_rank, alpha=actor.lora_alpha, target_modules=tuple(actor.target_modules),
            adapter_path=path,
        )  # fmt: skip

    @property
    def all_linear(self) -> bool:
        return not self.target_modules or ALL_LINEAR in self.target_modules

    def peft_config(self) -> Any:
        """The `peft.LoraConfig` these settings describe."""
        from peft import LoraConfig

        targets: str | list[str] = ALL_LINEAR if self.all_linear else list(self.target_modules)
        alpha: Any = self.alpha  # peft annotates an int; it only divides it by r, so a float is fine
        return LoraConfig(
            r=self.rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none"
        )


def apply_lora(model: nn.Module, settings: LoraSettings, *, seed: int) -> int:
    """Inject `settings`' adapters into `model` in place, freezing everything else; return how many
    projections were adapted. `lora_A` is drawn under `seed` (the caller's RNG stream is untouched)."""
    from peft import inject_adapter_in_model

    if adapted_modules(model):
        raise ValueError("the model already has LoRA adapters; apply actor.use_lora once, to a plain model")
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)  # the same adapters on every rank and every rerun
        try:
            inject_adapter_in_model(settings.peft_config(), model)
        except ValueError as err:
            raise ValueError(
                f"actor.target_modules={list(settings.target_modules)!r} matches no layer of "
                f"{type(model).__name__} ({err}); name its linear layers (e.g. [q_proj, k_proj, v_proj, "
                f"o_proj]) or set actor.target_modules: [] for all linear layers"
            ) from err
    layers = adapted_modules(model)
    _check_adapted(model, layers, settings)
    adapters = {id(p) for m in layers.values() for ab in (m.lora_A, m.lora_B) for p in ab.parameters()}
    for p in model.parameters():  # peft froze the base already; nothing else may train
        p.requires_grad_(id(p) in adapters)
    if settings.adapter_path is not None:
        load_adapter(model, settings.adapter_path, settings)
    return len(layers)


def load_adapter(model: nn.Module, path: str | Path, settings: LoraSettings) -> None:
    """Copy the adapters of peft's adapter directory `path` into `model`'s (injected by `apply_lora`),
    checking that it holds every adapter with this run's rank and alpha (the scale `alpha / r` decides
    what the adapters mean)."""
    from safetensors.torch import load_file

    directory = Path(path)
    config_file, weights_file = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(
            f"actor.lora_path={str(path)!r} has no adapter_config.json and adapter_model.safetensors; point it at "
            "a peft adapter directory, e.g. a laden export's hf/adapter/"
        )
    saved = json.loads(config_file.read_text())
    if saved.get("r") != settings.rank or float(saved.get("lora_alpha", -1)) != settings.alpha:
        raise ValueError(
            f"actor.lora_path={str(path)!r} holds adapters of rank {saved.get('r')} and alpha "
            f"{saved.get('lora_alpha')}, but actor.lora_rank={settings.rank} and actor.lora_alpha={settings.alpha}; "
            "set them to the adapter's values"
        )
    theirs = load_file(str(weights_file))
    mine = {name: t for name, t in peft_adapter_state(dict(model.named_parameters())) if t.requires_grad}
    missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    if missing or extra:
        raise ValueError(
            f"actor.lora_path={str(path)!r} does not adapt the layers this run adapts ({len(missing)} missing, e.g. "
            f"{missing[:1]}; {len(extra)} not adapted here, e.g. {extra[:1]}); set actor.target_modules to the "
            f"adapter's target_modules {saved.get('target_modules')!r}"
        )
    with torch.no_grad():
        for name, param in mine.items():
            param.copy_(theirs[name])


def _check_adapted(model: nn.Module, layers: dict[str, Any], settings: LoraSettings) -> None:
    from peft.tuners.lora import Linear as LoraLinear

    shown = f"actor.target_modules={list(settings.target_modules)!r}"
    others = [name for name, m in layers.items() if not isinstance(m, LoraLinear)]
    if others:
        raise ValueError(
            f"{shown} adapts {others[:3]}, which are not linear layers; laden's LoRA adapts linear layers "
            "only: remove them from actor.target_modules"
        )
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is not None and any(m is head for m in layers.values()):
        raise ValueError(
            f"{shown} adapts the output head, whose weight the chunked loss reads directly (the adapter would "
            "never run); remove it from actor.target_modules"
        )


def adapted_modules(model: nn.Module) -> dict[str, Any]:
    """The LoRA layers of `model` by module name; {} for a plain model."""
    if "peft" not in sys.modules:  # nothing was adapted in a process that never imported peft
        return {}
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


# ---------------------------------------------------------------------------------------
# The merged view


@dataclass(frozen=True, slots=True)
class _Merge:
    """One adapted projection of the merged view: `name = base + scaling * lora_b @ lora_a`."""

    name: str  # `<module>.weight`, the base model's name
    base: str  # `<module>.base_layer.weight` [out, in]
    lora_a: str  # `<module>.lora_A.default.weight` [r, in]
    lora_b: str  # `<module>.lora_B.default.weight` [out, r]
    scaling: float


_Copy = tuple[str, str]
"""(name in the merged view, state-dict name it is read from)."""


def _plan(model: nn.Module, state_names: list[str]) -> list[_Merge | _Copy]:
    """The merged view of `state_names` (the adapted model's `hf_state_names`), in their order."""
    layers = adapted_modules(model)
    renamed: dict[str, _Merge | _Copy | None] = {}
    for prefix, layer in layers.items():
        renamed[f"{prefix}.base_layer.weight"] = _Merge(
            name=f"{prefix}.weight", base=f"{prefix}.base_layer.weight",
            lora_a=f"{prefix}.lora_A.{_ADAPTER}.weight", lora_b=f"{prefix}.lora_B.{_ADAPTER}.weight",
            scaling=float(layer.scaling[_ADAPTER]),
        )  # fmt: skip
        renamed[f"{prefix}.base_layer.bias"] = (f"{prefix}.bias", f"{prefix}.base_layer.bias")
        for ab in ("lora_A", "lora_B"):
            renamed[f"{prefix}.{ab}.{_ADAPTER}.weight"] = None  # merged into the base weight
    plan: list[_Merge | _Copy] = []
    for name in state_names:
        entry = renamed.get(name, (name, name))
        if entry is not None:
            plan.append(entry)
    return plan


def merged_weights(
    model: nn.Module,
    state_names: list[str],
    fetch: Fetch,
    dtype: torch.dtype,
    device: torch.device | str | None,
    *,
    trained_only: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` of the merged view of `model`, one full tensor at a time.

    `state_names`: the adapted model's `hf_state_names`, in the order to yield; `fetch`: how the
    engine hands out one of them. An adapted projection is fetched in fp32 (base, A, B), merged,
    and cast to `dtype` on `device`; every other tensor is fetched as asked. A plain model's view
    is its state itself. `trained_only`: only the adapted projections (all tensors of a plain
    model, all of whose weights train).
    """
    skip_frozen = trained_only and bool(adapted_modules(model))
    for entry in _plan(model, state_names):
        if isinstance(entry, _Merge):
            yield entry.name, _merge(entry, fetch, dtype, device)
        elif not skip_frozen:
            yield entry[0], fetch(entry[1], dtype, device)


@torch.no_grad()
def _merge(
    entry: _Merge, fetch: Fetch, dtype: torch.dtype, device: torch.device | str | None
) -> torch.Tensor:
    base = fetch(entry.base, torch.float32, None)  # [out, in]
    a = fetch(entry.lora_a, torch.float32, None)  # [r, in]
    b = fetch(entry.lora_b, torch.float32, None)  # [out, r]
    merged = torch.addmm(
        base.to(a.device), b, a, alpha=entry.scaling
    )  # a new tensor: the sources stay as they are
    return merged.to(device=device or merged.device, dtype=dtype)


# ---------------------------------------------------------------------------------------
# The adapter as peft writes it


def peft_adapter_state(trained: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapters of an engine's `state_dict()["model"]` (a LoRA model's trained parameters) under
    the names of peft's adapter files (`base_model.model.<module>.lora_A.weight`)."""
    for name, t in trained.items():
        yield "base_model.model." + name.replace(f".{_ADAPTER}.", "."), t


def adapter_config(model: nn.Module) -> Any:
    """The `peft.LoraConfig` of `model`'s adapters as an adapter directory records it (a causal LM
    on the base model `model.config.name_or_path`)."""
    import copy

    config = copy.deepcopy(getattr(model, "peft_config")[_ADAPTER])  # noqa: B009 - set by peft's injection
    config.task_type = "CAUSAL_LM"
    config.base_model_name_or_path = getattr(model.config, "name_or_path", None) or None
    return config
