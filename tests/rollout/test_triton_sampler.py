"""The fused Triton sampler (`laden.rollout.native.kernels.triton_sampler`) against plain-PyTorch references.

Each check takes a device. On CUDA it runs in the test process at full size (the default chunk,
vocabularies of several chunks and of 151,936). Without a GPU, when Triton is installed, they run
once on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`, in a subprocess: the variable is
read at import) on small cases, with 16-logit chunks so that a row still spans several, and each
test reports its own check. The interpreter takes tens of milliseconds a program, too slow for
many draws, so there the distribution is checked in two steps: the kernel's draws equal, token for
token, the race computed in torch from the same Philox numbers (`_reference_keys`, Triton's Philox
rewritten on int64 tensors), and that race, run in torch for many draws, matches
softmax(logits / T) (`test_reference_race_matches_softmax`, which needs no Triton). On CUDA the
kernel's own frequencies are checked as well."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable

import pytest
import torch
from interpreted import interpret

from laden.rollout.native.attention import triton_available

gpu = pytest.mark.gpu
needs_triton = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")

_M32 = 0xFFFFFFFF
NEG_INF = float("-inf")


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32 bits of `a * b`, a 32-bit constant times uint32 values held in int64
    (in 16-bit halves, so nothing overflows)."""
    t = a * (b & 0xFFFF)
    u = a * (b >> 16) + (t >> 16)
    return u >> 16, ((u & 0xFFFF) << 16) | (t & 0xFFFF)


def _philox(seed: int, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor):
    """Triton's `tl.philox` (Philox4x32, 10 rounds, key = the seed's low and high words)."""
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(0xCD9E8D57, c2)
        hi_a, lo_a = _mul_hi_lo(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return c0, c1, c2, c3


def _reference_keys(
    logits: torch.Tensor, temperature: torch.Tensor, seed: int, step: int, chunk: int
) -> torch.Tensor:
    """The race keys `logits / T - log(-log(U))` of the kernel's documented stream: logit j of row
    r takes number `(j % chunk) // (chunk / 4)` of the Philox counter
    `(j // chunk * chunk / 4 + j % (chunk / 4), r, step low, step high)`."""
    b, v = logits.shape
    q = chunk // 4
    j = torch.arange(v, device=logits.device)
    shape = (b, v)
    counters = (
        ((j // chunk) * q + j % q).expand(shape),
        torch.arange(b, device=logits.device)[:, None].expand(shape),
        torch.full(shape, step & _M32, device=logits.device),
        torch.full(shape, step >> 32, device=logits.device),
    )
    numbers = torch.stack(_philox(seed, *counters))
    r = numbers.gather(0, ((j % chunk) // q).expand(shape)[None])[0]
    u = ((r >> 9).float() + 0.5) * 2.0**-23
    return logits.float() * (1.0 / temperature[:b])[:, None] - torch.log(-torch.log(u))


def _reference_uniform(seed: int, step: int, rows: int, device) -> torch.Tensor:
    """`METHOD = "cdf"`'s uniform of each row: the first number of Philox counter (0, row, step)."""
    zero = torch.zeros(rows, dtype=torch.int64, device=device)
    r = _philox(seed, zero, torch.arange(rows, device=device), zero + (step & _M32), zero + (step >> 32))[0]
    return ((r >> 9).double() + 0.5) * 2.0**-23


def _reference_cdf(logits: torch.Tensor, temperature: torch.Tensor, seed: int, step: int):
    """(tokens, cumulative distribution `[B, V]` in fp64, uniforms): the first token whose
    cumulative probability passes the row's uniform."""
    b = logits.shape[0]
    p = torch.softmax(logits.double() / temperature[:b, None].double(), dim=-1)
    cdf = p.cumsum(-1)
    u = _reference_uniform(seed, step, b, logits.device)
    tokens = torch.searchsorted(cdf, u[:, None], right=True)[:, 0]
    last = torch.where(p > 0, torch.arange(p.shape[1], device=p.device), -1).max(-1).values
    return torch.minimum(tokens, last), cdf, u


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _state(seed: int, offset: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor([seed], dtype=torch.int64, device=device),
        torch.tensor([offset], dtype=torch.int64, device=device),
    )


def _log_softmax(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float() / temperature[: logits.shape[0], None], dim=-1)


def _at(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return values.gather(1, tokens[:, None])[:, 0]


def _chunk(device: str) -> int:
    from laden.rollout.native.kernels.options import SamplerOptions

    CHUNK = SamplerOptions().chunk

    return 16 if device == "cpu" else CHUNK


def _assert_frequencies(tokens: torch.Tensor, probs: torch.Tensor, hot: list[int]) -> None:
    """Frequencies of the `hot` tokens and of all the others together within 5 binomial sigma."""
    n = tokens.numel()
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    p = probs.double().cpu()
    rest = torch.ones_like(p, dtype=torch.bool)
    rest[hot] = False
    seen = torch.cat([counts[hot], counts[rest].sum()[None]]) / n
    want = torch.cat([p[hot], p[rest].sum()[None]])
    tol = 5 * (want * (1 - want) / n).sqrt() + 1e-9
    assert ((seen - want).abs() <= tol).all(), (seen, want, tol)


CHECKS: dict[str, Callable[[str], None]] = {}


def _check(fn: Callable[[str], None]) -> Callable[[str], None]:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


@_check
def check_greedy(device: str) -> None:
    """Greedy rows: the first argmax (ties across chunks and across a chunk's four tiles), the
    log_softmax there; the max in the last, partial chunk; only the first B rows of the settings read."""
    from laden.rollout.native.kernels.triton_sampler import sample_fused

    chunk = _chunk(device)
    v = 3 * chunk + 17
    b = 6 if device == "cpu" else 64
    q = chunk // 4
    tolerances = {torch.float32: (1e-5, 1.3e-6), torch.bfloat16: (1e-4, 1e-5), torch.float16: (1e-4, 1e-5)}
    for dtype, (atol, rtol) in tolerances.items():
        logits = torch.randn(b, v, generator=_gen(0)) * 3
        logits[0, v - 1] = 50.0  # in the last, partial chunk
        logits[1, [5, chunk + 3]] = 40.0  # a tie across chunks
        logits[2, [2 * chunk + q + 1, 2 * chunk + 3]] = 40.0  # a later tile's lane 1 vs tile 0's lane 3
        logits[3, :] = NEG_INF
        logits[3, chunk + 2] = -3.0  # the one finite logit
        logits[4, [chunk + 1 + i * q for i in range(4)]] = 40.0  # one lane, all four tiles
        logits = logits.to(device=device, dtype=dtype)
        # two rows past B whose settings would break the batch if read
        temperature = torch.cat([torch.ones(b), torch.zeros(2)]).to(device)
        greedy = torch.cat([torch.ones(b, dtype=torch.bool), torch.zeros(2, dtype=torch.bool)]).to(device)
        seed, offset = _state(7, 3, device)
        tokens, logprobs = sample_fused(logits, temperature, greedy, seed, offset, chunk=chunk)
        assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
        want = logits.float().argmax(-1)
        assert want[:5].tolist() == [v - 1, 5, 2 * chunk + 3, chunk + 2, chunk + 1]
        assert torch.equal(tokens, want), (dtype, tokens, want)
        ref = _at(_log_softmax(logits, temperature), want)
        torch.testing.assert_close(logprobs, ref, atol=atol, rtol=rtol)
        assert offset.item() == 4


@_check
def check_sampled_logprobs(device: str) -> None:
    """Sampled rows at several temperatures: a finite logit drawn, its log_softmax(logits / T) returned."""
    from laden.rollout.native.kernels.triton_sampler import sample_fused

    chunk = _chunk(device)
    v = 3 * chunk + 17
    b = 8 if device == "cpu" else 256
    logits = torch.randn(b, v, generator=_gen(1)) * 2
    logits[torch.rand(b, v, generator=_gen(2)) < 0.1] = NEG_INF
    logits = logits.to(device)
    temperature = (0.3 + 1.7 * torch.rand(b, generator=_gen(3))).to(device)
    greedy = torch.zeros(b, dtype=torch.bool, device=device)
    seed, offset = _state(11, 0, device)
    for _ in range(1 if device == "cpu" else 4):
        tokens, logprobs = sample_fused(logits, temperature, greedy, seed, offset, chunk=chunk)
        assert ((tokens >= 0) & (tokens < v)).all()
        assert torch.isfinite(_at(logits, tokens)).all()
        ref = _at(_log_softmax(logits, temperature), tokens)
        torch.testing.assert_close(logprobs, ref, atol=3e-5, rtol=1e-5)


@_check
def check_race_equals_reference(device: str) -> None:
    """Sampled rows draw the argmax of the documented race keys, token for token (a token whose
    reference key is within 1e-4 of the best counts: rounding on the GPU may split a near tie);
    64-bit seed and step, consecutive steps."""
    from laden.rollout.native.kernels.triton_sampler import sample_fused

    chunk = _chunk(device)
    v = 3 * chunk + 17
    b = 8 if device == "cpu" else 128
    logits = (torch.randn(b, v, generator=_gen(4)) * 0.5).to(device)  # flat: the noise decides
    temperature = torch.tensor([0.5, 1.0, 2.0, 1.3]).repeat(b // 4).to(device)
    greedy = torch.zeros(b, dtype=torch.bool, device=device)
    seed_value, step = 2**40 + 12345, 2**32 + 3
    seed, offset = _state(seed_value, step, device)
    for s in (step, step + 1):
        tokens, _ = sample_fused(logits, temperature, greedy, seed, offset, chunk=chunk)
        keys = _reference_keys(logits, temperature, seed_value, s, chunk)
        want = keys.argmax(-1)
        gap = _at(keys, want) - _at(keys, tokens)
        assert (gap <= 1e-4).all(), (s, tokens, want, gap)
        assert (tokens == want).float().mean() >= 0.9, (tokens, want)
        assert offset.item() == s + 1


@_check
def check_offsets(device: str) -> None:
    """The same seed and offset draw the same tokens, whatever the batch size; another offset
    (low or high word) or seed draws others; identical rows draw independently; +1 a call."""
    from laden.rollout.native.kernels.triton_sampler import sample_fused

    v, chunk, b = (32, 32, 12) if device == "cpu" else (3 * 4096 + 17, 4096, 256)
    logits = torch.zeros(b, v, device=device)  # uniform
    temperature = torch.ones(b, device=device)
    greedy = torch.zeros(b, dtype=torch.bool, device=device)

    def draw(seed_value: int, at: int, rows: int = b) -> torch.Tensor:
        seed, offset = _state(seed_value, at, device)
        tokens, _ = sample_fused(logits[:rows], temperature, greedy, seed, offset, chunk=chunk)
        assert offset.item() == at + 1
        return tokens

    first = draw(5, 9)
    assert torch.equal(draw(5, 9), first)
    assert torch.equal(draw(5, 9, rows=b // 2), first[: b // 2])
    for other in (draw(5, 10), draw(5, 9 + 2**32), draw(6, 9)):
        assert (other != first).float().mean() > 0.5, (first, other)
    assert len(set(first.tolist())) > b // 2, first


@_check
def check_mixed_batch(device: str) -> None:
    """Greedy and sampled rows at different temperatures in one batch: greedy rows as alone, sampled
    rows draw the reference race of their own row, every logprob as log_softmax(logits / T)."""
    from laden.rollout.native.kernels.triton_sampler import sample_fused

    chunk = _chunk(device)
    v = 3 * chunk + 17
    b = 8 if device == "cpu" else 128
    logits = (torch.randn(b, v, generator=_gen(5)) * 2).to(device)
    greedy = (torch.arange(b) % 2 == 0).to(device)
    temperature = torch.where(greedy.cpu(), 1.0, torch.tensor([0.5, 0.8, 1.5, 3.0]).repeat(b // 4)).to(device)
    seed, offset = _state(21, 2, device)
    tokens, logprobs = sample_fused(logits, temperature, greedy, seed, offset, chunk=chunk)
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
    torch.testing.assert_close(logprobs, _at(_log_softmax(logits, temperature), tokens), atol=3e-5, rtol=1e-5)
    keys = _reference_keys(logits, temperature, 21, 2, chunk)
    sampled = ~greedy
    gap = _at(keys, keys.argmax(-1)) - _at(keys, tokens)
    assert (gap[sampled] <= 1e-4).all(), (tokens, keys.argmax(-1))
    seed, offset = _state(21, 2, device)
    alone, _ = sample_fused(logits, temperature, torch.ones_like(greedy), seed, offset, chunk=chunk)
    assert torch.equal(tokens[greedy], alone[greedy])


@_check
def check_masked_never_drawn(device: str, method: str = "race") -> None:
    """-inf logits (bf16) are never drawn, at high temperature too: a row of one finite logit, a row
    whose first and last chunks are all -inf, a row finite only in its last, partial chunk."""
    from laden.rollout.native.kernels.triton_sampler import sample_fused

    chunk = _chunk(device)
    v = 3 * chunk + 17
    b = 8 if device == "cpu" else 256
    logits = torch.randn(b, v, generator=_gen(6))
    logits[torch.rand(b, v, generator=_gen(7)) < 0.8] = NEG_INF
    logits[0, :] = NEG_INF
    logits[0, 2 * chunk + 1] = 4.0
    logits[1, :chunk] = NEG_INF
    logits[1, 3 * chunk :] = NEG_INF
    logits[2, : 3 * chunk] = NEG_INF
    logits = logits.to(device=device, dtype=torch.bfloat16)
    temperature = torch.tensor([1.0, 4.0, 2.0, 8.0]).repeat(b // 4).to(device)
    greedy = torch.zeros(b, dtype=torch.bool, device=device)
    seed, offset = _state(3, 0, device)
    for _ in range(2 if device == "cpu" else 50):
        tokens, logprobs = sample_fused(logits, temperature, greedy, seed, offset, chunk=chunk, method=method)
        assert torch.isfinite(_at(logits, tokens).float()).all(), tokens
        assert tokens[0].item() == 2 * chunk + 1 and abs(logprobs[0].item()) < 1e-6
        assert chunk <= tokens[1].item() < 3 * chunk and tokens[2].item() >= 3 * chunk
        assert torch.isfinite(logprobs).all()


@_check
def check_cdf_masked_never_drawn(device: str) -> None:
    """As `check_masked_never_drawn`, drawn by the inverse of the cumulative distribution."""
    check_masked_never_drawn(device, "cdf")


@_check
def check_cdf_equals_reference(device: str) -> None:
    """`method="cdf"`: sampled rows draw the first token whose cumulative probability passes the
    row's Philox uniform, token for token with an fp64 reference (or within 1e-5 of its boundary);
    greedy rows their argmax; every logprob log_softmax(logits / T); 64-bit seed and step,
    consecutive steps, +1 a call."""
    from laden.rollout.native.kernels.triton_sampler import sample_fused

    chunk = _chunk(device)
    v = 3 * chunk + 17
    b = 8 if device == "cpu" else 256
    logits = torch.randn(b, v, generator=_gen(12)) * 2
    logits[torch.rand(b, v, generator=_gen(13)) < 0.1] = NEG_INF
    logits[0, :] = 0.0  # uniform: the uniform alone places the token
    logits = logits.to(device)
    greedy = (torch.arange(b) % 4 == 3).to(device)
    temperature = torch.where(greedy.cpu(), 1.0, torch.tensor([0.5, 1.0, 2.0, 1.0]).repeat(b // 4)).to(device)
    seed_value, step = 2**40 + 777, 2**32 + 5
    seed, offset = _state(seed_value, step, device)
    for at in (step, step + 1):
        tokens, logprobs = sample_fused(logits, temperature, greedy, seed, offset, chunk=chunk, method="cdf")
        assert offset.item() == at + 1
        sampled = ~greedy
        want, cdf, u = _reference_cdf(logits, temperature, seed_value, at)
        rows = sampled.nonzero()[:, 0]
        got = tokens[rows]
        at_tok = cdf[rows].gather(1, got[:, None])[:, 0]
        before = torch.where(got > 0, cdf[rows].gather(1, (got - 1).clamp(min=0)[:, None])[:, 0], 0.0)
        assert ((before <= u[rows] + 1e-5) & (at_tok >= u[rows] - 1e-5)).all(), (got, want[rows])
        assert (got == want[rows]).double().mean() >= 0.9, (got, want[rows])
        assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
        torch.testing.assert_close(
            logprobs, _at(_log_softmax(logits, temperature), tokens), atol=3e-5, rtol=1e-5
        )


@_check
def check_frequencies(device: str, method: str = "race") -> None:
    """The kernel's own draws (CUDA only: the interpreter is too slow for enough of them) match
    softmax(logits / T): a small vocabulary, one of four chunks whose most likely token is the
    last, in the partial chunk, and a full 151,936 one, at three temperatures."""
    from laden.rollout.native.kernels.options import SamplerOptions
    from laden.rollout.native.kernels.triton_sampler import sample_fused

    CHUNK = SamplerOptions().chunk

    b, calls = 512, 50
    small = torch.randn(24, generator=_gen(8)) * 1.5
    # ~12,000 unlikely tokens, at most 11 nats below the best (further, rounding in U shows: see the module)
    four = torch.full((3 * CHUNK + 17,), -4.0)
    four_hot = [5, CHUNK + 1, 2 * CHUNK + 2049, 3 * CHUNK + 3, 3 * CHUNK + 16]
    four[four_hot] = torch.tensor([0.0, 0.5, -0.5, 1.0, 1.5])
    four[100:200] = NEG_INF
    full = torch.full((151936,), NEG_INF)
    full_hot = torch.randperm(151936, generator=_gen(9))[:6].tolist()
    full[full_hot] = torch.tensor([1.0, 0.3, -0.2, 0.8, -1.0, 0.0])
    cases = ((small, list(range(24))), (four, four_hot), (full, full_hot))
    seed, offset = _state(99, 0, device)
    greedy = torch.zeros(b, dtype=torch.bool, device=device)
    for row, hot in cases:
        logits = row.to(device).expand(b, -1).contiguous()
        for t in (0.5, 1.0, 2.0):
            temperature = torch.full((b,), t, device=device)
            draws = [
                sample_fused(logits, temperature, greedy, seed, offset, method=method)[0]
                for _ in range(calls)
            ]
            _assert_frequencies(torch.cat(draws), torch.softmax(row / t, -1), hot)


@_check
def check_cdf_frequencies(device: str) -> None:
    """As `check_frequencies`, drawn by the inverse of the cumulative distribution (CUDA only)."""
    check_frequencies(device, "cdf")


INTERPRETED = [name for name in CHECKS if not name.endswith("frequencies")]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_reference_cdf_matches_softmax(temperature):
    """`method="cdf"`'s documented draw (one 23-bit Philox uniform a row, the first token whose
    cumulative probability passes it) samples softmax(logits / T): 40,000 draws over rows and
    steps (one past 2^32); -inf logits never."""
    v, rows = 53, 10000
    row = torch.randn(v, generator=_gen(14))
    row[[3, 20, 50]] = NEG_INF
    logits = row.expand(rows, -1)
    t = torch.full((rows,), temperature)
    draws = torch.cat([_reference_cdf(logits, t, 4321, step)[0] for step in (0, 1, 77, 2**32 + 1)])
    assert not torch.isin(draws, torch.tensor([3, 20, 50])).any()
    _assert_frequencies(draws, torch.softmax(row / temperature, -1), list(range(v)))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_reference_race_matches_softmax(temperature):
    """The documented stream's race (uniforms from 23 Philox bits, Gumbel keys, argmax) draws from
    softmax(logits / T): 40,000 draws over rows and steps (one past 2^32), 16-logit chunks."""
    v, rows = 3 * 16 + 5, 10000
    row = torch.randn(v, generator=_gen(10))
    row[[3, 20, 50]] = NEG_INF
    logits = row.expand(rows, -1)
    t = torch.full((rows,), temperature)
    draws = [_reference_keys(logits, t, 1234, step, 16).argmax(-1) for step in (0, 1, 77, 2**32 + 1)]
    _assert_frequencies(torch.cat(draws), torch.softmax(row / temperature, -1), list(range(v)))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    """Every check but the CUDA-only one, once, under the interpreter: name -> "ok" or its traceback."""
    code = textwrap.dedent(
        """
        import json, traceback
        import test_triton_sampler as t
        results = {}
        for name in t.INTERPRETED:
            try:
                t.CHECKS[name]("cpu")
                results[name] = "ok"
            except Exception:
                results[name] = traceback.format_exc()
        print(json.dumps(results))
        """
    )
    done = interpret(code)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="runs on CUDA instead")
@pytest.mark.parametrize("name", INTERPRETED)
def test_in_the_interpreter(name, interpreted):
    assert interpreted[name] == "ok", interpreted[name]


@gpu
@needs_triton
@pytest.mark.parametrize("name", list(CHECKS))
def test_on_cuda(name):
    CHECKS[name]("cuda")
