"""PPO's critic: a value model on the actor's kind of engine, trained with the clipped value loss.

`Critic` builds the value model from the `critic` section (its unset fields take the actor's:
`critic_engine_config`), as the actor's causal LM with a one-output head
(`laden.model.value_head`), on an engine `critic.backend` names (fsdp, roundpipe or archon, in
the actor's processes, on the actor's share of each batch; under tensor parallel the one-row head
is replicated, `laden.engine.parallel.parallelize`). Per RL step the trainer asks it for the
values of every completion token before any update (`values`), computes GAE advantages and
returns from them (`laden.rl.gae`), and then trains it on the returns in
`critic.ppo_n_minibatches` optimizer steps (`update`), after the policy's own steps. Its engine
state goes into every checkpoint (`critic/`).

The value loss is AReaL's (`ppo_critic_loss_fn` with its squared error): per loss token, with v
the current value, v_old the value before the step (field `old_values`) and R the return
(`returns`),

    l_t = max((v - R)^2, (v_old + clip(v - v_old, -eps_clip, eps_clip) - R)^2) / 2

`ValueObjective` returns its sum over a micro-batch; the engine divides by the global number of
loss tokens (a token mean, as AReaL weighs micro-batches by their loss tokens). With
`critic.mask_no_eos_with_zero` the tokens of truncated completions carry no loss; their values
still enter GAE. Metrics per RL step: `critic_loss`, `critic_grad_norm`, `critic_lr` and
`value_clip_fraction` of its steps, and from the values before them `value_mean`, `return_mean`
and `explained_variance` (1 - Var(R - V) / Var(R) over tokens). The critic is not exported with
`checkpoint.export_hf` (a Hugging Face causal LM with a one-output head is a format only laden
reads).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from laden.config import LadenConfig
from laden.config.model_configs import critic_engine_config
from laden.data import PackedBatch, unpack
from laden.data.batch import IGNORE_INDEX
from laden.engine.backend import resolve_backend
from laden.engine.checkpoint import keep_new_hyperparameters
from laden.engine.runtime import batch_device, load_model
from laden.model.value_head import to_value_model, token_values
from laden.optim import OptimSettings
from laden.rl.batches import pack_trajectories
from laden.rl.token_stats import TokenStats


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ValueSettings:
    """The clipped value loss (AReaL's `critic.eps_clip`)."""

    eps_clip: float = 0.5
    """A value may move at most this far from its value before the step before the clipped term binds; > 0."""

    def __post_init__(self) -> None:
        if not self.eps_clip > 0 or math.isnan(self.eps_clip):
            raise ValueError(f"critic.eps_clip={self.eps_clip} must be > 0 (the value clip); use 0.5")


class ValueObjective:
    """Summed clipped value loss of a micro-batch (see the module docstring); an `Objective`."""

    def __init__(self, settings: ValueSettings | None = None) -> None:
        self.settings = settings if settings is not None else ValueSettings()
        self._stats = TokenStats()

    def __call__(self, hidden: torch.Tensor, head_weight: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        mask = batch.labels.reshape(-1) != IGNORE_INDEX  # [T]
        value = token_values(hidden, head_weight)  # [T] fp32
        old, target = _field(batch, "old_values"), _field(batch, "returns")
        eps = self.settings.eps_clip
        unclipped = (value - target).square()
        clipped = (old + (value - old).clamp(-eps, eps) - target).square()
        losses = torch.where(mask, torch.maximum(unclipped, clipped) / 2, 0.0)  # [T]
        self._stats.add({"value_clip_fraction": (clipped > unclipped).float()}, mask)
        return losses.sum()

    def pop_stats(self) -> dict[str, torch.Tensor]:
        """Token means of the statistics over every call since the last pop (then reset)."""
        means = self._stats.pop()
        means.pop("num_loss_tokens", None)
        return means


def _field(batch: PackedBatch, name: str) -> torch.Tensor:
    try:
        value = batch.fields[name]
    except KeyError:
        raise ValueError(
            f"ValueObjective needs the per-token field {name!r} (have {sorted(batch.fields)}); pack it with "
            f"pack_samples(..., fields={{{name!r}: ...}})"
        ) from None
    return value.float()


class Critic:
    """The value model's engine in `laden rl` (see the module docstring)."""

    def __init__(
        self,
        cfg: LadenConfig,
        rt: Any,
        *,
        settings: ValueSettings,
        total_steps: int,
        global_sum: Callable[[int], int],
    ) -> None:
        assert cfg.critic is not None
        self.section = cfg.critic
        self.cfg = critic_engine_config(cfg)
        backend = resolve_backend(self.cfg)  # the critic's own engine settings
        self.engine = backend.build(
            self.cfg,
            to_value_model(load_model(self.cfg, rt, backend)),
            total_steps=total_steps,
            device=rt.device,
        )
        self.optim = OptimSettings.from_config(self.cfg.actor.optimizer, total_steps)
        self.objective = ValueObjective(settings)
        self.device = batch_device(backend, rt)
        self.global_sum = global_sum
        """Sums a count over the data-parallel ranks (the loss normaliser)."""

    def keep(self, step: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
        """The resume policy for the critic's optimizer (this run's schedule and hyper-parameters)."""
        return keep_new_hyperparameters(self.engine, self.optim, step)

    def values(self, trajs: Sequence[Any]) -> list[torch.Tensor]:
        """Per trajectory, `[C + 1]` fp32: V before each completion token, then V after the last one (the
        trainer takes the end as terminal and sets that one to 0)."""
        mbs, bins = self._pack(trajs, {})
        outs = self.engine.forward(mbs, outputs=("values",))
        per: list[torch.Tensor] = [torch.empty(0)] * len(trajs)
        for mb, indices, out in zip(mbs, bins, outs):
            for i, doc in zip(indices, unpack(mb, out["values"])):
                # position P-1+t holds the state before completion token t (P >= 1 prompt tokens)
                per[i] = doc[len(trajs[i].prompt_ids) - 1 :].clone()
        return per

    def update(
        self,
        chunks: Sequence[Sequence[Any]],
        old_values: dict[int, torch.Tensor],
        returns: dict[int, torch.Tensor],
    ) -> dict[str, float]:
        """One optimizer step per chunk of trajectories (`old_values`, `returns`: `[C]` per `id(traj)`);
        the metrics averaged over the steps, as floats (one host sync per step)."""
        metrics: dict[str, float] = {}
        for chunk in chunks:
            fields = {"old_values": [old_values[id(t)].tolist() for t in chunk],
                      "returns": [returns[id(t)].tolist() for t in chunk]}  # fmt: skip
            loss = [t.has_eos for t in chunk] if self.section.mask_no_eos_with_zero else None
            mbs, _ = self._pack(chunk, fields, loss=loss)
            normalizer = self.global_sum(sum(mb.num_loss_tokens for mb in mbs))
            value_loss = self.engine.forward_backward(mbs, self.objective, normalizer=max(normalizer, 1))
            step = self.engine.optimizer_step()
            values = {"critic_loss": value_loss, "critic_grad_norm": step["grad_norm"], "critic_lr": step["lr"],
                      **self.objective.pop_stats()}  # fmt: skip
            for name, value in values.items():
                metrics[name] = metrics.get(name, 0.0) + float(value) / len(chunks)
        return metrics

    def _pack(
        self,
        trajs: Sequence[Any],
        fields: dict[str, list[list[float]]],
        *,
        loss: Sequence[bool] | None = None,
    ) -> tuple[list[PackedBatch], list[list[int]]]:
        cfg = self.cfg
        spec = cfg.actor.mb_spec
        budget = spec.max_tokens_per_mb or cfg.train_dataset.max_length + cfg.gconfig.max_new_tokens
        return pack_trajectories(
            trajs, fields, max_tokens_per_mb=budget, n_mbs=spec.n_mbs or 1, algorithm=spec.packing_algorithm,
            device=self.device, loss=loss,
        )  # fmt: skip
