"""`RoundPipeEngine`: the config-driven roundpipe backend (`actor.backend: roundpipe:...`).

It implements `TrainEngine` over the same pipeline as the library API, with the optimizer
driven internally, parameter group by parameter group, as soon as a group's gradient is
complete:

- the gradient norm is summed group by group on the landing thread while the device still
  runs the backward of earlier layers (and, data parallel, each group is all-reduced there,
  in a fixed order so every replica issues the same collectives);
- without gradient clipping each group's AdamW update starts right away on the optimizer
  thread, overlapping the rest of the backward; with clipping the updates wait for the
  global norm and then run in forward order, so the next step's first stages can start
  uploading as soon as their own weights are updated (per-group generation counters);
- fp32 masters with bf16 compute: the update writes the bf16 upload copy in the same pass
  (`HostAdamW.step_params(..., params_out_bf16=...)`), so there is no separate cast pass;
  `adam_bf16` (and fp32 masters with fp32 compute): the master *is* the upload copy, the
  Kahan update writes in place what the next residency uploads (no copy at all).

`optim_step="sync"` is exact: step k+1 reads the weights of update k (it waits per group).
`optim_step="async"` is one-step stale: step k+1 reads the upload buffer holding the
weights of update k-1 while update k writes the other one, so the whole optimizer step
hides behind the next step's compute; it costs a second upload buffer and a second
gradient inbox in host memory (and, for masters shared with the upload copy, one buffer
copy per update). Host bytes per parameter of every mode: `host.memory`; what an engine
holds: `host_bytes_by_kind()`.

A model with its parameters on the meta device (`host.memory.meta_params`) is materialised
layer by layer into the host store and filled by `init_meta` (default: a Hugging Face
model's `_init_weights`), so building a large model never needs a second copy of it.

Each `PackedBatch` is one micro-batch (a packed row `[1, T]`); `num_microbatch` is the
planner's hint to the trainer for how many rows to pack per step.

Without an explicit `execute_plan` the stages are planned by `ModelExecutePlan.auto` for
`max_tokens_per_mb` tokens per micro-batch (weights and activations); a step whose longest
micro-batch is longer than planned for is re-planned first (deterministically, from sizes).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from laden.data.batch import PackedBatch
from laden.engine.roundpipe.device import default_devices
from laden.engine.roundpipe.distributed import host_grad_group
from laden.engine.roundpipe.host.store import ParamGroup, PinMode
from laden.engine.roundpipe.pipeline import Pipeline, sum_losses
from laden.engine.roundpipe.plan import ModelExecutePlan
from laden.engine.roundpipe.step_grads import StepGrads
from laden.model.split import DEFAULT_LOSS_CHUNK_SIZE, causal_lm_loss, split_causal_lm
from laden.optim import HostAdamW, OptimSettings, build_lr_scheduler

OptimStep = Literal["sync", "async"]


def no_weight_decay(name: str, p: torch.Tensor) -> bool:
    """Biases and 1-D params (norm gains) get no weight decay: the engine groups them apart."""
    return p.ndim < 2 or name.endswith("bias")


class RoundPipeEngine:
    """A causal LM in host memory, trained by streaming stages through the device pool."""

    def __init__(
        self,
        model: nn.Module,
        *,
        optim: OptimSettings,
        compute_dtype: torch.dtype = torch.bfloat16,
        optimizer_dtype: torch.dtype = torch.float32,
        num_microbatch: int | None = None,
        recompute_grain: Literal["stage", "layer"] = "stage",
        model_memory_limit: float | None = None,
        pin_model: PinMode = "alloc",
        optim_step: OptimStep = "sync",
        devices: Sequence[torch.device] | None = None,
        loss_chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE,
        process_group: Any = None,
        execute_plan: ModelExecutePlan | None = None,
        min_stages: int | None = None,
        max_tokens_per_mb: int | None = None,
        init_meta: Callable[[nn.Module], None] | None = None,
        compile_backend: str | None = None,
    ) -> None:
        if optim_step not in ("sync", "async"):
            raise ValueError(f"actor.roundpipe.optim_step={optim_step!r} must be 'sync' or 'async'")
        if recompute_grain not in ("stage", "layer"):
            raise ValueError(
                f"actor.roundpipe.recompute_grain={recompute_grain!r} must be 'stage' or 'layer'"
            )
        if loss_chunk_size < 1:
            raise ValueError(f"actor.loss_chunk_size={loss_chunk_size} must be >= 1 token, e.g. 1024")
        self.model = model.train()
        self.compute_dtype = compute_dtype
        self.optim_settings = optim
        self.num_microbatch = num_microbatch
        self.recompute_grain = recompute_grain
        self.optim_step = optim_step
        self.loss_chunk_size = loss_chunk_size
        master_dtype = master_dtype_for(optim.type, optimizer_dtype)
        if compile_backend is not None:  # actor.roundpipe.compile
            from laden.model.patches.compiled import enable_compiled_layers

            enable_compiled_layers(model, backend=compile_backend)
        split = split_causal_lm(model)
        names = {id(p): n for n, p in model.named_parameters()}
        self.pipe = Pipeline(
            list(split.layers), param_names=names, devices=devices, pin_model=pin_model,
            compute_dtype=compute_dtype, master_dtype=master_dtype, create_masters=True,
            group_key=no_weight_decay, name="roundpipe-engine", loss_chunk_size=loss_chunk_size,
            init_meta=init_meta or _default_init(model, devices),
        )  # fmt: skip
        self._auto_plan = execute_plan is None
        self._plan_limits = (model_memory_limit, min_stages)
        self._planned_tokens = max_tokens_per_mb
        if execute_plan is None:
            execute_plan = self._make_plan(max_tokens_per_mb)
        execute_plan.check_valid(self.pipe.num_layers, "fused")
        self.plan = execute_plan
        self.optimizer = _build_optimizer(self.pipe, optim, any(lane.is_cuda for lane in self.pipe.lanes))
        self.scheduler = build_lr_scheduler(
            self.optimizer, type=optim.lr_scheduler_type, total_steps=optim.total_steps,
            warmup_steps=optim.warmup_steps, min_lr_ratio=optim.min_lr_ratio,
        )  # fmt: skip
        self.process_group = host_grad_group(process_group)
        self.preserve_rng = _has_dropout(model)  # recompute must replay dropout masks
        self._num_steps = 0
        if optim_step == "async":
            self.pipe.store.add_upload_buffer()
            self.pipe.store.ensure_inboxes(2)

    # ---- plan -------------------------------------------------------------------------
    def _make_plan(self, num_tokens: int | None) -> ModelExecutePlan:
        limit, min_stages = self._plan_limits
        return ModelExecutePlan.auto(
            "fused", self.pipe, model_memory_limit=limit, min_stages=min_stages,
            tokens_per_microbatch=num_tokens, recompute_grain=self.recompute_grain,
        )  # fmt: skip

    def _fit_plan(self, micro_batches: Sequence[PackedBatch]) -> None:
        """Re-plan an automatic plan for micro-batches longer than it was planned for."""
        if not self._auto_plan or not micro_batches:
            return
        longest = max(mb.num_tokens for mb in micro_batches)
        if self._planned_tokens is None or longest > self._planned_tokens:
            self.plan = self._make_plan(longest)
            self._planned_tokens = longest

    # ---- TrainEngine --------------------------------------------------------------------
    def train_batch(
        self, micro_batches: Sequence[PackedBatch], *, global_num_loss_tokens: int
    ) -> dict[str, torch.Tensor]:
        self._fit_plan(micro_batches)
        pipe = self.pipe
        buf = pipe.read_buf
        clipping = self.optim_settings.gradient_clipping > 0
        # A tied weight's gradient stays on the device between its stages; the automatic plan
        # leaves room for it (a given plan keeps the host path: its stages were sized without it).
        carried = pipe.carried_params(self.plan) if self._auto_plan else frozenset()
        grads = StepGrads(
            pipe, self.plan, buf, process_group=self.process_group,
            update=None if clipping else (lambda g: self._submit_update(g, buf, 1.0)), carried=carried,
        )  # fmt: skip
        try:
            run = pipe.run_call(
                inputs=[((), _packed_kwargs(mb)) for mb in micro_batches],
                labels=[mb.labels[None] for mb in micro_batches],
                loss_fn=_ScaledLoss(global_num_loss_tokens, self.loss_chunk_size),
                plan=self.plan, grain=self.recompute_grain, backward=True, preserve_rng=self.preserve_rng,
                on_landing=grads.on_landing, carried=carried,
            )  # fmt: skip
        except BaseException as error:
            self._abandon_step(grads, buf, error)
            raise
        grads.check_complete()
        pipe.store.mark_pending(pipe.trainable_groups(), buf)
        norm = grads.norm()
        coef = _clip_coef(norm, self.optim_settings.gradient_clipping) if clipping else 1.0
        for group in grads.pending_updates():  # forward order: the next step's first stages first
            self._submit_update(group, buf, coef)
        lr = self.scheduler.base_lrs[0] * self.scheduler.lr_lambdas[0](self._num_steps)
        pipe.jobs.submit_optim(_scheduler_step, self.scheduler)
        self._num_steps += 1
        if self.optim_step == "async":
            pipe.read_buf = 1 - buf
        return {"loss": self._global_loss(sum_losses(run)), "grad_norm": norm, "lr": torch.tensor(lr)}

    @torch.no_grad()
    def eval_batch(
        self, micro_batches: Sequence[PackedBatch], *, global_num_loss_tokens: int
    ) -> dict[str, torch.Tensor]:
        self._fit_plan(micro_batches)
        self.model.eval()  # shells copy the mode: no dropout
        try:
            run = self.pipe.run_call(
                inputs=[((), _packed_kwargs(mb)) for mb in micro_batches],
                labels=[mb.labels[None] for mb in micro_batches],
                loss_fn=_ScaledLoss(global_num_loss_tokens, self.loss_chunk_size),
                plan=self.plan, grain=self.recompute_grain, backward=False, preserve_rng=False,
            )  # fmt: skip
        finally:
            self.model.train()
        return {"loss": self._global_loss(sum_losses(run))}

    def state_dict(self) -> dict[str, Any]:
        self.pipe.jobs.drain()
        masters = {
            hp.name: hp.master.detach().clone() for hp in self.pipe.store.params if hp.master is not None
        }
        return {
            "model": masters,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "num_steps": self._num_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pipe.jobs.drain()
        store = self.pipe.store
        with torch.no_grad():
            for hp in store.params:
                if hp.master is not None:
                    hp.master.copy_(state["model"][hp.name])
        groups = self.pipe.trainable_groups()
        for buf in range(store.num_upload_buffers):
            self.pipe.refresh_uploads(groups, buf)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._num_steps = state.get("num_steps", 0)

    def export_hf(self, out_dir: Path, *, tokenizer: Any | None = None) -> None:
        """Hugging Face directory in the compute dtype; replicas hold the same weights, so replica 0 writes."""
        from laden.model.hf.export import export_hf

        self.pipe.jobs.drain()
        if self.dp_rank != 0:
            return
        masters = {id(hp.param): hp.master for hp in self.pipe.store.params if hp.master is not None}
        state = dict(self.model.state_dict())
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) in masters:
                state[name] = masters[id(p)]
        export_hf(self.model, out_dir, dtype=self.compute_dtype, tokenizer=tokenizer, state_dict=state)

    def _global_loss(self, loss: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """Each replica's loss is its share of the global token mean: sum them over the replicas."""
        assert isinstance(loss, torch.Tensor), "the engine's loss function returns one tensor"
        if self.process_group is None:
            return loss
        # Deliberate sync: the host-gradient group is gloo, so the scalar goes through the host.
        total = loss.detach().float().cpu().clone()
        torch.distributed.all_reduce(total, group=self.process_group)
        return total

    @property
    def dp_rank(self) -> int:
        """This replica's index: the trainer gives it its share of each global batch."""
        return 0 if self.process_group is None else torch.distributed.get_rank(self.process_group)

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas whose host gradients are summed."""
        return 1 if self.process_group is None else torch.distributed.get_world_size(self.process_group)

    @property
    def num_params(self) -> int:
        return sum(hp.numel for hp in self.pipe.store.params)

    def host_bytes_by_kind(self) -> dict[str, int]:
        """Host bytes of the model state as allocated now, by kind (see `host.memory.HOST_KINDS`).

        Optimizer states appear after the first update; drains the host jobs first.
        """
        from laden.engine.roundpipe.host.memory import measured_host_bytes

        self.pipe.jobs.drain()
        return measured_host_bytes(self.pipe.store, self.optimizer)

    def _abandon_step(self, grads: StepGrads, buf: int, error: BaseException) -> None:
        """A failed step (e.g. out of memory) leaves no gradients behind, so a retry is exact."""
        for lane in self.pipe.lanes:
            lane.synchronize()  # deliberate: let queued copies finish before the buffers are reused
        with contextlib.suppress(RuntimeError):  # a failed landing is re-raised by the next call
            self.pipe.jobs.drain_landing()
        for hp in self.pipe.store.params:
            hp.filled[buf] = False
        if grads.updated:
            raise RuntimeError(
                f"the step failed after {len(grads.updated)} parameter groups were already updated "
                "(early per-group updates run when gradient clipping is off), so it cannot be retried "
                "exactly; set actor.optimizer.gradient_clipping > 0 to update only complete steps"
            ) from error

    # ---- updates ------------------------------------------------------------------------
    def _submit_update(self, group: ParamGroup, buf: int, coef: float) -> None:
        self.pipe.jobs.submit_optim(self._update_group, group, buf, coef)

    @torch.no_grad()
    def _update_group(self, group: ParamGroup, buf: int, coef: float) -> None:
        """Optimizer thread: update one group's masters and write its upload copy `buf`.

        Shared masters (optimizer dtype == compute dtype) are updated in place in buffer `buf`;
        separate fp32 masters write the bf16 copy in the same pass.
        """
        members = group.members
        grads = [hp.grad(buf) for hp in members]
        if coef < 1.0:
            group.grad_flats[buf].mul_(coef)
        self.pipe.store.move_masters_to(group, buf)
        masters = [hp.master for hp in members if hp.master is not None]
        opt = self.optimizer
        if isinstance(opt, HostAdamW):
            fused_out = (
                not group.shares_master
                and opt.state_dtype == torch.float32
                and group.compute_dtype == torch.bfloat16
            )
            outs = [hp.uploads[buf] for hp in members] if fused_out else None
            opt.step_params(masters, grads=grads, params_out_bf16=outs)
        else:
            fused_out = False
            _subset_step(opt, masters, grads)
        if not fused_out:
            self.pipe.refresh_uploads([group], buf)
        for hp in members:
            hp.filled[buf] = False
        self.pipe.store.mark_done([group], buf)


class _ScaledLoss:
    """Summed token cross-entropy of a micro-batch over the step's global loss-token count."""

    def __init__(self, global_num_loss_tokens: int, chunk_size: int) -> None:
        self.denom = float(max(global_num_loss_tokens, 1))
        self.chunk_size = chunk_size

    def __call__(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(outputs, labels, chunk_size=self.chunk_size) / self.denom


def _packed_kwargs(mb: PackedBatch) -> dict[str, Any]:
    """One packed row as the split model's inputs (labels are already shifted per document)."""
    return {
        "input_ids": mb.input_ids[None],  # [1, T]
        "position_ids": mb.position_ids[None],  # [1, T]
        "cu_seq_lens_q": mb.cu_seqlens,
        "cu_seq_lens_k": mb.cu_seqlens,
        "max_length_q": mb.max_seqlen,
        "max_length_k": mb.max_seqlen,
    }


def _has_dropout(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    if any(getattr(config, name, 0.0) for name in ("attention_dropout", "hidden_dropout", "dropout")):
        return True
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())


def _default_init(
    model: nn.Module, devices: Sequence[torch.device] | None
) -> Callable[[nn.Module], None] | None:
    """For parameters on the meta device: a Hugging Face model's own per-module initialisation.

    With a GPU, each module's parameters are initialised there and copied into the host store:
    random fills on the CPU run on one core (about 5 ns per parameter, 40 s for an 8B model),
    on the GPU they are free and the copy runs at transfer speed.
    """
    if not any(p.is_meta for p in model.parameters()):
        return None
    init = getattr(model, "_init_weights", None)
    if init is None:
        return None
    device = next((d for d in devices or default_devices() if torch.device(d).type == "cuda"), None)
    return init if device is None else functools.partial(_init_on_device, init, torch.device(device))


@torch.no_grad()
def _init_on_device(init: Callable[[nn.Module], None], device: torch.device, module: nn.Module) -> None:
    """`init(module)` on device twins of the module's own parameters, copied back into them."""
    originals = {name: p for name, p in module._parameters.items() if p is not None}
    try:
        for name, p in originals.items():
            module._parameters[name] = nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad
            )
        init(module)
        for name, p in originals.items():
            p.copy_(module._parameters[name])  # type: ignore[arg-type]
    finally:
        module._parameters.update(originals)


def master_dtype_for(optimizer_type: str, optimizer_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the host master weights (and gradients) for `actor.optimizer.type`."""
    if optimizer_type == "adam_bf16":
        return torch.bfloat16
    if optimizer_type == "adam" and optimizer_dtype == torch.bfloat16:
        warnings.warn(
            "actor.optimizer.type=adam with actor.optimizer_dtype=bfloat16: the roundpipe engine uses the "
            "Kahan-compensated bf16 update (adam_bf16) for it; set type=adam_bf16 to say so",
            stacklevel=3,
        )
    return optimizer_dtype


def _build_optimizer(pipe: Pipeline, o: OptimSettings, on_gpu: bool) -> torch.optim.Optimizer:
    masters = [hp for hp in pipe.store.params if hp.master is not None]
    decay = [hp.master for hp in masters if not hp.group.key]  # type: ignore[union-attr]
    no_decay = [hp.master for hp in masters if hp.group.key]  # type: ignore[union-attr]
    groups: list[dict[str, Any]] = [
        {"params": params, "weight_decay": wd}
        for params, wd in ((decay, o.weight_decay), (no_decay, 0.0))
        if params
    ]
    if o.type == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    if o.type not in ("adam", "adam_bf16"):
        raise ValueError(f"actor.optimizer.type={o.type!r} is not supported; use adam, adam_bf16 or sgd")
    state_dtype = groups[0]["params"][0].dtype
    # Leave four cores: the thread feeding the GPU, autograd's device thread, gradient landings, uploads.
    threads = max(1, torch.get_num_threads() - 4) if on_gpu else None
    return HostAdamW(
        groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, state_dtype=state_dtype,
        num_threads=threads,
    )  # fmt: skip


def _subset_step(
    optimizer: torch.optim.Optimizer, masters: list[nn.Parameter], grads: list[torch.Tensor]
) -> None:
    """A torch optimizer steps only params with a gradient: give one only to this group's masters."""
    for p, g in zip(masters, grads):
        p.grad = g
    optimizer.step()
    for p in masters:
        p.grad = None


def _scheduler_step(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Advance the LR schedule after this step's updates (optimizer thread, after them in order)."""
    # The updates call step_params, not step(); tell the scheduler the optimizer did step.
    scheduler.optimizer._opt_called = True  # type: ignore[attr-defined]
    scheduler.step()


def _clip_coef(norm: torch.Tensor, max_norm: float) -> float:
    """The factor torch's clip_grad_norm_ applies: max_norm / (norm + 1e-6), at most 1."""
    return min(1.0, max_norm / (float(norm) + 1e-6))  # host tensor: no device sync


def build_roundpipe_engine(
    cfg: Any, model: nn.Module, *, mode: Any, optim: OptimSettings, device: Any
) -> RoundPipeEngine:
    """Map `actor.*` and `actor.roundpipe.*` onto a `RoundPipeEngine` (called by the engine factory).

    Devices: the CPU when `device` is the CPU; one process per node (the `roundpipe:dN` layout:
    N data-parallel replicas) pools every visible GPU; several processes per node each keep
    to their own `device`.
    """
    from laden.engine.factory import DTYPES

    actor, rp = cfg.actor, cfg.actor.roundpipe
    devices = None
    if device is not None and torch.device(device).type == "cpu":
        devices = [torch.device("cpu")]
    elif device is not None and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        devices = [torch.device(device)]
    return RoundPipeEngine(
        model, optim=optim, compute_dtype=DTYPES[actor.dtype], optimizer_dtype=DTYPES[actor.optimizer_dtype],
        num_microbatch=rp.num_microbatch, recompute_grain=rp.recompute_grain,
        model_memory_limit=rp.model_memory_limit, pin_model=rp.pin_model, optim_step=rp.optim_step,
        devices=devices, loss_chunk_size=actor.loss_chunk_size, max_tokens_per_mb=actor.mb_spec.max_tokens_per_mb,
        compile_backend="inductor" if rp.compile else None,
    )  # fmt: skip
