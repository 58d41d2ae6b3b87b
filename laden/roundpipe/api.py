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

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from laden.engine.roundpipe.context import OptimizerCtx, doing_optimizer, note_step_submitted
from laden.engine.roundpipe.distributed import host_grad_group
from laden.engine.roundpipe.host.store import PinMode
from laden.engine.roundpipe.pipeline import Pipeline, sum_losses
from laden.engine.roundpipe.plan import ModelExecutePlan
from laden.roundpipe import hf_capture
from laden.roundpipe.autograd import attach_graph, begin_graph, needs_graph
from laden.roundpipe.batching import merge_outputs, num_tokens, split_microbatches
from laden.roundpipe.hf_outputs import (
    host_output,
    is_split_lm,
    moe_output,
    pop_hf_options,
    with_hf_labels,
)
from laden.roundpipe.run_config import RoundPipeRunConfig, resolve
from laden.roundpipe.timer import IterTimer, ModelTimer


def pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """The layers RoundPipe streams: an nn.Sequential's children, a split causal LM, or the module."""
    if isinstance(model, nn.Sequential):
        return list(model)
    if hasattr(getattr(model, "config", None), "model_type") and hasattr(model, "lm_head"):
        from laden.model.split import split_causal_lm

        return list(split_causal_lm(model).layers)
    return [model]


class ForwardsAttributes:
    """RoundPipe's attribute shim for a wrapper module whose model is its submodule `model`: after
    `__init__` sets `_initialized`, reads it lacks and writes or deletes of new public attributes go
    to the wrapped model (or to the one given to `set_original_model`); the wrapper's own
    attributes, private names and submodules stay on the wrapper."""

    def set_original_model(self, original_model: nn.Module) -> None:
        """Forward attribute reads and writes to `original_model` (the module a split model came from)."""
        object.__setattr__(self, "_original_model", original_model)

    def _target(self) -> nn.Module:
        return self.__dict__.get("_original_model") or self.__dict__["_modules"]["model"]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # type: ignore[misc]  # nn.Module's, next in the MRO
        except AttributeError:
            return getattr(self._target(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        """After construction, writes of new public attributes go to the wrapped model (reads come
        from there too); the wrapper's own attributes, private names and submodules stay here."""
        if self.__dict__.get("_initialized") and _forwarded(self, name):
            setattr(self._target(), name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get("_initialized") and _forwarded(self, name):
            delattr(self._target(), name)
        else:
            super().__delattr__(name)


class MasterParameterViews(nn.Module):
    """`parameters()` / `named_parameters()` of a wrapper that are the master weights inside
    `OptimizerCtx` (and so inside `step_fn`), as RoundPipe's are."""

    def optim_named_parameters(
        self, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, master weight) of every trainable parameter: each wrapper says where its masters are."""
        raise NotImplementedError(f"{type(self).__name__} must define optim_named_parameters")

    def optim_parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.optim_named_parameters())

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The model's parameters; inside `OptimizerCtx` (and `step_fn`) the master weights."""
        if doing_optimizer():
            return self.optim_parameters()
        return super().parameters(recurse)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's named parameters; inside `OptimizerCtx` (and `step_fn`) the master weights."""
        if doing_optimizer():
            return self.optim_named_parameters(prefix, remove_duplicate)
        return super().named_parameters(prefix, recurse, remove_duplicate)


class RoundPipe(ForwardsAttributes, MasterParameterViews, nn.Module):
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
        layers = pipeline_layers(model)
        pipe = Pipeline(
            layers, param_names=names, devices=devices, pin_model=pin_model,
            master_dtype=optim_dtype, name=f"roundpipe-{self.name}",
        )  # fmt: skip
        self.model_timer = ModelTimer(list(layers))
        """Per-layer timings of this model's calls (`timer.py`; `ModelTimer.VERBOSE` prints them)."""
        object.__setattr__(self, "pipe", pipe)  # not a submodule: its layers are the model's
        object.__setattr__(self, "process_group", host_grad_group(process_group))
        self.optim_dtype = optim_dtype
        self.grad_reduce = grad_reduce
        self._last_inbox = 0
        self._original_model: nn.Module | None = None
        self._initialized = True  # from here on, new public attributes are written to the model

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
    def optim_named_parameters(
        self, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, master weight) for every trainable parameter: build the optimizer on these.

        remove_duplicate: False lists a tied parameter under each of its names (one master).
        The masters are created by this call (not lazily by the iterator).
        """
        self.pipe.store.ensure_masters()
        params = [hp for hp in self.pipe.store.params if hp.master is not None]
        if remove_duplicate:
            pairs = [(hp.name, hp.master) for hp in params]
        else:
            masters = {id(hp.param): hp.master for hp in params}
            pairs = [
                (n, masters[id(p)])
                for n, p in self.model.named_parameters(remove_duplicate=False)
                if id(p) in masters
            ]
        return iter([(f"{prefix}.{n}" if prefix else n, m) for n, m in pairs])  # type: ignore[misc]

    # ---- compute -----------------------------------------------------------------------
    def forward_backward(
        self,
        input_args: tuple = (),
        input_kwargs: dict[str, Any] | None = None,
        label: Any = None,
        loss_fn: Callable[[Any, Any], Any] = lambda outputs, labels: outputs,
        return_outputs: bool = False,
        run_config: RoundPipeRunConfig | None = None,
    ) -> Any:
        """Forward, loss and backward over all micro-batches; returns the summed micro-batch losses.

        `loss_fn(outputs, labels)` runs on the device for each micro-batch and returns a
        tensor (or a sequence of tensors, summed separately). Gradients accumulate in host
        memory across calls until `step`. `return_outputs=True` returns `(loss_sum, outputs)`,
        the outputs detached and merged by the config's `merge_output`; both are placed on its
        `output_device`.
        """
        cfg = resolve(run_config, self.model_run_config, num_devices=self.num_devices)
        inputs, labels = split_microbatches(
            tuple(input_args), dict(input_kwargs or {}), label, cfg.num_microbatch,
            split_input=cfg.split_input, split_label=cfg.split_label,
        )  # fmt: skip
        hf = with_hf_labels(inputs, labels, loss_fn) if is_split_lm(self.pipe) else None
        if hf is not None:  # labels= / num_items_in_batch= / return_logits= in input_kwargs
            labels, loss_fn = hf
        plan = cfg.execute_plan or ModelExecutePlan.auto(
            "fused", self, tokens_per_microbatch=num_tokens(inputs), recompute_grain=cfg.recompute_grain
        )
        timer = IterTimer(self.model_timer)
        run = self.pipe.run_call(
            inputs=inputs, labels=labels, loss_fn=loss_fn, plan=plan, grain=cfg.recompute_grain,
            backward=True, preserve_rng=cfg.preserve_rng_state, keep_outputs=return_outputs, timer=timer,
        )  # fmt: skip
        self._last_inbox = self.pipe.read_buf
        loss = to_device(sum_losses(run), cfg.output_device)
        self._fold_timings(timer)
        if not return_outputs:
            return loss
        outputs = merge_outputs([h.host_tree() for h in run.outputs if h is not None], cfg.merge_output)
        return loss, to_device(outputs, cfg.output_device)

    def forward(
        self, *args: Any, roundpipe_run_config: RoundPipeRunConfig | None = None, **kwargs: Any
    ) -> Any:
        """The model's outputs over micro-batches; under grad mode they carry a graph whose backward
        runs the pipeline's backward (`autograd.py`: one forward more than `forward_backward`).

        Runs on the weights the next `forward_backward` would use (after asynchronous steps,
        those of one update earlier; call `synchronize()` first for the newest). A causal LM
        returns a `CausalLMOutputWithPast` (`.logits`, and `.loss` when `labels` are passed;
        `hf_outputs.py`). Buffers written in forward persist (`laden.engine.roundpipe.buffers`).
        """
        cfg = resolve(roundpipe_run_config, self.model_run_config, num_devices=self.num_devices)
        split_lm = is_split_lm(self.pipe)
        hf_options = pop_hf_options(kwargs) if split_lm else None
        router = bool(kwargs.pop("output_router_logits", False)) if split_lm else False
        mask = kwargs.get("attention_mask")
        inputs, _ = split_microbatches(args, kwargs, None, cfg.num_microbatch, split_input=cfg.split_input)
        graph = begin_graph(self, inputs, cfg) if needs_graph(self, cfg) else None
        plan = cfg.execute_plan or ModelExecutePlan.auto(
            "infer", self, tokens_per_microbatch=num_tokens(inputs)
        )
        timer = IterTimer(self.model_timer)
        with (
            hf_capture.recording(self.model, ("router_logits",))
            if router
            else contextlib.nullcontext() as rec
        ):
            capture = hf_capture.begin()
            try:
                run = self.pipe.run_call(
                    inputs=inputs, labels=None, loss_fn=None, plan=plan, grain=cfg.recompute_grain,
                    backward=False, preserve_rng=False,
                    saved_buffers=None if graph is None else graph.saved_buffers, timer=timer, capture=capture,
                )  # fmt: skip
            finally:
                hf_capture.end(capture)
        per_mb = [h.host_tree() for h in run.outputs if h is not None]
        self._fold_timings(timer)
        outputs = merge_outputs(per_mb, cfg.merge_output)
        if graph is not None:
            outputs = attach_graph(graph, per_mb, outputs)
        if split_lm:
            outputs = host_output(outputs, hf_options)
        if rec is not None:  # output_router_logits=True on the split model: the family's auxiliary loss
            outputs = moe_output(self.model, outputs, rec["router_logits"], mask)
        return to_device(outputs, cfg.output_device)

    def _fold_timings(self, timer: IterTimer) -> None:
        """Hand a finished call's spans to `model_timer` and fold in every finished call (a call
        whose device work is still running is folded in by a later one, or by `synchronize`)."""
        timer.submit()
        self.model_timer.update_times()

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
        note_step_submitted()
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
        with OptimizerCtx():  # model.parameters() in step_fn: the masters
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
        self.model_timer.update_times()
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


def _forwarded(wrapper: Any, name: str) -> bool:
    """Whether an attribute write on the wrapper belongs to the wrapped model."""
    own = wrapper.__dict__
    return not (
        name.startswith("_")
        or name in own
        or hasattr(type(wrapper), name)
        or name in own["_modules"]
        or name in own["_parameters"]
        or name in own["_buffers"]
    )


def to_device(tree: Any, device: torch.device | None) -> Any:
    """`tree`'s tensors moved to `device` (None: left on the host)."""
    if device is None:
        return tree
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)
