"""Load a `LadenConfig` from YAML plus dotted `key=value` overrides, and write it back.

Every problem is collected, never the first one only: unknown keys (with the closest
valid key), wrong types, bad override syntax, then the cross-field rules of `validate`.
One `ConfigError` lists them all. A field whose value is rejected keeps its default so
the remaining checks still run; the cost is that a cross-field rule may, rarely, judge a
default where the user meant something else (it is reported alongside the type error).
Type coercion is strict (no bool for int, no float for int) with two reliefs: an int is
accepted for a float, and a numeric string for a float, because YAML 1.1 reads `1e-5`
as a string. Path fields are made absolute as they load (`laden.config.paths`): a
config file's relative paths against its directory, the command line's and defaults against the
working directory.

AReaL's files load as they are: overrides follow Hydra's forms (`key=value`, `+key=value` adds
a key, `~key` deletes one), then `${dotted.key}` interpolations are resolved by OmegaConf
(only when the tree holds one, so plain files never import it), then `laden.config.areal`
maps AReaL's keys to laden's before the strict typed construction sees the tree.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from laden.config.areal import from_areal
from laden.config.paths import PathRule, note_rules, resolve_in_file, resolve_rest, warn_missing_datasets
from laden.config.schema import AUTO_KNOBS, LadenConfig
from laden.config.validate import validate_config
from laden.config.validate_agent import apply_agent_aliases
from laden.config.validate_data import dataset_errors

Job = Literal["sft", "rl", "dpo", "rw", "any"]


class ConfigError(ValueError):
    """All problems found in a configuration; `.errors` holds one line per problem."""

    def __init__(self, errors: Sequence[str]):
        self.errors = list(errors)
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"{len(self.errors)} configuration error(s):\n{lines}")


def load_config(path: str | Path | None, overrides: Sequence[str] = (), *, job: Job = "any") -> LadenConfig:
    """Read YAML at `path` (optional), apply overrides, resolve `${...}`, validate for `job`.

    Overrides are `key=value` (set), `+key=value` (add a key not set yet), `++key=value` (set)
    and `~key` / `~key=value` (delete it, the latter only while it holds that value).
    Raises ConfigError listing every problem.
    """
    errors: list[str] = []
    raw: dict[str, Any] = {}
    from_file: dict[str, tuple[str, PathRule]] = {}
    if path is not None:
        raw = _read_yaml(Path(path), errors)
        from_file = resolve_in_file(raw, Path(path))  # before overrides: only the file's own values
    for item in overrides:
        _apply_override(raw, item, errors)
    return _from_raw(raw, job=job, errors=errors, from_file=from_file)


def config_from_dict(data: Mapping[str, Any], *, job: Job = "any") -> LadenConfig:
    """Build and validate a config from a nested mapping (relative paths: to the working directory);
    raise ConfigError listing every problem."""
    return _from_raw(data, job=job, errors=[])


def _from_raw(
    data: Mapping[str, Any],
    *,
    job: Job,
    errors: list[str],
    from_file: dict[str, tuple[str, PathRule]] | None = None,
) -> LadenConfig:
    if job not in ("sft", "rl", "dpo", "rw", "any"):
        raise ValueError(f"job={job!r} is not one of 'sft', 'rl', 'dpo', 'rw', 'any'")
    data = _resolve_interpolations(dict(data), errors)
    data = from_areal(data, job=job, laden_keys=all_keys(), errors=errors)
    plain: dict[str, Any] = copy.deepcopy(dict(data))
    autos = _take_autos(plain, errors)
    cfg = _build(LadenConfig, plain, "", errors)
    cfg.auto = [*dict.fromkeys([*cfg.auto, *autos])]
    errors += [
        f"auto: {name!r} cannot be chosen automatically; the knobs that can: {', '.join(AUTO_KNOBS)}"
        for name in cfg.auto
        if name not in AUTO_KNOBS
    ]
    _cluster_from_launcher(cfg, data.get("cluster"))
    rules = resolve_rest(cfg, from_file or {})
    errors += note_rules(validate_config(cfg, job=job) + dataset_errors(cfg), rules)
    warn_missing_datasets(cfg, rules)
    if errors:
        raise ConfigError(errors)
    if cfg.max_concurrent_rollouts is not None:  # the alias agrees with rollout (checked above)
        cfg.rollout.max_concurrent_rollouts = cfg.max_concurrent_rollouts
    apply_agent_aliases(cfg)  # likewise checked by validate_config
    return cfg


def _take_autos(data: dict[str, Any], errors: list[str]) -> list[str]:
    """Remove every `AUTO_KNOBS` field whose value is `auto` from `data` (the field keeps its default
    until the planner resolves it) and return their dotted names."""
    found = []
    if data.get("max_concurrent_rollouts") == "auto":  # the top-level alias the OOM guide writes
        del data["max_concurrent_rollouts"]
        rollout = data.get("rollout")
        given = rollout.get("max_concurrent_rollouts") if isinstance(rollout, Mapping) else None
        if given not in (None, "auto"):
            errors.append(
                f"max_concurrent_rollouts=auto but rollout.max_concurrent_rollouts={given!r}: they are one knob; "
                "set one of them (or both to auto)"
            )
        else:
            found.append("rollout.max_concurrent_rollouts")
    for name in AUTO_KNOBS:
        *parents, leaf = name.split(".")
        node: Any = data
        for part in parents:
            node = node.get(part) if isinstance(node, Mapping) else None
        if isinstance(node, dict) and node.get(leaf) == "auto":
            del node[leaf]
            found.append(name)
    return found


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
    fields = {f.name for f in dataclasses.fields(cfg)}
    cls: type = type(cfg)
    for name in (n for n in _hints(cls) if n in fields):
        value = getattr(cfg, name)
        if dataclasses.is_dataclass(value):
            value = config_to_dict(value)
        elif isinstance(value, list):
            value = [config_to_dict(v) if dataclasses.is_dataclass(v) else v for v in value]
        out[name] = value
    return out


def format_config(cfg: LadenConfig) -> str:
    """The config as YAML text, sections in declaration order (for `laden config show`)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def dump_config(cfg: LadenConfig, path: str | Path) -> Path:
    """Write the config as YAML to `path` (parent directories created); `load_config` reads it back.
    The file is replaced atomically and never written through a link (`laden.safe_io`, a leaf
    module that imports nothing of laden)."""
    from laden.safe_io import atomic_write_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, format_config(cfg))


def _read_yaml(path: Path, errors: list[str]) -> dict[str, Any]:
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.y*ml") if p.is_file())
        example = str(path / (inside[0] if inside else "config.yaml"))
        found = f" (it holds {', '.join(inside[:5])}{', ...' if len(inside) > 5 else ''})" if inside else ""
        errors.append(
            f"config file {str(path)!r} is a directory{found}; pass the YAML file inside it (e.g. {example})"
        )
        return {}
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


_OVERRIDE_HINT = (
    "expected 'dotted.key=value' (set), '+dotted.key=value' (add a key) or '~dotted.key' (delete one), "
    "e.g. 'actor.mb_spec.max_tokens_per_mb=4096'"
)
_NO_VALUE = object()


def _apply_override(raw: dict[str, Any], item: str, errors: list[str]) -> None:
    """Apply one override to the nested `raw` mapping; the value is parsed as YAML."""
    prefix = next((p for p in ("++", "+", "~") if item.startswith(p)), "")
    key, sep, text = item[len(prefix) :].partition("=")
    key = key.strip()
    parts = key.split(".")
    if not key or not all(parts) or (not sep and prefix != "~"):
        errors.append(f"override {item!r}: {_OVERRIDE_HINT}")
        return
    value = _override_value(text) if sep else _NO_VALUE
    if prefix == "~":
        _delete(raw, parts, value, item, errors)
        return
    node = raw
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    leaf = parts[-1]
    if prefix == "+" and leaf in node:
        errors.append(
            f"override {item!r}: {key} is already set (to {_show(node[leaf])}); '+' adds a key that is not set "
            f"yet: write {key}={text} to change it"
        )
    elif isinstance(value, dict) and isinstance(node.get(leaf), dict):
        _deep_merge(node[leaf], value)  # `actor.mb_spec={n_mbs: 2}` keeps the file's other keys
    else:
        node[leaf] = value


def _override_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text  # not YAML (e.g. an unbalanced quote): take the text literally


def _delete(raw: dict[str, Any], parts: list[str], value: Any, item: str, errors: list[str]) -> None:
    """`~a.b` removes `a.b`; `~a.b=v` removes it only while it holds `v` (Hydra's rule)."""
    node: Any = raw
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    key = ".".join(parts)
    if not isinstance(node, dict) or parts[-1] not in node:
        errors.append(f"override {item!r}: {key} is not set, so there is nothing to delete; check the key")
    elif value is not _NO_VALUE and node[parts[-1]] != value:
        errors.append(
            f"override {item!r}: {key} is {_show(node[parts[-1]])}, not {_show(value)}; '~{key}=value' deletes "
            f"it only while it holds that value: write ~{key} to delete it whatever it holds"
        )
    else:
        del node[parts[-1]]


def _deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = value


# ---------------------------------------------------------------------------------------
# `${...}` interpolation


def _resolve_interpolations(raw: dict[str, Any], errors: list[str]) -> dict[str, Any]:
    """`raw` with every `${...}` resolved by OmegaConf (`${actor.path}`, `${oc.env:HOME}`, ...).

    A string that cannot be resolved is reported with its key and removed (its field keeps its
    default), so the other interpolations are still resolved and every error reported at once.
    """
    leaves = [(path, v) for path, v in _leaves(raw, ()) if isinstance(v, str) and "${" in v]
    if not leaves:
        return raw
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    data = copy.deepcopy(raw)
    good = []
    for path, value in leaves:  # a malformed one would make the whole tree fail to load
        try:
            OmegaConf.create({"v": value})
            good.append((path, value))
        except OmegaConfBaseException as err:
            errors.append(f"{_dotted(path)}={value!r}: not a valid interpolation ({_first_line(err)}); "
                          "write ${dotted.key}, e.g. ${actor.path}")  # fmt: skip
            _remove(data, path)
    try:
        conf = OmegaConf.create(_with_referenced_defaults(data, [v for _, v in good]))
    except (OmegaConfBaseException, ValueError) as err:
        errors.append(f"the config cannot be read for resolving its interpolations: {_first_line(err)}")
        return data
    for path, value in good:
        try:
            node: Any = conf
            for part in path:
                node = node[part]  # indexing the last one resolves it
            resolved = (
                OmegaConf.to_container(node, resolve=True)
                if isinstance(node, (DictConfig, ListConfig))
                else node
            )
        except OmegaConfBaseException as err:
            errors.append(_interpolation_error(path, value, err, raw))
            _remove(data, path)
            continue
        _place(data, path, resolved)
    return data


def _with_referenced_defaults(data: dict[str, Any], values: list[str]) -> dict[str, Any]:
    """`data` plus laden's default of every key an interpolation names that `data` leaves out (AReaL's
    `actor.max_new_tokens: ${gconfig.max_new_tokens}` in a file that sets `gconfig.max_tokens` only), for resolving
    only: the defaults are not written into the config."""
    named = {m for v in values for m in re.findall(r"\$\{([A-Za-z_][\w.]*)\}", v)}
    missing = named - {_dotted(p) for p, _ in _leaves(data, ())}
    defaults = {_dotted(p): v for p, v in _leaves(config_to_dict(LadenConfig()), ()) if _dotted(p) in missing}
    out = copy.deepcopy(data) if defaults else data
    for key, value in defaults.items():
        node: Any = out
        for part in key.split(".")[:-1]:
            node = node.setdefault(part, {}) if isinstance(node, dict) else None
        if isinstance(node, dict):  # not under a section the file sets to something else (null)
            node[key.rsplit(".", 1)[-1]] = value
    return out


def _interpolation_error(path: tuple[Any, ...], value: str, err: Exception, raw: dict[str, Any]) -> str:
    message = _first_line(err)
    missing = re.search(r"Interpolation key '([^']+)' not found", message)
    if missing is None:
        return f"{_dotted(path)}={value!r}: cannot resolve the interpolation ({message})"
    key = missing.group(1)
    known = [_dotted(p) for p, _ in _leaves(raw, ())]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    fix = f"did you mean ${{{close[0]}}}?" if close else f"set {key}, or write the value itself"
    return f"{_dotted(path)}={value!r}: cannot resolve the interpolation: {key} is not set; {fix}"


def _leaves(node: Any, path: tuple[Any, ...]) -> list[tuple[tuple[Any, ...], Any]]:
    if isinstance(node, dict):
        return [leaf for k, v in node.items() for leaf in _leaves(v, (*path, k))]
    if isinstance(node, list):
        return [leaf for i, v in enumerate(node) for leaf in _leaves(v, (*path, i))]
    return [(path, node)]


def _place(data: Any, path: tuple[Any, ...], value: Any) -> None:
    for part in path[:-1]:
        data = data[part]
    data[path[-1]] = value


def _remove(data: Any, path: tuple[Any, ...]) -> None:
    """Drop a mapping key (its field keeps its default); a list item becomes null (positions stay)."""
    for part in path[:-1]:
        data = data[part]
    if isinstance(data, dict):
        del data[path[-1]]
    else:
        data[path[-1]] = None


def _dotted(path: tuple[Any, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


# ---------------------------------------------------------------------------------------
# Typed construction


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The fields' types, the class's own fields first, then those it inherits (`LadenConfig`'s `AgentFields`)."""
    hints = typing.get_type_hints(cls)
    own = [name for name in vars(cls).get("__annotations__", {}) if name in hints]
    return {**{name: hints[name] for name in own}, **hints}


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


def list_section_type(tp: Any) -> type | None:
    """The dataclass type of a list-of-sections annotation (`list[X]`), else None."""
    if typing.get_origin(tp) is not list:
        return None
    (item,) = typing.get_args(tp)
    return item if isinstance(item, type) and dataclasses.is_dataclass(item) else None


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
    item_section = list_section_type(tp)
    if item_section is not None:  # a list of sections (`reward_fns`): each item built and checked
        if isinstance(value, (list, tuple)) and all(isinstance(v, Mapping) for v in value):
            return True, [_build(item_section, v, f"{dotted}[{i}].", errors) for i, v in enumerate(value)]
        errors.append(
            f"{dotted}={_show(value)}: expected a list of mappings, each with the keys "
            f"{', '.join(_hints(item_section))}"
        )
        return False, None
    choices = [a for a in typing.get_args(tp) if a is not type(None)] if _is_union(tp) else [tp]
    optional = _is_union(tp) and len(choices) < len(typing.get_args(tp))
    if optional and value is None:
        return True, None
    for choice in choices:  # `bool | Literal["auto"]`: the first alternative that takes the value
        converted = _convert_scalar(value, choice)
        if converted is not _INVALID:
            return True, converted
    expected = " or ".join(_describe(c) for c in choices) + (" or null" if optional else "")
    errors.append(f"{dotted}={_show(value)}: expected {expected}; set it to {_example(choices[0], default)}")
    return False, None


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
    if origin is dict:  # `dataset_kwargs`, `rename_columns`: names to values
        value_tp = typing.get_args(tp)[1]
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            return _INVALID
        mapped = {k: v if value_tp is Any else _convert_scalar(v, value_tp) for k, v in value.items()}
        return _INVALID if any(v is _INVALID for v in mapped.values()) else mapped
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
    if origin is dict:
        value_tp = typing.get_args(tp)[1]
        return "a mapping of names to " + {str: "strings", int: "integers"}.get(value_tp, "values")
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _example(tp: Any, default: Any) -> str:
    if default is not None and default != [] and default != {}:
        return f"e.g. {yaml_scalar(default)} (the default)"
    origin = typing.get_origin(tp)
    if origin is dict:
        return (
            "a mapping, e.g. {question: prompt}"
            if typing.get_args(tp)[1] is str
            else "a mapping, e.g. {key: 1}"
        )
    if origin is list:
        return "e.g. [1, 2]"
    return {bool: "true or false", int: "e.g. 4096", float: "e.g. 0.5"}.get(tp, "a valid value")


def yaml_scalar(value: Any) -> str:
    """`value` as inline YAML, e.g. `true`, `null`, `1.0e-05`, `[1, 2]`."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def _show(value: Any) -> str:
    text = yaml_scalar(value) if value is None or isinstance(value, bool) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
