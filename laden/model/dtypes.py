"""The config's dtype names and the torch dtypes they mean: the one map every engine reads."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    """`actor.dtype` / `actor.optimizer_dtype` as a torch dtype."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES)}") from None
