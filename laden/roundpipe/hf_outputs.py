"""Hugging Face call conventions for a wrapped causal LM: model-output types and loss inputs.

A Hugging Face causal LM called with `labels` returns its mean next-token loss in
`out.loss` (`sum / num_items_in_batch` when that count is given), and its logits in
`out.logits` unless `return_logits=False`. The split pipeline's head does not compute
logits (`laden.model.split.HeadStep`), so these options are taken out of the model inputs
before they reach the first layer and applied to the head output:

- in `forward_backward` they ride with each micro-batch's label to the fused stage, where the
  loss is the chunked cross-entropy on the device (`[T, V]` logits are only built when
  `return_logits` is not False, which is the memory the option exists to save);
- in `forward` the merged logits come back to the host and the loss is computed there from
  them, so that it is differentiable through the call's graph (`autograd.py`).

Each micro-batch's loss is divided by `num_items_in_batch` when given (then the summed
micro-batch losses equal the whole batch's mean), else by its own count of target tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from laden.model.split import LMHeadOutput, causal_lm_loss, shift_labels

HF_OPTIONS = ("labels", "return_logits", "num_items_in_batch")
IGNORE_INDEX = -100


def pop_hf_options(kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """Remove the Hugging Face loss options from a call's kwargs; None when there were none."""
    found = {key: kwargs.pop(key) for key in HF_OPTIONS if key in kwargs}
    return found or None


def _output(loss: torch.Tensor | None, logits: torch.Tensor | None) -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=loss, logits=logits)


def _denominator(targets: torch.Tensor, options: dict[str, Any]) -> Any:
    count = options.get("num_items_in_batch")
    if count is None:
        return (targets != IGNORE_INDEX).sum()
    return count.to(targets.device) if isinstance(count, torch.Tensor) else count


def head_output(head: LMHeadOutput, options: dict[str, Any]) -> Any:
    """The model output of one micro-batch on the device (in the fused stage's loss)."""
    labels, loss = options.get("labels"), None
    if labels is not None:
        targets = shift_labels(labels, IGNORE_INDEX)
        loss = causal_lm_loss(head, targets, ignore_index=IGNORE_INDEX) / _denominator(targets, options)
    logits = head.logits if options.get("return_logits", True) is not False else None
    return _output(loss, logits)


def moe_output(model: Any, output: Any, router_logits: list[torch.Tensor], attention_mask: Any) -> Any:
    """`output` (a `forward` call's) with the router's logits and load-balancing loss, as the MoE
    family's own forward returns them: the loss with labels gains `router_aux_loss_coef` times it."""
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    from laden.roundpipe.hf_capture import router_aux_loss

    aux = router_aux_loss(model, router_logits, attention_mask)
    loss = output.loss
    if loss is not None:
        loss = loss + model.router_aux_loss_coef * aux.to(loss.device)
    per_layer: Any = tuple(router_logits)  # transformers annotates it as a 1-tuple
    return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=output.logits, router_logits=per_layer)


def host_output(logits: torch.Tensor, options: dict[str, Any] | None) -> Any:
    """The model output of a whole `forward` call from its merged logits `[B, T, V]`."""
    options = options or {}
    labels, loss = options.get("labels"), None
    if labels is not None:
        targets = shift_labels(labels.to(logits.device), IGNORE_INDEX)
        total = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
            ignore_index=IGNORE_INDEX, reduction="sum",
        )  # fmt: skip
        loss = total / _denominator(targets, options)
    return _output(loss, logits if options.get("return_logits", True) is not False else None)


def with_hf_labels(
    inputs: list[tuple[tuple, dict[str, Any]]], labels: list[Any], loss_fn: Any
) -> tuple[list[Any], Any] | None:
    """For `forward_backward`: move the options out of each micro-batch's kwargs into its label and
    wrap `loss_fn` to see the model output; None when no micro-batch had options."""
    per_mb = [pop_hf_options(kwargs) for _, kwargs in inputs]
    if all(options is None for options in per_mb):
        return None
    packed = [(options or {}, label) for options, label in zip(per_mb, labels)]

    def hf_loss_fn(head: LMHeadOutput, pair: tuple[dict[str, Any], Any]) -> Any:
        options, label = pair
        return loss_fn(head_output(head, options), label)

    return packed, hf_loss_fn


def is_split_lm(pipe: Any) -> bool:
    """Whether the pipeline is a split causal LM (its last layer hands out an `LMHeadOutput`)."""
    from laden.model.split import HeadStep

    return bool(pipe.store.layers) and isinstance(pipe.store.layers[-1].module, HeadStep)
