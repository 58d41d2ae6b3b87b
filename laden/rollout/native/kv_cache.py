"""The paged KV cache: fixed-size blocks of token slots, handed to sequences by a host-side allocator.

Every layer's keys and values are one tensor `[num_blocks, block_size, kv_heads, head_dim]`
each; a sequence holds a list of block ids. Blocks are reference counted so the completions of
one prompt share its full prompt blocks (prefilled once); a partial last block is copied for
each completion, which then writes its own tokens after the prompt's. Block 0 is reserved as
the sink for writes that belong to no sequence (padding rows, tokens past a sequence's end).
"""

from __future__ import annotations

import torch


class BlockAllocator:
    """Free list plus reference counts of blocks `1..num_blocks-1` (block 0 is the sink)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is the sink), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{n} KV blocks asked for, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: list[int]) -> list[int]:
        """Another owner for `blocks` (a completion forked from a prefilled prompt)."""
        for b in blocks:
            assert self._refs[b] > 0, f"block {b} is not allocated"
            self._refs[b] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self._refs[b] > 0, f"block {b} freed twice"
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def used(self) -> int:
        return self.capacity - len(self._free)


class KVCache:
    """The cache tensors of every layer plus their allocator."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers, self.block_size, self.kv_heads, self.head_dim = (
            num_layers,
            block_size,
            kv_heads,
            head_dim,
        )
        self.dtype, self.device = dtype, device
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.allocate_tensors()

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block(
            num_layers=self.num_layers, block_size=self.block_size, kv_heads=self.kv_heads,
            head_dim=self.head_dim, dtype=self.dtype,
        )  # fmt: skip

    def allocate_tensors(self) -> None:
        shape = (self.num_blocks, self.block_size, self.kv_heads, self.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    def release_tensors(self) -> None:
        """Free the cache memory (`sleep`); the allocator must hold no sequence's blocks."""
        assert self.allocator.used() == 0, "sleep with sequences in the cache"
        self.k, self.v = [], []

    @property
    def allocated(self) -> bool:
        return bool(self.k)

    def copy_block(self, src: int, dst: int) -> None:
        for t in (*self.k, *self.v):
            t[dst].copy_(t[src])

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)
