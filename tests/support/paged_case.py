"""A random paged KV cache and its block tables (kernel tests; imports nothing but torch)."""

from __future__ import annotations

import torch


def paged_case(b, hq, hkv, d, page, lengths, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_pages = max(-(-n // page) for n in lengths) + 1
    num_blocks = sum(-(-n // page) for n in lengths) + 3
    kc = torch.randn(num_blocks, page, hkv, d, generator=g).to(device, dtype)
    vc = torch.randn(num_blocks, page, hkv, d, generator=g).to(device, dtype)
    q = torch.randn(b, hq, d, generator=g).to(device, dtype)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(b, max_pages, dtype=torch.int32)
    for i, n in enumerate(lengths):
        k = -(-n // page)
        table[i, :k] = torch.tensor([perm.pop() for _ in range(k)], dtype=torch.int32)
    return q, kc, vc, table.to(device), torch.tensor(lengths, dtype=torch.int32, device=device)
