"""How many KV cache blocks the native engine allocates.

On CUDA the engine reserves `mem_fraction_static` of the GPU's memory for its weights plus the KV
cache (SGLang's meaning of the knob): a profiling pass runs a prefill of `max_prefill_tokens`
tokens and a decode step of `max_concurrent` rows against a two-block cache, and what it needed
for activations (plus the sampler's `[B, V]` fp32 temporaries) is kept out of the cache. On the
CPU the cache holds `max_concurrent` sequences of `max_model_len` tokens.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from laden.rollout.native.kv_cache import KVCache

if TYPE_CHECKING:
    from laden.rollout.native.engine import NativeEngine


def plan_blocks(engine: NativeEngine, kv_cache_tokens: int | None) -> int:
    """KV blocks for `engine` (its sink block included): `kv_cache_tokens` when given, `max_concurrent`
    sequences of `max_model_len` tokens on the CPU, what profiling leaves on CUDA; the smallest
    over the ranks under tensor parallel (every rank: the same block ids)."""
    bs = engine.block_size
    if kv_cache_tokens is not None:
        blocks = math.ceil(kv_cache_tokens / bs) + 1
    elif engine.device.type != "cuda":
        blocks = engine.max_concurrent * (math.ceil(engine.paged.max_model_len / bs) + 1) + 1
    else:
        blocks = _profile_blocks(engine)
    return blocks if engine.tp is None else engine.tp.min_int(blocks)  # every rank: the same block ids


def _profile_blocks(engine: NativeEngine) -> int:
    """Blocks that fit in `mem_fraction_static` of the GPU after weights and the activations of a
    profiling pass at the largest prefill and decode batch."""
    from laden.rollout.native.model import DecodeMeta, PrefillMeta

    cfg: Any = engine.model.config
    dev = engine.device
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    probe = KVCache(num_blocks=2, **engine.cache_kwargs)  # type: ignore[arg-type]
    n = engine.max_prefill_tokens
    pos = torch.arange(n, device=dev) % engine.paged.max_model_len
    chunk = min(n, engine.paged.max_model_len)
    bounds = list(range(0, n, chunk)) + [n]
    meta = PrefillMeta(
        positions=pos, slots=torch.zeros(n, dtype=torch.long, device=dev),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=dev), bounds=bounds, max_len=chunk,
        last=torch.tensor(bounds[1:], device=dev) - 1,
    )  # fmt: skip
    engine.paged.prefill(torch.zeros(n, dtype=torch.long, device=dev), meta, probe.k, probe.v)
    b = engine.max_concurrent
    mb = probe.blocks_for(engine.paged.max_model_len)
    dmeta = DecodeMeta(
        positions=torch.zeros(b, dtype=torch.long, device=dev), slots=torch.zeros(b, dtype=torch.long, device=dev),
        block_tables=torch.zeros(b, mb, dtype=torch.int32, device=dev),
        context_lens=torch.ones(b, dtype=torch.int32, device=dev),
    )  # fmt: skip
    logits = engine.paged.decode(torch.zeros(b, dtype=torch.long, device=dev), dmeta, probe.k, probe.v)
    # the sampler's [B, V] fp32 temporaries (log-probs, probabilities, the race, a sort)
    extra = 6 * b * int(cfg.vocab_size) * 4
    del logits, probe
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) + extra
    free, physical = torch.cuda.mem_get_info(dev)
    # the GPU's memory is what this process may use: all of it, or its set_per_process_memory_fraction
    total = int(physical * _process_memory_fraction(dev))
    budget = engine.mem_fraction_static * total - peak
    others = physical - free - torch.cuda.memory_reserved(dev)  # other processes on this GPU
    allocated = torch.cuda.memory_allocated(dev)
    budget = min(
        budget,
        free + torch.cuda.memory_reserved(dev) - allocated - extra - 2**30,
        total - allocated - extra - 2**30,
    )
    per_block = KVCache.bytes_per_block(**{k: v for k, v in engine.cache_kwargs.items() if k != "device"})  # type: ignore[arg-type]
    blocks = int(budget // per_block)
    need = engine.paged.max_model_len // engine.block_size + 2
    if blocks < need:
        raise RuntimeError(
            f"the native engine's KV cache does not fit: native.mem_fraction_static={engine.mem_fraction_static} of "
            f"{total / 2**30:.1f} GiB leaves {max(budget, 0) / 2**30:.2f} GiB after the weights and activations "
            f"({peak / 2**30:.2f} GiB; {others / 2**30:.1f} GiB used by other processes), under one sequence of "
            f"{engine.paged.max_model_len} tokens; raise native.mem_fraction_static, lower rollout.max_concurrent_rollouts "
            "or the context length, or use more tensor parallel"
        )
    return blocks


def _process_memory_fraction(device: torch.device) -> float:
    """The share of the GPU this process may allocate (`torch.cuda.set_per_process_memory_fraction`; 1 if unset)."""
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return float(get(device)) if get is not None else 1.0
