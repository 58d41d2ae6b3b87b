"""The reward, started and checked before anything else of a run: a reward that cannot work stops the run
at start-up with the reason, never after hours of training on zeros.

`start_rewards(cfg, sources, tokenizer)`:
1. starts the `RewardPool` on `reward_fn` (with `reward_fn_style`) or `reward_fns`; its workers import
   the reward in subprocesses, so a module that blocks at import is reported after
   `reward_import_timeout_s`, never inherited by the trainer;
2. checks every row of every data source (training and held-out) for the fields the reward's signature
   requires, naming the file and line of the first row that lacks one and how many do;
3. calls the reward once on the first training row with an empty completion: a call that fails (a
   missing package such as math-verify, a signature that does not take laden's arguments, a field of
   the wrong kind) stops the run with the reward's own error. A reward must score any completion,
   and an empty one is what an untrained model may produce.
The pool is closed again when any check fails.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from laden.rl.reward_pool import RewardPool
from laden.rl.reward_styles import RAW_PROMPT_KEY, RewardInfo, RewardSpec, missing_fields

log = logging.getLogger("laden.rl")


class RewardCheckError(ValueError):
    """The reward cannot score this run's data (a start-up check failed); the message says why and the fix."""


def reward_specs(cfg: Any) -> str | list[RewardSpec]:
    """What the pool scores with: `reward_fns` when set, else `reward_fn` with `reward_fn_style`."""
    if cfg.reward_fns:
        return [RewardSpec(fn=r.fn, weight=r.weight, style=r.style, name=r.name) for r in cfg.reward_fns]
    if cfg.reward_fn_style == "auto":
        return cfg.reward_fn
    return [RewardSpec(fn=cfg.reward_fn, style=cfg.reward_fn_style)]


def describe(specs: str | list[RewardSpec]) -> str:
    """The reward as a config names it, for messages."""
    if isinstance(specs, str):
        return f"reward_fn={specs!r}"
    return ", ".join(f"{s.fn!r} (weight {s.weight:g}, style {s.style})" for s in specs)


async def start_rewards(
    cfg: Any, sources: Sequence[Any], tokenizer: Any, *, probe: bool = True
) -> tuple[RewardPool, RewardInfo]:
    """The started and checked pool and what its workers found (see the module docstring). `sources`:
    the data sources (`laden.data.Records`), training first."""
    specs = reward_specs(cfg)
    pool = RewardPool(
        specs, num_workers=cfg.reward_workers, timeout_s=cfg.reward_timeout_s,
        import_timeout_s=cfg.reward_import_timeout_s, max_calls_per_worker=cfg.reward_worker_max_calls,
        max_rss_gb=cfg.reward_worker_max_rss_gb,
    )  # fmt: skip
    try:
        info = pool.wait_ready()  # blocks the loop: nothing else runs at start-up
        for records in sources:
            check_fields(info, records)
        if probe and sources:
            await probe_call(pool, specs, sources[0], tokenizer)
    except BaseException:
        pool.close()
        raise
    log.info(
        "reward: %s (%s), ready",
        describe(specs),
        ", ".join(f"{n}: {s}" for n, s in zip(info.names, info.styles)),
    )
    return pool, info


def check_fields(info: RewardInfo, records: Sequence[Mapping[str, Any]]) -> None:
    """Raise `RewardCheckError` naming the first row (file and line) that lacks a field the reward needs."""
    bad = [(i, missing) for i, row in enumerate(records) if (missing := missing_fields(info, row))]
    if not bad:
        return
    i, missing = bad[0]
    source = getattr(records, "source", "the dataset")
    where = records.where(i) if hasattr(records, "where") else f"{source} row {i + 1}"
    raise RewardCheckError(
        f"{where}: the row has no {', '.join(repr(m) for m in missing)} field, which the reward needs "
        f"({_needs(info)}); {len(bad)} of {len(records)} rows of {source} lack one. Add the field to every row, "
        "or rename the column to the name the reward function takes"
    )


def _needs(info: RewardInfo) -> str:
    parts = [
        f"{name} takes {', '.join('|'.join(alt) for alt in req)}"
        for name, req in info.required_fields.items()
        if req
    ]
    return "; ".join(parts) or "its signature"


async def probe_call(
    pool: RewardPool, specs: str | list[RewardSpec], records: Sequence[Mapping[str, Any]], tokenizer: Any
) -> None:
    """Score the first row's prompt with an empty completion; a failed call is a `RewardCheckError`."""
    from laden.rl.workflow import render_prompt, reward_fields

    row = dict(records[0])
    try:
        prompt = render_prompt(row, tokenizer)
    except (ValueError, TypeError, KeyError):
        return  # a custom workflow's rows: its own prompt fields, which only it can render
    kwargs = dict(reward_fields(row, prompt.key), prompt=prompt.text, completion="")
    kwargs.update(prompt_ids=list(prompt.ids), completion_ids=[], **{RAW_PROMPT_KEY: row[prompt.key]})
    outcome = await pool.score_outcome(**kwargs)
    if outcome.error is not None:
        where = records.where(0) if hasattr(records, "where") else "the first row"
        raise RewardCheckError(
            f"{describe(specs)} fails on a probe call with {where} and an empty completion, so it would fail "
            f"on every completion of the run:\n{outcome.error.rstrip()}\nA reward function must score any "
            "completion (an empty one scores 0); fix it, or install what it imports"
        )
