"""Weights that lie back to back in one buffer, used as one matrix without a copy.

Projections that read the same input (an attention layer's query, key and value: see
`laden.model.sink_linear`) are one GEMM instead of several when their weights are rows of
one matrix. Hugging Face modules own one tensor per weight, but an engine that streams weights
(the roundpipe engine uploads each layer's parameters as one flat buffer, in the order the
module lists them) has them back to back already: `stacked_rows` finds that out and returns
the joint matrix as a view, and `None` otherwise (separately allocated weights, a bias in
between, another dtype), in which case the caller runs its projections one by one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["stacked_rows"]


def stacked_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """`torch.cat(tensors)` as a view: 2-D contiguous tensors with the same number of columns,
    dtype and device, each starting in the same storage where the one before it ends; else None.

    The view shares no autograd history with the inputs (it is built from their data): callers
    use it inside an autograd function that takes the tensors themselves as inputs.
    """
    first = tensors[0]
    if first.dim() != 2 or first.device.type == "meta":
        return None
    cols, storage = first.shape[1], first.untyped_storage().data_ptr()
    ptr, rows = first.data_ptr(), 0
    for t in tensors:
        if (
            t.dim() != 2
            or t.shape[1] != cols
            or t.dtype != first.dtype
            or t.device != first.device
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage
            or t.data_ptr() != ptr
        ):
            return None
        ptr += t.numel() * t.element_size()
        rows += t.shape[0]
    return first.detach().as_strided((rows, cols), (cols, 1))
