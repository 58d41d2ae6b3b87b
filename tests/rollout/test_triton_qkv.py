"""The fused q/k RMSNorm + rotary embedding + KV cache write kernel (`triton_qkv.rope_store`).

Checked against the plain PyTorch steps it replaces: the returned q, the written cache slots, and
every other slot untouched (the caches start filled with a sentinel). On a GPU in-process; on the
CPU through Triton's interpreter when Triton is installed (`TRITON_INTERPRET=1`, in a subprocess:
the variable is read at import)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from interpreted import interpret_ok

from laden.rollout.native.attention import triton_available

gpu = pytest.mark.gpu
needs_triton = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")

SENTINEL = -7.0
PAGE = 16
# (nh, nkv, D): GQA ratios 2, 1, 4 and 2, head dims 128, 64, 16
HEADS = [(16, 8, 128), (8, 8, 64), (16, 4, 128), (4, 2, 64), (2, 1, 16)]
TOKENS = [1, 7, 300]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face RMSNorm: fp32 statistics, weight applied in the input dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def reference(qkv, positions, cos, sin, q_norm_w, k_norm_w, eps, k_cache, v_cache, slots, nh, nkv):
    n, d = qkv.shape[0], cos.shape[-1]
    q, k, v = qkv.view(n, nh + 2 * nkv, d).split([nh, nkv, nkv], dim=1)
    if q_norm_w is not None:
        q, k = _rms(q, q_norm_w, eps), _rms(k, k_norm_w, eps)
    c, s = cos[positions][:, None], sin[positions][:, None]
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    k_cache.view(-1, nkv, d).index_copy_(0, slots, k)
    v_cache.view(-1, nkv, d).index_copy_(0, slots, v)
    return q


def rope_tables(length: int, d: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    emb = torch.cat([torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)] * 2, dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def make_case(n, nh, nkv, d, norm, dtype, device, seed=0):
    """Inputs of one call: slots a random choice across the blocks of a cache with room to spare."""
    g = torch.Generator().manual_seed(seed)
    length = 1024
    cos, sin = rope_tables(length, d, dtype, device)
    qkv = (torch.randn(n, (nh + 2 * nkv) * d, generator=g) * 3).to(device, dtype)
    positions = torch.randint(0, length, (n,), generator=g).to(device)
    num_blocks = -(-2 * n // PAGE) + 2
    slots = torch.randperm(num_blocks * PAGE, generator=g)[:n].to(device)
    qw = kw = None
    if norm:
        qw = (1 + 0.3 * torch.randn(d, generator=g)).to(device, dtype)
        kw = (1 + 0.3 * torch.randn(d, generator=g)).to(device, dtype)
    cache = torch.full((num_blocks, PAGE, nkv, d), SENTINEL, dtype=dtype, device=device)
    return qkv, positions, cos, sin, qw, kw, 1e-6, cache, cache.clone(), slots, nh, nkv


def check(n, nh, nkv, d, norm, dtype, device, seed=0, block_heads=None):
    """rope_store equals the reference on one case: q and written slots within bf16 (fp32)
    tolerance, v exactly (it is only copied), every other slot still the sentinel."""
    from laden.rollout.native.kernels.triton_qkv import rope_store

    args = make_case(n, nh, nkv, d, norm, dtype, device, seed)
    ref_args = list(args)
    ref_args[7], ref_args[8] = args[7].clone(), args[8].clone()
    ref_q = reference(*ref_args)
    q = rope_store(*args, block_heads=block_heads)
    case = f"n={n} nh={nh} nkv={nkv} d={d} norm={norm} {dtype} block_heads={block_heads}"
    assert q.shape == (n, nh, d) and q.dtype == dtype, case
    k, v, ref_k, ref_v = (c.view(-1, nkv, d) for c in (args[7], args[8], ref_args[7], ref_args[8]))
    slots = args[9]
    _close(q, ref_q, f"{case} q")
    _close(k[slots], ref_k[slots], f"{case} k")
    assert torch.equal(v[slots], ref_v[slots]), case
    untouched = torch.ones(k.shape[0], dtype=torch.bool, device=k.device)
    untouched[slots] = False
    assert bool((k[untouched] == SENTINEL).all()) and bool((v[untouched] == SENTINEL).all()), case


def _close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """fp32: 1e-5. bf16: the reference rounds each product and the sum of the rotation where the
    kernel rounds once, so they differ by a few units in the last place of the largest term: a few
    of bf16's 2**-8 relative steps of the values' scale."""
    if ref.dtype == torch.float32:
        atol, rtol = 1e-5, 1e-5
    else:
        atol, rtol = 2**-5 * float(ref.float().abs().max()), 2**-7
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


# The interpreter runs a program in tens of milliseconds: every head configuration at 1 and 7
# tokens, 300 tokens for two of them (one program a token), and head blocks other than the default
# (1, 2, 4 heads; 12 heads in blocks of 8, a partial last block). Default blocks mix kinds of heads
# (4 + 2 + 2 heads in one block of 8) and end partially (24 heads in blocks of 16).
INTERPRETER_CASES = [
    *((n, nh, nkv, d, norm, None) for nh, nkv, d in HEADS for n in (1, 7) for norm in (False, True)),
    (300, 16, 8, 128, True, 32),
    (300, 4, 2, 64, False, None),
    *((7, 16, 8, 128, True, b) for b in (1, 2, 4)),
    (7, 4, 4, 64, True, 8),
]


def check_interpreter_cases(dtype: torch.dtype) -> None:
    for n, nh, nkv, d, norm, block_heads in INTERPRETER_CASES:
        check(n, nh, nkv, d, norm, dtype, "cpu", seed=n, block_heads=block_heads)


@needs_triton
@pytest.mark.parametrize(
    "dtype",
    # slow: bfloat16, the same kernel with other load and store types; fp32 runs every case here against
    # the tighter tolerance, and the GPU tests run both dtypes
    ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)],
)
def test_rope_store_in_the_interpreter(dtype):
    code = textwrap.dedent(
        f"""
        import torch
        from test_triton_qkv import check_interpreter_cases
        check_interpreter_cases(torch.{dtype})
        print("ok")
        """
    )
    interpret_ok(code, timeout=600)


@needs_triton
def test_rope_store_rejects_bad_shapes():
    from laden.rollout.native.kernels.triton_qkv import rope_store

    for d in (8, 48):  # too small, not a power of two
        args = list(make_case(3, 4, 2, 16, False, torch.float32, "cpu"))
        args[2], args[3] = rope_tables(64, d, torch.float32, "cpu")
        with pytest.raises(ValueError, match="power of two"):
            rope_store(*args)
    args = list(make_case(3, 4, 2, 16, True, torch.float32, "cpu"))
    args[5] = None
    with pytest.raises(ValueError, match="together"):
        rope_store(*args)
    args = list(make_case(3, 4, 2, 16, False, torch.float32, "cpu"))
    with pytest.raises(ValueError, match="qkv"):
        rope_store(*args[:-2], 4, 1)  # width of 4 + 2 * 1 heads, not 4 + 2 * 2


@gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("n", [*TOKENS, 16384])
@pytest.mark.parametrize("nh,nkv,d", HEADS)
def test_rope_store_on_cuda(nh, nkv, d, n, norm, dtype):
    check(n, nh, nkv, d, norm, dtype, "cuda", seed=n)


@gpu
@needs_triton
def test_rope_store_replays_in_a_cuda_graph():
    from laden.rollout.native.kernels.triton_qkv import rope_store

    args = list(make_case(64, 16, 8, 128, True, torch.bfloat16, "cuda", seed=1))
    qkv, positions, slots = args[0], args[1], args[9]
    rope_store(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = rope_store(*args)
    new = make_case(64, 16, 8, 128, True, torch.bfloat16, "cuda", seed=2)
    qkv.copy_(new[0])
    positions.copy_(new[1])
    slots.copy_(new[9])
    args[7].fill_(SENTINEL)
    args[8].fill_(SENTINEL)
    # the graph keeps the captured norm weights and tables: only qkv, positions and slots are new
    ref_args = [new[0], new[1], *args[2:7], new[7].clone(), new[8].clone(), new[9], 16, 8]
    ref_q = reference(*ref_args)
    graph.replay()
    _close(q, ref_q, "q")
    _close(args[7], ref_args[7], "k cache")
    assert torch.equal(args[8], ref_args[8])
