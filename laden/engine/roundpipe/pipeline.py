"""A model as a pipeline of layers over a device pool: the core both front-ends share.

`Pipeline` owns the host store (weights, masters, gradients), the device lanes and the
host threads, and runs one call (`run_call`): tasks over the pool, then one deliberate
device synchronisation (the caller reads losses on the host, and the host may rewrite
upload buffers afterwards), then it waits for the call's gradient landings and for the
optimizer jobs queued before the call (so a failed update is reported by the next call,
deterministically; `host.jobs`). The library API (`RoundPipe`) and the config-driven
engine (`RoundPipeEngine`) differ only in what happens to the gradients afterwards: a user
`step(fn)`, or per-group updates.

Upload-buffer and inbox indices: a call reads upload buffer `read_buf` and writes gradient
inbox `read_buf`. The synchronous step keeps both at 0. The asynchronous step writes the
new weights into the buffer the finished call read and flips `read_buf`, so the next call
reads the other buffer (the weights from one update earlier) while the update runs.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from laden.engine.roundpipe.call import AutocastState, CallSpec, Grain, Run
from laden.engine.roundpipe.device import Lane, default_devices, lanes_for, wait_host
from laden.engine.roundpipe.host.jobs import HostJobs
from laden.engine.roundpipe.host.layout import HostLayout
from laden.engine.roundpipe.host.store import HostStore, InitFn, LayerInfo, ParamGroup, PinMode
from laden.engine.roundpipe.plan import ModelExecutePlan, default_memory_limit_gib
from laden.engine.roundpipe.residency import GradLanding, carried_params
from laden.engine.roundpipe.transfer import Aborted, Handoff, HostBuffers
from laden.engine.roundpipe.workers import run_tasks

LandingHook = Callable[[GradLanding], None]
_collected = False  # whether a pipeline ran its one full garbage collection (see gc_paused)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector does not run while a call queues its GPU work.

    A call allocates tens of thousands of small Python objects (autograd nodes, tensors,
    closures), so the collector would otherwise start collections in the middle of it, and a
    full one stops the one thread that feeds the GPU for as long as it walks every tracked
    object. The collector runs again after the call. One call's cyclic garbage is held until then.

    Held back, the collector's first full collection (every object tracked since the process
    started: the model, compiled code, library state) would fall right after the second call,
    and the third would wait for it (0.3 s for a tiny CPU model with fused kernels, a step
    otherwise takes 0.04 s). So the first pipeline of a process runs that collection itself,
    once, after its first call's device synchronisation, where the GPU waits for the host
    anyway. (Freezing the objects alive then, `gc.freeze()`, would make later collections
    cheaper still, but it would also keep every reference cycle of the process alive then from
    ever being collected: a decision for the application, not for a library.)
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Pipeline:
    """Layers, their host state, a device pool and host threads (see the module docstring)."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        *,
        param_names: dict[int, str],
        devices: Sequence[torch.device] | None,
        pin_model: PinMode,
        compute_dtype: torch.dtype | None = None,
        master_dtype: torch.dtype | None = None,
        group_key: Callable[[str, nn.Parameter], Hashable] | None = None,
        create_masters: bool = False,
        init_meta: InitFn | None = None,
        name: str = "roundpipe",
        loss_chunk_size: int | None = None,
    ) -> None:
        self.lanes: list[Lane] = lanes_for(list(devices) if devices else default_devices())
        layout = HostLayout(
            layers, param_names=param_names, compute_dtype=compute_dtype, master_dtype=master_dtype,
            group_key=group_key,
        )  # fmt: skip
        self.store = HostStore(
            layout, pin_mode=pin_model, pin=any(lane.is_cuda for lane in self.lanes),
            create_masters=create_masters, init_meta=init_meta,
        )  # fmt: skip
        self.jobs = HostJobs(name)
        self.host_buffers = HostBuffers(pin=self.store.pin)  # parked activations, reused across calls
        self.read_buf = 0
        self.loss_chunk_size = loss_chunk_size  # for activation estimates; None: laden's default

    # ---- what ModelExecutePlan.auto asks -----------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.store.layers)

    @property
    def num_devices(self) -> int:
        return len(self.lanes)

    def layer_bytes(self, *, with_grads: bool) -> list[int]:
        return self.store.layer_bytes(with_grads=with_grads)

    def shared_bytes(self, *, with_grads: bool) -> list[tuple[frozenset[int], int]]:
        return self.store.layout.shared_bytes(with_grads=with_grads)

    def default_memory_limit_gib(self) -> float:
        return default_memory_limit_gib([lane.device for lane in self.lanes])

    def layer_activation_bytes(self, num_tokens: int) -> list[tuple[int, int]]:
        """Per layer, (kept, transient) activation bytes of a `num_tokens` micro-batch (0 if unknown)."""
        return layer_activation_bytes(self.store.layers, num_tokens, self.loss_chunk_size)

    # ---- one call ----------------------------------------------------------------------
    def run_call(
        self,
        *,
        inputs: list[Any],
        labels: list[Any] | None,
        loss_fn: Callable[[Any, Any], Any] | None,
        plan: ModelExecutePlan,
        grain: Grain,
        backward: bool,
        preserve_rng: bool,
        on_landing: LandingHook | None = None,
        carried: frozenset[int] = frozenset(),
        keep_outputs: bool = False,
        write_buffers: bool = True,
        saved_buffers: dict[int, torch.Tensor] | None = None,
        timer: Any = None,
        capture: Any = None,
    ) -> Run:
        """Run every micro-batch through the plan; gradients land in inbox `read_buf`.

        `carried`: tied parameters whose gradient stays on the device between the backward
        stages that use it (`carried_params`; the caller counts their landings accordingly).
        `write_buffers`, `saved_buffers`: see `CallSpec` and `buffers.py`. `timer`: an `IterTimer`
        the layers' forward, recompute and backward spans are recorded into
        (`laden.roundpipe.timer`); `capture`: the Hugging Face output capture the layers' hooks
        append to (`laden.roundpipe.hf_capture`).
        """
        self.jobs.raise_errors()
        before = self.jobs.last_optim()  # the call reports this job's failure, whenever it happens
        if loss_fn is None and not backward:  # inference: a fused plan's last stage runs forward too
            plan = ModelExecutePlan(fwd_plan=plan.forward_stages(self.num_layers))
        plan.check_valid(self.num_layers, "infer" if loss_fn is None and not backward else "fused")
        if backward:
            self.store.ensure_inboxes(self.read_buf + 1)
        pin = self.store.pin
        spec = CallSpec(
            inputs=[Handoff.of_host(x, pin=pin) for x in inputs],
            labels=None if labels is None else [Handoff.of_host(y, pin=pin) for y in labels],
            loss_fn=loss_fn, plan=plan, grain=grain, backward=backward, preserve_rng=preserve_rng,
            autocast=AutocastState.capture(), buf=self.read_buf, inbox=self.read_buf,
            required=self.store.required_gens(self.read_buf), carried=carried if backward else frozenset(),
            keep_outputs=keep_outputs, timer=timer, capture=capture,
            write_buffers=write_buffers, saved_buffers={} if saved_buffers is None else saved_buffers,
        )  # fmt: skip
        run = Run(
            self.store,
            spec,
            on_landed=lambda landing: self._submit_landing(landing, on_landing),
            host_failed=self.jobs.failed,
            buffers=self.host_buffers,
        )
        try:
            with gc_paused():
                run_tasks(run, self.lanes)
        except Aborted:
            self.jobs.raise_errors()  # the host job whose failure stopped the run
            raise
        finally:
            run.tasks = []  # each task refers to the run: a cycle that would hold this pipeline
            self.host_buffers.end_call()
        for lane in self.lanes:
            lane.synchronize()  # deliberate: losses are read on the host next
        global _collected
        if not _collected:  # once per process, after a first call's synchronisation (see gc_paused)
            gc.collect()
            _collected = True
        self.jobs.drain_landing()
        self.jobs.wait_for(before)
        return run

    def carried_params(self, plan: ModelExecutePlan) -> frozenset[int]:
        """The tied parameters whose gradient a call of `plan` can keep on the device: those of
        `residency.carried_params` when one device runs every stage in plan order (with several,
        the stages that use a tied weight may run on different devices)."""
        return carried_params(self.store, plan) if len(self.lanes) == 1 else frozenset()

    def _submit_landing(self, landing: GradLanding, hook: LandingHook | None) -> None:
        self.jobs.submit_landing(_land, landing, hook)

    # ---- host-side helpers ---------------------------------------------------------------
    def trainable_groups(self) -> list[ParamGroup]:
        return [g for g in self.store.groups if g.trainable]

    def refresh_uploads(self, groups: Sequence[ParamGroup], buf: int) -> None:
        """Write the masters of `groups` into upload buffer `buf` (cast to the compute dtype)."""
        self.store.write_uploads(groups, buf)

    def release_device_memory(self) -> None:
        """Between calls: hand back what the pipeline keeps for the next one (see `RoundPipeEngine.offload`).

        Waits for the host jobs and the devices, drops the pooled host buffers of parked
        activations (page-locked on a GPU machine; they go back to torch's host allocator, for
        anyone in the process), and returns the device memory that torch's caching allocator
        still reserves to the driver. Nothing else of a call outlives it on a device: weights,
        gradient accumulators and a tied weight's carried gradient live for one residency or one
        call, and the host state is untouched. The next call refills the pool as it goes.
        """
        self.jobs.drain()
        for lane in self.lanes:
            lane.synchronize()  # deliberate: nothing queued may still use what is released
        self.host_buffers.clear()
        if any(lane.is_cuda for lane in self.lanes):
            gc.collect()  # a call's cyclic garbage (see gc_paused) may still hold device tensors
            torch.cuda.empty_cache()

    def close(self) -> None:
        self.jobs.drain()


def layer_activation_bytes(
    layers: Sequence[LayerInfo], num_tokens: int, loss_chunk_size: int | None
) -> list[tuple[int, int]]:
    """Per layer, (kept, transient) activation bytes of a `num_tokens` micro-batch (0 if unknown).

    Layers of a split causal LM have an estimate (`laden.model.split.activation_bytes`), at
    the dtype their weights are uploaded in; other modules count as zero.
    """
    from laden.model.split import DEFAULT_LOSS_CHUNK_SIZE, activation_bytes

    chunk = loss_chunk_size or DEFAULT_LOSS_CHUNK_SIZE
    out = []
    for info in layers:
        floating = [g.compute_dtype for g in info.weight_deps() if g.compute_dtype.is_floating_point]
        dtype = floating[0] if floating else torch.get_default_dtype()
        out.append(activation_bytes(info.module, num_tokens, dtype=dtype, loss_chunk_size=chunk))
    return out


def _land(landing: GradLanding, hook: LandingHook | None) -> None:
    """Landing job: wait for the copy, add a staged gradient into its inbox, tell the hook."""
    wait_host(landing.event)  # deliberate: the host reads the gradient next
    if landing.staged:
        with torch.no_grad():
            if landing.group is not None:
                _apply_staged_group(landing)
            else:
                hp = landing.param
                assert hp is not None and hp.staging is not None
                hp.grad(landing.inbox).add_(hp.staging)
    if hook is not None:
        hook(landing)


def _apply_staged_group(landing: GradLanding) -> None:
    """Add a staged group gradient into its inbox; members new to this window are copied instead."""
    group = landing.group
    assert group is not None and group.staging_flat is not None
    staging, inbox = group.staging_flat, group.grad_flats[landing.inbox]
    if not landing.overwrite:
        inbox.add_(staging)
        return
    fresh = {id(hp) for hp in landing.overwrite}
    for hp in group.members:
        part = slice(hp.offset, hp.offset + hp.numel)
        if id(hp) in fresh:
            inbox[part].copy_(staging[part])
        else:
            inbox[part].add_(staging[part])


def sum_losses(run: Run) -> torch.Tensor | list[torch.Tensor]:
    """Sum the micro-batch losses (host tensors; the call already synchronised)."""
    per_mb = [h.host_tree() for h in run.losses if h is not None]
    totals = [sum(parts[i] for parts in per_mb) for i in range(len(per_mb[0]))]
    return totals[0] if len(totals) == 1 else totals
