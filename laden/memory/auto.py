"""`auto` knob values, chosen from the planner's predictions before anything is built.

`resolve_auto(cfg, budget)` replaces every `auto` in `cfg` with a value and returns one log line
per choice: the value and the predicted peaks it was chosen from. The budget is this rank's
memory for training: the GPU's total on a CUDA device, the host's on the CPU (where the fsdp
engine's tensors live in host memory). Resolved once per run, before the config is written
to the run directory, so `config.yaml` records what ran.

- `actor.gradient_checkpointing: auto`: off when the fsdp training step is predicted to fit
  the budget without recompute (faster), on otherwise; off under roundpipe (its stages
  recompute by design).
"""

from __future__ import annotations

from typing import Any

import torch

from laden.memory.estimate import GIB, FsdpTraining, ModelShapes, host_memory_bytes, patched_meta_model

HEADROOM = 0.9
"""The share of the budget a prediction may use (the allocator's slack, the runtime, other processes)."""


def training_budget(device: torch.device) -> int:
    """This rank's memory for training: the GPU's total, or the host's physical memory on the CPU
    (0 where the OS does not say: every `auto` then takes its memory-saving value)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory_bytes() or 0


def resolve_auto(cfg: Any, budget: int) -> list[str]:
    """Set every `auto` knob of `cfg` (in place); one line per choice (see the module docstring)."""
    lines: list[str] = []
    actor = cfg.actor
    if actor.gradient_checkpointing == "auto":
        from laden.config import AllocationMode

        if AllocationMode.parse(actor.backend).backend != "fsdp":
            actor.gradient_checkpointing = False
            lines.append(f"actor.gradient_checkpointing=auto -> false: {actor.backend} recomputes by design")
        else:
            try:
                model = patched_meta_model(cfg)
                shapes = ModelShapes.from_model(model)
            except (OSError, ValueError) as err:  # a .gguf file, or no config.json: nothing to plan from
                actor.gradient_checkpointing = True
                lines.append(f"actor.gradient_checkpointing=auto -> true: no shapes to plan from ({err})")
                return lines
            peaks = {}
            for on in (False, True):
                actor.gradient_checkpointing = on
                peaks[on] = FsdpTraining(model).estimate(cfg, shapes).gpu
            limit = int(HEADROOM * budget)
            actor.gradient_checkpointing = peaks[False] > limit
            lines.append(
                f"actor.gradient_checkpointing=auto -> {str(actor.gradient_checkpointing).lower()}: predicted "
                f"training peak {peaks[False] / GIB:.2f} GiB without recompute, {peaks[True] / GIB:.2f} GiB with, "
                f"against {limit / GIB:.2f} GiB ({HEADROOM:.0%} of {budget / GIB:.2f} GiB)"
            )
    return lines
