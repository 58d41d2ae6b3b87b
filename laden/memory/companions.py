"""The models `laden rl` holds beside the policy, as lines of the training phase's plan.

- the reference model (`actor.kl_ctl` != 0) and the teacher (`teacher`): frozen models on the actor's
  engine and layout (`laden.rl.scoring.frozen_engine`), holding their weights in the never-stepped
  config's storage dtype (`laden.config.model_configs.never_stepped`: the compute dtype, 2 bytes a parameter in bf16) where that
  engine keeps weights (the GPU under fsdp, the host under roundpipe or `fsdp.offload_params`), as the
  engine's `frozen_estimator` counts them. Their forwards run before the policy's step; their
  activations are gone by then.
- the critic (`critic`): a second trained model (`laden.rl.critic`), the actor's architecture with a
  one-row head on the engine `critic.backend` names, with its own gradients and optimizer states. Its
  model states stay through the policy's step and the policy's through its own, so both count; the
  two steps' activations do not overlap, so the critic adds only what its step's transients exceed
  the policy's by (per side, GPU and host).

Models load one after another: a load-time host copy (`Component.load_time`) larger than the
policy's adds the difference.

`laden dpo` keeps no second model: its reference log-probs are computed on the policy's own engine
before the first step (`laden.align.task`); `laden sft` and `laden rw` train one model.
"""

from __future__ import annotations

from typing import Any

from laden.engine.estimates import Component, ModelShapes, PhaseEstimate, meta_model


class Companions:
    """The other models of a `laden rl` config; their meta-device builds made once (`components` is called
    for each knob value the `auto` resolver tries)."""

    def __init__(self, cfg: Any, job: str) -> None:
        from laden.memory.estimate import patched_meta_model

        rl = job == "rl"
        self.ref = rl and bool(cfg.actor.kl_ctl)
        self.teacher = meta_model(cfg.teacher.path) if rl and cfg.teacher is not None else None
        self.critic = None
        if rl and cfg.critic is not None:
            from laden.config.model_configs import critic_engine_config
            from laden.model.value_head import to_value_model

            self.critic = to_value_model(patched_meta_model(critic_engine_config(cfg)))

    def __bool__(self) -> bool:
        return self.ref or self.teacher is not None or self.critic is not None

    def components(
        self, cfg: Any, policy: PhaseEstimate, model: Any, gpu_capacity: int | None
    ) -> list[Component]:
        """The lines to add to `policy` (the policy's training step, `model` its meta build) for `cfg`."""
        from laden.config.model_configs import never_stepped, teacher_engine_config

        parts: list[Component] = []
        loads = [c.host for c in policy.components if c.load_time]
        if self.ref:
            frozen = self._frozen(never_stepped(cfg), model)
            parts += _labelled("reference model, frozen", frozen, loads)
        if self.teacher is not None:
            tcfg = never_stepped(teacher_engine_config(cfg))
            parts += _labelled("teacher, frozen", self._frozen(tcfg, self.teacher), loads)
        if self.critic is not None:
            parts += self._critic(cfg, policy, gpu_capacity, loads)
        if loads:
            load = max(loads) - max((c.host for c in policy.components if c.load_time), default=0)
            if load > 0:
                parts.append(Component("host: another model's load above the policy's", host=load,
                                       load_time=True))  # fmt: skip
        return parts

    @staticmethod
    def _frozen(cfg: Any, model: Any) -> PhaseEstimate:
        from laden.engine.backend import resolve_backend

        backend = resolve_backend(cfg)
        estimator = backend.frozen_estimator(model)
        if estimator is None:
            from laden.memory.estimate import no_estimator

            raise ValueError(f"actor.backend={cfg.actor.backend!r}: {no_estimator(backend.name)}")
        return estimator.estimate(cfg, ModelShapes.from_model(model))

    def _critic(
        self, cfg: Any, policy: PhaseEstimate, gpu_capacity: int | None, loads: list[int]
    ) -> list[Component]:
        from laden.config.model_configs import critic_engine_config
        from laden.memory.estimate import training_estimator

        ccfg = critic_engine_config(cfg)
        step = training_estimator(ccfg, self.critic, gpu_capacity).estimate(
            ccfg, ModelShapes.from_model(self.critic)
        )
        resident = [c for c in step.components if c.exact and not c.load_time]
        parts = [Component(f"critic: {c.name}", gpu=c.gpu, host=c.host) for c in resident]
        loads += [c.host for c in step.components if c.load_time]

        def transient(phase: PhaseEstimate, side: str) -> int:
            return sum(getattr(c, side) for c in phase.components if not c.exact and not c.load_time)

        gpu, host = (max(0, transient(step, side) - transient(policy, side)) for side in ("gpu", "host"))
        if gpu or host:
            parts.append(
                Component(
                    "critic: its step's activations above the policy's", gpu=gpu, host=host, exact=False
                )
            )
        return parts


def _labelled(label: str, frozen: PhaseEstimate, loads: list[int]) -> list[Component]:
    """`frozen`'s resident lines named after the model; its load-time bytes go to `loads`."""
    loads += [c.host for c in frozen.components if c.load_time]
    return [Component(f"{label}: {c.name}", gpu=c.gpu, host=c.host, exact=c.exact)
            for c in frozen.components if not c.load_time]  # fmt: skip


def training_phase(
    cfg: Any, model: Any, shapes: ModelShapes, gpu_capacity: int | None, job: str,
    companions: Companions | None = None,
) -> PhaseEstimate:  # fmt: skip
    """The training phase of `job`: the policy's step (`actor.backend`'s estimator) and the models beside it."""
    from laden.memory.estimate import training_estimator

    phase = training_estimator(cfg, model, gpu_capacity).estimate(cfg, shapes)
    others = companions if companions is not None else Companions(cfg, job)
    if others:
        phase.components += others.components(cfg, phase, model, gpu_capacity)
    return phase
