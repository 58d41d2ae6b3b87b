"""The launch settings of laden's Triton kernels, as one value (`KernelOptions`) handed to the
engine (`NativeEngine(kernel_options=...)`) and from it to the model, the CUDA graphs and the
sampler; two engines in one process may run different ones. No Triton import: the engine reads
them on machines without it.

The defaults were measured on an H200 (`benchmarks/decode_kernel.py`, `skinny_gemm.py`,
`sampler_kernel.py`, `swiglu_kernel.py`, inside CUDA graphs; `benchmarks/RESULTS.md`); those
marked "not measured yet" stay off until a benchmark says otherwise
(`benchmarks/generate_throughput.py --kernel-option`, `benchmarks/pick_options.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodeOptions:
    """The paged decode attention kernel (`triton_decode`). 256-token splits were the fastest from
    2 to 64 rows of workload B's lengths (16 rows: 25 us against 38 unsplit and 26 in 512-token
    splits; 64 rows: 84 against 87); at 256 rows (2,048 programs on 132 SMs) the unsplit kernel
    beat every split."""

    tile_tokens: int = 128
    """Tokens of one KV head an iteration reads (halved for fp32, whose tiles take twice the shared memory)."""
    num_warps: int = 4
    """Warps a program."""
    num_stages: int = 2
    """Software pipeline stages."""
    split_tokens: int = 256
    """Tokens a split covers when a launch is split."""
    max_splits: int = 64
    """Most splits a row (longer splits beyond)."""
    unsplit_programs_per_sm: int = 4
    """The fewest programs (rows x KV heads) per SM at which one split per row is fastest."""
    mask_loads: bool | None = None
    """Whether the key and value loads of a row's last tile skip the tokens past its end (masked loads
    zero-fill shared memory without touching HBM) instead of reading them and masking the scores;
    None is "when one split a row" (measured: 71.4 against 73.5 us for workload A's 256 rows; split
    launches of 16 and 64 rows were slower masked)."""
    heads_inner: bool = True
    """Program order: True runs a row's KV heads in adjacent programs (they read neighbouring 256-byte
    pieces of each cached token's keys), False one KV head of consecutive rows. Measured: 71.2
    against 71.3 us for workload A's rows, 274.5 against 275.8 for B's, the split launches even."""
    prefetch_table: bool = False
    """Whether each iteration loads the next tile's block numbers (so the key and value addresses of a
    tile are known an iteration early, for the pipeline) instead of its own. Not measured yet."""
    heads_per_program: int = 1
    """KV heads a program attends (1 or 2): with 2, each iteration reads half as many tokens of both
    heads (the same entries and shared memory), so a short row makes half as many programs, each
    with twice the work to hide its start behind. Not measured yet."""
    max_registers: int | None = None
    """Registers a thread may use (Triton's `maxnreg`; None: the compiler's choice). Compiled for sm_90
    (tests/rollout/test_triton_compile.py) the default configuration takes 197 a thread: 25,216 a program of
    4 warps, so two programs fit an SM's 65,536. 128 fits three (with 64-token tiles, four) at the
    price of a few spilled bytes. Not measured yet."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearOptions:
    """The split-K linear (`triton_linear`) of the decode step's narrow projections. Measured on an
    H200: the attention output (1024 x 2048) and down projection (1024 x 3072) took cuBLAS 7 to 14
    us and this kernel 5.4 to 6.7 us for 1 to 128 rows in 4 splits; the wide ones (q/k/v fused,
    4096 x 1024, and gate/up, 6144 x 1024) were as fast or faster in cuBLAS."""

    max_rows: int = 128
    """Rows up to which the kernel may be used (above: cuBLAS)."""
    max_block_m: int = 128
    """Rows of one tile: more rows are more row tiles (`benchmarks/skinny_gemm.py`'s grid does the same)."""
    narrow_tiles_per_sm: float = 0.5
    """The share of the SMs below which cuBLAS's tiles of the output leave the GPU idle (then the
    kernel splits K until the programs fill it)."""
    block_n: int = 32
    """Output features of one tile."""
    block_k: int = 128
    """Reduction depth of one tile."""
    min_split_k: int = 256
    """The shallowest K range one split may take."""


@dataclass(frozen=True, kw_only=True, slots=True)
class QKVOptions:
    """The q/k norm + rotary embedding + cache write kernel (`triton_qkv`): a `[BLOCK_H, D]` tile of
    1024 values (8 heads of 128) keeps 16-byte bf16 loads in every thread of four warps and gives
    a decode batch of a few tokens several programs each."""

    tile_elements: int = 1024
    """Values per program."""
    num_warps: int = 4
    """Warps a program."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplerOptions:
    """The fused sampler (`triton_sampler`): 4096 logits over 4 warps is four 1024-wide tiles, eight
    logits a thread in each (one 16-byte load in bf16)."""

    chunk: int = 4096
    """Logits per program of the first kernel (a power of two, at least 16; the draws depend on it)."""
    num_warps: int = 4
    """Warps a program of the first kernel."""
    method: str = "race"
    """How sampled rows draw: "race" (an exponential race: one Philox number and one logarithm a
    logit) or "cdf" (the inverse of the row's cumulative distribution at one Philox uniform a row).
    Both draw from softmax(logits / T); the tokens differ. "cdf" is not measured yet
    (`benchmarks/sampler_kernel.py --methods race cdf`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SwigluOptions:
    """The SwiGLU kernel (`triton_swiglu`): 1024 columns over 4 warps is eight bf16 values a thread
    (one 16-byte load from each half)."""

    block: int = 1024
    """Columns per program."""
    num_warps: int = 4
    """Warps a program."""
    in_decode: bool = False
    """Whether the fused decode layer uses this kernel instead of the compiled torch SwiGLU. Not
    measured yet against inductor's kernel (`benchmarks/swiglu_kernel.py`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelOptions:
    """Every kernel's launch settings; the defaults are what the engine runs."""

    decode: DecodeOptions = field(default_factory=DecodeOptions)
    """Paged decode attention."""
    linear: LinearOptions = field(default_factory=LinearOptions)
    """The split-K linear."""
    qkv: QKVOptions = field(default_factory=QKVOptions)
    """The q/k norm + rotary + cache write kernel."""
    sampler: SamplerOptions = field(default_factory=SamplerOptions)
    """The fused sampler."""
    swiglu: SwigluOptions = field(default_factory=SwigluOptions)
    """SwiGLU."""

    def with_setting(self, target: str, value: Any) -> KernelOptions:
        """A copy with one setting changed; `target` names it as `triton_MODULE.NAME` (the kernel's
        module and the field in capitals, e.g. `triton_decode.HEADS_PER_PROGRAM`). Raises
        `ValueError` naming the settings there are for an unknown one."""
        module, dot, name = target.rpartition(".")
        kernel = module.removeprefix("triton_")
        part: Any = getattr(self, kernel, None) if module.startswith("triton_") and dot else None
        fields = [f.name for f in dataclasses.fields(part)] if part is not None else []
        if name.lower() not in fields:
            raise ValueError(f"kernel option {target!r} does not exist; there are {', '.join(self.names())}")
        changed: dict[str, Any] = {kernel: dataclasses.replace(part, **{name.lower(): value})}
        return dataclasses.replace(self, **changed)

    @classmethod
    def names(cls) -> list[str]:
        """Every setting as `triton_MODULE.NAME` (what `with_setting` takes)."""
        out = []
        for part in dataclasses.fields(cls):
            default = part.default_factory()  # type: ignore[misc]
            out += [f"triton_{part.name}.{f.name.upper()}" for f in dataclasses.fields(default)]
        return out
