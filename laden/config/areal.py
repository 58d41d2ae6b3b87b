"""AReaL's YAML in laden: map the keys laden has a meaning for, accept the rest with a warning.

AReaL's RL and SFT example files load in `laden rl` / `laden sft` unchanged but for model and
dataset paths. `from_areal` rewrites the resolved YAML tree (after overrides and `${...}`
interpolation, before the strict loader) in four passes:

1. Keys that are neither laden's nor AReaL's (`AREAL_KEYS`, every field of AReaL's config
   dataclasses, current and recent versions) inside a section laden does not have are errors,
   with the closest key; unknown keys in laden's own sections are left to the loader.
2. AReaL keys with a laden meaning are mapped: `allocation_mode` -> `rollout.backend` and
   `actor.backend`, `saver.freq_steps` -> `checkpoint.save_freq_steps`, `recover.mode` ->
   `checkpoint.resume`, `actor.init_from_scratch` -> `actor.init_from_config` (the critic's
   likewise; its `is_critic: true` is what laden's `critic` section is), the decoupled loss's
   behaviour weight (`_map_rejection`: AReaL 1.0.4's `actor.rejection_sampling`, or the names before
   it), `async_training: false` -> `rollout.max_head_offpolicyness: 0`, the `teacher` section's `train`
   form and `init_from_scratch` -> laden's `teacher`. Features laden does not have (tree training, ...)
   are errors that say so.
3. Copies (`rollout.experiment_name: ${experiment_name}`, `tokenizer_path: ${actor.path}`,
   `rollout.consumer_batch_size: ${train_dataset.batch_size}`, `stats_logger.fileroot:
   ${cluster.fileroot}`, ...) are dropped when they equal
   what they copy, and are errors when they differ, because laden reads the original only.
4. The remaining AReaL keys (schedulers, launchers, name resolution, tracers, server options,
   DataLoader workers, ...) are dropped; each group of them that would have done something in
   AReaL (its value is not null, false, 0, empty or `disabled`) gets one `logging` warning
   naming what laden does instead. Groups irrelevant to the run (the `vllm` section when
   rollouts use SGLang, `ref` without a KL term, every RL section in `laden sft`) are dropped in
   silence, as AReaL ignores them too.

AReaL's `stats_logger` (wandb, swanlab, tensorboard, trackio) is a section of laden's own schema with
AReaL's field names (`laden.trackers`), so it passes through the loader as it is written; only its
`experiment_name`, `trial_name` and `fileroot` are copies.

The data (AReaL's key table, the groups with their reasons, the copies and the refused
features) lives in `laden.config.areal_keys`; this module holds the passes, as short functions.

Trade-off: AReaL's defaults are not applied; a key an AReaL file leaves out takes laden's
default (`actor.kl_ctl` 0 instead of 0.1, `actor.ppo_n_minibatches` 1 instead of 4,
`actor.adv_norm` group mean and std instead of none; the schema names the first two). The
key table must follow AReaL's releases; an AReaL key missing from it is reported as unknown,
never ignored in silence.
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
import functools
import logging
from collections.abc import Iterator
from typing import Any

import yaml

from laden.config.alloc import AllocationMode, split_areal_allocation
from laden.config.areal_keys import (
    AREAL_KEYS,
    COPIES,
    MISSING,
    UNSUPPORTED,
    Group,
    KeyTree,
    Run,
    areal_node,
    group_of,
)
from laden.config.dotted import get_dotted, pop_dotted, put_dotted
from laden.config.schema import LadenConfig
from laden.config.validate_model import read_model_config

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------
# The passes


def from_areal(
    raw: dict[str, Any], *, job: str, laden_keys: tuple[str, ...], errors: list[str]
) -> dict[str, Any]:
    """`raw` with AReaL's keys mapped to laden's and the others dropped (see the module docstring).

    Appends an error line per problem to `errors`; `raw` is not modified.
    """
    data = copy.deepcopy(raw)
    laden = _laden_tree(laden_keys)
    areal_file = _speaks_areal(data, *laden)
    _drop_unknown(data, AREAL_KEYS, "", laden, errors)
    _unsupported(data, errors)
    _map_allocation_mode(data, errors)
    run = _run_of(data, job)
    rejection = functools.partial(_map_rejection, areal_file=areal_file)
    rules = (_map_async, _map_checkpoint, _map_init, _map_dropout, _map_attn_impl, rejection, _map_critic,
             _map_teacher)  # fmt: skip
    for rule in rules:
        rule(data, errors)
    _map_is_critic(data, run, errors)
    for dotted in ("gconfig.stop", "actor.mb_spec.n_mbs", "sglang.mem_fraction_static"):
        if get_dotted(data, dotted, 0) is None:  # AReaL's null: the engine's default, which laden has too
            pop_dotted(data, dotted)
    if get_dotted(data, "train_dataset.drop_last", None) is True:
        pop_dotted(data, "train_dataset.drop_last")  # what laden does
    hits: dict[Group, list[str]] = {}
    _sort_out(data, data, "", laden, run, hits, errors)
    for group, items in hits.items():
        kind = "an AReaL setting" if len(items) == 1 and "{" not in items[0] else "AReaL settings"
        log.warning("%s: %s without effect in laden; %s", ", ".join(items), kind, group.reason)
    return data


def _laden_tree(laden_keys: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str]]:
    """(laden's dotted keys, those of them that are sections)."""
    return _laden_tree_cached(tuple(laden_keys))


@functools.cache
def _laden_tree_cached(laden_keys: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str]]:
    keys = frozenset(laden_keys)
    return keys, frozenset(k.rsplit(".", 1)[0] for k in keys if "." in k)


def _speaks_areal(
    node: dict[str, Any], keys: frozenset[str], sections: frozenset[str], prefix: str = ""
) -> bool:
    """Whether the tree holds a key that is not laden's (an AReaL file, not one of laden's own)."""
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if dotted in sections and isinstance(value, dict):
            if _speaks_areal(value, keys, sections, f"{dotted}."):
                return True
        elif dotted not in keys:
            return True
    return False


def _drop_unknown(
    node: dict[str, Any],
    table: KeyTree,
    prefix: str,
    laden: tuple[frozenset[str], frozenset[str]],
    errors: list[str],
) -> None:
    """Report and remove keys that neither laden nor AReaL has, inside sections laden does not have."""
    keys, sections = laden
    laden_parent = prefix == "" or prefix[:-1] in sections
    for key in list(node):
        dotted, value = f"{prefix}{key}", node[key]
        sub = table.get(key, MISSING) if isinstance(key, str) else MISSING
        if sub is not MISSING or dotted in keys:
            if isinstance(value, dict) and (isinstance(sub, dict) or dotted in sections):
                _drop_unknown(value, sub if isinstance(sub, dict) else {}, dotted + ".", laden, errors)
            continue
        if laden_parent:
            continue  # the loader reports it, with laden's closest key
        del node[key]
        known = [f"{prefix}{k}" for k in table]
        close = difflib.get_close_matches(dotted, known, n=1, cutoff=0.6)
        fix = f"did you mean {close[0]}?" if close else "remove it"
        listing = (
            f" (AReaL's keys in {prefix[:-1]}: {', '.join(map(str, table))})" if len(table) <= 16 else ""
        )
        errors.append(f"{dotted}={_short(value)}: unknown key, neither laden's nor AReaL's; {fix}{listing}")


def _unsupported(data: dict[str, Any], errors: list[str]) -> None:
    for dotted, asks, message in UNSUPPORTED:
        value = pop_dotted(data, dotted)
        if value is not MISSING and asks(value):
            errors.append(f"{dotted}={_short(value)}: {message}")


def _run_of(data: dict[str, Any], job: str) -> Run:
    rl = job == "rl" or (job == "any" and get_dotted(data, "train_dataset.type", "sft") == "rl")
    rollout = str(get_dotted(data, "rollout.backend", "native")).partition(":")[0]
    kl = get_dotted(data, "actor.kl_ctl", 0)
    recover = get_dotted(data, "recover.mode", "disabled") in ("on", "auto", "fault", "resume")
    evaluator = get_dotted(data, "valid_dataset", None) is not None
    kind = job if job != "any" else get_dotted(data, "train_dataset.type", "sft")
    return Run(rl=rl, rollout=rollout, kl=isinstance(kl, (int, float)) and kl > 0, recover=recover,
                evaluator=evaluator, pairs=kind if kind in ("dpo", "rw") else None)  # fmt: skip


def _map_is_critic(data: dict[str, Any], run: Run, errors: list[str]) -> None:
    """AReaL's `actor.is_critic: true` is a reward model's actor: what `laden rw` trains, and only it."""
    value = pop_dotted(data, "actor.is_critic")
    if value is MISSING or value is None or bool(value) == (run.pairs == "rw"):
        return
    if value:
        errors.append(
            "actor.is_critic=true trains the actor as a reward model (a scalar head): run `laden rw` with "
            "train_dataset.type: rw; PPO's value model is laden's critic section; else remove actor.is_critic"
        )
    else:
        errors.append(
            "actor.is_critic=false: `laden rw` trains a reward model (AReaL's is_critic: true); set it to true "
            "or remove it, or run `laden dpo` / `laden sft` to train a language model"
        )


def _sort_out(
    root: dict[str, Any],
    node: dict[str, Any],
    prefix: str,
    laden: tuple[frozenset[str], frozenset[str]],
    run: Run,
    hits: dict[Group, list[str]],
    errors: list[str],
) -> None:
    """Remove the AReaL keys left under `node`: copies checked, groups recorded in `hits` where they matter."""
    keys, sections = laden
    for key in list(node):
        dotted, value = f"{prefix}{key}", node[key]
        if dotted in keys:
            if isinstance(value, dict) and dotted in sections:
                _sort_out(root, value, dotted + ".", laden, run, hits, errors)
            continue
        if areal_node(dotted) is MISSING:
            continue  # not AReaL's: the loader reports it
        del node[key]
        if _check_copy(root, dotted, value, run, errors):
            continue
        group = group_of(dotted)
        assert group is not None, f"AReaL key {dotted} has no group"  # test_every_areal_key_has_a_role
        if not group.when(run):
            continue
        value = _without_copies(root, value, dotted, run, errors)
        if not _inert(value):
            hits.setdefault(group, []).append(_describe(dotted, value))


def _describe(dotted: str, value: Any) -> str:
    """`key=value`, or `section.{a, b.c}` naming the keys of an AReaL section that ask for something."""
    leaves = list(_set_leaves(dotted, value))
    if len(leaves) == 1:
        return f"{leaves[0][0]}={_short(leaves[0][1])}"
    names = [k.removeprefix(dotted + ".") for k, _ in leaves]
    names = names if len(names) <= 6 else [*names[:5], f"... {len(names) - 5} more"]
    return f"{dotted}.{{{', '.join(names)}}}"


def _set_leaves(dotted: str, value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict) and isinstance(areal_node(dotted), dict):
        for key, sub in value.items():
            yield from _set_leaves(f"{dotted}.{key}", sub)
    elif not _inert(value):
        yield dotted, value


def _check_copy(root: dict[str, Any], dotted: str, value: Any, run: Run, errors: list[str]) -> bool:
    """Whether `dotted` is a copy (then an error is added if it differs from its source and matters)."""
    rule = next((c for c in COPIES if fnmatch.fnmatchcase(dotted, c.pattern)), None)
    if rule is None:
        return False
    if value is None or not rule.when(run):
        return True  # AReaL's null: take the source
    source = get_dotted(root, rule.source, MISSING)
    if source is MISSING:
        source = _laden_default(rule.source)
    if value != source:
        errors.append(
            f"{dotted}={_short(value)} differs from {rule.source}={_short(source)}: laden reads {rule.source} "
            f"only; set {dotted}: ${{{rule.source}}} (as AReaL's examples do), or remove it"
        )
    return True


def _without_copies(root: dict[str, Any], value: Any, dotted: str, run: Run, errors: list[str]) -> Any:
    if not isinstance(value, dict):
        return value
    out = {}
    for key, sub in value.items():
        if not _check_copy(root, f"{dotted}.{key}", sub, run, errors):
            out[key] = _without_copies(root, sub, f"{dotted}.{key}", run, errors)
    return out


def _inert(value: Any) -> bool:
    """Whether a value asks for nothing (null, false, 0, empty, 'disabled'), so dropping it changes nothing."""
    if isinstance(value, dict):
        return all(_inert(v) for v in value.values())
    if isinstance(value, (list, tuple, str)):
        return len(value) == 0 or value == "disabled"
    return value is None or value is False or (isinstance(value, (int, float)) and value == 0)


# ---------------------------------------------------------------------------------------
# Mapped keys


def _map_allocation_mode(data: dict[str, Any], errors: list[str]) -> None:
    """`allocation_mode: sglang:d4p1t1+fsdp:d4p1t1` -> rollout.backend and actor.backend.

    Also the older form `actor.backend: fsdp`, naming only the engine whose dims allocation_mode gives.
    """
    text = pop_dotted(data, "allocation_mode")
    engine = get_dotted(data, "actor.backend", None)
    bare = engine if engine in ("fsdp", "megatron", "archon") else None
    if bare is not None:
        pop_dotted(data, "actor.backend")
    if text in (MISSING, None):
        if bare is not None:
            errors.append(
                f"actor.backend={bare!r} names an engine without parallel sizes; write "
                f"actor.backend: {bare}:d<N> (e.g. {bare}:d4), or give AReaL's allocation_mode"
            )
        return
    shown = f"allocation_mode={text!r}"
    try:
        rollout, actor, auto = split_areal_allocation(str(text))
    except ValueError as err:
        errors.append(f"{shown}: {err}")
        return
    if rollout is not None:
        _assign(data, "rollout.backend", rollout, shown, errors)
    if actor is not None and bare is not None:
        if not auto and actor.partition(":")[0] != bare:
            errors.append(f"{shown} trains with {actor!r} but actor.backend={bare!r}; make them agree")
            return
        actor = f"{bare}:{actor.partition(':')[2]}"
    if actor is not None:
        _assign(data, "actor.backend", actor, shown, errors)


def _map_async(data: dict[str, Any], errors: list[str]) -> None:
    value = pop_dotted(data, "async_training")
    if value is MISSING or value is True:
        return  # laden's asynchrony is rollout.max_head_offpolicyness
    if value is not False:
        errors.append(f"async_training={_short(value)}: expected true or false")
        return
    lag = get_dotted(data, "rollout.max_head_offpolicyness", 0)
    if lag:
        log.warning(
            "async_training=false: rollouts are synchronous, so rollout.max_head_offpolicyness=%s is set to 0",
            lag,
        )
    put_dotted(data, "rollout.max_head_offpolicyness", 0)


_RECOVER_MODES = dict.fromkeys(("on", "auto", "fault", "resume"), "auto") | dict.fromkeys(
    ("off", "disabled"), "never"
)


def _map_checkpoint(data: dict[str, Any], errors: list[str]) -> None:
    freq = pop_dotted(data, "saver.freq_steps")
    if freq not in (MISSING, None):
        _assign(data, "checkpoint.save_freq_steps", freq, f"saver.freq_steps={freq!r}", errors)
    mode = pop_dotted(data, "recover.mode")
    if mode is MISSING:
        return
    if mode not in _RECOVER_MODES:
        errors.append(f"recover.mode={_short(mode)}: expected one of {', '.join(map(repr, _RECOVER_MODES))}")
        return
    _assign(data, "checkpoint.resume", _RECOVER_MODES[mode], f"recover.mode={mode!r}", errors)


def _map_init(data: dict[str, Any], errors: list[str]) -> None:
    value = pop_dotted(data, "actor.init_from_scratch")
    if value is not MISSING:
        _assign(data, "actor.init_from_config", value, f"actor.init_from_scratch={_short(value)}", errors)


def _map_dropout(data: dict[str, Any], errors: list[str]) -> None:
    """`disable_dropout: true` is laden's behaviour when the model has no dropout; else say it is kept."""
    for section in ("actor", "critic"):
        if pop_dotted(data, f"{section}.disable_dropout") is True:
            path = get_dotted(data, f"{section}.path", "") or get_dotted(data, "actor.path", "")
            _warn_dropout(section, path)


def _warn_dropout(section: str, path: Any) -> None:
    config, _ = read_model_config(path) if isinstance(path, str) and path else (None, None)
    dropouts = {
        k: v
        for part in (config or {}, (config or {}).get("text_config") or {})
        for k, v in part.items()
        if ("dropout" in k or k.endswith("_pdrop")) and isinstance(v, (int, float)) and v > 0
    }
    if dropouts:
        shown = ", ".join(f"{k}={v}" for k, v in dropouts.items())
        log.warning(
            "%s.disable_dropout=true: an AReaL setting without effect in laden; laden trains with the dropout "
            "of %s/config.json (%s): set those to 0.0 there to train without dropout",
            section,
            path,
            shown,
        )


def _map_critic(data: dict[str, Any], errors: list[str]) -> None:
    """AReaL's `critic` section: `is_critic: true` is what laden's critic is, `init_from_scratch` is
    `critic.init_from_config`, and a bare `backend: fsdp` (older files) names the actor's allocation."""
    is_critic = pop_dotted(data, "critic.is_critic")
    if is_critic is False:
        errors.append(
            "critic.is_critic=false: laden's critic section always trains a value model; remove critic.is_critic, "
            "or set critic: null to train without a critic"
        )
    init = pop_dotted(data, "critic.init_from_scratch")
    if init is not MISSING:
        _assign(data, "critic.init_from_config", init, f"critic.init_from_scratch={_short(init)}", errors)
    bare, actor = get_dotted(data, "critic.backend", None), get_dotted(data, "actor.backend", "")
    if bare not in ("fsdp", "megatron", "archon"):
        return
    if isinstance(actor, str) and actor.partition(":")[0] == bare:
        put_dotted(data, "critic.backend", actor)
    else:
        errors.append(
            f"critic.backend={bare!r} names an engine without parallel sizes and actor.backend={actor!r} is not a "
            f"{bare} allocation; write critic.backend: {bare}:d<N> (e.g. {bare}:d4), or leave it out for the actor's"
        )


def _map_teacher(data: dict[str, Any], errors: list[str]) -> None:
    """AReaL's `teacher`: the flat form of its example (a train engine's keys), or TeacherConfig's
    `engine_type: train` with the engine under `train` (lifted into `teacher`) or `engine_type: rollout`
    (an inference server in AReaL; `teacher.rollout` is dropped with a warning: laden scores the teacher
    on the actor's engine). `init_from_scratch` is `teacher.init_from_config`; `disable_dropout` is what
    laden's scoring does (engines score in eval mode)."""
    teacher = get_dotted(data, "teacher", None)
    if not isinstance(teacher, dict):
        return
    kind, train = pop_dotted(data, "teacher.engine_type"), pop_dotted(data, "teacher.train")
    if kind not in (MISSING, None, "train", "rollout"):
        errors.append(f"teacher.engine_type={_short(kind)}: expected train or rollout (AReaL's choices)")
    if kind == "train" and not isinstance(train, dict):
        errors.append("teacher.engine_type='train' needs the teacher.train section (AReaL's); add it, or write "
                      "the teacher's keys in teacher itself")  # fmt: skip
    if isinstance(train, dict) and kind in (MISSING, None, "train"):
        for key, value in train.items():
            _assign(data, f"teacher.{key}", value, f"teacher.train.{key}={_short(value)}", errors)
    init = pop_dotted(data, "teacher.init_from_scratch")
    if init is not MISSING:
        _assign(data, "teacher.init_from_config", init, f"teacher.init_from_scratch={_short(init)}", errors)
    pop_dotted(data, "teacher.disable_dropout")  # the teacher scores in eval mode: no dropout either way


_AREAL_ATTN = {"flash_attention_2": "auto", "flash_attention_3": "auto"}
_LADEN_ATTN = ("auto", "varlen", "sdpa", "eager")


def _map_attn_impl(data: dict[str, Any], errors: list[str]) -> None:
    """AReaL's flash-attention names are laden's `auto` (packed rows, no padding); others fall back to it."""
    value = get_dotted(data, "actor.attn_impl", MISSING)
    if value in _AREAL_ATTN:
        put_dotted(data, "actor.attn_impl", _AREAL_ATTN[value])
    elif isinstance(value, str) and value not in _LADEN_ATTN and (value == "flex_attention" or "/" in value):
        pop_dotted(data, "actor.attn_impl")
        log.warning(
            "actor.attn_impl=%r: an AReaL setting without effect in laden; laden picks its attention kernel by "
            "actor.attn_impl: auto (the default), varlen, sdpa or eager",
            value,
        )


def _map_rejection(data: dict[str, Any], errors: list[str], *, areal_file: bool) -> None:
    """The behaviour weight of AReaL's decoupled loss. 1.0.4's `rejection_sampling` is laden's section of that
    name, and without it an AReaL file (`areal_file`: it has keys laden lacks) gets 1.0.4's no weight
    (`apply_behav_imp_weight: false`); laden's own files keep laden's default. The names before 1.0.4
    (`behave_imp_weight_mode`, `behave_imp_weight_cap`) get what they meant then (`_legacy_weight`)."""
    spec, cap = pop_dotted(data, "actor.rejection_sampling"), pop_dotted(data, "actor.behave_imp_weight_cap")
    mode = pop_dotted(data, "actor.behave_imp_weight_mode")
    if not areal_file:  # laden's own section, read by laden's rules
        if spec is not MISSING:
            put_dotted(data, "actor.rejection_sampling", spec)
        return
    legacy = {
        k: v
        for k, v in (("behave_imp_weight_mode", mode), ("behave_imp_weight_cap", cap))
        if v is not MISSING
    }
    if not get_dotted(data, "actor.use_decoupled_loss", False):
        for shown in [f"rejection_sampling={_short(spec)}"] * isinstance(spec, dict) + [f"{k}={_short(v)}" for k, v in legacy.items()]:  # fmt: skip
            log.warning(  # AReaL ignores them too, and says so
                "actor.%s is ignored without actor.use_decoupled_loss (as in AReaL); set "
                "actor.use_decoupled_loss: true to weight or filter stale tokens",
                shown,
            )
        return
    if isinstance(spec, dict) and legacy:
        errors.append(
            f"actor.rejection_sampling={_short(spec)} (AReaL 1.0.4) and actor.{', actor.'.join(legacy)} (before "
            "1.0.4) both set the decoupled loss's behaviour weight; keep one of them"
        )
    elif isinstance(spec, dict):
        put_dotted(data, "actor.rejection_sampling", spec)
    elif spec not in (MISSING, None):
        errors.append(
            f"actor.rejection_sampling={_short(spec)} must be a section (level, action, metric, agg, upper, lower) "
            "or null"
        )
    elif legacy:
        _legacy_weight(data, mode, cap, errors)
    elif (
        areal_file and get_dotted(data, "actor.behav_imp_weight_cap", None) is None
    ):  # 1.0.4: no weight by default
        shown = "actor.rejection_sampling=null" if spec is None else "actor.use_decoupled_loss=true"
        _assign(data, "actor.apply_behav_imp_weight", False, f"{shown} (AReaL 1.0.4)", errors)


_LEGACY_MODES = {  # behave_imp_weight_mode -> (level, action) of AReaL 1.0.4's migration table
    "token_truncate": ("token", "clamp"),
    "sequence_mask": ("sequence", "mask"),
    "sequence_truncate": ("sequence", "clamp"),
}


def _legacy_weight(data: dict[str, Any], mode: Any, cap: Any, errors: list[str]) -> None:
    """AReaL's names before 1.0.4 (defaults `token_mask`, cap 5.0): `disabled` is no behaviour weight; `token_mask`
    is laden's `behav_imp_weight_cap` (the weight on every token, 0 above the cap); the other modes are the
    `rejection_sampling` AReaL 1.0.4's migration table gives them (clamping leaves every token in the loss, so
    the truncating modes mean the same under both semantics)."""
    mode = "token_mask" if mode in (MISSING, None) else mode
    cap = 5.0 if cap in (MISSING, None) else cap
    shown = f"actor.behave_imp_weight_mode={_short(mode)}"
    if mode == "disabled":
        _assign(data, "actor.apply_behav_imp_weight", False, shown, errors)
    elif mode == "token_mask":
        _assign(
            data,
            "actor.behav_imp_weight_cap",
            cap,
            f"{shown} with behave_imp_weight_cap={_short(cap)}",
            errors,
        )
    elif mode in _LEGACY_MODES:
        level, action = _LEGACY_MODES[mode]
        spec = {"level": level, "action": action, "metric": "ratio", "upper": cap}
        put_dotted(data, "actor.rejection_sampling", spec)
        log.info(
            "%s (before AReaL 1.0.4) is actor.rejection_sampling=%s, as AReaL 1.0.4 migrates it", shown, spec
        )
    else:
        errors.append(
            f"{shown} is not one of AReaL's modes; use disabled, token_mask, token_truncate, sequence_mask or "
            "sequence_truncate, or AReaL 1.0.4's actor.rejection_sampling section"
        )


def _assign(data: dict[str, Any], target: str, value: Any, source: str, errors: list[str]) -> None:
    """Set laden's `target` from the AReaL setting `source`; an error if the file sets `target` differently."""
    current = get_dotted(data, target, MISSING)
    if current is MISSING or _same(current, value):
        put_dotted(data, target, value)
        return
    errors.append(
        f"{source} gives {target}={_short(value)}, but {target}={_short(current)} is set too; "
        f"set only one of them ({target} is laden's)"
    )


def _same(a: Any, b: Any) -> bool:
    if a == b:
        return True
    try:
        return AllocationMode.parse(a) == AllocationMode.parse(b)  # `fsdp:d4p1t1` is `fsdp:d4`
    except ValueError:
        return False


def _laden_default(dotted: str) -> Any:
    node: Any = LadenConfig()
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _short(value: Any) -> str:
    """A value as the loader shows it (`'text'`, `4`, `true`, `null`), containers shortened."""
    if value is None or isinstance(value, bool):
        return yaml.safe_dump(value).removesuffix("\n...\n").strip()
    text = repr(value)
    if len(text) <= 60:
        return text
    if isinstance(value, list):
        return f"[{len(value)} item{'s' * (len(value) != 1)}]"
    if isinstance(value, dict):
        return f"{{{', '.join(map(str, value))}}}"[:60]
    return text[:57] + "..."
