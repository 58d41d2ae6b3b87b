"""Dotted access (`actor.optimizer.lr`) to a config file's nested mapping, as the AReaL mapping reads and
rewrites it before the file becomes a `LadenConfig`."""

from __future__ import annotations

from typing import Any

__all__ = ["MISSING", "get_dotted", "pop_dotted", "put_dotted"]

MISSING: Any = object()
"""The value of a key a tree does not hold (None is a value)."""


def get_dotted(data: dict[str, Any], dotted: str, default: Any) -> Any:
    """`data["a"]["b"]` for `a.b`; `default` where a part is missing or not a mapping."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def pop_dotted(data: dict[str, Any], dotted: str) -> Any:
    """Remove and return the value at `dotted`; `MISSING` when there is none."""
    *parents, leaf = dotted.split(".")
    node = get_dotted(data, ".".join(parents), None) if parents else data
    return node.pop(leaf, MISSING) if isinstance(node, dict) else MISSING


def put_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set the value at `dotted`, making (or replacing non-mapping) parents as mappings."""
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[leaf] = value
