"""Validation against the model: its attention heads must divide over the tensor and context splits.

`validate_against_model` takes the head counts (the engines call it with the loaded model's);
`model_errors` reads them from `actor.path`/config.json (as JSON: no weights, no torch), so
`laden config show` and every rank of a job report a head split that does not divide before
anything is loaded. A .gguf file, and a Hub id (`org/name`, `is_hub_id`) that is not a local path, are
checked only once loaded: the Hub model is fetched when the run starts (`laden.model.hf.hub`), not here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from laden.config.alloc import head_rule_errors
from laden.config.schema import LadenConfig
from laden.config.validate_alloc import parse_or_none

__all__ = ["is_hub_id", "model_errors", "read_model_config", "validate_against_model"]

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


def validate_against_model(
    cfg: LadenConfig, *, num_attention_heads: int, num_key_value_heads: int | None, rollout: bool = True
) -> list[str]:
    """Head-rule errors for actor `t`, `c` (and their product) and, if `rollout`, rollout `t`."""
    errors: list[str] = []
    heads = (num_attention_heads, num_key_value_heads)
    actor = parse_or_none(cfg.actor.backend)
    if actor is not None:
        field = f"actor.backend={cfg.actor.backend!r}"
        for size, axis in ((actor.tp, "tensor (t)"), (actor.cp, "context (c)")):
            errors += head_rule_errors(size, *heads, field=field, axis_name=axis)
        if actor.tp > 1 and actor.cp > 1 and not errors:
            errors += head_rule_errors(actor.tp * actor.cp, *heads, field=field, axis_name="t*c")
    rollout_mode = parse_or_none(cfg.rollout.backend) if rollout else None
    if rollout_mode is not None:
        field = f"rollout.backend={cfg.rollout.backend!r}"
        errors += head_rule_errors(rollout_mode.tp, *heads, field=field, axis_name="tensor (t)")
    return errors


_HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads")
_KV_HEAD_KEYS = ("num_key_value_heads", "n_head_kv", "num_kv_heads", "multi_query_group_num")


def model_errors(cfg: LadenConfig, *, rl: bool) -> list[str]:
    """The head rules of `validate_against_model` on `actor.path`/config.json, read without the weights."""
    path = cfg.actor.path
    if not path:
        return []  # reported by `laden.config.validate` where the job needs a model
    config, error = read_model_config(path)
    if error is not None:
        return [error]
    if config is None:
        return []  # a .gguf file: its heads are checked once it is loaded
    heads = _first_int(config, _HEAD_KEYS)
    if heads is None:
        return []  # an architecture without a head count: nothing to divide
    kv_heads = _first_int(config, _KV_HEAD_KEYS) or heads
    errors = validate_against_model(cfg, num_attention_heads=heads, num_key_value_heads=kv_heads, rollout=rl)
    source = Path(path).expanduser() / "config.json"
    return [f"{e} (head counts from {source})" for e in errors]


def read_model_config(path: str) -> tuple[dict[str, Any] | None, str | None]:
    """(`config.json` of the model at `path`, None), (None, None) for a .gguf file or a Hub id that is not a
    local path, or (None, error line)."""
    field = f"actor.path={path!r}"
    directory = Path(path).expanduser()
    if not directory.exists():
        if is_hub_id(path):
            return None, None  # fetched from the Hub (or its cache) when the run starts
        return None, (
            f"{field} does not exist and is not a Hub id (org/name); set actor.path to a Hugging Face model "
            "directory, a .gguf file or a Hub id such as Qwen/Qwen3-0.6B (a Hub model can also be downloaded "
            "first: `hf download <id> --local-dir DIR`, then actor.path=DIR)"
        )
    if directory.is_file():
        if directory.suffix == ".gguf":
            return None, None
        return (
            None,
            f"{field} is a file; set it to a Hugging Face model directory (config.json + weights) or a .gguf file",
        )
    file = directory / "config.json"
    if not file.is_file():
        return None, (
            f"{field} has no config.json; set actor.path to a Hugging Face model directory (config.json "
            "plus weights, as written by `save_pretrained`) or to a .gguf file"
        )
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return (
            None,
            f"{field}: {file} cannot be read ({e}); re-download the model or re-save it with `save_pretrained`",
        )
    if not isinstance(config, dict):
        return (
            None,
            f"{field}: {file} holds a {type(config).__name__}, not a JSON object; re-download the model",
        )
    return config, None


def is_hub_id(path: str) -> bool:
    """Whether `path` is shaped like a Hugging Face Hub repository id (`org/name`, the Hub's naming rules)."""
    return (
        bool(_HUB_ID.fullmatch(path)) and "--" not in path and ".." not in path and not path.endswith(".git")
    )


def _first_int(config: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    """The first integer under `keys`, at the top level or in `text_config` (multimodal models)."""
    for section in (config, config.get("text_config")):
        if not isinstance(section, dict):
            continue
        for key in keys:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
