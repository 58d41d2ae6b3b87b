"""Trajectories as training micro-batches: prompt + completion sequences packed to a token budget.

Each trajectory is one sequence, its prompt then its completion; the completion's tokens carry the
loss, except those a trajectory's `loss_mask` marks as not the model's (tool outputs and user turns inside
an agent's concatenated conversation). Per-token fields are given per completion token (`fields[name][i]` holds one value per token
of `trajs[i].completion_ids`) and land in the labels' layout (`laden.data.pack_samples`): the value
of completion token t sits at the position that predicts it, the one whose hidden state is the
state before token t. The policy's micro-batches carry `advantages` and `old_logprobs`; the
critic's carry `old_values` and `returns`, and read their values back per position with
`laden.data.unpack` in the order of `bins`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from laden.data import PackedBatch, pack_samples, partition_microbatches


def pack_trajectories(
    trajs: Sequence[Any],
    fields: Mapping[str, Sequence[Sequence[float]]],
    *,
    max_tokens_per_mb: int,
    n_mbs: int,
    algorithm: Literal["ffd", "kk"],
    device: torch.device,
    loss: Sequence[bool] | None = None,
) -> tuple[list[PackedBatch], list[list[int]]]:
    """(micro-batches on `device`, the trajectory indices each one holds, in packing order).

    loss: per trajectory, whether its completion tokens carry loss (default all); a trajectory
    without loss still packs, so its positions still get outputs from `TrainEngine.forward`.
    """
    samples: list[tuple[list[int], list[int]]] = []
    packed_fields: dict[str, list[list[float]]] = {name: [] for name in fields}
    for i, t in enumerate(trajs):
        p, c = len(t.prompt_ids), len(t.completion_ids)
        on = 1 if loss is None or loss[i] else 0
        mask = [on] * c if t.loss_mask is None else [on * int(m) for m in t.loss_mask]
        samples.append(([*t.prompt_ids, *t.completion_ids], [0] * p + mask))
        for name, values in fields.items():
            packed_fields[name].append([0.0] * p + [float(x) for x in values[i]])
    bins = partition_microbatches(
        [len(ids) for ids, _ in samples],
        max_tokens_per_mb=max_tokens_per_mb,
        n_mbs=n_mbs,
        algorithm=algorithm,
    )
    batches = []
    for b in bins:
        batch = pack_samples(
            [samples[i] for i in b], fields={k: [v[i] for i in b] for k, v in packed_fields.items()}
        )
        batches.append(batch.to(device, non_blocking=True))
    return batches, [list(b) for b in bins]


def repeated_prefix_tokens(sequences: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(tokens packing computes, tokens a prefix tree computes) for `sequences` (prompt + completion ids).

    laden packs every trajectory as a sequence of its own, so tokens that several sequences begin with
    (a group's shared prompt; with `export_style: individual`, every earlier turn of an agent's
    conversation) are computed once per sequence. AReaL's tree training (`enable_tree_training`, not
    implemented here) computes each distinct prefix once: the nodes of the sequences' token trie,
    counted here as the sum over the sorted sequences of each one's length past its common prefix with
    the one before it.
    """
    ordered = sorted(tuple(s) for s in sequences)
    tree = 0
    previous: tuple[int, ...] = ()
    for seq in ordered:
        common = 0
        for a, b in zip(seq, previous):
            if a != b:
                break
            common += 1
        tree += len(seq) - common
        previous = seq
    return sum(len(s) for s in ordered), tree
