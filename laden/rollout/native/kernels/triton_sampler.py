"""laden's fused sampler (Triton): temperature, greedy argmax, the exponential race and the drawn
token's log-probability in one read of the logits.

`sampler.sample` in torch makes about eight full passes over the `[B, V]` logits per decode step
(the fp32 cast, the division by the temperature, log_softmax, exp, exponential_, the division by
the race, two argmaxes, the gather): at V = 151,936 and B = 512 that is about 2.5 GB of fp32
traffic a step. Here each logit is read once, in the LM head's dtype, and the rest happens in
registers in fp32: `scaled = logits / T`, its max m and sum of exponentials (the log-sum-exp), and
the race winner `argmax(p_i / E_i)` with `E_i = -log2(U_i)`, computed as `exp(scaled_i - m) / E_i`
from the exponentials the sum needs (E in base 2 is the exponential variable over ln 2, the same
scale for every logit, so the draw is the same; each chunk reports `log(best key) + m`, comparable
across chunks). That is one logarithm a logit, an `lg2.approx` instruction: the sampler is bound by
arithmetic, not by the logits' bytes (the Gumbel form, two libdevice logarithms a logit, took
93 us a step at 139 rows of 151,936 on an H200; this one 56 us). Greedy rows draw no random
numbers and take the argmax of `scaled`, ties to the smallest index as `torch.argmax`. The logprob
returned is `scaled[token] - logsumexp(scaled)`, as `sample` returns. Only the plain case: rows
with top-k / top-p or `min_new_tokens` stay on the torch path.

The vocabulary is split into chunks of `CHUNK` logits. One program per (row, chunk) loads its
whole chunk at once (no loop: every load is in flight together) and writes the chunk's max, sum
of exponentials, best race key and its index; a second kernel, one program per row, merges the
row's chunks (a few hundred bytes) and reloads the one winning logit. At V = 151,936 that is 38
programs a row, so one row already spreads over 38 SMs and four fill an H200; longer chunks would
leave small batches on a few SMs, shorter ones only add partials to merge.

The uniforms come from Philox4x32-10 (the generator behind torch's `exponential_`) keyed by `seed`
with the counter `(chunk * CHUNK / 4 + i, row, step low, step high)`: each counter gives four
numbers, for the chunk's logits i, i + CHUNK/4, i + CHUNK/2 and i + 3 CHUNK/4, so a number is
unique to its (step, row, logit) whatever B and V are (graphs of different batch sizes never
share one); the draws depend on `CHUNK`. `U = (k + 1/2) 2^-23` from the top 23 bits lies in
[2^-24, 1 - 2^-24], never 0 or 1, so E is finite and positive, and a -inf logit (e = 0) is never
drawn unless its whole row is -inf. As with torch's `exponential_` (whose uniforms are as coarse
near 1), the smallest E are few and coarse: a token more than about 15 nats below the row's best
is drawn less often than its probability says, and one more than about 19 nats below never.

The step is the device tensor `offset`: the merge kernel adds one to it once every program of the
first kernel has read it, so each replay of a CUDA graph draws fresh numbers with no host work.
No host value is read and the grid depends only on B and V: the call is CUDA graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from laden.rollout.native.attention import TRITON_INTERPRETED
from laden.rollout.native.kernels.options import SamplerOptions

_DEFAULT = SamplerOptions()  # the settings' meanings: `SamplerOptions`


@triton.jit
def _neg_log2(u, FAST: tl.constexpr):
    """-log2(u) for u in (0, 1): one `lg2.approx` on the GPU (relative error about 2^-22),
    libdevice's log2 under the interpreter (which runs no inline assembly)."""
    if FAST:
        return -tl.inline_asm_elementwise(
            "lg2.approx.f32 $0, $1;", "=f,f", [u], dtype=tl.float32, is_pure=True, pack=1
        )
    return -tl.log2(u)


@triton.jit
def _race_key(e, r, FAST: tl.constexpr):
    """The race key `e / E` of a logit, `e = exp(x - m)` (m: the chunk's max), `E = -log2(U)` from
    the top 23 bits of a Philox number `r`: `U = (bits + 1/2) 2^-23` in (0, 1). The Gumbel-max key
    `x - log(-ln U)` is this key's log plus `m` and a constant (E in base 2 is E in base e over
    ln 2), so both draw the same token; this form needs one logarithm and the exponential the
    log-sum-exp needs anyway."""
    u = ((r >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    return tl.fdiv(e, _neg_log2(u, FAST), ieee_rounding=False)


@triton.jit
def _sample_chunks(
    LOGITS, TEMP, GREEDY, SEED, OFFSET, PART_M, PART_S, PART_K, PART_I, UNIFORM,
    V, stride_l,
    CHUNK: tl.constexpr, FAST: tl.constexpr, CDF: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    n_chunks = tl.num_programs(1)
    Q: tl.constexpr = CHUNK // 4
    lane = tl.arange(0, Q)
    i0 = chunk * CHUNK + lane
    i1 = i0 + Q
    i2 = i0 + 2 * Q
    i3 = i0 + 3 * Q
    base = LOGITS + row.to(tl.int64) * stride_l
    inv_t = 1.0 / tl.load(TEMP + row)
    # written out four times: a loop over the four tiles would serialise their loads
    x0 = tl.load(base + i0, mask=i0 < V, other=float("-inf")).to(tl.float32) * inv_t
    x1 = tl.load(base + i1, mask=i1 < V, other=float("-inf")).to(tl.float32) * inv_t
    x2 = tl.load(base + i2, mask=i2 < V, other=float("-inf")).to(tl.float32) * inv_t
    x3 = tl.load(base + i3, mask=i3 < V, other=float("-inf")).to(tl.float32) * inv_t
    m = tl.max(tl.maximum(tl.maximum(x0, x1), tl.maximum(x2, x3)), axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # an all -inf chunk: sum 0, not NaN
    e0 = tl.exp(x0 - m_safe)
    e1 = tl.exp(x1 - m_safe)
    e2 = tl.exp(x2 - m_safe)
    e3 = tl.exp(x3 - m_safe)
    s = tl.sum(e0 + e1 + e2 + e3, axis=0)
    greedy = tl.load(GREEDY + row)
    if CDF:  # no race: the keys are the logits (the argmax greedy rows need); one uniform a row
        k0, k1, k2, k3 = x0, x1, x2, x3
        if chunk == 0:
            step = tl.load(OFFSET)
            zero = tl.zeros([Q], tl.uint32)
            r, _, _, _ = tl.philox(
                tl.load(SEED), zero, zero + row.to(tl.uint32), zero + step.to(tl.uint32),
                zero + (step >> 32).to(tl.uint32),
            )  # fmt: skip
            # every lane holds the same number (counter (0, row, step)): one of them
            tl.store(UNIFORM + row, (tl.max(r >> 9, axis=0).to(tl.float32) + 0.5) * 1.1920928955078125e-07)
    elif greedy:
        k0, k1, k2, k3 = x0, x1, x2, x3
    else:
        step = tl.load(OFFSET)
        zero = tl.zeros([Q], tl.uint32)
        r0, r1, r2, r3 = tl.philox(
            tl.load(SEED),
            (chunk * Q + lane).to(tl.uint32),
            zero + row.to(tl.uint32),
            zero + step.to(tl.uint32),
            zero + (step >> 32).to(tl.uint32),
        )
        k0 = _race_key(e0, r0, FAST)
        k1 = _race_key(e1, r1, FAST)
        k2 = _race_key(e2, r2, FAST)
        k3 = _race_key(e3, r3, FAST)
    # per lane the larger key, the earlier index on a tie (i0 < i1 < i2 < i3)
    best = k0
    arg = i0
    take = k1 > best
    best = tl.where(take, k1, best)
    arg = tl.where(take, i1, arg)
    take = k2 > best
    best = tl.where(take, k2, best)
    arg = tl.where(take, i2, arg)
    take = k3 > best
    best = tl.where(take, k3, best)
    arg = tl.where(take, i3, arg)
    k_max = tl.max(best, axis=0)
    arg = tl.min(tl.where(best == k_max, arg, 2147483647), axis=0)  # the first index of the max
    if not greedy and not CDF:
        k_max = tl.log(k_max) + m_safe  # comparable across chunks (-inf where nothing can be drawn)
    out = row * n_chunks + chunk
    tl.store(PART_M + out, m)
    tl.store(PART_S + out, s)
    tl.store(PART_K + out, k_max)
    tl.store(PART_I + out, arg)


@triton.jit
def _chunk_weights(PART_M, PART_S, part, mask):
    """A row's chunks: each one's share of the row's sum of exponentials, `s exp(m - M)` (0 for an
    all -inf chunk), the row's max `M` (0 where every logit is -inf), their total and the row's
    log-sum-exp."""
    m = tl.load(PART_M + part, mask=mask, other=float("-inf"))
    s = tl.load(PART_S + part, mask=mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = s * tl.exp(m - m_safe)
    total = tl.sum(w, axis=0)
    return w, m_safe, total, m_safe + tl.log(total)


@triton.jit
def _first_best(PART_K, PART_I, part, mask):
    """The token of the row's largest chunk key, the first chunk's on a tie."""
    k = tl.load(PART_K + part, mask=mask, other=float("-inf"))
    a = tl.load(PART_I + part, mask=mask, other=2147483647)
    return tl.min(tl.where(k == tl.max(k, axis=0), a, 2147483647), axis=0)


@triton.jit
def _emit(base, inv_t, lse, token, row, TOKENS, LOGPROBS, OFFSET):
    """Store the row's token and its log-probability; row 0 advances the step, once every program
    of the first kernel has read it."""
    scaled = tl.load(base + token).to(tl.float32) * inv_t
    tl.store(TOKENS + row, token.to(tl.int64))
    tl.store(LOGPROBS + row, scaled - lse)
    if row == 0:
        tl.store(OFFSET, tl.load(OFFSET) + 1)


@triton.jit
def _merge_chunks(
    LOGITS, TEMP, OFFSET, PART_M, PART_S, PART_K, PART_I, TOKENS, LOGPROBS,
    n_chunks, stride_l,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < n_chunks
    part = row * n_chunks + offs
    _, _, _, lse = _chunk_weights(PART_M, PART_S, part, mask)
    token = _first_best(PART_K, PART_I, part, mask)
    inv_t = 1.0 / tl.load(TEMP + row)
    _emit(LOGITS + row.to(tl.int64) * stride_l, inv_t, lse, token, row, TOKENS, LOGPROBS, OFFSET)


@triton.jit
def _merge_cdf(
    LOGITS, TEMP, GREEDY, OFFSET, PART_M, PART_S, PART_K, PART_I, UNIFORM, TOKENS, LOGPROBS,
    n_chunks, V, stride_l,
    CHUNK: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """`method="cdf"`: the row's log-sum-exp from its chunks; greedy rows take the first argmax,
    sampled rows the first token whose cumulative weight passes `U * total`: the chunk from the
    chunks' weights `s exp(m - M)`, the token from that chunk's exponentials, re-read."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < n_chunks
    part = row * n_chunks + offs
    w, m_safe, total, lse = _chunk_weights(PART_M, PART_S, part, mask)
    inv_t = 1.0 / tl.load(TEMP + row)
    base = LOGITS + row.to(tl.int64) * stride_l
    if tl.load(GREEDY + row):
        token = _first_best(PART_K, PART_I, part, mask)
    else:
        target = tl.load(UNIFORM + row) * total
        cum = tl.cumsum(w, axis=0)
        last = tl.max(tl.where(mask & (w > 0), offs, -1), axis=0)  # rounding never picks past it
        c = tl.maximum(tl.minimum(tl.sum((mask & (cum <= target)).to(tl.int32), axis=0), last), 0)
        before = tl.sum(tl.where(offs < c, w, 0.0), axis=0)
        lane = tl.arange(0, CHUNK)
        cols = c * CHUNK + lane
        e = tl.exp(tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_t - m_safe)
        within = tl.sum(((before + tl.cumsum(e, axis=0)) <= target).to(tl.int32), axis=0)
        # (an all -inf row, total 0: its first token, as nothing can be drawn)
        token = c * CHUNK + tl.maximum(tl.minimum(within, tl.max(tl.where(e > 0, lane, -1), axis=0)), 0)
    _emit(base, inv_t, lse, token, row, TOKENS, LOGPROBS, OFFSET)


def sample_fused(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    *,
    chunk: int = _DEFAULT.chunk,
    num_warps: int = _DEFAULT.num_warps,
    method: str = _DEFAULT.method,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits [B, V]` (bf16, fp16 or fp32, unit stride along V) -> (`tokens [B]` int64,
    `logprobs [B]` fp32), as `sampler.sample` without top-k / top-p / min-token masking.

    `temperature [>= B]` fp32 (1 where greedy) and `greedy [>= B]` bool: only the first B rows are
    read. `seed [1]` and `offset [1]` int64 on the device: the Philox key and the step counter,
    which the call advances by one on the device. `chunk`: logits per program (a power of two, at
    least 16; the draws depend on it). `method`: "race" or "cdf" (`SamplerOptions.method`)."""
    b, v = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("sample_fused needs logits with unit stride along the vocabulary")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, at least 16, got {chunk}")
    if method not in ("race", "cdf"):
        raise ValueError(f"method must be 'race' or 'cdf', got {method!r}")
    n_chunks = triton.cdiv(v, chunk)
    part = torch.empty(3, b, n_chunks, device=logits.device, dtype=torch.float32)
    part_i = torch.empty(b, n_chunks, device=logits.device, dtype=torch.int32)
    tokens = torch.empty(b, device=logits.device, dtype=torch.int64)
    logprobs = torch.empty(b, device=logits.device, dtype=torch.float32)
    cdf = method == "cdf"
    uniform = torch.empty(b if cdf else 1, device=logits.device, dtype=torch.float32)
    _sample_chunks[(b, n_chunks)](
        logits, temperature, greedy, seed, offset, part[0], part[1], part[2], part_i, uniform,
        v, logits.stride(0),
        CHUNK=chunk, FAST=not TRITON_INTERPRETED, CDF=cdf, num_warps=num_warps,
    )  # fmt: skip
    if cdf:
        _merge_cdf[(b,)](
            logits, temperature, greedy, offset, part[0], part[1], part[2], part_i, uniform, tokens, logprobs,
            n_chunks, v, logits.stride(0),
            CHUNK=chunk, BLOCK_C=max(2, triton.next_power_of_2(n_chunks)), num_warps=4,
        )  # fmt: skip
        return tokens, logprobs
    _merge_chunks[(b,)](
        logits, temperature, offset, part[0], part[1], part[2], part_i, tokens, logprobs,
        n_chunks, logits.stride(0),
        BLOCK_C=max(2, triton.next_power_of_2(n_chunks)), num_warps=1,
    )  # fmt: skip
    return tokens, logprobs
