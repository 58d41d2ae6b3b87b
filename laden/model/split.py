"""Splitting a Hugging Face causal LM into a pipeline of layers: embedding, decoder layers, head.

The roundpipe engine streams a model through the GPU a few layers at a time, so it needs
the model as a flat sequence of modules where each one takes the previous one's output.
`split_causal_lm` builds that sequence around the model's own submodules (no copy, the
parameters are the same objects, tied embeddings stay tied):

    EmbedStep(input_ids, ...) -> DecoderState
    DecoderStep(DecoderState) -> DecoderState        one per decoder layer
    HeadStep(DecoderState)    -> LMHeadOutput         final norm; the lm_head weight rides along

The state between steps carries only what cannot be recomputed cheaply: hidden states
`[B, T, H]`, `position_ids [B, T]`, the 2-D padding mask, and the packed-row kwargs
(`cu_seq_lens_q/k`, `max_length_q/k`). Rotary cos/sin and the 4-D attention mask are derived
per device and cached on the state object while it stays on one device; they are dropped
when the state is flattened for a host transfer (see the pytree registration), so a stage
boundary moves `H + ~2` values per token instead of `H + head_dim + T`. The cost is that
every stage recomputes them once per micro-batch, which is negligible next to a layer.

The head does not materialise logits: `causal_lm_loss` runs the chunked linear +
cross-entropy on the normed hidden states and the lm_head weight, so `[T, V]` logits never
exist. `LMHeadOutput.logits` builds them for callers that want them (inference).

`activation_bytes` estimates each step's activation memory for one micro-batch, so that
the roundpipe planner can size stages by weights and activations; it is an analytic count
of what the transformers layers save for backward, not a measurement.

Supported: the Qwen3, Qwen2, Llama and Mistral families and the mixture-of-experts Qwen3-MoE
and GPT-OSS, as laid out by transformers 5.x (`model.model.embed_tokens/layers/norm/rotary_emb`,
`model.lm_head`, decoder layers called with `position_embeddings=(cos, sin)`; GPT-OSS's attention
sinks and per-layer sliding windows live inside its layers and `config.layer_types`). Anything
else is refused with a ValueError rather than split by guesswork. The mixture-of-experts models'
load-balancing loss is not computed: Hugging Face adds it only with `config.output_router_logits`
(off in the released checkpoints), and it couples every layer's routing statistics over the whole
batch, which a pipeline streaming one micro-batch and one stage at a time does not hold; such a
config is refused (set `output_router_logits=False`). `laden.model.moe.enable_router_aux_loss` adds a
per-layer, per-micro-batch version that does stream (and `apply_expert_parallel` spreads the experts).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.utils import _pytree as pytree

from laden.model.attention import LADEN_VARLEN, LADEN_VARLEN_KERNEL
from laden.model.loss import DEFAULT_LOSS_CHUNK_SIZE, chunked_linear_cross_entropy
from laden.model.patches.lean_mlp import is_lean_mlp
from laden.model.patches.lean_norm import class_swap as lean_norm_swap
from laden.model.patches.tiled import tile_tokens_of

__all__ = [
    "DEFAULT_LOSS_CHUNK_SIZE",
    "PACKED_KWARGS",
    "SUPPORTED_MODEL_TYPES",
    "DecoderState",
    "DecoderStep",
    "EmbedStep",
    "HeadStep",
    "LMHeadOutput",
    "SplitModel",
    "activation_bytes",
    "causal_lm_loss",
    "shift_labels",
    "split_causal_lm",
]

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral", "qwen3_moe", "gpt_oss")
PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_PACKED_IMPLS = (LADEN_VARLEN, LADEN_VARLEN_KERNEL)  # attention kept per document by cu_seq_lens


class DecoderState:
    """What flows between decoder layers; `cache` holds per-device derived tensors, never transferred."""

    __slots__ = ("attention_mask", "cache", "hidden_states", "packed", "position_ids")

    def __init__(
        self,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        packed: dict[str, Any],
        cache: dict[Any, Any] | None = None,
    ) -> None:
        self.hidden_states = hidden_states  # [B, T, H]
        self.position_ids = position_ids  # [B, T] (or [1, T] for packed rows)
        self.attention_mask = attention_mask  # [B, T], 1 = token, 0 = padding; None = no padding
        self.packed = packed  # cu_seq_lens_q/k [D + 1] int32, max_length_q/k int; {} if not packed
        self.cache = {} if cache is None else cache

    def with_hidden(self, hidden_states: torch.Tensor) -> DecoderState:
        """The same state with new hidden states; derived tensors are shared (same device)."""
        return DecoderState(hidden_states, self.position_ids, self.attention_mask, self.packed, self.cache)


def _flatten_state(state: DecoderState):
    keys = tuple(sorted(state.packed))
    children = [
        state.hidden_states,
        state.position_ids,
        state.attention_mask,
        *(state.packed[k] for k in keys),
    ]
    return children, keys


def _unflatten_state(children, keys) -> DecoderState:
    hidden, position_ids, attention_mask, *packed = children
    return DecoderState(hidden, position_ids, attention_mask, dict(zip(keys, packed)))


pytree.register_pytree_node(
    DecoderState, _flatten_state, _unflatten_state, serialized_type_name="laden.model.split.DecoderState"
)


@dataclass(slots=True)
class LMHeadOutput:
    """Final normed hidden states and the output projection; the loss applies one to the other."""

    hidden_states: torch.Tensor  # [B, T, H]
    lm_head_weight: torch.Tensor  # [V, H]

    @property
    def logits(self) -> torch.Tensor:
        """Full `[B, T, V]` logits (memory heavy; the training loss never builds them)."""
        return torch.matmul(self.hidden_states, self.lm_head_weight.t())


class EmbedStep(nn.Module):
    """Token embedding; builds the `DecoderState` from the model inputs."""

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **packed: Any,
    ) -> DecoderState:
        unknown = sorted(set(packed) - set(PACKED_KWARGS))
        if "output_router_logits" in unknown:
            raise ValueError(
                "output_router_logits reaches the split model's layers: a RoundPipe forward() under "
                "torch.no_grad() returns the router logits and load-balancing loss; forward_backward does "
                "not compute that loss (train with output_router_logits=False)"
            )
        if unknown:
            raise ValueError(f"unexpected model inputs {unknown}; a split causal LM takes input_ids, "
                             f"attention_mask, position_ids and the packed-row kwargs {PACKED_KWARGS}")  # fmt: skip
        hidden = self.embed_tokens(input_ids)  # [B, T, H]
        if position_ids is None:
            batch, length = input_ids.shape
            position_ids = torch.arange(length, device=input_ids.device).repeat(batch, 1)  # [B, T]
        if attention_mask is not None and packed:
            raise ValueError("pass either attention_mask (padded batch) or the packed-row kwargs, not both")
        return DecoderState(hidden, position_ids, attention_mask, dict(packed))


class DecoderStep(nn.Module):
    """One decoder layer, called the way the model's own forward calls it."""

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, config: Any, layer_index: int) -> None:
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb
        object.__setattr__(self, "config", config)  # shared, not a submodule
        self.attention_type = _attention_type(config, layer_index)

    def forward(self, state: DecoderState) -> DecoderState:
        hidden = state.hidden_states
        out = self.layer(
            hidden,
            attention_mask=self._mask(state),
            position_ids=state.position_ids,
            position_embeddings=self._rope(state),
            **state.packed,
        )
        if isinstance(out, tuple):  # older layer signatures return (hidden, ...)
            out = out[0]
        return state.with_hidden(out)

    def _rope(self, state: DecoderState) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("rope", state.hidden_states.dtype)
        if key not in state.cache:
            state.cache[key] = self.rotary_emb(state.hidden_states, state.position_ids)  # cos, sin [B, T, D]
        return state.cache[key]

    def _mask(self, state: DecoderState):
        key = ("mask", self.attention_type, state.hidden_states.dtype)
        if key not in state.cache:
            state.cache[key] = _build_mask(self.config, self.attention_type, state)
        return state.cache[key]


class HeadStep(nn.Module):
    """Final norm; hands the lm_head weight to the loss instead of computing logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, state: DecoderState) -> LMHeadOutput:
        weight = self.lm_head.weight
        assert isinstance(weight, torch.Tensor)
        return LMHeadOutput(self.norm(state.hidden_states), weight)


@dataclass(slots=True)
class SplitModel:
    """A causal LM as a pipeline: `layers[0]` embeds, `layers[1:-1]` decode, `layers[-1]` is the head."""

    layers: nn.Sequential
    model: nn.Module
    config: Any

    @property
    def num_decoder_layers(self) -> int:
        return len(self.layers) - 2


def split_causal_lm(model: nn.Module) -> SplitModel:
    """Split a supported Hugging Face causal LM (see `SUPPORTED_MODEL_TYPES`) into pipeline steps."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"cannot split {type(model).__name__} (model_type={model_type!r}) into pipeline layers; "
            f"supported model types are {SUPPORTED_MODEL_TYPES}. Wrap an nn.Sequential of your own "
            "layers instead, or add the family to laden.model.split"
        )
    base = getattr(model, "model", None)
    missing = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(base, a)]
    if missing or not hasattr(model, "lm_head"):
        raise ValueError(
            f"{type(model).__name__} lacks {missing or ['lm_head']}; laden.model.split expects the "
            "transformers 5.x layout model.model.{embed_tokens, layers, norm, rotary_emb} and model.lm_head"
        )
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            f"{type(model).__name__} has config.output_router_logits=True, so its own forward adds the "
            "router load-balancing loss, which laden.model.split does not compute (it couples every layer's "
            "routing over the whole batch); set model.config.output_router_logits = False to train on the "
            "language-model loss alone, as the released checkpoints do (laden.model.moe.enable_router_aux_loss "
            "adds a per-layer load-balancing loss that streams)"
        )
    if getattr(model.lm_head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}'s lm_head has a bias; the chunked loss assumes none")
    steps: list[nn.Module] = [EmbedStep(base.embed_tokens)]
    for i, layer in enumerate(base.layers[: config.num_hidden_layers]):
        steps.append(DecoderStep(layer, base.rotary_emb, config, i))
    steps.append(HeadStep(base.norm, cast(nn.Module, model.lm_head)))
    return SplitModel(layers=nn.Sequential(*steps), model=model, config=config)


def causal_lm_loss(
    outputs: LMHeadOutput,
    labels: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Summed next-token cross-entropy (fp32 scalar) of a head output; labels `[B, T]` already shifted.

    `labels[b, t]` is the target of position t (use `shift_labels` on HF-style labels).
    Divide by the number of loss tokens outside to get the mean.
    """
    hidden = outputs.hidden_states
    flat = hidden.reshape(-1, hidden.shape[-1])  # [B*T, H]
    return chunked_linear_cross_entropy(
        flat, outputs.lm_head_weight, labels.reshape(-1), chunk_size=chunk_size, ignore_index=ignore_index
    )


def activation_bytes(
    step: nn.Module, num_tokens: int, *, dtype: torch.dtype, loss_chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE
) -> tuple[int, int]:
    """(kept, transient) device bytes of one pipeline step for a micro-batch of `num_tokens` tokens.

    kept: what the step's forward saves for its backward; transient: the most it allocates on
    top while its forward or backward runs. `dtype` is the compute dtype. (0, 0) for modules
    that `split_causal_lm` did not make.
    """
    b = dtype.itemsize
    if isinstance(step, DecoderStep):
        per_token, tile_bytes = _decoder_bytes_per_token(step.config, b, step.layer)
        kept = num_tokens * per_token
        # backward: the gradients of the layer's activations, as large again, plus one MLP tile's
        # intermediates and their gradients when the MLP is tiled
        return kept, kept + tile_bytes
    if isinstance(step, EmbedStep):
        vocab, hidden = _weight(step.embed_tokens).shape
        # the output; backward builds a dense [V, H] weight gradient in the compute dtype
        return num_tokens * hidden * b, vocab * hidden * b + num_tokens * hidden * b
    if isinstance(step, HeadStep):
        vocab, hidden = _weight(step.lm_head).shape
        chunk = min(num_tokens, loss_chunk_size)
        # the norm's fp32 input and its output; the loss's hidden and weight gradients, computed in
        # forward and held until backward
        kept = num_tokens * hidden * (4 + 2 * b) + vocab * hidden * b
        # one chunk's fp32 logits and their fp32 log-softmax (then the softmax and its compute-dtype
        # copy); the fp32 [V, H] accumulator and a chunk's [V, H] product (laden.model.loss; on CUDA
        # the product goes straight into the accumulator, but the estimate keeps the CPU's bound)
        # with the logits whole (no chunking) their compute-dtype matmul output stays beside the fp32 pair
        per_logit = 8 + b if chunk >= num_tokens else max(8, 4 + b)
        return kept, chunk * vocab * per_logit + vocab * hidden * (4 + b)
    return 0, 0


def _weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _decoder_bytes_per_token(config: Any, b: int, layer: nn.Module | None = None) -> tuple[int, int]:
    """(bytes a decoder layer saves per token, the extra transient bytes of one MLP tile).

    With Hugging Face's modules, in the compute dtype (`b` bytes): the layer input, both norm
    outputs, the q/k/v projections, the normed and the rotated q and k, the attention output,
    the attention and MLP outputs (residual adds) and gate, up, act(gate), act(gate) * up:
    5H + 4q + 4kv + 4I. In fp32: the inputs RMSNorm upcasts (two of width H, q- and k-norm),
    and a softmax statistic per head. On one Qwen3-1.7B layer in bf16 this is 122,944 bytes
    against 117,416 measured with saved-tensor hooks (`tests/model/test_roundpipe_split.py` checks the
    estimate against such a measurement).

    The long-context knobs (`actor.tiled_mlp_tokens`) change what `layer` saves: a tiled MLP
    (`laden.model.patches.tiled`) keeps only its input, already counted (-4I per token, plus a tile's
    intermediates and gradients while its backward runs), a lean MLP (`laden.model.patches.lean_mlp`,
    not tiled) keeps gate and up but not act(gate) and act(gate) * up (-2I per token), and lean
    RMSNorms (`laden.model.patches.lean_norm`) keep no fp32 copy of their input (-4 bytes per normed value).
    """
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q = heads * head_dim
    kv = getattr(config, "num_key_value_heads", None) or heads
    kv *= head_dim
    inter = _mlp_width(config, layer)
    per_token = b * (5 * hidden + 4 * q + 4 * kv + 4 * inter) + 4 * (2 * hidden + q + kv + heads)
    tile_bytes = 0
    mlp = getattr(layer, "mlp", None)
    tile_tokens = tile_tokens_of(mlp)
    if tile_tokens:
        per_token -= 4 * inter * b
        tile_bytes = 2 * tile_tokens * 4 * inter * b  # a tile's four [n, I] tensors and their gradients
    elif is_lean_mlp(mlp):
        per_token -= 2 * inter * b  # act(gate) and act(gate) * up are recomputed in backward
    attn = getattr(layer, "self_attn", None)
    normed = (  # (owner, norm attribute, values it normalises per token), Hugging Face's names
        (layer, "input_layernorm", hidden), (layer, "post_attention_layernorm", hidden),
        (attn, "q_norm", q), (attn, "k_norm", kv),
    )  # fmt: skip
    lean = lean_norm_swap()
    for owner, name, width in normed:
        norm = getattr(owner, name, None)
        if norm is not None and lean.applied(norm):
            per_token -= 4 * width
    return per_token, tile_bytes


def _mlp_width(config: Any, layer: nn.Module | None) -> int:
    """Intermediate values per token of a layer's MLP: a mixture of experts runs `num_experts_per_tok`
    experts of `moe_intermediate_size` (Qwen3-MoE) or `intermediate_size` (GPT-OSS) each per token
    (its router's few logits per token are left out); a dense MLP runs `intermediate_size`."""
    mlp = getattr(layer, "mlp", None)
    if mlp is None or not hasattr(mlp, "experts"):
        return config.intermediate_size
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return config.num_experts_per_tok * width


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """HF-convention labels `[B, T]` (aligned with input_ids) -> next-token targets `[B, T]`."""
    pad = labels.new_full((*labels.shape[:-1], 1), ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def _attention_type(config: Any, layer_index: int) -> str:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[layer_index]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


def _build_mask(config: Any, attention_type: str, state: DecoderState):
    """The 4-D mask (or None) the attention implementation wants, built as the model's forward does."""
    if config._attn_implementation in _PACKED_IMPLS and state.attention_mask is None and state.packed:
        return None  # the varlen kernel separates documents by cu_seq_lens; no mask, no host sync
    from transformers import masking_utils

    if attention_type == "sliding_attention":
        fn = masking_utils.create_sliding_window_causal_mask
    else:
        fn = masking_utils.create_causal_mask
    return fn(**_mask_kwargs(fn, config, state))


_MASK_PARAMS: dict[Any, frozenset[str]] = {}


def _mask_kwargs(fn, config: Any, state: DecoderState) -> dict[str, Any]:
    """Keyword arguments for transformers' mask builders, whose argument names moved across 5.x."""
    if fn not in _MASK_PARAMS:
        _MASK_PARAMS[fn] = frozenset(inspect.signature(fn).parameters)
    names = _MASK_PARAMS[fn]
    kwargs: dict[str, Any] = {"config": config, "attention_mask": state.attention_mask}
    kwargs["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = state.hidden_states
    for cache_name in ("cache", "past_key_values"):
        if cache_name in names:
            kwargs[cache_name] = None
    if "position_ids" in names:
        kwargs["position_ids"] = state.position_ids
    if "cache_position" in names:
        kwargs["cache_position"] = torch.arange(
            state.hidden_states.shape[1], device=state.hidden_states.device
        )
    return kwargs
