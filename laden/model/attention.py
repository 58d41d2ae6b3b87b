"""Padding-free (packed) attention for Hugging Face causal LMs.

A training micro-batch is one row of several documents concatenated: `input_ids [1, T]`,
`position_ids [1, T]` restarting at 0 per document, `cu_seqlens [B+1]` int32 document
boundaries and `max_seqlen`. Attention must never cross a document boundary, and no `[T, T]`
mask may ever be built: at T = 32k that mask alone is 1 GiB in bool and 4 GiB in fp32, and
a dense mask also forces SDPA off its flash kernels.

We register an attention function, `laden_varlen`, with transformers' `AttentionInterface`
and a mask function with `AttentionMaskInterface` that returns None for unpadded input. The
model's forward passes the flash-attention style kwargs (`cu_seq_lens_q`, `max_length_q`, ...)
through to every attention layer, where:

- on CUDA in bf16/fp16, `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10) runs all
  documents in one kernel, causal, GQA native or with repeated KV heads;
- when every document of the row has the same length (known from `cu_seqlens`' length and
  `max_seqlen` alone, no sync: D documents of `max_seqlen` tokens fill T), the row is a
  `[D, H, max_seqlen, head_dim]` batch for one causal `scaled_dot_product_attention` call. On
  Hopper GPUs (compute capability 9+) in bf16/fp16 that call prefers cuDNN's attention, which
  runs a 4096-token Qwen3-1.7B layer's forward and backward in 0.73 ms where the varlen flash
  kernel takes 1.24 ms (`benchmarks/kernels_h200.py`); `attn_impl='varlen'` keeps the varlen
  kernel for every row. On the CPU this path replaces the per-document loop below;
- otherwise (CPU, fp32, older torch) a Python loop runs `scaled_dot_product_attention` per
  document: exact, memory `O(max_seqlen^2)` per head instead of `O(T^2)`, but one kernel
  launch per document. That is the price of correctness without a varlen kernel.

`cu_seqlens` must end at the row's token count (a padding tail is its own document), as
`PackedBatch` and the boundaries recovered from `position_ids` do.

Without `cu_seq_lens_*` (a plain `model(input_ids, position_ids=...)` call) the documents
are recovered from `position_ids` at the cost of one host sync; a padded batch with a 2-D
`attention_mask` (generation) falls back to transformers' SDPA path and its mask.

Trade-off of the mask function: because it is registered, transformers still scans
`position_ids` for packed documents before calling it (one small host sync per forward).
Not registering it would save that sync but drop the padding mask of padded batches.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Literal

import torch
import torch.nn.functional as F

from laden.model.loss import DEFAULT_LOSS_CHUNK_SIZE

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - depends on the installed torch
    _varlen_attn = None  # type: ignore[assignment]

__all__ = [
    "LADEN_VARLEN_KERNEL",
    "LADEN_VARLEN",
    "AttnImpl",
    "describe_auto",
    "lm_head_weight",
    "packed_causal_lm_loss",
    "packed_forward_hidden",
    "register_packed_attention",
    "set_attention",
    "shift_packed_labels",
    "varlen_attention_forward",
]

LADEN_VARLEN = "laden_varlen"  # equal-length documents through SDPA (cuDNN on Hopper), others varlen
LADEN_VARLEN_KERNEL = "laden_varlen_kernel"  # every packed row through the varlen kernel
AttnImpl = Literal["auto", "varlen", "sdpa", "eager"]
_IMPL_NAMES: dict[str, str] = {
    "auto": LADEN_VARLEN,
    "varlen": LADEN_VARLEN_KERNEL,
    "sdpa": "sdpa",
    "eager": "eager",
}
_VARLEN_PARAMS = (
    frozenset(inspect.signature(_varlen_attn).parameters) if _varlen_attn is not None else frozenset()
)
_FLASH_DTYPES = (torch.bfloat16, torch.float16)


def _unsupported(kwargs: dict, dropout: float) -> None:
    if dropout:
        raise NotImplementedError(
            f"laden_varlen attention has no dropout, got attention dropout={dropout}; "
            "set the model config's attention_dropout to 0.0 (fine-tuning runs without it)"
        )
    for key, what in (("softcap", "logit soft-capping"), ("s_aux", "attention sinks")):
        if kwargs.get(key) is not None:
            raise NotImplementedError(
                f"laden_varlen attention does not implement {what} (`{key}`); "
                "use attn_impl='sdpa' or 'eager' for this model"
            )


def _cu_seqlens_from_position_ids(position_ids: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, int]:
    """Document boundaries of flattened rows: a new document wherever a position does not follow
    its predecessor by 1, and at every row start. One host sync (for the boundary count)."""
    pos = position_ids.reshape(-1, position_ids.shape[-1])  # [B, T]
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    idx = torch.nonzero(starts.reshape(-1)).squeeze(1)  # sync: data-dependent size
    end = torch.tensor([num_tokens], device=idx.device, dtype=idx.dtype)
    cu_seqlens = torch.cat([idx, end]).to(torch.int32)
    return cu_seqlens, int(cu_seqlens.diff().max())


def _per_document_sdpa(q, k, v, cu_seqlens, scaling, sliding_window) -> torch.Tensor:
    """q: [N, Hq, D], k/v: [N, Hkv, D] -> [N, Hq, Dv]; causal SDPA per document, no [N, N] tensor."""
    bounds = cu_seqlens.tolist()  # host list; a sync on CUDA (this path is for CPU / no varlen kernel)
    gqa = q.shape[1] != k.shape[1]
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        qd, kd, vd = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))  # [1, H, L, D]
        mask = None
        if sliding_window is not None and end - start > sliding_window:
            i = torch.arange(end - start, device=q.device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window)  # [L, L]
        out = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=gqa
        )
        pieces.append(out[0].transpose(0, 1))  # [L, Hq, Dv]
    tail = q.shape[0] - bounds[-1]
    if tail > 0:  # tokens past the last document (row padding) attend to nothing
        pieces.append(q.new_zeros(tail, q.shape[1], v.shape[-1]))
    return torch.cat(pieces, dim=0)


def _equal_documents(cu_seqlens: torch.Tensor, max_seqlen: int, num_tokens: int, sliding_window) -> int:
    """D when the row is D documents of exactly `max_seqlen` tokens each (and a sliding window,
    if any, spans a whole document), else 0. Read from shapes and host ints only: no sync."""
    docs = cu_seqlens.numel() - 1
    if docs < 1 or max_seqlen * docs != num_tokens:  # boundaries end at num_tokens: all D equal
        return 0
    if sliding_window is not None and max_seqlen > sliding_window:
        return 0
    return docs


@functools.cache
def _cudnn_attention(device: torch.device) -> bool:
    """Whether SDPA should prefer cuDNN's attention on `device`: a Hopper or newer GPU with it enabled."""
    if device.type != "cuda" or not torch.backends.cudnn.is_available():
        return False
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def _cudnn_first_args() -> tuple[list, dict]:
    """`sdpa_kernel` arguments (looked up once): cuDNN's backend tried first, the others after it
    for inputs it does not take; on a torch without priorities, cuDNN's alone, as measured."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if "set_priority" not in inspect.signature(sdpa_kernel).parameters:
        return [SDPBackend.CUDNN_ATTENTION], {}
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.MATH]  # fmt: skip
    return order, {"set_priority": True}


def _cudnn_first() -> AbstractContextManager:
    from torch.nn.attention import sdpa_kernel

    backends, kwargs = _cudnn_first_args()
    return sdpa_kernel(backends, **kwargs)


def _kernels(device: torch.device, dtype: torch.dtype, prefer_cudnn: bool) -> tuple[bool, bool]:
    """(the varlen kernel runs here, equal-length documents go to cuDNN's SDPA): the one choice that
    the attention function makes and `describe_auto` reports."""
    varlen = _varlen_attn is not None and device.type == "cuda" and dtype in _FLASH_DTYPES
    return varlen, varlen and prefer_cudnn and _cudnn_attention(device)


def _equal_documents_sdpa(query, key, value, docs: int, scaling, cudnn: bool) -> torch.Tensor:
    """query [B, Hq, T, D], key/value [B, Hkv, T, D] as `docs` equal documents -> [B, T, Hq, Dv]."""
    batch, _, num_q, _ = query.shape

    def split(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, D] -> [docs, H, L, D], a view when B == 1
        heads, dim = x.shape[1], x.shape[-1]
        return x.transpose(1, 2).reshape(docs, batch * num_q // docs, heads, dim).transpose(1, 2)

    q, k, v = split(query), split(key), split(value)
    with _cudnn_first() if cudnn else nullcontext():
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
        )  # [docs, Hq, L, Dv]
    return out.transpose(1, 2).reshape(batch, num_q, out.shape[1], out.shape[-1])


def describe_auto(device: torch.device) -> str:
    """What `attn_impl='auto'` runs on `device` in bf16 (for `laden doctor`)."""
    varlen, cudnn = _kernels(device, torch.bfloat16, prefer_cudnn=True)
    if cudnn:
        return "equal-length documents through cuDNN's SDPA in one batch, others through the varlen kernel"
    if varlen:
        return "every packed row through the varlen kernel"
    return "equal-length documents through SDPA in one batch, others through SDPA per document"


def _varlen_kernel(q, k, v, cu_seqlens, max_seqlen, scaling, sliding_window) -> torch.Tensor:
    """All documents in one `varlen_attn` call; adapts to the installed torch's signature."""
    kwargs: dict = {}
    if "scale" in _VARLEN_PARAMS:
        kwargs["scale"] = scaling
    elif scaling is not None and abs(scaling * q.shape[-1] ** 0.5 - 1.0) > 1e-6:
        raise NotImplementedError(
            f"this layer scales attention by {scaling} and the installed torch's varlen_attn has no scale "
            "argument; upgrade torch to >= 2.11 or use attn_impl='sdpa'"
        )
    if "window_size" in _VARLEN_PARAMS:  # torch >= 2.11: causal is a (left, 0) window
        kwargs["window_size"] = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
    elif sliding_window is not None:
        raise NotImplementedError(
            f"this layer has sliding_window={sliding_window} and the installed torch's varlen_attn "
            "has no window_size; upgrade torch to >= 2.11 or use attn_impl='sdpa'"
        )
    else:
        kwargs["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = _varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)
    assert isinstance(out, torch.Tensor), "no auxiliary outputs were requested"
    return out


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    *,
    prefer_cudnn: bool = True,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The `laden_varlen` attention: query [B, Hq, T, D], key/value [B, Hkv, T, D] -> ([B, T, Hq, D], None).

    Reads `cu_seq_lens_q` (int32, over the B*T flattened tokens) and `max_length_q` from kwargs.
    Rows of equal-length documents run as one SDPA batch, through cuDNN on Hopper GPUs unless
    `prefer_cudnn=False` (then the varlen kernel takes every CUDA row).
    """
    _unsupported(kwargs, dropout)
    batch, num_heads, num_q, _ = query.shape
    cu_seqlens, max_seqlen = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu_seqlens is None:
        position_ids = kwargs.get("position_ids")
        if attention_mask is not None or key.shape[2] != num_q or position_ids is None:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(
                module, query, key, value, attention_mask, scaling=scaling, **kwargs
            )
        cu_seqlens, max_seqlen = _cu_seqlens_from_position_ids(position_ids, batch * num_q)
    if max_seqlen is None:
        max_seqlen = cu_seqlens.diff().max()
    if isinstance(max_seqlen, torch.Tensor):
        max_seqlen = int(max_seqlen)  # sync; callers that care pass a Python int
    varlen, cudnn = _kernels(query.device, query.dtype, prefer_cudnn)
    docs = _equal_documents(cu_seqlens, max_seqlen, batch * num_q, sliding_window)
    if docs and (cudnn or not varlen):
        return _equal_documents_sdpa(query, key, value, docs, scaling, cudnn), None
    q = query.transpose(1, 2).reshape(batch * num_q, num_heads, -1)  # [N, Hq, D]
    k = key.transpose(1, 2).reshape(batch * num_q, key.shape[1], -1)  # [N, Hkv, D]
    v = value.transpose(1, 2).reshape(batch * num_q, value.shape[1], -1)  # [N, Hkv, Dv]
    cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if varlen:
        out = _varlen_kernel(q, k, v, cu_seqlens, max_seqlen, scaling, sliding_window)
    else:
        out = _per_document_sdpa(q, k, v, cu_seqlens, scaling, sliding_window)
    return out.reshape(batch, num_q, num_heads, -1), None  # [B, T, Hq, Dv]


def kernel_varlen_attention_forward(*args, **kwargs) -> tuple[torch.Tensor, None]:
    """`laden_varlen_kernel`: `varlen_attention_forward` with every CUDA row through the varlen kernel."""
    return varlen_attention_forward(*args, prefer_cudnn=False, **kwargs)


def _varlen_mask(*, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """No mask for unpadded (packed) rows; a padded batch gets transformers' SDPA mask."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(attention_mask=attention_mask, **kwargs)


def register_packed_attention() -> None:
    """Register `laden_varlen` and `laden_varlen_kernel` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    functions = (
        (LADEN_VARLEN, varlen_attention_forward),
        (LADEN_VARLEN_KERNEL, kernel_varlen_attention_forward),
    )
    for name, forward in functions:
        AttentionInterface.register(name, forward)
        AttentionMaskInterface.register(name, _varlen_mask)


def set_attention(model: torch.nn.Module, impl: AttnImpl = "auto") -> str:
    """Switch `model`'s attention implementation; returns the transformers name now in use."""
    if impl not in _IMPL_NAMES:
        raise ValueError(
            f"attn_impl={impl!r} is not one of {sorted(_IMPL_NAMES)}; use 'auto' (packed varlen)"
        )
    name = _IMPL_NAMES[impl]
    register_packed_attention()
    setter: Callable | None = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(name)
    else:
        model.config._attn_implementation = name
    if model.config._attn_implementation != name:
        raise RuntimeError(
            f"{type(model).__name__} did not switch to attention {name!r} (it reports "
            f"{model.config._attn_implementation!r}); it probably does not use transformers' AttentionInterface"
        )
    return name


def packed_forward_hidden(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
) -> torch.Tensor:
    """Run the base decoder (no lm_head) on one packed row: input_ids/position_ids [T] -> hidden [T, H]."""
    if input_ids.dim() != 1 or position_ids.shape != input_ids.shape:
        raise ValueError(
            f"packed input_ids and position_ids must both be [T]; got {tuple(input_ids.shape)} "
            f"and {tuple(position_ids.shape)}"
        )
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    out = decoder(
        input_ids=input_ids[None],
        position_ids=position_ids[None],
        use_cache=False,
        cu_seq_lens_q=cu_seqlens,
        cu_seq_lens_k=cu_seqlens,
        max_length_q=max_seqlen,
        max_length_k=max_seqlen,
    )
    return out.last_hidden_state[0]  # [T, H]


_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def lm_head_weight(model: torch.nn.Module) -> torch.Tensor:
    """The output projection [V, H] (the embedding matrix itself when tied; autograd sums both uses)."""
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(model).__name__} has no output embedding (lm_head); is it a causal LM?")
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError(
            f"{type(model).__name__}'s lm_head has a bias; the packed loss assumes none"
        )
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for attr in _LOGIT_POSTPROCESSING:
        value = getattr(config, attr, None)
        if value is not None and value != 1.0:
            raise NotImplementedError(
                f"{type(model).__name__} post-processes its logits ({attr}={value}); the packed loss "
                "applies the lm_head alone and would be wrong for this model"
            )
    return head.weight


def shift_packed_labels(
    labels: torch.Tensor, cu_seqlens: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Next-token targets within each document: out[t] = labels[t+1], ignore_index at document ends.

    labels: [T] aligned with input_ids (the Hugging Face convention); the result is what
    `packed_causal_lm_loss` takes. No host sync.
    """
    shifted = torch.cat([labels[1:], labels.new_full((1,), ignore_index)])  # [T]
    last_of_doc = (cu_seqlens[1:].to(torch.long) - 1).clamp(min=0).to(labels.device)  # [B]
    return shifted.index_fill_(0, last_of_doc, ignore_index)


def packed_causal_lm_loss(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    labels: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    chunked: bool = True,
    chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Sum of next-token cross-entropy over a packed row (fp32 scalar; divide by the global token count).

    labels: [T] next-token targets, already shifted within each document (labels[t] follows
    input_ids[t]; ignore_index at document ends and where no loss) as in
    `laden.data.batch.PackedBatch`; `shift_packed_labels` builds them from input-aligned labels.
    """
    from laden.model.objective import CrossEntropy  # the one cross-entropy path of every engine

    hidden = packed_forward_hidden(model, input_ids, position_ids, cu_seqlens, max_seqlen)  # [T, H]
    objective = CrossEntropy(chunked=chunked, chunk_size=chunk_size)
    return objective.on_labels(hidden, lm_head_weight(model), labels, ignore_index=ignore_index)
