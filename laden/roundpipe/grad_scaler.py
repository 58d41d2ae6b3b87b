"""`GradScaler`: fp16 loss scaling for `RoundPipe`, whose optimizer step runs on a host thread.

Usage (as with `torch.amp.GradScaler`):

    scaler = GradScaler()
    loss = model.forward_backward(..., loss_fn=lambda out, y: scaler.scale(criterion(out, y)))
    model.step(lambda: (scaler.step(optimizer), optimizer.zero_grad()))
    scaler.update()

`scale` runs in `loss_fn` (device worker threads); `step` / `unscale_` run inside `step_fn`
on the optimizer thread, where the masters hold the gradients; `update` runs on the main
thread. Two scales are kept: the one losses are multiplied by, and the one the optimizer
thread unscales with. With `model.step(is_async=True)` the next `forward_backward` runs
before the step has seen its gradients, so `update(is_async=True)` computes the new scale
once that step finished and it takes effect at the following `update()`: losses are scaled
one update late, and the two scales always agree for the step that reads them. With
`model.step(is_async=False)` and `update(is_async=False)` the math is exactly
`torch.amp.GradScaler`'s. Trade-off: one iteration of delay in reacting to an overflow, for
never stalling the pipeline on the optimizer thread.

Differences, each an error with its reason: `unscale_` from the main thread raises (laden
hands gradients to the masters only inside `step_fn`; call it there), and `update` from
inside a step raises (as with the engine this mirrors).
"""

from __future__ import annotations

import threading
from typing import Any, TypeVar

import torch
from torch.optim import Optimizer
from torch.utils import _pytree as pytree

from laden.engine.roundpipe.context import steps_submitted

T = TypeVar("T")


class GradScaler:
    """Loss scaling whose update follows the asynchronous optimizer step (see the module docstring).

    init_scale: the initial scale factor.
    growth_factor: multiplies the scale after `growth_interval` steps without inf/NaN gradients.
    backoff_factor: multiplies the scale after a step with inf/NaN gradients (the step is skipped).
    growth_interval: consecutive finite steps before the scale grows.
    enabled: False makes `step` call `optimizer.step()` and every other method a no-op.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled
        # The optimizer thread's scaler: unscale, inf check, skip and the growth/backoff rule.
        self._main = torch.amp.GradScaler("cpu", init_scale, growth_factor, backoff_factor, growth_interval)
        self._main._lazy_init_scale_growth_tracker(torch.device("cpu"))
        self._loss_scale = torch.full((), init_scale, dtype=torch.float32)  # what `scale` multiplies by
        self._next_scale = self._loss_scale.clone()  # the newest computed scale, used from the next update
        self._cond = threading.Condition()
        self._num_steps = 0  # scaler steps finished
        self._num_updates = 0  # updates asked for
        self._num_resolved = 0  # updates computed
        self._pending_new_scale: float | torch.Tensor | None = None
        self._submitted_at_update = steps_submitted()  # RoundPipe steps handed over by the last update
        self._local = threading.local()  # `in_step`: the calling thread is inside `step`

    # ---- loss side (device worker threads) ----------------------------------------------
    def scale(self, outputs: T) -> T:
        """`outputs` (a tensor or an iterable of tensors) multiplied by the current loss scale."""
        if not self.enabled:
            return outputs
        scale = self._main._scale if self._in_step() else self._loss_scale
        assert scale is not None

        def mul(t: Any) -> Any:
            return t * scale.to(device=t.device, non_blocking=True) if isinstance(t, torch.Tensor) else t

        if isinstance(outputs, torch.Tensor):
            return mul(outputs)  # type: ignore[return-value]
        if isinstance(outputs, (list, tuple)):
            return pytree.tree_map(mul, outputs)
        return map(mul, outputs)  # type: ignore[return-value,call-overload]

    # ---- optimizer side (inside `step_fn`) ----------------------------------------------
    def unscale_(self, optimizer: Optimizer) -> None:
        """Divide the optimizer's gradients by the scale; call it inside `step_fn` (optional)."""
        if not self.enabled:
            return
        if threading.current_thread() is threading.main_thread() and not self._in_step():
            raise RuntimeError(
                "GradScaler.unscale_ was called from the main thread: laden hands the gradients to the "
                "master weights only inside step_fn; call scaler.unscale_(optimizer) there"
            )
        self._main.unscale_(optimizer)

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done), then `optimizer.step(*args, **kwargs)` unless a gradient is inf/NaN."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        self._local.in_step = True
        try:
            result = self._main.step(optimizer, *args, **kwargs)
        finally:
            self._local.in_step = False
        with self._cond:
            self._num_steps += 1
            if self._num_updates >= self._num_steps and self._num_resolved < self._num_updates:
                self._resolve()  # `update()` came first; its scale is due now that this step is done
        return result

    # ---- main thread ---------------------------------------------------------------------
    def update(self, new_scale: float | torch.Tensor | None = None, is_async: bool = True) -> None:
        """Compute the next scale from the last step (backoff on inf/NaN, growth after an interval).

        is_async: match `RoundPipe.step(is_async=...)`. True: the new scale is computed once the
            step finished and is used from the next `update()` on. False: waits for the step and
            uses the new scale at once.
        """
        if not self.enabled:
            return
        if self._in_step():
            raise RuntimeError("GradScaler.update() must be called from the main thread, after model.step")
        submitted = steps_submitted()
        with self._cond:
            self._cond.wait_for(lambda: self._num_resolved == self._num_updates)  # the previous update
            if (
                not is_async
                and submitted == self._submitted_at_update
                and self._num_steps <= self._num_updates
            ):
                # no model.step since the last update: no gradients to judge, nothing to wait for
                if new_scale is None:
                    raise RuntimeError(
                        "GradScaler.update() with no model.step since the last update has no gradients to "
                        "judge; call it after model.step, or pass new_scale to set the scale"
                    )
                self._set_scale(new_scale)
                return
            self._submitted_at_update = submitted
            self._loss_scale.copy_(self._next_scale)
            self._num_updates += 1
            self._pending_new_scale = new_scale
            if self._num_steps >= self._num_updates:
                self._resolve()
            if not is_async:
                # Deliberate wait for the optimizer thread: the exact synchronous scaler.
                self._cond.wait_for(lambda: self._num_resolved == self._num_updates)
                self._loss_scale.copy_(self._next_scale)
                assert self._main._scale is not None
                self._main._scale.copy_(self._next_scale)

    def _set_scale(self, new_scale: float | torch.Tensor) -> None:
        """Every copy of the scale set to `new_scale` (copied in: later edits of it do not leak)."""
        value = torch.as_tensor(new_scale, dtype=torch.float32).detach().reshape(())
        for scale in (self._loss_scale, self._next_scale, self._main._scale):
            if scale is not None:
                scale.copy_(value)

    def _resolve(self) -> None:
        """Run the torch scaler's update on the newest scale; keep the old one for unscaling until
        the next `update()` hands the new one to the loss side too. Caller holds `_cond`."""
        main_scale = self._main._scale
        assert main_scale is not None
        in_use = self._next_scale.clone()  # what the loss side multiplies by from this update on
        main_scale.copy_(in_use)
        self._main.update(self._pending_new_scale)
        self._next_scale.copy_(main_scale)
        main_scale.copy_(in_use)
        self._num_resolved += 1
        self._cond.notify_all()

    def get_scale(self) -> float:
        """The loss scale (inside `step`: the scale gradients are unscaled with); 1.0 if disabled."""
        if not self.enabled:
            return 1.0
        scale = self._main._scale if self._in_step() else self._loss_scale
        assert scale is not None
        return float(scale.item())  # a host tensor: no device sync

    def get_growth_factor(self, up_to_date: bool = False) -> float:
        self._wait(up_to_date)
        return self._main.get_growth_factor()

    def set_growth_factor(self, new_factor: float) -> None:
        self._main.set_growth_factor(new_factor)

    def get_backoff_factor(self, up_to_date: bool = False) -> float:
        self._wait(up_to_date)
        return self._main.get_backoff_factor()

    def set_backoff_factor(self, new_factor: float) -> None:
        self._main.set_backoff_factor(new_factor)

    def get_growth_interval(self, up_to_date: bool = False) -> int:
        self._wait(up_to_date)
        return self._main.get_growth_interval()

    def set_growth_interval(self, new_interval: int) -> None:
        self._main.set_growth_interval(new_interval)

    def is_enabled(self) -> bool:
        return self.enabled

    def _wait(self, up_to_date: bool) -> None:
        if up_to_date and not self._in_step():
            with self._cond:
                self._cond.wait_for(lambda: self._num_resolved == self._num_updates)

    def _in_step(self) -> bool:
        return getattr(self._local, "in_step", False)
