"""A Hugging Face decoder run over a paged KV cache (Qwen3, Qwen2, Llama, Mistral).

`PagedModel` holds a `transformers` causal LM as is (its modules and weights: the same tensors
a trainer's weights are copied into, under the same Hugging Face names) and runs its decoder
layers with laden's attention in place of the model's own: queries, keys and values from the
layer's projections (with Qwen3's q/k norms, Qwen2's biases), rotary embeddings from a table
built once from the model's `rotary_emb`, the new keys and values written into the cache slots
of their tokens, then prefill or decode attention (`laden.rollout.native.attention`). Norms and
MLPs are the model's modules. Only the rows whose next token is wanted go through the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from laden.rollout.native.attention import (
    DecodeBackend,
    decode_attention_torch,
    decode_attention_varlen,
    prefill_attention,
)

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")


@dataclass(slots=True)
class PrefillMeta:
    """Packed prompts: `positions [N]`, `slots [N]` (cache slot of each token), `cu_seqlens
    [P + 1]` int32 with `bounds` its host copy, `last [P]` (index of each prompt's last token)."""

    positions: torch.Tensor
    slots: torch.Tensor
    cu_seqlens: torch.Tensor
    bounds: list[int]
    max_len: int
    last: torch.Tensor


@dataclass(slots=True)
class DecodeMeta:
    """One token per sequence: `positions [B]`, `slots [B]`, `block_tables [B, MB]` int32,
    `context_lens [B]` int32 (the new token included)."""

    positions: torch.Tensor
    slots: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PagedModel:
    """See the module docstring. `model`: a `*ForCausalLM` of a supported family, on its device."""

    def __init__(
        self, model: nn.Module, *, max_model_len: int, decode_backend: DecodeBackend = "torch"
    ) -> None:
        config: Any = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"the native rollout engine runs {', '.join(SUPPORTED_MODEL_TYPES)} models; this one is "
                f"{config.model_type!r}: use rollout.backend: vllm or sglang for it"
            )
        window = getattr(config, "sliding_window", None)
        if (
            window
            and getattr(config, "use_sliding_window", config.model_type == "mistral")
            and max_model_len > window
        ):
            raise ValueError(
                f"the model attends over a sliding window of {window} tokens, which the native engine does not "
                f"implement; keep gconfig.max_new_tokens + the prompt length <= {window}, or use vllm / sglang"
            )
        self.model: Any = model
        self.config = config
        self.decoder: Any = getattr(model, "model")  # noqa: B009 - typed Any: a transformers decoder
        self.layers = list(self.decoder.layers)
        attn = self.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.scale = float(getattr(attn, "scaling"))  # noqa: B009
        self.max_model_len = max_model_len
        self.decode_backend: DecodeBackend = decode_backend
        self.num_splits = 1
        self.workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        self._build_rope()

    @property
    def device(self) -> torch.device:
        return self.decoder.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.embed_tokens.weight.dtype

    def _build_rope(self) -> None:
        """cos/sin for every position up to `max_model_len` (the model's own rotary embedding)."""
        pos = torch.arange(self.max_model_len, device=self.device)[None]
        probe = torch.empty(1, device=self.device, dtype=torch.float32)
        with torch.no_grad():
            cos, sin = self.decoder.rotary_emb(probe, pos)
        self.cos = cos[0].to(self.dtype)  # [L, D]
        self.sin = sin[0].to(self.dtype)

    def rebuild_rope(self) -> None:
        """After the weights came back from `sleep` (the table lives with them)."""
        self._build_rope()

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos = self.cos[positions][:, None, :]  # [N, 1, D]
        sin = self.sin[positions][:, None, :]
        return x * cos + _rotate_half(x) * sin

    def _qkv(self, layer: nn.Module, h: torch.Tensor, positions: torch.Tensor):
        attn = layer.self_attn
        n = h.shape[0]
        q = attn.q_proj(h).view(n, self.num_heads, self.head_dim)
        k = attn.k_proj(h).view(n, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(h).view(n, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        return self._rope(q, positions), self._rope(k, positions), v

    @staticmethod
    def _store(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
        cache.view(-1, cache.shape[2], cache.shape[3]).index_copy_(0, slots, values)

    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor,
        meta: PrefillMeta,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """Run packed prompts, fill their cache slots; fp32 logits `[P, V]` at each prompt's last token."""
        x = self.decoder.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            q, k, v = self._qkv(layer, h, meta.positions)
            self._store(k_caches[i], meta.slots, k)
            self._store(v_caches[i], meta.slots, v)
            o = prefill_attention(q, k, v, meta.cu_seqlens, meta.bounds, meta.max_len, self.scale)
            x = x + layer.self_attn.o_proj(o.reshape(o.shape[0], -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.logits(x[meta.last])

    @torch.no_grad()
    def decode(
        self,
        input_ids: torch.Tensor,
        meta: DecodeMeta,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """One token per sequence; fp32 logits `[B, V]`. No host sync (CUDA graph safe)."""
        x = self.decoder.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            q, k, v = self._qkv(layer, h, meta.positions)
            self._store(k_caches[i], meta.slots, k)
            self._store(v_caches[i], meta.slots, v)
            o = self._decode_attention(q, k_caches[i], v_caches[i], meta)
            x = x + layer.self_attn.o_proj(o.reshape(o.shape[0], -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.logits(x)

    def _decode_attention(self, q, k_cache, v_cache, meta: DecodeMeta) -> torch.Tensor:
        if self.decode_backend == "triton":
            from laden.rollout.native.triton_decode import paged_decode

            return paged_decode(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                self.scale,
                self.num_splits,
                self.workspace,
            )
        if self.decode_backend == "varlen":
            cu_q = torch.arange(q.shape[0] + 1, device=q.device, dtype=torch.int32)
            return decode_attention_varlen(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                self.scale,
                cu_q,
                self.max_model_len,
            )
        return decode_attention_torch(q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.decoder.norm(hidden)).float()
