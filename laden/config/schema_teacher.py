"""The `teacher` section of the config tree (AReaL's): on-policy distillation in `laden rl`.

The teacher is a second causal LM, frozen, that scores the policy's completions: its log-probs of
the sampled tokens enter the actor's loss (`laden.rl.objectives`, `DistillSettings`) weighted by
`distill_loss_weight`, beside the RL loss weighted by `rl_loss_weight`. It runs as laden's reference
model does: on the actor's engine and layout (`actor.backend`), in the actor's processes, on the
actor's micro-batches, never stepped (`laden.rl.scoring`).
"""

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, slots=True)
class TeacherConfig:
    """On-policy distillation (AReaL's `teacher`): a frozen model whose log-probs of the policy's completions enter the actor's loss; it runs on the actor's engine and layout (`actor.backend`), as the reference model does."""

    path: str = ""
    """Hugging Face model directory (or Hub id `org/name`) of the teacher; its tokenizer must give the actor's tokens the actor's ids. Relative paths as `actor.path`'s."""
    revision: str = ""
    """Branch, tag or commit of the Hub model when `path` is a Hub id; '' = main."""
    init_from_config: bool = False
    """Initialise the teacher randomly from `path`/config.json (seeded by `seed`) instead of loading its weights (AReaL's `init_from_scratch`; for tests)."""
    dtype: Literal["bfloat16", "float16", "float32"] | None = None
    """Compute dtype of the teacher's weights and activations; null = `actor.dtype`."""
    temperature: float | None = None
    """The teacher's logits are divided by it when it scores; null = `actor.temperature` (AReaL's default is 1.0)."""
    rl_loss_weight: float = 1.0
    """Weight of the RL loss (the PPO loss with its KL term); 0 = pure distillation: the loss is the teacher term alone, in its importance-weighted form."""
    distill_loss_weight: float = 0.005
    """Weight of the distillation term: per loss token `logp - teacher_logp` (rl_loss_weight > 0), or `-exp(logp - old_logp) * (teacher_logp - logp)` with the second logp held constant (rl_loss_weight = 0); AReaL's terms."""
