"""The bodies of the three stage tasks: forward, fused (forward + loss + backward), backward.

Every body loops over all micro-batches inside one residency. Inputs are copied on the `h2d`
stream, which runs its copies in the order they are queued: the first micro-batch's when the
stage's weights are queued (`prefetch_first`, while the stage before it computes), and each
later one's right after every input of the micro-batch before it, whenever its producer has
already parked it (otherwise just in time), so the copies overlap compute and the compute
stream never waits for a copy it does not need yet. Outputs and gradients are parked on the
`d2h` stream as soon as they exist.

Recompute: a backward stage recomputes its forward from the saved input of its first layer
(`recompute_grain="stage"`: the stage's activations of one micro-batch are alive at once),
or layer by layer from each layer's saved input (`"layer"`: one layer's activations alive
at once, at the price of moving every layer's input through host memory). The fused stage
needs no recompute with stage grain; with layer grain it runs forward without a graph,
keeping each layer's input on the device for the current micro-batch only, and then
recomputes and backpropagates one layer at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from laden.engine.roundpipe import buffers
from laden.engine.roundpipe.call import StageTask, capture_rng, restored_rng
from laden.engine.roundpipe.context import forward_scope, recompute_scope
from laden.engine.roundpipe.device import Lane
from laden.engine.roundpipe.residency import (
    Residency,
    accumulate_microbatch,
    arm_early_download,
    download_grads,
    release,
    upload_stage,
)
from laden.engine.roundpipe.transfer import (
    Aborted,
    Handoff,
    Shared,
    as_leaves,
    fetch,
    float_leaves,
    input_grads,
    park,
)


def prepare(task: StageTask, lane: Lane) -> Residency:
    """Queue the upload of the task's weights to `lane`, once the host has finished writing them,
    then the copies of its first micro-batch's inputs (`prefetch_first`)."""
    run, store = task.run, task.run.store
    buf, required = run.spec.buf, run.spec.required
    if not store.wait_weights(task.weight_groups(), buf, required, run.aborted):
        raise Aborted
    trainable = run.spec.backward and task.kind != "forward"
    carry_out = frozenset(
        hp.index
        for layer in task.layers
        for hp in store.layers[layer].foreign
        if hp.index in run.spec.carried
    )
    if run.spec.write_buffers and task.kind != "backward":  # before any write-back: what recomputes see
        buffers.snapshot_host(store, task.layers, run.spec.saved_buffers)
    res = upload_stage(
        store, lane, task.layers, buf=buf, trainable=trainable, carry_out=carry_out, carried=run.carried,
        buffer_source=run.spec.saved_buffers if task.kind == "backward" else None,
    )  # fmt: skip
    prefetch_first(task, lane)
    return res


def execute(task: StageTask, lane: Lane, res: Residency) -> None:
    """Queue the task's work on `lane`: its forward, fused or backward pass over every micro-batch."""
    body = {"forward": run_forward, "fused": run_fused, "backward": run_backward}
    body[task.kind](task, lane, res)


def call_layer(res: Residency, layer_id: int, x: Any) -> Any:
    """Layer 0 receives the call's `(args, kwargs)`; every later layer the previous output."""
    module = res.layer(layer_id)
    if layer_id == 0:
        args, kwargs = x
        return module(*args, **kwargs)
    return module(x)


class _Prefetcher:
    """Fetch a task's inputs in consumption order: `get` the current one, then queue the next `ahead`.

    Handoffs are looked up, not removed, from the run's tables (the producer may not have
    filled them yet); each one's host copy is dropped once fetched, unless `keep` says a
    later task reads it again (a stage input that is also saved for the backward).
    """

    def __init__(
        self,
        abort: Callable[[], bool],
        lane: Lane,
        handoffs: list[Handoff],
        *,
        grad_leaves: bool | list[bool],
        keep: list[bool] | None = None,
        shared: Shared | None = None,
    ) -> None:
        # `abort`, not the task: the task holds its prefetchers, and a cycle would outlive the call.
        self.abort, self.lane, self.handoffs, self.shared = abort, lane, handoffs, shared
        self.grad_leaves = grad_leaves if isinstance(grad_leaves, list) else [grad_leaves] * len(handoffs)
        self.keep = keep or [False] * len(handoffs)
        self.pending: dict[int, tuple[Any, Any]] = {}

    def get(self, i: int) -> Any:
        """Input number `i` on the device, with the compute stream ordered after its copy."""
        data, event = self.pending.pop(i) if i in self.pending else self._fetch(i)
        self.lane.wait(self.lane.compute, event)
        if not self.keep[i]:
            self.handoffs[i].release()  # the queued copy keeps what it needs alive
        return data

    def ahead(self, i: int) -> None:
        """Queue input `i`'s copy now if its producer has parked it (a no-op past the last input)."""
        if i < len(self.handoffs) and i not in self.pending and self.handoffs[i].is_ready():
            self.pending[i] = self._fetch(i)

    def _fetch(self, i: int) -> tuple[Any, Any]:
        return fetch(
            self.lane, self.handoffs[i], self.abort, grad_leaves=self.grad_leaves[i], shared=self.shared
        )


def run_forward(task: StageTask, lane: Lane, res: Residency) -> None:
    run, spec = task.run, task.run.spec
    first, stop = task.layers.start, task.layers.stop
    inputs = task_inputs(task, lane)["x"]
    for mb in range(run.num_microbatches):
        x = inputs.get(mb)
        inputs.ahead(mb + 1)
        _at_last_microbatch(task, mb)
        with torch.no_grad(), spec.autocast.enter(), lane.on(lane.compute), _capture_scope(run, mb):
            for layer in task.layers:
                if (layer, mb) in run.saved:
                    if layer != first:
                        park(lane, x, into=run.saved[(layer, mb)], pool=run.buffers, shared=run.shared)
                    if spec.preserve_rng:
                        run.rng[(layer, mb)] = capture_rng(lane)
                with _forward_scope(run, layer, mb), _time_fwd(run, lane, layer, "fwd"):
                    x = call_layer(res, layer, x)
            if task.final:
                run.outputs[mb] = park(lane, _host_output(x))
            else:
                park(lane, x, into=run.acts[(stop, mb)], pool=run.buffers, shared=run.shared)
    if spec.write_buffers:
        buffers.write_back(run.store, lane, res.modules, task.layers)
    release(res)


def run_fused(task: StageTask, lane: Lane, res: Residency) -> None:
    run, spec = task.run, task.run.spec
    loss_fn = spec.loss_fn
    assert loss_fn is not None, "the fused stage computes the loss"
    first = task.layers.start
    prefetchers = task_inputs(task, lane)
    inputs, labels = prefetchers["x"], prefetchers.get("labels")
    for mb in range(run.num_microbatches):
        _arm_if_last(task, res, mb)
        x = inputs.get(mb)
        label = labels.get(mb) if labels is not None else None
        for prefetcher in prefetchers.values():
            prefetcher.ahead(mb + 1)
        _at_last_microbatch(task, mb)
        with spec.autocast.enter(), lane.on(lane.compute), _capture_scope(run, mb):
            if not spec.backward:
                with torch.no_grad():
                    out = _run_layers(res, task.layers, x, timed=(run, lane, ("fwd",)))
                    losses = _losses(loss_fn(out, label))
                grad_in = None
            elif spec.grain == "stage":
                with torch.enable_grad():
                    # the forward that builds the graph stands in for the recompute as well
                    out = _run_layers(res, task.layers, x, timed=(run, lane, ("fwd", "re")))
                    losses = _losses(loss_fn(out, label))
                    with _time_bwd(run, lane, task.layers):
                        torch.autograd.backward(losses)
                grad_in = input_grads(x)
            else:
                losses, grad_in, out = _fused_layerwise(task, lane, res, x, label, mb)
            run.losses[mb] = park(lane, [loss.detach() for loss in losses], flat=True)
            if spec.keep_outputs:  # forward_backward(return_outputs=True)
                run.outputs[mb] = park(lane, _host_output(_detached(out)))
            del out
            if spec.backward and first > 0:
                park(lane, grad_in, into=run.grads[(first, mb)], flat=True, pool=run.buffers)
        del x, grad_in, losses
        if spec.backward:
            accumulate_microbatch(res)
    if spec.write_buffers:
        buffers.write_back(run.store, lane, res.modules, task.layers)
    _finish_backward(task, res)


def _fused_layerwise(
    task: StageTask, lane: Lane, res: Residency, x: Any, label: Any, mb: int
) -> tuple[list[torch.Tensor], list[Any], Any]:
    """Layer grain in the fused stage: forward without a graph, then recompute + backward per layer."""
    run, layers = task.run, list(task.layers)
    loss_fn = run.spec.loss_fn
    assert loss_fn is not None, "the fused stage computes the loss"
    kept: dict[int, tuple[Any, Any]] = {}
    with torch.no_grad():
        for layer in layers[:-1]:
            kept[layer] = (x, capture_rng(lane) if run.spec.preserve_rng else None)
            with forward_scope(run.recompute_data, (layer, mb)), _time_fwd(run, lane, layer, "fwd"):
                x = call_layer(res, layer, x)
    kept[layers[-1]] = (x, None)
    undo = buffers.device_snapshot(run.store, res.modules, layers[:-1])  # the recompute rewrites them
    grads: list[Any] | None = None
    losses: list[torch.Tensor] = []
    final: Any = None
    for layer in reversed(layers):
        x_in, rng = kept.pop(layer)
        x_in = as_leaves(x_in) if layer > 0 else x_in
        last = layer == layers[-1]  # its one forward: not a recompute
        recompute = (
            contextlib.nullcontext() if last else recompute_scope(run.recompute_data.pop((layer, mb), None))
        )
        with torch.enable_grad(), restored_rng(lane, rng), recompute:
            with _time_fwd(run, lane, layer, *(("fwd", "re") if last else ("re",))):
                out = call_layer(res, layer, x_in)
            if grads is None:
                final = out
                losses = _losses(loss_fn(out, label))
                with _time_bwd(run, lane, range(layer, layer + 1)):
                    torch.autograd.backward(losses)
            else:
                with _time_bwd(run, lane, range(layer, layer + 1)):
                    _backward(out, grads)
        grads = input_grads(x_in)
    buffers.restore_device(undo)
    return losses, grads, final  # type: ignore[return-value]


def run_backward(task: StageTask, lane: Lane, res: Residency) -> None:
    run, spec = task.run, task.run.spec
    first, stop = task.layers.start, task.layers.stop
    prefetchers = task_inputs(task, lane)
    grads_in, saved = prefetchers["grads"], prefetchers["saved"]
    starts = _recompute_starts(task)
    for mb in range(run.num_microbatches):
        _arm_if_last(task, res, mb)
        grads: Any = None
        with spec.autocast.enter(), lane.on(lane.compute):
            for j, start in enumerate(starts):
                # Copies in the order of need: this recompute's input, then the output gradient (the
                # recompute runs before it is read), then the next recompute's input, and so on.
                k = mb * len(starts) + j
                x = saved.get(k)
                saved.ahead(k + 1)
                if j == len(starts) - 1:
                    grads_in.ahead(mb + 1)
                if j == 0:
                    _at_last_microbatch(task, mb)
                end = stop if spec.grain == "stage" else start + 1
                with torch.enable_grad(), restored_rng(lane, run.rng.pop((start, mb), None)):
                    out = _recompute_layers(run, lane, res, range(start, end), x, mb)
                    if j == 0:
                        grads = grads_in.get(mb)
                    with _time_bwd(run, lane, range(start, end)):
                        _backward(out, grads)
                del out
                grads = input_grads(x)
            if first > 0:
                park(lane, grads, into=run.grads[(first, mb)], flat=True, pool=run.buffers)
        del x, grads
        accumulate_microbatch(res)
    _finish_backward(task, res)


def _arm_if_last(task: StageTask, res: Residency, mb: int) -> None:
    """Before the last micro-batch of a backward: gradients go home as each becomes final."""
    run = task.run
    if run.spec.backward and res.trainable and mb == run.num_microbatches - 1:
        arm_early_download(run.store, res, run.spec.inbox, run.on_landed)


def task_inputs(task: StageTask, lane: Lane) -> dict[str, _Prefetcher]:
    """The task's input prefetchers by role, built once (`prefetch_first` may have started them):
    "x" (stage input; a forward or fused stage), "labels" (fused, when the call has labels),
    "grads" (the gradients of a backward stage's outputs) and "saved" (its recompute inputs)."""
    if task.inputs is None:
        task.inputs = _build_inputs(task, lane)
    return task.inputs


def prefetch_first(task: StageTask, lane: Lane) -> None:
    """Queue the copies of the task's first micro-batch inputs whose producers are done: when the
    task's weights are queued (`StageTask.prepare`), so they cross the bus before it computes."""
    for prefetcher in task_inputs(task, lane).values():
        prefetcher.ahead(0)


def _at_last_microbatch(task: StageTask, mb: int) -> None:
    """At the last micro-batch, once the inputs of its first compute are queued (with layer grain,
    the inputs of its later layers follow the next task's first ones): the worker's hook
    (`StageTask.early`) that queues the next task's uploads while this micro-batch computes."""
    if mb == task.run.num_microbatches - 1 and task.early is not None:
        task.early()


def _build_inputs(task: StageTask, lane: Lane) -> dict[str, _Prefetcher]:
    run, spec, first = task.run, task.run.spec, task.layers.start
    num_mb, abort = run.num_microbatches, run.aborted
    if task.kind == "backward":
        order = [(mb, layer) for mb in range(num_mb) for layer in _recompute_starts(task)]
        return {  # in the order of need: a recompute's input before the gradient it meets
            "saved": _Prefetcher(
                abort, lane, [run.saved[(layer, mb)] for mb, layer in order],
                grad_leaves=[layer > 0 for _, layer in order], shared=run.shared,
            ),
            "grads": _Prefetcher(
                abort, lane, [run.grads[(task.layers.stop, mb)] for mb in range(num_mb)], grad_leaves=False
            ),
        }  # fmt: skip
    # A fused stage's input is a leaf of the graph (with stage grain) unless it is the call's input.
    grad_leaves = task.kind == "fused" and spec.backward and spec.grain == "stage" and first > 0
    inputs = {
        "x": _Prefetcher(
            abort, lane, [run.acts[(first, mb)] for mb in range(num_mb)], grad_leaves=grad_leaves,
            keep=[(first, mb) in run.saved for mb in range(num_mb)], shared=run.shared,
        )
    }  # fmt: skip
    if task.kind == "fused" and spec.labels is not None:
        inputs["labels"] = _Prefetcher(abort, lane, list(spec.labels), grad_leaves=False)
    return inputs


def _recompute_starts(task: StageTask) -> list[int]:
    """The layers a backward stage recomputes from a saved input, in order (one per micro-batch
    with stage grain; every layer, last first, with layer grain)."""
    return [task.layers.start] if task.run.spec.grain == "stage" else list(reversed(task.layers))


def _finish_backward(task: StageTask, res: Residency) -> None:
    run = task.run
    if run.spec.backward and res.trainable:
        download_grads(run.store, res, run.spec.inbox, run.on_landed)
    release(res)


def _forward_scope(run: Any, layer: int, mb: int) -> Any:
    """A forward that a backward stage recomputes later may leave data for it (`save_for_recompute`)."""
    if not run.spec.backward:
        return contextlib.nullcontext()
    return forward_scope(run.recompute_data, (layer, mb))


def _recompute_layers(run: Any, lane: Lane, res: Residency, layers: range, x: Any, mb: int) -> Any:
    for layer in layers:
        with recompute_scope(run.recompute_data.pop((layer, mb), None)), _time_fwd(run, lane, layer, "re"):
            x = call_layer(res, layer, x)
    return x


def _run_layers(res: Residency, layers: range, x: Any, *, timed: tuple[Any, Lane, tuple[str, ...]]) -> Any:
    run, lane, actions = timed
    for layer in layers:
        with _time_fwd(run, lane, layer, *actions):
            x = call_layer(res, layer, x)
    return x


def _time_fwd(run: Any, lane: Lane, layer: int, *actions: str) -> Any:
    """The call's `IterTimer` spans of `layer` for each action (`fwd`, `re`) around the block."""
    timer = run.spec.timer
    if timer is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for action in actions:
        stack.enter_context(timer.time_fwd(action, layer, lane.compute))
    return stack


def _capture_scope(run: Any, mb: int) -> Any:
    """Micro-batch `mb` of a call made inside a Hugging Face forward that records outputs."""
    capture = run.spec.capture
    return contextlib.nullcontext() if capture is None else capture.scope(mb)


def _time_bwd(run: Any, lane: Lane, layers: range) -> Any:
    """The call's `IterTimer` span of the backward of `layers` around the block."""
    timer = run.spec.timer
    return contextlib.nullcontext() if timer is None else timer.time_bwd(layers, lane.compute)


def _backward(outputs: Any, grads: list[Any]) -> None:
    """Backpropagate `grads` (aligned with the flattened outputs) through `outputs`."""
    leaves = float_leaves(outputs)
    if len(leaves) != len(grads):
        raise RuntimeError(
            f"a stage produced {len(leaves)} output leaves but the next stage returned {len(grads)} "
            "gradients; the layer outputs changed structure between forward and recompute"
        )
    pairs = [
        (o, g)
        for o, g in zip(leaves, grads)
        if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
    ]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _losses(loss: Any) -> list[torch.Tensor]:
    if isinstance(loss, torch.Tensor):
        return [loss]
    if isinstance(loss, (list, tuple)) and loss and all(isinstance(t, torch.Tensor) for t in loss):
        return list(loss)
    raise TypeError(f"loss_fn must return a tensor or a sequence of tensors; got {type(loss).__name__}")


def _detached(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


def _host_output(x: Any) -> Any:
    """Inference outputs go to the host; a causal-LM head output becomes its logits first."""
    from laden.model.split import LMHeadOutput

    return x.logits if isinstance(x, LMHeadOutput) else x
