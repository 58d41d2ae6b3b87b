"""Split and merge specs: `TensorChunkSpec(dim)` / `_Replicate` / `_CustomReducer` markers.

A spec mirrors the structure of the value it describes (a tuple for the positional
arguments, a dict for the keyword arguments, any nesting for a label or an output); each
marker governs the whole sub-tree at its position, and None there means the automatic rule
(`batching`). Outputs kept unmerged (`merge_output=False`) are `PackedOutputs`: one value per
micro-batch; given to another `RoundPipe` call with as many micro-batches they are handed
out one per micro-batch again, so a chain of models skips a merge and a re-split.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils import _pytree as pytree


class PackedOutputs(list):
    """One output leaf per micro-batch (`merge_output=False`); a plain list otherwise."""

    def synchronize(self) -> PackedOutputs:
        return self  # outputs are on the host once the call returns


def _markers() -> tuple[Any, Any, Any]:
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer, _Replicate

    return TensorChunkSpec, _Replicate, _CustomReducer


def is_marker(spec: Any) -> bool:
    chunk, replicate, reducer = _markers()
    return spec is None or spec is replicate or isinstance(spec, (chunk, replicate, reducer))


def leaf_rules(value: Any, spec: Any, where: str = "input") -> list[tuple[Any, Any]]:
    """(leaf, marker) for every pytree leaf of `value`, the marker being the spec over it (None: auto)."""
    if is_marker(spec):
        return [(leaf, spec) for leaf in pytree.tree_leaves(value)]
    if isinstance(spec, (tuple, list)) and isinstance(value, (tuple, list)) and len(spec) == len(value):
        return [pair for v, s in zip(value, spec) for pair in leaf_rules(v, s, where)]
    if isinstance(spec, dict) and isinstance(value, dict):
        unknown = set(spec) - set(value)
        if unknown:
            raise ValueError(f"the {where} spec names {sorted(unknown)}, which the {where} does not have")
        return [pair for k, v in value.items() for pair in leaf_rules(v, spec.get(k), where)]
    raise ValueError(
        f"the {where} spec {spec!r} does not match the {where}'s structure ({type(value).__name__}); give one "
        "TensorChunkSpec(dim) / _Replicate / None per element"
    )


def num_chunks(rules: list[tuple[Any, Any]], requested: int, auto_batch: int | None) -> int:
    """Micro-batches a spec'd split makes: `requested`, fewer when a split dim is shorter."""
    chunk, _, _ = _markers()
    sizes = [len(leaf) for leaf, _ in rules if isinstance(leaf, PackedOutputs)]
    if sizes:
        return sizes[0]
    for leaf, spec in rules:
        if isinstance(spec, chunk) and isinstance(leaf, torch.Tensor):
            sizes.append(leaf.shape[spec.split_dim])
        elif spec is None and _auto_splits(leaf, auto_batch):
            sizes.append(leaf.shape[0])
    return max(1, min([requested, *sizes])) if sizes else 1


def _auto_splits(leaf: Any, batch: int | None) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.ndim > 0 and leaf.shape[0] == batch


def split_leaf(leaf: Any, spec: Any, num: int, auto_batch: int | None) -> list[Any]:
    """`num` pieces of one leaf under its marker."""
    chunk, _, _ = _markers()
    if isinstance(leaf, PackedOutputs):
        if len(leaf) != num:
            raise ValueError(
                f"an unmerged output holds {len(leaf)} micro-batches but this call makes {num}; "
                "use the same num_microbatch in both calls"
            )
        return list(leaf)
    if isinstance(spec, chunk):
        if not isinstance(leaf, torch.Tensor):
            raise ValueError(f"TensorChunkSpec({spec.split_dim}) was given for a {type(leaf).__name__}")
        return list(torch.tensor_split(leaf, num, dim=spec.split_dim))
    if spec is None and num > 1 and _auto_splits(leaf, auto_batch):
        return list(torch.tensor_split(leaf, num, dim=0))
    return [leaf] * num


def merge_leaf(values: list[Any], spec: Any) -> Any:
    """One output leaf from its micro-batch values: concatenated, averaged, replicated or reduced."""
    chunk, replicate, reducer = _markers()
    first = values[0]
    if isinstance(spec, chunk):
        return torch.cat(values, dim=spec.split_dim)
    if isinstance(spec, reducer):
        return functools.reduce(spec.reduce_fn, values, spec.init_value)
    if spec is replicate or isinstance(spec, replicate):
        return first
    if isinstance(first, torch.Tensor):
        if first.ndim > 0:
            return torch.cat(values, dim=0)
        stacked = torch.stack(values)
        if stacked.is_floating_point() or stacked.is_complex():
            return stacked.mean(0)  # a scalar per micro-batch (a mean loss): averaged
        if bool((stacked == first).all()):  # an integer or bool scalar the micro-batches agree on
            return first
        return stacked.double().mean(0)  # integers that differ: their mean, as a float
    if any(v != first for v in values[1:]):
        raise ValueError(
            f"micro-batch outputs differ in a non-tensor value ({values!r}); give merge_output a function "
            "or a spec with a _CustomReducer for it"
        )
    return first
