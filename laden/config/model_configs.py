"""The configs of the models `laden rl` builds beside the policy, derived from the actor's: what the
engines' `build` and the loader read (as `actor`), and what `laden plan` plans them with.

- `never_stepped`: a frozen model (the reference model, the teacher; `laden.rl.scoring`);
- `teacher_engine_config`: the teacher's model on the actor's engine settings;
- `critic_engine_config`: the critic's engine settings, unset ones the actor's (`laden.rl.critic`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from laden.config.schema import LadenConfig


def never_stepped(cfg: LadenConfig) -> LadenConfig:
    """`cfg` for a model that is never stepped: its weights stored in the compute dtype (no fp32 masters
    beside them), a stateless optimizer (SGD without momentum) and, under roundpipe, the synchronous step
    (the asynchronous one allocates a second weight buffer and two gradient inboxes at build), so it holds
    its weights and nothing else. The weights computed with are the same: the compute copy is the
    checkpoint cast to `actor.dtype` either way."""
    a = cfg.actor
    optimizer = dataclasses.replace(a.optimizer, type="sgd", momentum=0.0)
    storage = a.dtype if a.dtype in ("float32", "bfloat16") else a.optimizer_dtype  # float16: fp32 masters
    roundpipe = dataclasses.replace(a.roundpipe, optim_step="sync")
    return dataclasses.replace(
        cfg, actor=dataclasses.replace(a, optimizer_dtype=storage, optimizer=optimizer, roundpipe=roundpipe)
    )


def teacher_engine_config(cfg: LadenConfig) -> LadenConfig:
    """`cfg` with `actor` naming the teacher's model (path, revision, random init, dtype) and no LoRA:
    what `load_model` and the engine's `build` read; every engine setting stays the actor's."""
    t = cfg.teacher
    assert t is not None, "teacher_engine_config needs a teacher section"
    actor = dataclasses.replace(
        cfg.actor, path=t.path, revision=t.revision, init_from_config=t.init_from_config,
        dtype=t.dtype or cfg.actor.dtype, use_lora=False, lora_path=None,
    )  # fmt: skip
    return dataclasses.replace(cfg, actor=actor)


def critic_engine_config(cfg: LadenConfig) -> LadenConfig:
    """`cfg` with `actor` carrying the critic's engine settings (unset ones stay the actor's): what
    `load_model` and `build_engine` read."""
    c, a = cfg.critic, cfg.actor
    assert c is not None, "critic_engine_config needs a critic section"

    def own(value: Any, actor_value: Any) -> Any:
        return actor_value if value is None or value == "" else value

    actor = dataclasses.replace(
        a, path=own(c.path, a.path), init_from_config=own(c.init_from_config, a.init_from_config),
        backend=own(c.backend, a.backend), dtype=own(c.dtype, a.dtype),
        optimizer_dtype=own(c.optimizer_dtype, a.optimizer_dtype),
        gradient_checkpointing=own(c.gradient_checkpointing, a.gradient_checkpointing),
        mb_spec=own(c.mb_spec, a.mb_spec), optimizer=own(c.optimizer, a.optimizer), fsdp=own(c.fsdp, a.fsdp),
        roundpipe=own(c.roundpipe, a.roundpipe), archon=own(c.archon, a.archon),
    )  # fmt: skip
    if any(f.name == "use_lora" for f in dataclasses.fields(actor)):
        # the critic trains all its weights: its head is new
        actor = dataclasses.replace(actor, use_lora=False)
    return dataclasses.replace(cfg, actor=actor)
