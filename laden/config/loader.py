"""Load a `LadenConfig` from YAML plus dotted `key=value` overrides, and write it back.

Every problem is collected, never the first one only: unknown keys (with the closest
valid key), wrong types, bad override syntax, then the cross-field rules of `validate`.
One `ConfigError` lists them all. A field whose value is rejected keeps its default so
the remaining checks still run; the cost is that a cross-field rule may, rarely, judge a
default where the user meant something else (it is reported alongside the type error).
Type coercion is strict (no bool for int, no float for int) with two reliefs: an int is
accepted for a float, and a numeric string for a float, because YAML 1.1 reads `1e-5`
as a string.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from laden.config.schema import LadenConfig
from laden.config.validate import validate_config

Job = Literal["sft", "rl", "any"]


class ConfigError(ValueError):
    """All problems found in a configuration; `.errors` holds one line per problem."""

    def __init__(self, errors: Sequence[str]):
        self.errors = list(errors)
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"{len(self.errors)} configuration error(s):\n{lines}")


def load_config(path: str | Path | None, overrides: Sequence[str] = (), *, job: Job = "any") -> LadenConfig:
    """Read YAML at `path` (optional), apply `key=value` overrides, validate for `job`.

    Raises ConfigError listing every problem.
    """
    errors: list[str] = []
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path), errors)
    for item in overrides:
        _apply_override(raw, item, errors)
    return _from_raw(raw, job=job, errors=errors)


def config_from_dict(data: Mapping[str, Any], *, job: Job = "any") -> LadenConfig:
    """Build and validate a config from a nested mapping; raise ConfigError listing every problem."""
    return _from_raw(data, job=job, errors=[])


def _from_raw(data: Mapping[str, Any], *, job: Job, errors: list[str]) -> LadenConfig:
    if job not in ("sft", "rl", "any"):
        raise ValueError(f"job={job!r} is not one of 'sft', 'rl', 'any'")
    cfg = _build(LadenConfig, data, "", errors)
    _cluster_from_launcher(cfg, data.get("cluster"))
    errors += validate_config(cfg, job=job)
    if errors:
        raise ConfigError(errors)
    if cfg.max_concurrent_rollouts is not None:  # the alias agrees with rollout (checked above)
        cfg.rollout.max_concurrent_rollouts = cfg.max_concurrent_rollouts
    return cfg


def _cluster_from_launcher(cfg: LadenConfig, given: Any) -> None:
    """Under torchrun, `cluster.n_nodes` / `cluster.n_gpus_per_node` left unset come from its
    environment (`WORLD_SIZE`, `LOCAL_WORLD_SIZE`), so `torchrun --nproc-per-node 2 ... actor.backend=
    fsdp:d2` needs no cluster fields; set ones are kept (a launch that contradicts them is reported
    when the run starts, naming both)."""
    world = os.environ.get("WORLD_SIZE")
    if world is None:
        return
    given = given if isinstance(given, Mapping) else {}
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if "n_gpus_per_node" not in given:
        cfg.cluster.n_gpus_per_node = per_node
    if "n_nodes" not in given:
        cfg.cluster.n_nodes = max(1, int(world) // max(per_node, 1))


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts/lists/scalars (YAML- and JSON-safe)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = config_to_dict(value)
        elif isinstance(value, list):
            value = list(value)
        out[f.name] = value
    return out


def format_config(cfg: LadenConfig) -> str:
    """The config as YAML text, sections in declaration order (for `laden config show`)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def dump_config(cfg: LadenConfig, path: str | Path) -> Path:
    """Write the config as YAML to `path` (parent directories created); `load_config` reads it back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(format_config(cfg))
    return path


def _read_yaml(path: Path, errors: list[str]) -> dict[str, Any]:
    if not path.is_file():
        errors.append(f"config file {str(path)!r} does not exist; pass an existing YAML file")
        return {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        errors.append(f"config file {str(path)!r} cannot be read as UTF-8 text ({err}); save it as UTF-8")
        return {}
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        errors.append(f"config file {str(path)!r} is not valid YAML: {err}")
        return {}
    if data is None:
        return {}
    if not isinstance(data, dict):
        errors.append(
            f"config file {str(path)!r} holds a {type(data).__name__}, expected a mapping of "
            "sections (e.g. 'actor:' with its keys below)"
        )
        return {}
    return data


def _apply_override(raw: dict[str, Any], item: str, errors: list[str]) -> None:
    """Set `a.b.c=value` into the nested `raw` mapping; the value is parsed as YAML."""
    key, sep, text = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or not all(parts):
        errors.append(
            f"override {item!r}: expected 'dotted.key=value', e.g. 'actor.mb_spec.max_tokens_per_mb=4096'"
        )
        return
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text  # not YAML (e.g. an unbalanced quote): take the text literally
    node = raw
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    leaf = parts[-1]
    if isinstance(value, dict) and isinstance(node.get(leaf), dict):
        _deep_merge(node[leaf], value)  # `actor.mb_spec={n_mbs: 2}` keeps the file's other keys
    else:
        node[leaf] = value


def _deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = value


# ---------------------------------------------------------------------------------------
# Typed construction


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def all_keys() -> tuple[str, ...]:
    """Every dotted key of the tree, sections included (e.g. `actor`, `actor.mb_spec.n_mbs`)."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, tp in _hints(cls).items():
            out.append(prefix + name)
            sub = section_type(tp)
            if sub is not None:
                walk(sub, prefix + name + ".")

    walk(LadenConfig, "")
    return tuple(out)


def section_type(tp: Any) -> type | None:
    """The dataclass type of a section annotation (`X` or `X | None`), else None."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] if _is_union(tp) else [tp]
    if len(args) == 1 and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _build(cls: type, data: Mapping[str, Any], prefix: str, errors: list[str]) -> Any:
    hints = _hints(cls)
    defaults = cls()
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in hints:
            errors.append(_unknown_key_error(dotted, value, cls, prefix))
            continue
        ok, coerced = _coerce(value, hints[key], dotted, errors, getattr(defaults, key))
        if ok:
            kwargs[key] = coerced
    return cls(**kwargs)


def _unknown_key_error(dotted: str, value: Any, cls: type, prefix: str) -> str:
    keys = all_keys()
    leaf = dotted.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    close = same_leaf or difflib.get_close_matches(dotted, keys, n=1, cutoff=0.6)
    section = prefix.rstrip(".") or "the top level"
    valid = ", ".join(_hints(cls))
    fix = f"did you mean {' or '.join(close)}?" if close else "remove it"
    return f"{dotted}={_show(value)}: unknown key; {fix} (valid keys in {section}: {valid})"


def _coerce(value: Any, tp: Any, dotted: str, errors: list[str], default: Any) -> tuple[bool, Any]:
    """(True, value converted to `tp`) or (False, None) after appending an error naming `default`."""
    section = section_type(tp)
    if section is not None:
        if value is None and _is_union(tp):
            return True, None
        if isinstance(value, Mapping):
            return True, _build(section, value, dotted + ".", errors)
        errors.append(
            f"{dotted}={_show(value)}: this is a section, not a value; give a mapping of its keys, "
            f"e.g. {dotted}.{next(iter(_hints(section)))}=..."
        )
        return False, None
    optional = _is_union(tp)
    if optional:
        if value is None:
            return True, None
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
    converted = _convert_scalar(value, tp)
    if converted is _INVALID:
        expected = _describe(tp) + (" or null" if optional else "")
        errors.append(f"{dotted}={_show(value)}: expected {expected}; set it to {_example(tp, default)}")
        return False, None
    return True, converted


_INVALID = object()


def _convert_scalar(value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value if isinstance(value, str) and value in typing.get_args(tp) else _INVALID
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            return _INVALID
        items = [_convert_scalar(v, item_tp) for v in value]
        return _INVALID if any(v is _INVALID for v in items) else items
    if tp is bool:
        return value if isinstance(value, bool) else _INVALID
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _INVALID
    if tp is float:
        return _to_float(value)
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # e.g. `trial_name: 2`
        return value if isinstance(value, str) else _INVALID
    return value


def _to_float(value: Any) -> Any:
    if isinstance(value, bool):
        return _INVALID
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads `1e-5` as a string
        except ValueError:
            return _INVALID
    return _INVALID


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if origin is list:
        return (
            "a list of integers" if typing.get_args(tp)[0] is int else f"a list of {typing.get_args(tp)[0]}"
        )
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _example(tp: Any, default: Any) -> str:
    if default is not None and default != []:
        return f"e.g. {yaml_scalar(default)} (the default)"
    origin = typing.get_origin(tp)
    if origin is list:
        return "e.g. [1, 2]"
    return {bool: "true or false", int: "e.g. 4096", float: "e.g. 0.5"}.get(tp, "a valid value")


def yaml_scalar(value: Any) -> str:
    """`value` as inline YAML, e.g. `true`, `null`, `1.0e-05`, `[1, 2]`."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def _show(value: Any) -> str:
    text = yaml_scalar(value) if value is None or isinstance(value, bool) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
