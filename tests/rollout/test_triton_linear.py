"""laden's split-K linear for the decode step's few rows, against `F.linear` (+ bias, + residual).

On the CPU through Triton's interpreter when Triton is installed (`TRITON_INTERPRET=1`, in a
subprocess: the variable is read at import); on a GPU in bf16 (`gpu` marker)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from interpreted import interpret_check, run_check

from laden.rollout.native.attention import triton_available

CASES = """
import torch, torch.nn.functional as F
from laden.rollout.native.kernels.triton_linear import LinearConfig, linear, pick_config

def check(dtype, device, tol):
    torch.manual_seed(0)
    shapes = [(1, 96, 256), (7, 130, 512), (33, 64, 1024), (64, 200, 384)]
    for m, n, k in shapes:
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype) * k**-0.5
        b = torch.randn(n, device=device, dtype=dtype)
        r = torch.randn(m, n, device=device, dtype=dtype)
        block_m = max(16, 1 << (m - 1).bit_length())
        configs = [None, LinearConfig(block_m, 32, 64, 4), LinearConfig(block_m, 64, 128, 1), LinearConfig(block_m, 32, 64, 3),
                   LinearConfig(16, 32, 64, 2)]  # the last: several row tiles
        for cfg in configs:
            for bias in (None, b):
                for res in (None, r):
                    want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
                    if res is not None:
                        want = want + res.float()
                    got = linear(x, w, res, cfg, bias=bias)
                    assert got.dtype == dtype and got.shape == (m, n)
                    err = (got.float() - want).abs().max().item()
                    assert err < tol, (m, n, k, cfg, bias is None, res is None, err)
"""


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
def test_linear_in_the_interpreter():
    interpret_check(CASES, torch.float32, "cpu", 1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_linear_on_cuda(dtype):
    run_check(CASES, dtype, "cuda", 5e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 3, 16, 48, 64, 100, 128])
@pytest.mark.parametrize("n,k", [(1024, 2048), (1024, 3072), (2048, 2048), (2048, 6144)])
def test_picked_configs_on_the_engines_shapes(rows, n, k):
    """The narrow projections of Qwen3-0.6B / 1.7B (attention output, down) with their residual;
    the wide ones (fused q/k/v, gate/up) and more rows go to cuBLAS."""
    from laden.rollout.native.kernels.options import LinearOptions
    from laden.rollout.native.kernels.triton_linear import linear, pick_config

    MAX_ROWS = LinearOptions().max_rows

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    config = pick_config(rows, n, k, sms)
    assert config is not None and config.splits > 1
    assert pick_config(MAX_ROWS + 1, n, k, sms) is None and pick_config(rows, 4096, 1024, sms) is None
    torch.manual_seed(0)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    r = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x.float(), w.float()) + r.float()
    torch.testing.assert_close(linear(x, w, r, config).float(), want, atol=5e-2, rtol=2e-2)


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
def test_more_rows_than_one_tile_are_row_tiles():
    """With `max_rows` raised past 128 the rows are tiles of `max_block_m`, as the benchmark's grid
    runs them, not one tile of every row."""
    from laden.rollout.native.kernels.options import LinearOptions
    from laden.rollout.native.kernels.triton_linear import pick_config

    options = LinearOptions(max_rows=256)
    assert pick_config(256, 1024, 3072, 132, options=options).block_m == options.max_block_m == 128
    assert pick_config(100, 1024, 3072, 132, options=options).block_m == 128
    assert pick_config(40, 1024, 3072, 132, options=options).block_m == 64


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
def test_tiles_shrink_to_the_gpus_shared_memory():
    """A GPU with less shared memory than an H200 (e.g. 99 KB a program on sm_86 / sm_89) gets fewer
    pipeline stages, then shallower K tiles; one where nothing fits gets cuBLAS. The decode
    kernel's tile halves likewise."""
    from laden.rollout.native.kernels.options import DecodeOptions
    from laden.rollout.native.kernels.triton_decode import tile_tokens_for
    from laden.rollout.native.kernels.triton_linear import pick_config, shared_memory

    TILE_TOKENS = DecodeOptions().tile_tokens
    h200, small = 232448, 101376
    big = pick_config(128, 1024, 3072, 132, h200)
    assert big is not None and big.num_stages == 4 and big.block_k == 128
    assert big == pick_config(128, 1024, 3072, 132)  # no limit reported: the H200's choice
    fitted = pick_config(128, 1024, 3072, 132, small)
    assert fitted is not None and shared_memory(fitted) <= 0.9 * small
    assert (fitted.num_stages, fitted.block_k) == (2, 128)
    assert pick_config(128, 1024, 3072, 132, 8192) is None
    assert tile_tokens_for(128, 2, 2, 32, h200) == TILE_TOKENS
    assert tile_tokens_for(128, 2, 2, 32, None) == TILE_TOKENS
    assert tile_tokens_for(128, 2, 2, 32, small) == TILE_TOKENS // 2
    assert tile_tokens_for(128, 4, 2, 32, small) == 32  # fp32: half the tokens again, not below a page
