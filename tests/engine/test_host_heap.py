"""`trim_host_heap`: the free pages glibc's heap keeps after a CPU step go back to the OS."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from laden.engine import device


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(device._malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_freed_heap_pages_are_returned_after_a_trim():
    # 64 KiB tensors live in the heap (below the mmap threshold); the last one pins the heap's top, so
    # glibc's own trimming (from the top only) cannot give the freed ones back
    chunks = [torch.ones(16 * 1024) for _ in range(2000)]  # 125 MiB
    pin = chunks.pop()
    del chunks
    before = _rss()
    device.trim_host_heap()
    assert before - _rss() > 64 * 2**20
    assert float(pin.sum()) == 16 * 1024
