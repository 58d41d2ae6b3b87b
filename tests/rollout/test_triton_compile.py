"""laden's Triton kernels compile for an H200 (sm_90) without one: Triton lowers them to PTX and
its bundled `ptxas` assembles them, as on the GPU machine, so a kernel or an option that cannot be
built for the GPU fails here, and each fits the shared memory a program may take there.

Integer arguments are declared divisible by 16 (`tt.divisibility`), as Triton's launcher
specializes the engine's strides and pointers; without that the loads are not vectorized and the
pipeliner leaves them alone, which is not what runs."""

from __future__ import annotations

import pytest

from laden.rollout.native.attention import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")

H200_SMEM = 232448  # bytes a program may opt into (shared_memory_per_block_optin)


def _compile(
    fn, types: dict[str, str], constexprs: dict, *, num_warps: int = 4, num_stages: int = 2, maxnreg=None
):
    """`fn` compiled for sm_90: `types` names each runtime argument's type ("*bf16", "i32", ...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = types[name]
        if types[name].startswith("*") or types[name] == "i32":
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages} | ({"maxnreg": maxnreg} if maxnreg else {})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert kernel.metadata.shared <= H200_SMEM, (fn.__name__, constexprs, kernel.metadata.shared)
    return kernel


def _decode_types() -> dict[str, str]:
    types = {n: "*bf16" for n in ("Q", "K", "V", "OUT")} | {"BT": "*i32", "LENS": "*i32", "LSE": "*fp32"}
    strides = ("qb", "qh", "kb", "ks", "kh", "btb", "ob", "oh", "os", "lb", "lh")
    return types | {"scale": "fp32"} | {f"stride_{s}": "i32" for s in strides}


@pytest.mark.parametrize(
    "heads,prefetch,tile_pages,stages",
    [(1, False, 4, 2), (1, True, 4, 2), (1, True, 4, 3), (1, True, 2, 3), (2, False, 2, 2), (2, True, 2, 3),
     (2, True, 1, 3)],
)  # fmt: skip
@pytest.mark.parametrize("direct", [True, False])
def test_the_decode_kernel_and_its_options_compile_for_sm90(heads, prefetch, tile_pages, stages, direct):
    from laden.rollout.native.kernels.triton_decode import _paged_decode_split

    constexprs = dict(
        GROUP=2, BLOCK_G=16, PAGE=32, D=128, TILE_PAGES=tile_pages, SPLIT_PAGES=8 if not direct else 64,
        DIRECT=direct, PRECISION="tf32", MASK_LOADS=direct, HEADS_INNER=True, PREFETCH_TABLE=prefetch, HEADS=heads,
    )  # fmt: skip
    _compile(_paged_decode_split, _decode_types(), constexprs, num_stages=stages)


@pytest.mark.parametrize("maxnreg", [168, 128])
def test_the_decode_kernel_compiles_under_a_register_cap(maxnreg):
    """`MAX_REGISTERS`: the cap holds (the compiler spills rather than fail)."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    from laden.rollout.native.kernels.triton_decode import _paged_decode_split

    constexprs = dict(
        GROUP=2, BLOCK_G=16, PAGE=32, D=128, TILE_PAGES=4, SPLIT_PAGES=64, DIRECT=True, PRECISION="tf32",
        MASK_LOADS=True, HEADS_INNER=True, PREFETCH_TABLE=False, HEADS=1,
    )  # fmt: skip
    kernel = _compile(_paged_decode_split, _decode_types(), constexprs, maxnreg=maxnreg)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip("this Triton has no cuobjdump to read the register count")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True
        )
    assert int(re.search(r"REG:(\d+)", usage.stdout).group(1)) <= maxnreg, usage.stdout


@pytest.mark.parametrize("block,warps", [(512, 4), (1024, 4), (2048, 8)])
def test_the_swiglu_kernel_compiles_for_sm90(block, warps):
    from laden.rollout.native.kernels.triton_swiglu import _swiglu

    types = {"GU": "*bf16", "OUT": "*bf16", "half": "i32", "stride_g": "i32", "stride_o": "i32"}
    _compile(_swiglu, types, {"BLOCK": block}, num_warps=warps)


@pytest.mark.parametrize("cdf", [False, True])
@pytest.mark.parametrize("chunk", [2048, 4096, 8192])
def test_the_sampler_kernels_compile_for_sm90(cdf, chunk):
    from laden.rollout.native.kernels.triton_sampler import _merge_cdf, _merge_chunks, _sample_chunks

    parts = {"PART_M": "*fp32", "PART_S": "*fp32", "PART_K": "*fp32", "PART_I": "*i32", "UNIFORM": "*fp32"}
    common = {"LOGITS": "*bf16", "TEMP": "*fp32", "GREEDY": "*i1", "SEED": "*i64", "OFFSET": "*i64"} | parts
    _compile(
        _sample_chunks, common | {"V": "i32", "stride_l": "i32"}, {"CHUNK": chunk, "FAST": True, "CDF": cdf}
    )
    merged = common | {
        "TOKENS": "*i64",
        "LOGPROBS": "*fp32",
        "n_chunks": "i32",
        "V": "i32",
        "stride_l": "i32",
    }
    if cdf:
        _compile(_merge_cdf, merged, {"CHUNK": chunk, "BLOCK_C": 128})
    else:
        _compile(_merge_chunks, merged, {"BLOCK_C": 64}, num_warps=1)
