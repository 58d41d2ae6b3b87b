"""Token-budget micro-batching: split a batch's sequences into micro-batches under a budget.

`actor.mb_spec.max_tokens_per_mb` bounds the tokens of one forward/backward pass, which is
what bounds activation memory; the batch size does not. Two partitioners:

- `ffd` (first-fit decreasing): fewest micro-batches in practice, O(n * bins); the last
  bins are often small, so pipeline stages idle on uneven micro-batches.
- `kk` (Karmarkar-Karp largest differencing, k-way): balanced token counts per micro-batch
  at the price of possibly one more micro-batch than `ffd`; O(n * k log k) per tried k.

Both return lists of sequence indices, each list sorted and the lists ordered by their
first index, so the same input always gives the same micro-batches in the same order.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Literal

PACKING_ALGORITHMS = ("ffd", "kk")
BUDGET_FIELD = "actor.mb_spec.max_tokens_per_mb"


def partition_microbatches(
    seqlens: Sequence[int],
    *,
    max_tokens_per_mb: int,
    n_mbs: int = 1,
    algorithm: Literal["ffd", "kk"] = "ffd",
) -> list[list[int]]:
    """Split sequences into at least `min(n_mbs, len(seqlens))` micro-batches of at most `max_tokens_per_mb` tokens."""
    partitioners: dict[str, Callable[[Sequence[int], int, int], list[list[int]]]] = {
        "ffd": ffd_partition,
        "kk": kk_partition,
    }
    if algorithm not in partitioners:
        raise ValueError(
            f"actor.mb_spec.packing_algorithm={algorithm!r} is not one of {PACKING_ALGORITHMS}; "
            "use `ffd` (fewest micro-batches) or `kk` (balanced micro-batches)"
        )
    if n_mbs < 1:
        raise ValueError(f"actor.mb_spec.n_mbs={n_mbs} must be at least 1")
    return partitioners[algorithm](seqlens, max_tokens_per_mb, n_mbs)


def ffd_partition(seqlens: Sequence[int], max_tokens: int, min_bins: int = 1) -> list[list[int]]:
    """First-fit decreasing bin packing of sequence indices under `max_tokens`, then split up to `min_bins`."""
    _check_inputs(seqlens, max_tokens, min_bins)
    loads: list[int] = []
    bins: list[list[int]] = []
    for index in sorted(range(len(seqlens)), key=lambda i: (-seqlens[i], i)):
        for b, load in enumerate(loads):
            if load + seqlens[index] <= max_tokens:
                loads[b] += seqlens[index]
                bins[b].append(index)
                break
        else:
            loads.append(seqlens[index])
            bins.append([index])
    _split_until(bins, seqlens, min(min_bins, len(seqlens)))
    return _canonical(bins)


def kk_partition(seqlens: Sequence[int], max_tokens: int, min_bins: int = 1) -> list[list[int]]:
    """Karmarkar-Karp k-way partition; k grows from the lower bound until every bin fits `max_tokens`."""
    _check_inputs(seqlens, max_tokens, min_bins)
    num_seqs = len(seqlens)
    if num_seqs == 0:
        return []
    k = max(min(min_bins, num_seqs), math.ceil(sum(seqlens) / max_tokens))
    # With k == num_seqs every sequence gets its own bin, which fits: the loop terminates.
    while True:
        bins = _karmarkar_karp(seqlens, k)
        if all(sum(seqlens[i] for i in b) <= max_tokens for b in bins):
            return _canonical(bins)
        k += 1


def _karmarkar_karp(seqlens: Sequence[int], k: int) -> list[list[int]]:
    """Largest differencing: repeatedly merge the two partial partitions with the largest spread."""
    # A partial partition is k (load, indices) bins sorted by decreasing load.
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for index, length in enumerate(seqlens):
        state = [(length, [index])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-length, index, state))
    counter = len(seqlens)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        # Heaviest bins of one side meet the lightest of the other.
        merged = [
            (load_a + load_b, items_a + items_b)
            for (load_a, items_a), (load_b, items_b) in zip(first, reversed(second))
        ]
        merged.sort(key=lambda bin_: (-bin_[0], min(bin_[1], default=-1)))
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], counter, merged))
        counter += 1
    bins = [items for _, items in heap[0][2]]
    # Positive lengths and k <= len(seqlens) leave no bin empty (the empty bins of one side
    # always meet the non-empty ones of the other).
    assert all(bins), "Karmarkar-Karp left an empty bin"
    return bins


def _split_until(bins: list[list[int]], seqlens: Sequence[int], num_bins: int) -> None:
    """Split the heaviest multi-sequence bin in two (alternating by length) until there are `num_bins`."""
    while len(bins) < num_bins:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        heaviest = max(splittable, key=lambda b: (sum(seqlens[i] for i in bins[b]), -b))
        by_length = sorted(bins[heaviest], key=lambda i: (-seqlens[i], i))
        bins[heaviest] = by_length[0::2]
        bins.append(by_length[1::2])


def _canonical(bins: list[list[int]]) -> list[list[int]]:
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def _check_inputs(seqlens: Sequence[int], max_tokens: int, min_bins: int) -> None:
    if max_tokens < 1:
        raise ValueError(f"{BUDGET_FIELD}={max_tokens} must be a positive number of tokens")
    if min_bins < 1:
        raise ValueError(f"actor.mb_spec.n_mbs={min_bins} must be at least 1")
    if not seqlens:
        return
    longest = max(range(len(seqlens)), key=lambda i: seqlens[i])
    if seqlens[longest] > max_tokens:
        raise ValueError(
            f"{BUDGET_FIELD}={max_tokens} is smaller than sequence {longest}, which has "
            f"{seqlens[longest]} tokens; set {BUDGET_FIELD} to at least {seqlens[longest]} "
            "(it must cover train_dataset.max_length + gconfig.max_new_tokens)"
        )
    shortest = min(range(len(seqlens)), key=lambda i: seqlens[i])
    if seqlens[shortest] < 1:
        raise ValueError(
            f"sequence {shortest} has {seqlens[shortest]} tokens; every sequence needs at least 1"
        )
