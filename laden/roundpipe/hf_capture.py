"""Hugging Face's output capture (router logits, hidden states, attentions) through a `RoundPipe`.

A Hugging Face model records what `output_router_logits=True` / `output_hidden_states=True` ask
for with forward hooks that append each module's output to a collector (a context variable
of `transformers.utils.output_capturing`) while the model's forward runs. A `RoundPipe` inside
that forward (the layers `wrap_model_to_roundpipe` wraps without a preset) runs each layer once
per micro-batch, on device worker threads: the hooks would append micro-batch slices, in the
pipeline's order, or see no collector at all on another thread. So a call made while a
collector is active (`begin`) swaps each of its lists for one that tags every append with its
micro-batch (`scope`, entered by the passes around each micro-batch, also makes the collector
visible on the worker thread), and `end` puts back one entry per recorded output: the
micro-batches' slices concatenated along the batch dimension, in batch order. The model's
own code (say the router's load-balancing loss) then sees whole-batch outputs, as without
micro-batches.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

_local = threading.local()


def _current_microbatch() -> int | None:
    return getattr(_local, "mb", None)


class _TaggedList(list):
    """A collector list that remembers each append's micro-batch. `len()` is what the hooks would
    see without micro-batches: the entries before the call plus this micro-batch's own (Hugging
    Face reads it to capture the initial hidden state and to select hidden-state layers)."""

    def __init__(self, before: int) -> None:
        super().__init__()
        self.before = before
        self.tags: list[int | None] = []
        self.counts: dict[int | None, int] = defaultdict(int)

    def append(self, value: Any) -> None:
        mb = _current_microbatch()
        super().append(value)
        self.tags.append(mb)
        self.counts[mb] += 1

    def __len__(self) -> int:
        return self.before + self.counts[_current_microbatch()]


@dataclass
class Capture:
    """An active collector during one `RoundPipe` call (`begin` / `scope` / `end`)."""

    var: Any
    collected: dict[str, Any]
    swapped: dict[str, tuple[list, _TaggedList]]

    @contextlib.contextmanager
    def scope(self, mb: int) -> Iterator[None]:
        """Micro-batch `mb`'s layer calls on this thread: appends are tagged, the collector active."""
        previous = _current_microbatch()
        _local.mb = mb
        token = self.var.set(self.collected)
        try:
            yield
        finally:
            self.var.reset(token)
            _local.mb = previous


def begin() -> Capture | None:
    """The active Hugging Face collector with its lists swapped for tagging ones; None without one."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # a transformers without output capturing: nothing records
        return None
    collected = _active_collector.get()
    if not collected:
        return None
    if "router_logits" in collected and torch.is_grad_enabled():
        raise NotImplementedError(
            "output_router_logits=True under grad mode: a RoundPipe forward records the router logits "
            "without a graph, so the router's load-balancing loss would not reach the gradients; run "
            "it under torch.no_grad() (evaluation), or train with output_router_logits=False"
        )
    swapped: dict[str, tuple[list, _TaggedList]] = {}
    for key, value in list(collected.items()):
        if isinstance(value, list) and not key.startswith("_"):  # `_hidden_states_layers` is a selection
            tagged = _TaggedList(len(value))
            collected[key] = tagged
            swapped[key] = (value, tagged)
    return Capture(_active_collector, collected, swapped)


def end(capture: Capture | None) -> None:
    """Put the original lists back, extended with the call's outputs merged over micro-batches."""
    if capture is None:
        return
    for key, (original, tagged) in capture.swapped.items():
        original.extend(_merge(key, list.__iter__(tagged), tagged.tags))
        capture.collected[key] = original


def _merge(key: str, values: Iterator[Any], tags: list[int | None]) -> list[Any]:
    untagged: list[Any] = []
    per_mb: dict[int, list[Any]] = defaultdict(list)
    for value, mb in zip(values, tags):
        (untagged if mb is None else per_mb[mb]).append(value)
    if not per_mb:
        return untagged
    lists = [per_mb[mb] for mb in sorted(per_mb)]
    if len({len(x) for x in lists}) != 1:
        warnings.warn(
            f"RoundPipe: the micro-batches recorded different numbers of {key!r} outputs "
            f"({[len(x) for x in lists]}); they are left unmerged, one entry per micro-batch and layer",
            stacklevel=3,
        )
        return untagged + [v for x in lists for v in x]
    merged: list[Any] = []
    for parts in zip(*lists):
        if all(p is None for p in parts):
            merged.append(None)
        elif all(isinstance(p, torch.Tensor) for p in parts):
            merged.append(parts[0] if len(parts) == 1 else torch.cat([p.to(parts[0].device) for p in parts]))
        else:
            merged.append(parts[0])
    return untagged + merged


@contextlib.contextmanager
def recording(model: Any, keys: tuple[str, ...]) -> Iterator[dict[str, list]]:
    """For a model that is not run by its own forward (laden's split): its output-capturing hooks
    installed and a collector of `keys` active while the block runs; yields the collector."""
    from transformers.utils.output_capturing import _active_collector, maybe_install_capturing_hooks

    maybe_install_capturing_hooks(model)
    collected: dict[str, list] = {key: [] for key in keys}
    token = _active_collector.set(collected)
    try:
        yield collected
    finally:
        _active_collector.reset(token)


def router_aux_loss(model: Any, router_logits: list[torch.Tensor], attention_mask: Any) -> torch.Tensor:
    """The model family's own load-balancing loss over whole-batch router logits (one per layer)."""
    import sys

    loss_fn = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    if loss_fn is None:
        raise NotImplementedError(
            f"{type(model).__name__} has no load_balancing_loss_func in its module; output_router_logits "
            "is supported for the Hugging Face MoE families that define one (Qwen3-MoE, GPT-OSS, ...)"
        )
    return loss_fn(tuple(router_logits), model.num_experts, model.num_experts_per_tok, attention_mask)
