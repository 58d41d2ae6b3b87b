"""Training through `forward`: under grad mode `model(x)` returns outputs with a graph.

The classic loop (`out = model(x); loss = fn(out); loss.backward(); model.step(...)`)
trains like `forward_backward`. The outputs come from an autograd Function whose backward
runs one fused forward-backward call over the forward's micro-batches with the loss
`sum(output * grad_output)` per micro-batch: its gradient with respect to the parameters
is exactly `J^T grad_output`, what autograd would compute through a resident model, and it
lands in the host gradient inboxes where `forward_backward` puts it, so `step` (or
`synchronize`) sees it, and several backwards before a step accumulate.

Cost: the backward computes the forward again (with stage grain, twice for all but the last
stage, as `forward_backward` does), so one forward per layer more than `forward_backward`;
use `forward_backward` when the loss can be written as a `loss_fn`. The forward keeps its
host inputs alive until the backward. The forward's RNG state is replayed for the backward
call, so dropout masks match when one device runs every stage; buffers are read as they
were before the forward and are not written again (`laden.engine.roundpipe.buffers`).

Differences from autograd, refused with a reason: an input that requires grad (RoundPipe
differentiates the parameters only, `batching.split_microbatches`), a `step` between the
forward and its backward (the weights the backward would recompute with are gone), a
second backward through the same graph (retain_graph), and a custom `merge_output`
(the gradient cannot be split back into micro-batches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from laden.engine.roundpipe.call import Grain
from laden.engine.roundpipe.plan import ModelExecutePlan
from laden.roundpipe.timer import IterTimer


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


@dataclass(eq=False)
class GraphCall:
    """What the backward of one `forward` call needs: its micro-batches, plan and RNG state."""

    model: Any  # the RoundPipe
    inputs: list[tuple[tuple, dict[str, Any]]]
    plan: ModelExecutePlan
    grain: Grain
    preserve_rng: bool
    buf: int  # the upload buffer the forward read
    gens: list[int]  # the weight updates queued for it then (`HostStore.required_gens`)
    rng: tuple[torch.Tensor, list[torch.Tensor]]
    saved_buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    # Per micro-batch, per float output leaf: its rows in the merged output (None: a scalar, which
    # `merge_outputs` averages over the micro-batches).
    rows: list[list[int | None]] = field(default_factory=list)
    done: bool = False

    def backward(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        if self.done:
            raise RuntimeError(
                "backward through a RoundPipe forward ran twice; laden does not keep the graph "
                "(retain_graph); call the model again for a second backward"
            )
        pipe = self.model.pipe
        if pipe.read_buf != self.buf or pipe.store.required_gens(self.buf) != self.gens:
            raise RuntimeError(
                "model.step() ran between this forward and its backward; the backward recomputes the "
                "forward on the weights it read, which the step replaced. Call backward before step"
            )
        labels = self._split(grads)
        timer = IterTimer(self.model.model_timer)
        with _replayed_rng(self.rng, pipe.lanes):
            pipe.run_call(
                inputs=self.inputs, labels=labels, loss_fn=_vjp_loss, plan=self.plan, grain=self.grain,
                backward=True, preserve_rng=self.preserve_rng, write_buffers=False,
                saved_buffers=self.saved_buffers, timer=timer,
            )  # fmt: skip
        self.model._fold_timings(timer)
        self.model._last_inbox = pipe.read_buf
        self.done = True
        self.inputs = []

    def _split(self, grads: tuple[torch.Tensor | None, ...]) -> list[list[torch.Tensor | None]]:
        per_mb: list[list[torch.Tensor | None]] = [[] for _ in self.rows]
        for i, grad in enumerate(grads):
            sizes = [rows[i] for rows in self.rows]
            if grad is None or len(per_mb) == 1:
                per_mb[0].append(None if grad is None else grad.cpu())
                continue
            if sizes[0] is None:  # a scalar: the merged output is the micro-batches' mean
                for out in per_mb:
                    out.append(grad.cpu() / len(per_mb))
                continue
            for out, part in zip(per_mb, torch.split(grad.cpu(), sizes)):  # type: ignore[arg-type]
                out.append(part)
        return per_mb


def _vjp_loss(output: Any, grads: list[torch.Tensor | None]) -> torch.Tensor:
    """`sum(output * grad)` over the float output leaves: its gradient is `J^T grad`."""
    from laden.engine.roundpipe.passes import _host_output

    leaves = [t for t in pytree.tree_leaves(_host_output(output)) if _is_float(t)]
    terms = [
        (leaf * grad.to(leaf.dtype)).sum()
        for leaf, grad in zip(leaves, grads)
        if grad is not None and leaf.requires_grad
    ]
    if not terms:  # no output the loss depended on needs the parameters
        return torch.zeros((), device=leaves[0].device if leaves else None, requires_grad=True)
    return torch.stack([t.float() for t in terms]).sum()


class _PipelineGraph(torch.autograd.Function):
    """Identity on the call's float outputs; its backward runs the pipeline's backward."""

    @staticmethod
    def forward(ctx: Any, call: GraphCall, anchor: torch.Tensor, *outputs: torch.Tensor) -> Any:
        ctx.call = call
        return tuple(t.detach() for t in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        ctx.call.backward(grads)
        return (None, None, *([None] * len(grads)))


def capture_rng(lanes: list[Any]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    cuda = [torch.cuda.get_rng_state(lane.device) for lane in lanes if lane.is_cuda]
    return torch.get_rng_state(), cuda


class _replayed_rng:
    """Run the backward call with the RNG state the forward started from, then restore the RNG."""

    def __init__(self, state: tuple[torch.Tensor, list[torch.Tensor]], lanes: list[Any]) -> None:
        self.state, self.devices = state, [lane.device for lane in lanes if lane.is_cuda]

    def __enter__(self) -> None:
        self.fork = torch.random.fork_rng(devices=self.devices, device_type="cuda")
        self.fork.__enter__()
        torch.set_rng_state(self.state[0])
        for device, cuda_state in zip(self.devices, self.state[1]):
            torch.cuda.set_rng_state(cuda_state, device)

    def __exit__(self, *exc: Any) -> None:
        self.fork.__exit__(*exc)


def needs_graph(model: Any, cfg: Any) -> bool:
    """Whether a `forward` call records a graph: `requires_grad` (default: grad mode) and some
    parameter trainable."""
    wanted = getattr(cfg, "requires_grad", None)
    wanted = torch.is_grad_enabled() if wanted is None else wanted
    return bool(wanted) and any(hp.trainable for hp in model.pipe.store.params)


def attach_graph(call: GraphCall, per_mb: list[Any], merged: Any) -> Any:
    """`merged` (the merged host outputs of `per_mb`) with its float leaves made outputs of the graph."""
    leaves, spec = pytree.tree_flatten(merged)
    index = [i for i, t in enumerate(leaves) if _is_float(t)]
    mb_leaves = [pytree.tree_leaves(out) for out in per_mb]
    if len(per_mb) == 1:
        call.rows = [[None for _ in index]]
    else:
        call.rows = [[_rows(mb[i]) for i in index] for mb in mb_leaves]
    anchor = torch.empty(0, requires_grad=True)
    attached = _PipelineGraph.apply(call, anchor, *(leaves[i] for i in index))
    for i, tensor in zip(index, attached):
        leaves[i] = tensor
    return pytree.tree_unflatten(leaves, spec)


def _rows(t: Any) -> int | None:
    return t.shape[0] if isinstance(t, torch.Tensor) and t.ndim > 0 else None


def begin_graph(model: Any, inputs: list[tuple[tuple, dict[str, Any]]], cfg: Any) -> GraphCall:
    """Before a `forward` that records a graph: what its backward will need (RNG first)."""
    if getattr(cfg, "merge_output", None) not in (None, True):
        raise ValueError(
            "a custom merge_output cannot be differentiated through (laden cannot split the output "
            "gradient back into micro-batches); call the model under torch.no_grad(), or train with "
            "forward_backward"
        )
    from laden.roundpipe.batching import num_tokens

    pipe = model.pipe
    plan = cfg.execute_plan or ModelExecutePlan.auto(
        "fused", model, tokens_per_microbatch=num_tokens(inputs), recompute_grain=cfg.recompute_grain
    )
    return GraphCall(
        model=model, inputs=inputs, plan=plan, grain=cfg.recompute_grain, preserve_rng=cfg.preserve_rng_state,
        buf=pipe.read_buf, gens=pipe.store.required_gens(pipe.read_buf), rng=capture_rng(pipe.lanes),
    )  # fmt: skip
