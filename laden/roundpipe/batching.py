"""Splitting a call's inputs and labels into micro-batches, and merging outputs back.

Default rule: the batch size is dim 0 of the first tensor argument; every tensor argument
whose dim 0 has that size is split into `num_microbatch` nearly equal pieces
(`torch.tensor_split`), everything else (scalars, flags, tensors of other sizes) is passed
whole to every micro-batch. When the batch is smaller than `num_microbatch`, there are as
many micro-batches as rows. Custom `split_input` / `split_label` callables replace the rule.

Packed rows (`[1, T]` with `cu_seq_lens_*`) cannot be split along dim 0: pass several rows
yourself, or use the config-driven engine, which takes one packed row per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from laden.engine.roundpipe.microbatch_spec import (
    PackedOutputs,
    leaf_rules,
    merge_leaf,
    num_chunks,
    split_leaf,
)


def batch_size_of(tree: Any) -> int | None:
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.ndim > 0:
            return leaf.shape[0]
    return None


def split_tree(tree: Any, num: int, batch: int) -> list[Any]:
    """`num` copies of `tree` with batch-sized tensors split along dim 0."""
    leaves, spec = pytree.tree_flatten(tree)
    columns = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.ndim > 0 and leaf.shape[0] == batch:
            columns.append(list(torch.tensor_split(leaf, num, dim=0)))
        else:
            columns.append([leaf] * num)
    return [pytree.tree_unflatten([col[i] for col in columns], spec) for i in range(num)]


def split_microbatches(
    args: tuple,
    kwargs: dict[str, Any],
    label: Any,
    num_microbatch: int,
    *,
    split_input: Callable | None = None,
    split_label: Callable | None = None,
) -> tuple[list[tuple[tuple, dict[str, Any]]], list[Any]]:
    """Per micro-batch `(args, kwargs)` and labels (see the module docstring)."""
    if split_input is not None and not callable(split_input):
        inputs = split_by_spec((tuple(args), dict(kwargs)), split_input, num_microbatch, "input")
    elif split_input is not None:
        args_list, kwargs_list = split_input(args, kwargs, num_microbatch)
        if not (
            isinstance(args_list, list)
            and isinstance(kwargs_list, list)
            and len(args_list) == len(kwargs_list)
        ):
            raise ValueError(
                "split_input must return two lists of equal length (args per micro-batch, kwargs)"
            )
        inputs = [(tuple(a), dict(k)) for a, k in zip(args_list, kwargs_list)]
    elif _has_packed((args, kwargs)):
        inputs = split_by_spec((tuple(args), dict(kwargs)), None, num_microbatch, "input")
    else:
        batch = batch_size_of((args, kwargs))
        if batch is None or min(num_microbatch, batch) <= 1:
            inputs = [(tuple(args), dict(kwargs))]
        else:
            inputs = split_tree((tuple(args), dict(kwargs)), min(num_microbatch, batch), batch)
    num = len(inputs)
    if split_label is not None and not callable(split_label):
        labels = split_by_spec(label, split_label, num, "label", exact=True)
    elif split_label is not None:
        labels = split_label(label, num)
        if not (isinstance(labels, list) and len(labels) == num):
            raise ValueError(f"split_label must return a list of {num} labels (one per micro-batch)")
    elif num == 1:
        labels = [label]
    else:
        label_batch = batch_size_of(label)
        labels = split_tree(label, num, label_batch) if label_batch is not None else [label] * num
    for args_i, kwargs_i in inputs:
        for leaf in pytree.tree_leaves((args_i, kwargs_i)):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                raise ValueError(
                    "an input tensor requires grad; RoundPipe computes gradients for the model's "
                    "parameters only. Pass inputs that do not require grad (detach them)"
                )
    return inputs, labels


def num_tokens(inputs: list[tuple[tuple, dict[str, Any]]]) -> int | None:
    """Tokens of the largest micro-batch: the size of its `input_ids` (else of its first integer
    tensor argument). None when there is none (not a language model): the planner then counts
    weights only.
    """
    counts = []
    for args, kwargs in inputs:
        ids = kwargs.get("input_ids")
        if not _is_token_ids(ids):
            ids = next((t for t in pytree.tree_leaves((args, kwargs)) if _is_token_ids(t)), None)
        if ids is not None:
            counts.append(ids.numel())
    return max(counts) if counts else None


def _is_token_ids(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.ndim > 0 and not leaf.is_floating_point()


def merge_outputs(outputs: list[Any], merge: Any = True) -> Any:
    """One output from the micro-batch outputs, by `merge` (`RoundPipeRunConfig.merge_output`).

    True: tensors with a batch dim are concatenated along dim 0, scalar tensors averaged,
    other values must agree. A function gets the list of outputs. A spec places markers
    (`laden.engine.roundpipe.microbatch_spec.merge_leaf`). False: each leaf becomes a `PackedOutputs` list.
    """
    if merge is not True and callable(merge):
        return merge(list(outputs))
    flat = [pytree.tree_flatten(o) for o in outputs]
    tree = flat[0][1]
    columns = [[leaves[i] for leaves, _ in flat] for i in range(len(flat[0][0]))]
    if merge is False:
        return pytree.tree_unflatten([PackedOutputs(col) for col in columns], tree)
    if len(outputs) == 1:
        return outputs[0]
    specs = (
        [None] * len(columns) if merge is True else [s for _, s in leaf_rules(outputs[0], merge, "output")]
    )
    return pytree.tree_unflatten([merge_leaf(col, s) for col, s in zip(columns, specs)], tree)


def split_by_spec(tree: Any, spec: Any, num_microbatch: int, where: str, *, exact: bool = False) -> list[Any]:
    """`tree` split into micro-batches by a spec of markers (`microbatch_spec`); `exact`: into exactly
    `num_microbatch` pieces (labels follow the inputs' count)."""
    rules = leaf_rules(tree, spec, where)
    packed = [leaf for leaf, _ in rules if isinstance(leaf, PackedOutputs)]
    # fed an unmerged output, the batch is its micro-batches' together: other batch-sized leaves split
    # with it, and a leaf of another length (however long) is replicated
    auto_batch = _packed_batch(packed[0]) if packed else batch_size_of(tree)
    num = num_microbatch if exact else num_chunks(rules, num_microbatch, auto_batch)
    columns = [split_leaf(leaf, marker, num, auto_batch) for leaf, marker in rules]
    tree_spec = pytree.tree_structure(tree)
    return [pytree.tree_unflatten([col[i] for col in columns], tree_spec) for i in range(num)]


def _packed_batch(packed: PackedOutputs) -> int | None:
    """The whole batch of an unmerged output: its micro-batches' dim-0 sizes summed (tensors only)."""
    sizes = [piece.shape[0] for piece in packed if isinstance(piece, torch.Tensor) and piece.ndim > 0]
    return sum(sizes) if len(sizes) == len(packed) else None


def _has_packed(tree: Any) -> bool:
    return any(isinstance(leaf, PackedOutputs) for leaf in pytree.tree_leaves(tree))
