"""Weights that lie back to back in one buffer, used as one matrix without a copy.

Projections that read the same input (an attention layer's query, key and value; a gated
MLP's gate and up) are one GEMM instead of several when their weights are rows of one
matrix. Hugging Face modules own one tensor per weight, but an engine that streams weights
(the roundpipe engine uploads each layer's parameters as one flat buffer, in the order the
module lists them) has them back to back already: `stacked_rows` finds that out and returns
the joint matrix as a view, and `None` otherwise (separately allocated weights, a bias in
between, another dtype), in which case the caller runs its projections one by one.

Off by default (`PatchOptions.joint_projections`, `laden.model.patches.options`, per model): on
an H200 the joint outputs' strided halves made the compiled elementwise kernels that read them
slower than the launches and adds they saved (`benchmarks/RESULTS.md`, sixth round). With the
fused kernels' static last dimensions (`PatchOptions.static_last_dims`, the default since the
seventh round) the reference step still ran 1 to 4 % slower with them (35,441 and 35,306
tokens/s against 35,835 and 36,615), so they stay off. The lean MLP reads the option from its
module at every call; `laden.model.patches.sink_linear.enable_sink_linears` gives an attention
module its joint query/key/value hooks only when the option is on.
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
