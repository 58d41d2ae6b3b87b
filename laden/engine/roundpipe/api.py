"""`RoundPipe`: the library API of the pipeline trainer (names as in the seed guide).

    model = RoundPipe(my_model, optim_dtype=torch.float32, pin_model="alloc")
    optimizer = torch.optim.AdamW(model.optim_parameters(), lr=1e-4)
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=fn, run_config=config)
    model.step(lambda: (optimizer.step(), optimizer.zero_grad()))

`my_model` is an `nn.Sequential` (each element is a pipeline layer; the first one receives
the call's arguments, each later one the previous output), a supported Hugging Face causal
LM (split by `laden.model.split`; use `causal_lm_loss` as `loss_fn`), or any other module
(one layer: it works, but nothing is streamed).

The optimizer is built on `optim_parameters()`: master weights in `optim_dtype` (default:
the parameter dtype) that live in host memory. When `optim_dtype` is the parameter dtype the
masters are no copy: they share storage with the upload copies (and so with the wrapped
model's parameters), and the optimizer updates those in place. `forward_backward`
accumulates gradients into host inboxes across calls; `step(fn)` hands them to the masters'
`.grad`, runs `fn` on the host optimizer thread, and writes the new weights into the upload
copies.

`step(fn, is_async=True)` (the default, as in the seed's trainer) returns at once and the
update runs while the next `forward_backward` computes with the weights from one update
earlier: step k's gradients are computed on the weights after update k-1 and applied to the
weights after update k (one-step stale). `is_async=False` is the exact synchronous step.
Parameters of the wrapped model are views of the upload copies; after asynchronous steps
call `synchronize()` before reading them. In asynchronous mode `fn` must clear the
gradients (zero_grad), because the next step's gradients are already landing.

With CPU-only PyTorch the CPU is the device: the same scheduling runs, copies are plain
and `pin_model` only chooses the layout (nothing can be page-locked).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from laden.engine.roundpipe.batching import merge_outputs, num_tokens, split_microbatches
from laden.engine.roundpipe.distributed import host_grad_group
from laden.engine.roundpipe.host.store import PinMode
from laden.engine.roundpipe.pipeline import Pipeline, sum_losses
from laden.engine.roundpipe.plan import ModelExecutePlan
from laden.engine.roundpipe.run_config import RoundPipeRunConfig, resolve


def pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """The layers RoundPipe streams: an nn.Sequential's children, a split causal LM, or the module."""
    if isinstance(model, nn.Sequential):
        return list(model)
    if hasattr(getattr(model, "config", None), "model_type") and hasattr(model, "lm_head"):
        from laden.model.split import split_causal_lm

        return list(split_causal_lm(model).layers)
    return [model]


class RoundPipe(nn.Module):
    """A CPU-resident model trained by streaming its layers through a pool of devices.

    model: an nn.Sequential, a supported Hugging Face causal LM, or any module (one layer).
    optim_dtype: dtype of the master weights the optimizer updates (default: the parameter dtype).
    name: a label for the host threads.
    model_run_config: defaults for every call's `RoundPipeRunConfig`.
    pin_model: "alloc" | "register" | "off", the host-memory / upload-speed trade-off
        (see `laden.engine.roundpipe.host.store`); accepted and layout-only without CUDA.
    devices: the device pool (default: every visible GPU, else the CPU).
    process_group: data-parallel replicas whose gradients are all-reduced at `step` (default:
        the initialised torch.distributed world, if larger than one process).
    grad_reduce: "mean" when each replica's loss is a local mean, "sum" when losses are
        already normalised by a global count.
    """

    def __init__(
        self,
        model: nn.Module,
        optim_dtype: torch.dtype | None = None,
        name: str | None = None,
        model_run_config: RoundPipeRunConfig | None = None,
        pin_model: PinMode = "alloc",
        *,
        devices: Sequence[torch.device] | None = None,
        process_group: Any = None,
        grad_reduce: Literal["mean", "sum"] = "mean",
    ) -> None:
        super().__init__()
        if grad_reduce not in ("mean", "sum"):
            raise ValueError(f"grad_reduce={grad_reduce!r} must be 'mean' or 'sum'")
        self.model = model
        self.name = name or type(model).__name__
        self.model_run_config = model_run_config or RoundPipeRunConfig()
        names = {id(p): n for n, p in model.named_parameters()}
        pipe = Pipeline(
            pipeline_layers(model), param_names=names, devices=devices, pin_model=pin_model,
            master_dtype=optim_dtype, name=f"roundpipe-{self.name}",
        )  # fmt: skip
        object.__setattr__(self, "pipe", pipe)  # not a submodule: its layers are the model's
        object.__setattr__(self, "process_group", host_grad_group(process_group))
        self.optim_dtype = optim_dtype
        self.grad_reduce = grad_reduce
        self._last_inbox = 0

    # ---- what ModelExecutePlan.auto asks -----------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.pipe.num_layers

    @property
    def num_devices(self) -> int:
        return self.pipe.num_devices

    def layer_bytes(self, *, with_grads: bool) -> list[int]:
        return self.pipe.layer_bytes(with_grads=with_grads)

    def shared_bytes(self, *, with_grads: bool) -> list[tuple[frozenset[int], int]]:
        return self.pipe.shared_bytes(with_grads=with_grads)

    def default_memory_limit_gib(self) -> float:
        return self.pipe.default_memory_limit_gib()

    def layer_activation_bytes(self, num_tokens: int) -> list[tuple[int, int]]:
        return self.pipe.layer_activation_bytes(num_tokens)

    # ---- optimizer parameters ----------------------------------------------------------
    def optim_named_parameters(self, prefix: str = "") -> Iterator[tuple[str, nn.Parameter]]:
        """(name, master weight) for every trainable parameter: build the optimizer on these.

        The masters are created by this call (not lazily by the iterator).
        """
        self.pipe.store.ensure_masters()
        named = [
            (f"{prefix}.{hp.name}" if prefix else hp.name, hp.master)
            for hp in self.pipe.store.params
            if hp.master is not None
        ]
        return iter(named)  # type: ignore[arg-type]

    def optim_parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.optim_named_parameters())

    # ---- compute -----------------------------------------------------------------------
    def forward_backward(
        self,
        input_args: tuple = (),
        input_kwargs: dict[str, Any] | None = None,
        label: Any = None,
        loss_fn: Callable[[Any, Any], Any] = lambda outputs, labels: outputs,
        return_outputs: bool = False,
        run_config: RoundPipeRunConfig | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Forward, loss and backward over all micro-batches; returns the summed micro-batch losses.

        `loss_fn(outputs, labels)` runs on the device for each micro-batch and returns a
        tensor (or a sequence of tensors, summed separately). Gradients accumulate in host
        memory across calls until `step`.
        """
        if return_outputs:
            raise ValueError("return_outputs=True is not supported; call the model (forward) for outputs")
        cfg = resolve(run_config, self.model_run_config, num_devices=self.num_devices)
        inputs, labels = split_microbatches(
            tuple(input_args), dict(input_kwargs or {}), label, cfg.num_microbatch,
            split_input=cfg.split_input, split_label=cfg.split_label,
        )  # fmt: skip
        plan = cfg.execute_plan or ModelExecutePlan.auto(
            "fused", self, tokens_per_microbatch=num_tokens(inputs), recompute_grain=cfg.recompute_grain
        )
        run = self.pipe.run_call(
            inputs=inputs, labels=labels, loss_fn=loss_fn, plan=plan, grain=cfg.recompute_grain,
            backward=True, preserve_rng=cfg.preserve_rng_state,
        )  # fmt: skip
        self._last_inbox = self.pipe.read_buf
        return sum_losses(run)

    def forward(
        self, *args: Any, roundpipe_run_config: RoundPipeRunConfig | None = None, **kwargs: Any
    ) -> Any:
        """Inference over micro-batches (no graph is recorded: use `forward_backward` to train).

        Runs on the weights the next `forward_backward` would use (after asynchronous steps,
        those of one update earlier; call `synchronize()` first for the newest). A causal LM
        returns its logits.
        """
        cfg = resolve(roundpipe_run_config, self.model_run_config, num_devices=self.num_devices)
        inputs, _ = split_microbatches(args, kwargs, None, cfg.num_microbatch, split_input=cfg.split_input)
        plan = cfg.execute_plan or ModelExecutePlan.auto(
            "infer", self, tokens_per_microbatch=num_tokens(inputs)
        )
        run = self.pipe.run_call(
            inputs=inputs, labels=None, loss_fn=None, plan=plan, grain=cfg.recompute_grain,
            backward=False, preserve_rng=False,
        )  # fmt: skip
        return merge_outputs([h.host_tree() for h in run.outputs if h is not None])

    # ---- optimizer step ----------------------------------------------------------------
    def step(self, step_fn: Callable[..., Any], is_async: bool = True, *args: Any, **kwargs: Any) -> None:
        """Hand the accumulated gradients to the masters and run `step_fn` on the optimizer thread.

        Asynchronous (default): returns at once; the next call computes on the weights from
        one update earlier. Synchronous: returns after the update and the weight refresh.
        """
        store, pipe = self.pipe.store, self.pipe
        if not any(hp.master is not None for hp in store.params):
            raise ValueError(
                "step() found no optimizer parameters: build the optimizer on model.optim_parameters() "
                "(master weights in host memory), not on model.parameters()"
            )
        pipe.jobs.raise_errors()
        buf = pipe.read_buf
        if is_async and store.num_upload_buffers == 1:
            store.add_upload_buffer()  # no job is writing buffer 0: every earlier step was synchronous
        groups = pipe.trainable_groups()
        store.mark_pending(groups, buf)
        future = pipe.jobs.submit_optim(self._step_job, step_fn, args, kwargs, buf, is_async)
        if is_async:
            pipe.read_buf = 1 - buf
        else:
            future.result()
            pipe.jobs.raise_errors()

    def _step_job(self, step_fn, args, kwargs, buf: int, is_async: bool) -> None:
        pipe, store = self.pipe, self.pipe.store
        groups = pipe.trainable_groups()
        if self.process_group is not None:
            self._all_reduce_grads(groups, buf)
        for group in groups:
            store.move_masters_to(group, buf)  # shared masters: step_fn writes buffer `buf` in place
        with torch.no_grad():
            for hp in store.params:
                if hp.master is None or not hp.filled[buf]:
                    continue
                grad = hp.grad(buf)
                if hp.master.grad is not None and hp.master.grad.data_ptr() != grad.data_ptr():
                    grad.add_(hp.master.grad)  # gradients the user kept from earlier steps
                hp.master.grad = grad
                hp.filled[buf] = False
        step_fn(*args, **kwargs)
        pipe.refresh_uploads(groups, buf)
        if not is_async and store.num_upload_buffers == 2:
            pipe.refresh_uploads(groups, 1 - buf)  # an exact step leaves no stale buffer behind
        store.mark_done(groups, buf)

    def _all_reduce_grads(self, groups, buf: int) -> None:
        """Data parallel: sum (or average) the host gradients of all replicas, group by group."""
        world = dist.get_world_size(self.process_group)
        for group in groups:
            flat = group.grad_flats[buf]
            if not all(hp.filled[buf] for hp in group.members):
                for hp in group.members:
                    if not hp.filled[buf]:
                        hp.grad(buf).zero_()
                        hp.filled[buf] = True
            dist.all_reduce(flat, group=self.process_group)
            if self.grad_reduce == "mean":
                flat.div_(world)

    def synchronize(self) -> None:
        """Wait for every host job, write the masters into every upload buffer (the model's params
        are current again) and put the accumulated gradients on the model's params' `.grad`."""
        pipe, store = self.pipe, self.pipe.store
        pipe.jobs.drain()
        groups = [g for g in pipe.trainable_groups() if g.has_masters]
        for buf in range(store.num_upload_buffers):
            pipe.refresh_uploads(groups, buf)
        inbox = self._last_inbox
        for hp in store.params:
            if inbox < len(hp.group.grad_flats) and hp.filled[inbox]:  # type: ignore[union-attr]
                hp.param.grad = hp.grad(inbox).to(hp.param.dtype, copy=True)
            else:
                hp.param.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget gradients accumulated since the last step (and the model params' `.grad`)."""
        self.pipe.jobs.drain()
        for hp in self.pipe.store.params:
            hp.filled = [False, False]
            hp.param.grad = None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_modules"]["model"], name)
