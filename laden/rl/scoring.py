"""Frozen models that score the policy's completions in `laden rl`: the reference model of
`actor.kl_ctl` and the teacher of on-policy distillation (`teacher`).

Both are built the same way (`frozen_engine`): loaded as the actor's model is (`load_model`: the
engine's loader, its patches), on the actor's engine and layout (`actor.backend`) in the actor's
processes, and never stepped: their weights are stored in the compute dtype with no master copy and no
optimizer state (`never_stepped`). Under `roundpipe` they live in host memory and stream through the
GPU as the policy does; under `fsdp` and `archon` they are sharded as the policy is. `score` adds their
log-probs of the labels to the policy's micro-batches as a per-token field, the same call the
trainer's own recomputed log-probs use. The reference model is the initial policy (`actor.path`); the
teacher is `teacher.path` (`teacher_engine_config`), whose tokenizer must agree with the actor's
(`check_teacher_vocab`): the labels are the actor's token ids and index the teacher's head.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from laden.config import LadenConfig
from laden.config.model_configs import never_stepped, teacher_engine_config
from laden.data import PackedBatch
from laden.engine.runtime import load_model

log = logging.getLogger("laden.rl")


def frozen_engine(
    cfg: LadenConfig,
    rt: Any,
    backend: Any,
    *,
    total_steps: int,
    check: Callable[[nn.Module], None] | None = None,
) -> Any:
    """An engine over the model `cfg.actor` names, on `backend` (the actor's engine), never stepped
    (`never_stepped`); `check(model)` runs on the loaded model before the engine takes it."""
    cfg = never_stepped(cfg)
    model = load_model(cfg, rt, backend)
    if check is not None:
        check(model)
    return backend.build(cfg, model, total_steps=total_steps, device=rt.device)


def score(engine: Any, mbs: list[PackedBatch], name: str, *, temperature: float) -> None:
    """Put `engine`'s log-probs of the labels into each of `mbs` (in place) as the per-token field `name`."""
    outs = engine.forward(mbs, outputs=("logprobs",), temperature=temperature)
    for i, (mb, out) in enumerate(zip(mbs, outs)):
        mbs[i] = mb.with_fields(**{name: out["logprobs"].to(mb.labels.device)})


def teacher_temperature(cfg: LadenConfig) -> float:
    """The temperature the teacher scores at: `teacher.temperature`, else `actor.temperature`."""
    assert cfg.teacher is not None
    t = cfg.teacher.temperature
    return cfg.actor.temperature if t is None else t


def build_teacher(cfg: LadenConfig, rt: Any, backend: Any, tokenizer: Any, *, total_steps: int) -> Any:
    """The teacher's frozen engine (`teacher_engine_config`), its vocabulary checked against `tokenizer`."""
    tcfg = teacher_engine_config(cfg)
    rows = {}

    def vocab_rows(model: nn.Module) -> None:
        head = model.get_output_embeddings()
        rows["head"] = int(head.weight.shape[0]) if head is not None else None

    engine = frozen_engine(tcfg, rt, backend, total_steps=total_steps, check=vocab_rows)
    teacher_tokenizer = _tokenizer_or_none(tcfg.actor.path)
    problem = check_teacher_vocab(tokenizer, teacher_tokenizer, rows.get("head"), path=tcfg.actor.path)
    if problem:
        raise ValueError(problem)
    t = cfg.teacher
    assert t is not None
    log.info("teacher %s on %s (never stepped): distill_loss_weight=%s, rl_loss_weight=%s", tcfg.actor.path,
             cfg.actor.backend, t.distill_loss_weight, t.rl_loss_weight)  # fmt: skip
    return engine


def _tokenizer_or_none(path: str) -> Any:
    from laden.model.hf.loading import load_tokenizer

    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as exc:
        log.warning("teacher.path=%r has no tokenizer that loads (%s): the actor's token ids are scored as "
                    "they are", path, exc)  # fmt: skip
        return None


def check_teacher_vocab(
    actor_tokenizer: Any, teacher_tokenizer: Any, head_rows: int | None, *, path: str
) -> str:
    """'' when the teacher can score the actor's tokens, else the error: the teacher's head must have a
    row for every actor token id, and a token both tokenizers know must have the same id in both (a
    token only the actor knows is scored by the teacher's row of that id, with a warning)."""
    actor_vocab = actor_tokenizer.get_vocab()
    largest = max(actor_vocab.values()) if actor_vocab else -1
    if head_rows is not None and head_rows <= largest:
        return (
            f"teacher.path={path!r}: the teacher's output head has {head_rows} rows but the actor's tokenizer has "
            f"token ids up to {largest}; the teacher must share the actor's tokenizer (a model of the same "
            "family), or set teacher: null"
        )
    if teacher_tokenizer is None:
        return ""
    theirs = teacher_tokenizer.get_vocab()
    moved = [(tok, i, theirs[tok]) for tok, i in actor_vocab.items() if tok in theirs and theirs[tok] != i]
    if moved:
        shown = ", ".join(f"{tok!r}: {i} vs {j}" for tok, i, j in moved[:3])
        return (
            f"teacher.path={path!r}: {len(moved)} tokens have other ids in the teacher's tokenizer than in the "
            f"actor's ({shown}, as actor vs teacher); the teacher's log-probs of the actor's ids would be those "
            "of other tokens. Use a teacher of the actor's model family (the same tokenizer), or set teacher: null"
        )
    missing = [tok for tok in actor_vocab if tok not in theirs]
    if missing:
        log.warning(
            "teacher.path=%r: %d of the actor's tokens are not in the teacher's tokenizer (e.g. %s); the teacher "
            "scores them by its head's rows of those ids",
            path, len(missing), ", ".join(map(repr, missing[:3])),
        )  # fmt: skip
    return ""
