"""A Hugging Face decoder run over a paged KV cache (Qwen3, Qwen2, Llama, Mistral).

`PagedModel` holds a `transformers` causal LM as is (its modules and weights: the same tensors
a trainer's weights are copied into, under the same Hugging Face names) and runs its decoder
layers with laden's attention in place of the model's own: queries, keys and values from the
layer's projections (with Qwen3's q/k norms, Qwen2's biases), rotary embeddings from a table
built once from the model's `rotary_emb`, the new keys and values written into the cache slots
of their tokens, then prefill or decode attention (`laden.rollout.native.attention`). Each
layer's q/k/v and gate/up weights are concatenated into one tensor each, the model's parameters
becoming views of them (updates copied in by name land there), so each is one projection. Only
the rows whose next token is wanted go through the LM head.

On CUDA with Triton a decode step runs laden's own layer (`fused_decode`): RMSNorm, the q/k/v
projection, one kernel for the q/k norms, the rotary embedding and both cache writes
(`kernels.triton_qkv`), paged attention, the output and down projections with their residuals through a
split-K kernel where few rows would leave cuBLAS's tiles short of the SMs (`kernels.triton_linear`):
about half the kernels a step of the compiled path, whose fixed costs bound the small batches. The kernels' launch settings are the engine's `KernelOptions`.

Under tensor parallel (`laden.rollout.native.tensor_parallel`) the model holds this rank's heads
and MLP features; the output and down projections are all-reduced between the compiled pieces
(no collective inside a `torch.compile` graph), and only the leader runs the LM head.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from laden.rollout.native.attention import (
    DecodeBackend,
    decode_attention_torch,
    decode_attention_varlen,
    prefill_attention,
    triton_available,
)
from laden.rollout.native.kernels.options import KernelOptions
from laden.rollout.native.tensor_parallel import TensorParallel, local_heads

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")

log = logging.getLogger(__name__)
# the decode step's projections that may take laden's split-K kernel (fp32 stays in cuBLAS)
SPLIT_K_DTYPES = (torch.bfloat16, torch.float16)


def triton_failed(error: BaseException) -> bool:
    """Whether `error` is Triton's own (a kernel that does not compile or fit on this GPU, e.g.
    `OutOfResources`, `CompilationError`): the engine then falls back to its torch paths."""
    return type(error).__module__.split(".")[0] == "triton"


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


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm (fp32 statistics, the weight applied in the input dtype)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def attention_inputs(
    x,
    ln_w,
    ln_eps: float,
    wqkv,
    bqkv,
    qn_w,
    kn_w,
    qk_eps: float,
    cos,
    sin,
    nh: int,
    nkv: int,
    hd: int,
):
    """A decoder layer up to attention, as plain functions of its weights (one compiled graph for
    every layer): input RMSNorm, the fused q/k/v projection (biases where the family has them),
    Qwen3's per-head q/k RMSNorm, rotary embedding. x `[N, H]`; cos/sin `[N, 1, D]`."""
    n = x.shape[0]
    h = _rms(x, ln_w, ln_eps)
    q, k, v = F.linear(h, wqkv, bqkv).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    q, k, v = q.reshape(n, nh, hd), k.reshape(n, nkv, hd), v.reshape(n, nkv, hd)
    if qn_w is not None:
        q, k = _rms(q, qn_w, qk_eps), _rms(k, kn_w, qk_eps)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    return q, k, v


def _add_rms(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float):
    """A residual sum and its RMSNorm in one pass: `(x + y, _rms(x + y))`."""
    s = x + y
    return s, _rms(s, weight, eps)


def _swiglu(gu: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of the fused gate/up projection's output `[N, 2I]`."""
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def attention_outputs(x, o, wo, bo, ln_w, ln_eps: float, wgu, wd):
    """The rest of a decoder layer: output projection and residual, post-attention RMSNorm, the
    SwiGLU MLP (gate and up fused) and its residual."""
    x = x + F.linear(o, wo, bo)
    h = _rms(x, ln_w, ln_eps)
    return x + F.linear(_swiglu(F.linear(h, wgu)), wd)


def parallel_mlp(x, attn, bo, ln_w, ln_eps: float, wgu, wd):
    """Tensor parallel: the attention's all-reduced output (and its bias, added once) into the
    residual, post-attention RMSNorm, and this rank's partial sum of the MLP (its share of the
    intermediate features); returns (residual, partial MLP output)."""
    x = x + attn if bo is None else x + attn + bo
    h = _rms(x, ln_w, ln_eps)
    return x, F.linear(_swiglu(F.linear(h, wgu)), wd)


def _eps_or_none(norm: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if isinstance(value, float):
            return value
    return None


def _eps(norm: nn.Module) -> float:
    value = _eps_or_none(norm)
    assert value is not None, "checked by PagedModel._functional_ok"
    return value


@dataclass(slots=True)
class FusedWeights:
    """One layer's fused projections: `qkv [(nh + 2 nkv) D, H]` (with `qkv_bias` where the family
    has biases) and `gate_up [2 I, H]`. The layer's own q/k/v and gate/up parameters are views of
    them, so an update copied into the parameters by name lands here."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor


def _views_of(linears: list[nn.Linear], fused: torch.Tensor | None, attr: str) -> bool:
    """Whether each linear's `attr` (weight or bias) is its slice of `fused`, in order."""
    if fused is None:
        return all(getattr(lin, attr) is None for lin in linears)
    ptr, size = fused.data_ptr(), fused.element_size()
    offset = 0
    for lin in linears:
        t = getattr(lin, attr)
        if t is None or t.data_ptr() != ptr + offset * size or not t.is_contiguous():
            return False
        offset += t.numel()
    return offset == fused.numel()


def _fuse(linears: list[nn.Linear], attr: str) -> torch.Tensor | None:
    """Concatenate the linears' `attr` along the output features and make each one a view of the
    result (the separate tensors are freed)."""
    parts = [getattr(lin, attr) for lin in linears]
    if any(p is None for p in parts):
        return None
    with torch.no_grad():
        fused = torch.cat([p.data for p in parts])
        for p, view in zip(parts, fused.split([p.shape[0] for p in parts])):
            p.data = view
    return fused


class PagedModel:
    """See the module docstring. `model`: a `*ForCausalLM` of a supported family, on its device."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_model_len: int,
        decode_backend: DecodeBackend = "torch",
        compile: bool = False,
        tensor_parallel: TensorParallel | None = None,
        fused_decode: bool | None = None,
        kernel_options: KernelOptions | None = None,
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
        self.tp = tensor_parallel
        if tensor_parallel is not None:  # this rank's heads (its weights are sharded by the engine)
            size = tensor_parallel.size
            self.num_heads, self.num_kv_heads = local_heads(self.num_heads, self.num_kv_heads, size)
        self.computes_logits = tensor_parallel is None or tensor_parallel.is_leader
        self.scale = float(getattr(attn, "scaling"))  # noqa: B009
        self.max_model_len = max_model_len
        self.decode_backend: DecodeBackend = decode_backend
        self.kernel_options = kernel_options or KernelOptions()
        self.split_pages: int | None = None  # Triton decode: pages per split (None: one split)
        self.workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        self._build_rope()
        self.functional = self._functional_ok()
        if tensor_parallel is not None:
            self._check_parallel()
        self._fused: list[FusedWeights] = []
        self.weights_epoch = 0  # bumped whenever the fused buffers are made again (graphs hold them)
        fused_ok = self._fused_decode_ok()
        if fused_decode and not fused_ok:
            raise ValueError(
                "fused_decode needs CUDA, Triton, the standard layers, a power-of-two head dim and no tensor parallel; "
                f"this engine has device {self.device.type}, Triton {triton_available()}, standard layers "
                f"{self.functional}, head dim {self.head_dim}, "
                f"tensor parallel {tensor_parallel is not None}: leave fused_decode unset to pick it when it can run"
            )
        self.fused_decode = fused_ok if fused_decode is None else fused_decode
        self._attn_in, self._attn_out, self._mlp = attention_inputs, attention_outputs, parallel_mlp
        self._rms, self._add_rms, self._swiglu = _rms, _add_rms, _swiglu
        if compile and self.functional:
            # dynamic: one graph for every token count (prefill and each captured decode batch)
            self._attn_in = torch.compile(attention_inputs, dynamic=True)
            self._attn_out = torch.compile(attention_outputs, dynamic=True)
            self._rms = torch.compile(_rms, dynamic=True)
            self._add_rms = torch.compile(_add_rms, dynamic=True)
            self._swiglu = torch.compile(_swiglu, dynamic=True)
            if tensor_parallel is not None:  # the all-reduces run between the compiled pieces
                self._mlp = torch.compile(parallel_mlp, dynamic=True)
        props = torch.cuda.get_device_properties(self.device) if self.fused_decode else None
        self._num_sms = props.multi_processor_count if props is not None else 0
        self._smem = getattr(props, "shared_memory_per_block_optin", None)

    def _check_parallel(self) -> None:
        mlp = self.layers[0].mlp
        projections = ("gate_proj", "up_proj", "down_proj")
        biased = self.functional and any(getattr(mlp, p).bias is not None for p in projections)
        if not self.functional or biased:
            raise ValueError(
                f"tensor parallel generation runs the standard {', '.join(SUPPORTED_MODEL_TYPES)} layers (RMSNorms, "
                "a SiLU gated MLP without biases); this model's differ: use rollout.backend: native:d<N> (t=1), "
                "or vllm / sglang for tensor parallel"
            )

    def _functional_ok(self) -> bool:
        """Whether the layers are the families' standard modules (RMSNorms with an epsilon, a SiLU
        gated MLP without biases), so the functional (and compiled) path computes exactly what they
        compute; otherwise the layers run their own modules."""
        act = getattr(self.config, "hidden_act", None)
        layer = self.layers[0]
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if hasattr(layer.self_attn, "q_norm"):
            norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
        mlp = layer.mlp
        return (
            act == "silu"
            and all(
                _eps_or_none(n) is not None and isinstance(getattr(n, "weight", None), torch.Tensor)
                for n in norms
            )
            and all(
                isinstance(getattr(mlp, p, None), nn.Linear) and getattr(mlp, p).bias is None
                for p in ("gate_proj", "up_proj", "down_proj")
            )
        )

    def _fused_decode_ok(self) -> bool:
        """Whether decode steps can run laden's Triton layer (fused q/k norm, rotary embedding and
        cache write; split-K projections): CUDA, Triton, the standard layers, no tensor parallel."""
        if self.device.type != "cuda" or not self.functional or self.tp is not None or not triton_available():
            return False
        return self.head_dim >= 16 and self.head_dim & (self.head_dim - 1) == 0

    def fused_weights(self) -> list[FusedWeights]:
        """Each layer's fused projections, made again wherever a parameter no longer is its view of
        them (the engine reallocates the weights after `sleep`; tensor parallel slices them):
        `weights_epoch` goes up then, so captured graphs know to capture again."""
        if not self.functional:
            return []
        if len(self._fused) != len(self.layers):
            self._fused = [None] * len(self.layers)  # type: ignore[list-item]
        for i, layer in enumerate(self.layers):
            a, mlp, f = layer.self_attn, layer.mlp, self._fused[i]
            qkv, gate_up = [a.q_proj, a.k_proj, a.v_proj], [mlp.gate_proj, mlp.up_proj]
            if (
                f is not None
                and _views_of(qkv, f.qkv, "weight")
                and _views_of(qkv, f.qkv_bias, "bias")
                and _views_of(gate_up, f.gate_up, "weight")
            ):
                continue
            w = _fuse(qkv, "weight")
            gu = _fuse(gate_up, "weight")
            assert w is not None and gu is not None
            self._fused[i] = FusedWeights(qkv=w, qkv_bias=_fuse(qkv, "bias"), gate_up=gu)
            self.weights_epoch += 1
        return self._fused

    def release_fused(self) -> None:
        """Drop the fused buffers (after the parameters were released: they would keep the memory)."""
        self._fused = []

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

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + _rotate_half(x) * sin

    def _layer_in(self, i: int, x: torch.Tensor, positions: torch.Tensor, cos, sin):
        """(q, k, v) of layer i for hidden states x (pre-norm); cos/sin `[N, 1, D]` of the positions."""
        layer = self.layers[i]
        if not self.functional:
            return self._qkv(layer, layer.input_layernorm(x), cos, sin)
        a, f = layer.self_attn, self._fused[i]
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        return self._attn_in(
            x, layer.input_layernorm.weight, _eps(layer.input_layernorm), f.qkv, f.qkv_bias,
            qn.weight if qn is not None else None, kn.weight if kn is not None else None,
            _eps(qn) if qn is not None else 0.0, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim,
        )  # fmt: skip

    def _layer_out(self, i: int, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        layer = self.layers[i]
        o = o.reshape(o.shape[0], -1)
        if self.tp is not None:
            return self._parallel_out(i, x, o)
        if not self.functional:
            x = x + layer.self_attn.o_proj(o)
            return x + layer.mlp(layer.post_attention_layernorm(x))
        a, mlp, ln = layer.self_attn, layer.mlp, layer.post_attention_layernorm
        return self._attn_out(
            x, o, a.o_proj.weight, a.o_proj.bias, ln.weight, _eps(ln), self._fused[i].gate_up, mlp.down_proj.weight,
        )  # fmt: skip

    def _parallel_out(self, i: int, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Row-parallel output and down projections, each all-reduced over the tensor parallel ranks."""
        assert self.tp is not None
        layer = self.layers[i]
        a, mlp, ln = layer.self_attn, layer.mlp, layer.post_attention_layernorm
        attn = F.linear(o, a.o_proj.weight)  # [N, H]: this rank's heads' share
        self.tp.all_reduce(attn)
        x, part = self._mlp(
            x, attn, a.o_proj.bias, ln.weight, _eps(ln), self._fused[i].gate_up, mlp.down_proj.weight
        )
        self.tp.all_reduce(part)
        return x + part

    def _qkv(self, layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        attn = layer.self_attn
        n = h.shape[0]
        q = attn.q_proj(h).view(n, self.num_heads, self.head_dim)
        k = attn.k_proj(h).view(n, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(h).view(n, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        return self._rope(q, cos, sin), self._rope(k, cos, sin), v

    @staticmethod
    def _store(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
        cache.view(-1, cache.shape[2], cache.shape[3]).index_copy_(0, slots, values)

    def _layers(self, input_ids: torch.Tensor, positions, slots, k_caches, v_caches, attend) -> torch.Tensor:
        """Every decoder layer: q/k/v, their keys and values into the cache slots, `attend(i, q, k, v)`."""
        self.fused_weights()
        x = self.decoder.embed_tokens(input_ids)
        cos = self.cos[positions][:, None, :]  # once for every layer
        sin = self.sin[positions][:, None, :]
        for i in range(len(self.layers)):
            q, k, v = self._layer_in(i, x, positions, cos, sin)
            self._store(k_caches[i], slots, k)
            self._store(v_caches[i], slots, v)
            x = self._layer_out(i, x, attend(i, q, k, v))
        return x

    def _linear(self, x: torch.Tensor, w: torch.Tensor, bias=None, residual=None):
        """`x @ w.T (+ bias)`; with a `residual`, `(residual, y)`: laden's split-K kernel for the few
        rows of a decode step (where it streams the weights faster than cuBLAS) adds the residual
        itself and returns `(residual + y, None)`; cuBLAS leaves the sum to the next RMSNorm
        (`_add_rms`: one kernel, where a residual in cuBLAS's epilogue cost a copy of it)."""
        from laden.rollout.native.kernels.triton_linear import linear, pick_config

        config = (
            pick_config(
                x.shape[0],
                w.shape[0],
                w.shape[1],
                self._num_sms,
                self._smem,
                x.element_size(),
                self.kernel_options.linear,
            )  # fmt: skip
            if x.dtype in SPLIT_K_DTYPES
            else None
        )
        if config is not None:
            y = linear(x, w, residual, config, bias=bias)
            return y if residual is None else (y, None)
        y = F.linear(x, w, bias)
        return y if residual is None else (residual, y)

    def _norm(self, x: torch.Tensor, pending: torch.Tensor | None, ln: nn.Module):
        """`(x, RMSNorm(x))` after adding a projection's output still `pending` to the residual."""
        weight: torch.Tensor = ln.weight  # type: ignore[assignment]
        if pending is None:
            return x, self._rms(x, weight, _eps(ln))
        return self._add_rms(x, pending, weight, _eps(ln))

    def _fused_layers(self, input_ids: torch.Tensor, meta: DecodeMeta, k_caches, v_caches) -> torch.Tensor:
        """The decode step's layers as laden's kernels (`fused_decode`): input RMSNorm, one q/k/v
        projection, one kernel for the q/k norms, the rotary embedding and the cache writes, paged
        attention, the output projection, RMSNorm, one gate/up projection, SwiGLU, the down
        projection; each residual sum in the projection before it or in the RMSNorm after it."""
        from laden.rollout.native.kernels.triton_qkv import rope_store
        from laden.rollout.native.kernels.triton_swiglu import swiglu

        qkv_opt, swiglu_opt = self.kernel_options.qkv, self.kernel_options.swiglu

        fused = self.fused_weights()
        x = self.decoder.embed_tokens(input_ids)
        n = x.shape[0]
        pending = None
        for i, layer in enumerate(self.layers):
            a, mlp, f = layer.self_attn, layer.mlp, fused[i]
            qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
            x, h = self._norm(x, pending, layer.input_layernorm)
            qkv = self._linear(h, f.qkv, f.qkv_bias)
            q = rope_store(
                qkv, meta.positions, self.cos, self.sin, qn.weight if qn is not None else None,
                kn.weight if kn is not None else None, _eps(qn) if qn is not None else 0.0,
                k_caches[i], v_caches[i], meta.slots, self.num_heads, self.num_kv_heads,
                tile_elements=qkv_opt.tile_elements, num_warps=qkv_opt.num_warps,
            )  # fmt: skip
            o = self._decode_attention(q, k_caches[i], v_caches[i], meta).reshape(n, -1)
            x, pending = self._linear(o, a.o_proj.weight, a.o_proj.bias, residual=x)
            x, h = self._norm(x, pending, layer.post_attention_layernorm)
            gu = self._linear(h, f.gate_up)
            act = (
                swiglu(gu, block=swiglu_opt.block, num_warps=swiglu_opt.num_warps)
                if swiglu_opt.in_decode
                else self._swiglu(gu)
            )
            x, pending = self._linear(act, mlp.down_proj.weight, residual=x)
        return x if pending is None else x + pending

    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor,
        meta: PrefillMeta,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor | None:
        """Run packed prompts, fill their cache slots; fp32 logits `[P, V]` at each prompt's last token
        (None on a tensor parallel follower: the leader samples)."""

        def attend(i, q, k, v):
            return prefill_attention(q, k, v, meta.cu_seqlens, meta.bounds, meta.max_len, self.scale)

        x = self._layers(input_ids, meta.positions, meta.slots, k_caches, v_caches, attend)
        return self.logits(x[meta.last]) if self.computes_logits else None

    @torch.no_grad()
    def decode(
        self,
        input_ids: torch.Tensor,
        meta: DecodeMeta,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        cast: bool = True,
    ) -> torch.Tensor | None:
        """One token per sequence; logits `[B, V]`, fp32 (`cast`) or in the model's dtype (None on a
        tensor parallel follower). No host sync (CUDA graph safe)."""
        x = None
        if self.fused_decode:
            try:
                x = self._fused_layers(input_ids, meta, k_caches, v_caches)
            except Exception as e:
                if not triton_failed(e):
                    raise
                # the layers below write the same cache slots again: nothing of the step is lost
                log.warning(
                    "laden's fused decode layer does not build on this GPU (%s: %s); decoding through the "
                    "compiled layers from now on (fused_decode=False)", type(e).__name__, (str(e).splitlines() or [""])[0],
                )  # fmt: skip
                self.fused_decode = False
        if x is None:

            def attend(i, q, k, v):
                return self._decode_attention(q, k_caches[i], v_caches[i], meta)

            x = self._layers(input_ids, meta.positions, meta.slots, k_caches, v_caches, attend)
        return self.logits(x, cast) if self.computes_logits else None

    def _decode_attention(self, q, k_cache, v_cache, meta: DecodeMeta) -> torch.Tensor:
        if self.decode_backend == "triton":
            from laden.rollout.native.kernels.triton_decode import paged_decode

            return paged_decode(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                self.scale,
                self.split_pages,
                self.workspace,
                options=self.kernel_options.decode,
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

    def logits(self, hidden: torch.Tensor, cast: bool = True) -> torch.Tensor:
        out = self.model.lm_head(self.decoder.norm(hidden))
        return out.float() if cast else out
