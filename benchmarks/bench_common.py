"""What every benchmark script records the same way: the model shapes it names, the commit it
ran, and the model and hardware FLOP utilisation of a run.

Standard library only: `roundpipe_ref.py` imports it in a process that must not load laden or
transformers 5.

FLOP counts (BENCHMARKS.md): MFU counts 6 N per token (N = parameters, tied embeddings once)
plus, in `mfu_attn`, causal attention (forward 2 S q per token and layer: QK^T and PV over on
average S/2 earlier tokens, 2 FLOPs per multiply-add; backward twice that). HFU adds the forward
recomputed in backward, layer by layer from the plan that ran: 2 x the layer's parameters
(and 2 S q of attention for a decoder layer) for each recomputed layer. The embedding lookup
costs no FLOPs, the head its matmul, so a run that recomputes every decoder layer (Hugging
Face gradient checkpointing) lands a little below 8 N; `hfu_8n` keeps the old count, 8 N for
every run, for comparison with earlier results.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PEAK_FLOPS = 989e12  # H200 dense bf16

# Qwen3 shapes, random init (BENCHMARKS.md's reference workloads).
QWEN3_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}  # fmt: skip


def shapes(*names: str, **extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The named Qwen3 shapes plus script-specific ones (e.g. a CPU smoke `tiny`)."""
    return {**{name: QWEN3_SHAPES[name] for name in names}, **extra}


def git_commit() -> str:
    """HEAD of the checkout the script runs from (`-dirty` with local changes), or $GIT_COMMIT."""
    try:
        root = Path(__file__).resolve().parent.parent
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("GIT_COMMIT", "unknown")


def cuda_graph_us(fn: Any, calls: int, replays: int = 20) -> float:
    """Microseconds a call of `fn(i)` (i = 0 .. calls - 1) inside one CUDA graph of the `calls`
    calls, replayed `replays` times after a warm-up pass: launches cost what they cost in the
    engine's graphs. (torch is imported here: this module stays standard library only.)"""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * calls)


def device_idle(prof: Any, top: int = 8, min_gap_us: float = 20.0) -> dict[str, Any]:
    """Where a profiled run's GPU sat idle: the span from its first kernel (or copy) to its last,
    the time anything ran (the union of the device events), the idle rest, the idle time in gaps
    of at least `min_gap_us`, and the `top` longest gaps with the device events on either side."""
    import torch

    try:
        spans = sorted(
            (e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
            for e in prof.profiler.kineto_results.events()
            if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0
        )
    except AttributeError as e:  # another torch's profiler internals
        return {"error": f"{type(e).__name__}: {e}"}
    if not spans:
        return {}
    busy, gaps, end, last = 0, [], spans[0][0], spans[0][2]
    for start, stop, name in spans:
        if start > end:
            gaps.append((start - end, last, name))
        if stop > end:
            busy += stop - max(start, end)
            end, last = stop, name
    span = end - spans[0][0]
    long = [g for g in gaps if g[0] >= min_gap_us * 1e3]
    return {
        "span_s": round(span / 1e9, 4), "busy_s": round(busy / 1e9, 4), "idle_s": round((span - busy) / 1e9, 4),
        f"idle_in_gaps_over_{min_gap_us:g}us_s": round(sum(g[0] for g in long) / 1e9, 4), "long_gaps": len(long),
        "longest": [
            {"us": round(g / 1e3, 1), "after": a[:60], "before": b[:60]} for g, a, b in sorted(gaps, reverse=True)[:top]
        ],
    }  # fmt: skip


def layer_forward_params(model: Any) -> list[int]:
    """Per pipeline layer of a Hugging Face causal LM, the parameters its forward multiplies each
    token by (2 FLOPs each): [embedding (a lookup: 0), decoder layers..., final norm + head].

    The head counts its weight even when it is tied to the embedding: the lookup costs nothing,
    the head's matmul does. Works on meta-device models (only sizes are read).
    """
    inner = model.model
    decoders = [sum(p.numel() for p in layer.parameters()) for layer in inner.layers]
    return [0, *decoders, model.lm_head.weight.numel() + inner.norm.weight.numel()]


def recomputed_layers(
    bwd_plan: Sequence[Sequence[int]], *, fused_stage_recomputes: bool = False
) -> list[int]:
    """Pipeline layers whose forward runs again in backward under a fused plan: every backward
    stage after the first; the first (fused: forward, loss and backward in one residency) only
    when it recomputes too (laden's engine with `recompute_grain="layer"`)."""
    stages = bwd_plan if fused_stage_recomputes else bwd_plan[1:]
    return sorted(i for stage in stages for i in stage)


def attention_forward_flops(config: Any, seq_len: int) -> float:
    """Causal attention forward FLOPs per token and decoder layer: 2 S q (q = heads x head_dim)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2.0 * seq_len * heads * head_dim


def utilisation(
    *,
    tokens_per_s: float,
    num_params: int,
    layer_params: Sequence[int],
    recomputed: Sequence[Sequence[int]] | None,
    attn_fwd_flops: float,
) -> dict[str, Any]:
    """MFU and HFU fields of a result (see the module docstring).

    `layer_params`: `layer_forward_params(model)`; `recomputed`: the recomputed pipeline layers
    of each timed step (plans may change between steps: their mean counts), None if unknown
    (then HFU is None); `attn_fwd_flops`: `attention_forward_flops(config, seq_len)`.
    """
    num_decoders = len(layer_params) - 2
    model_flops = 6.0 * num_params
    model_attn = 3.0 * attn_fwd_flops * num_decoders
    out: dict[str, Any] = {
        "mfu": round(model_flops * tokens_per_s / PEAK_FLOPS, 4),
        "mfu_attn": round((model_flops + model_attn) * tokens_per_s / PEAK_FLOPS, 4),
        "hfu_8n": round(8.0 * num_params * tokens_per_s / PEAK_FLOPS, 4),
        "hfu": None,
        "hfu_attn": None,
        "recomputed_layers": None,
        "recomputed_params": None,
    }
    if recomputed is None or not recomputed:
        return out
    for layers in recomputed:
        bad = [i for i in layers if not 0 <= i < len(layer_params)]
        if bad:
            raise ValueError(f"recomputed layers {bad} are outside the {len(layer_params)} pipeline layers")
    steps = len(recomputed)
    extra_params = sum(sum(layer_params[i] for i in layers) for layers in recomputed) / steps
    extra_decoders = sum(sum(1 for i in layers if 1 <= i <= num_decoders) for layers in recomputed) / steps
    hw_flops = model_flops + 2.0 * extra_params
    hw_attn = model_attn + attn_fwd_flops * extra_decoders
    out.update(
        hfu=round(hw_flops * tokens_per_s / PEAK_FLOPS, 4),
        hfu_attn=round((hw_flops + hw_attn) * tokens_per_s / PEAK_FLOPS, 4),
        recomputed_layers=round(sum(len(layers) for layers in recomputed) / steps, 2),
        recomputed_params=round(extra_params),
    )
    return out
