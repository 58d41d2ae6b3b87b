"""`laden plan --profile`'s training step, per job: the engines the job builds and one step of each
(`laden.memory.profile.profile_phases` measures it; this module sits above `laden.rl` and `laden.align`,
which build them).

- `laden sft`: the policy's engine and its cross-entropy.
- `laden dpo` / `laden rw`: the same engine (`laden rw`'s model with its one-row head) and the pair
  job's objective (`laden.align.task.PairTask`) on micro-batches of whole pairs; DPO's reference
  log-probs ride in the micro-batches (no reference model: `laden.align.task`).
- `laden rl`: the policy's engine and the models beside it, built by the functions `laden rl` builds
  them with: the reference model (`actor.kl_ctl`) and the teacher (`teacher`) on the actor's engine
  (`laden.rl.scoring`), which score the micro-batches first, and the critic (`laden.rl.critic.Critic`),
  whose values are read, then stepped after the policy on the same micro-batches (zero targets: its
  memory does not depend on them). The policy's loss is the cross-entropy (an RL objective's extra
  per-token fields are a few bytes a token).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from laden.engine.runtime import load_model

Step = Callable[[list[Any]], float]
"""One optimizer step (of every trained model) on the micro-batches; the policy's loss."""


def training_step(cfg: Any, rt: Any, job: str) -> tuple[Any, Step]:
    """(the policy's engine, its step for `job`), every model built as the job builds it."""
    backend = rt.backend
    model = load_model(cfg, rt, backend)
    if job == "rw":
        from laden.model.value_head import to_value_model

        model = to_value_model(model)
    engine = backend.build(cfg, model, total_steps=1, device=rt.device)
    del model
    if job in ("dpo", "rw"):
        from laden.align.task import PairTask

        objective = PairTask(cfg, job).objective

        def pair_step(mbs: list[Any]) -> float:
            pairs = sum(len(mb.seqlens) for mb in mbs) // 2
            return float(engine.train_batch(mbs, global_num_loss_tokens=pairs, objective=objective)["loss"])

        return engine, pair_step
    scorers, critic = _rl_companions(cfg, rt, backend) if job == "rl" else ([], None)

    def step(mbs: list[Any]) -> float:
        from laden.rl.scoring import score

        for name, frozen in scorers:
            score(frozen, mbs, name, temperature=1.0)
        loss = float(
            engine.train_batch(mbs, global_num_loss_tokens=sum(mb.num_loss_tokens for mb in mbs))["loss"]
        )
        if critic is not None:
            _critic_step(critic, mbs)
        return loss

    return engine, step


def _rl_companions(cfg: Any, rt: Any, backend: Any) -> tuple[list[tuple[str, Any]], Any]:
    """The reference model and the teacher (as (field, engine)) and the critic, as `laden rl` builds them."""
    from laden.rl.scoring import build_teacher, frozen_engine

    scorers = []
    if cfg.actor.kl_ctl:
        scorers.append(("ref_logprobs", frozen_engine(cfg, rt, backend, total_steps=1)))
    if cfg.teacher is not None:
        from laden.model.hf.loading import load_tokenizer

        teacher = build_teacher(cfg, rt, backend, load_tokenizer(cfg.actor.path), total_steps=1)
        scorers.append(("teacher_logprobs", teacher))
    critic = None
    if cfg.critic is not None:
        from laden.rl.critic import Critic, ValueSettings

        critic = Critic(cfg, rt, settings=ValueSettings(), total_steps=1, global_sum=lambda n: n)
    return scorers, critic


def _critic_step(critic: Any, mbs: list[Any]) -> None:
    """The critic's values of `mbs`, then one step of its value loss toward zero returns."""
    critic.engine.forward(mbs, outputs=("values",))
    zeros = [torch.zeros(mb.num_tokens, device=mb.labels.device) for mb in mbs]
    fed = [mb.with_fields(old_values=z, returns=z) for mb, z in zip(mbs, zeros, strict=True)]
    normalizer = max(1, sum(mb.num_loss_tokens for mb in fed))
    critic.engine.forward_backward(fed, critic.objective, normalizer=normalizer)
    critic.engine.optimizer_step()
