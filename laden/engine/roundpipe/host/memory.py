"""Host memory of the roundpipe engine: what it allocated, what it will allocate, and cheap builds.

The engine keeps every byte of model state in host memory, so host memory, not the GPU, is
what decides whether a model trains (a Qwen3-8B shape is killed by the OOM killer on a
128 GiB machine with fp32 masters). Bytes per trainable parameter, compute in bf16, as
`measured_host_bytes` counts them and `planned_host_bytes` predicts them (exactly, for the
model state; tests compare the two):

| optimizer            | step  | weights | master | states | grads | total |
| -------------------- | ----- | ------- | ------ | ------ | ----- | ----- |
| adam (fp32 master)   | sync  | 2       | 4      | 8      | 4     | 18    |
| adam (fp32 master)   | async | 2 + 2   | 4      | 8      | 4 + 4 | 24    |
| adam_bf16 (Kahan)    | sync  | 2       | shared | 6      | 2     | 10    |
| adam_bf16 (Kahan)    | async | 2 + 2   | shared | 6      | 2 + 2 | 14    |
| adam (bf16 master)   | sync  | 2       | shared | 4      | 2     | 8     |
| adam (bf16 master)   | async | 2 + 2   | shared | 4      | 2 + 2 | 12    |

`adam_bf16` keeps its bf16 master in the upload copy (`host.layout`: shared masters), so the
Kahan update writes what the GPU uploads next; its states are bf16 `exp_avg`, `exp_avg_sq`
and the Kahan compensation. `adam` with `actor.optimizer_dtype: bfloat16` is what it says,
as under every engine: `torch.optim.AdamW` on the bf16 masters, bf16 moments and no
compensation (the builder warns: updates below bf16 resolution are lost). The asynchronous
step adds a second upload buffer (the one-step stale weights the next step reads while the
update writes the other) and a second gradient inbox (the next step's gradients land while
the update reads this step's).

Why fp32 masters take 18, not 16: their gradient inbox is fp32 (4 B). The device sums the
micro-batch gradients in fp32, and the host adds more into the inbox (a tied embedding's
two uses, accumulation across `forward_backward` calls, the data-parallel all-reduce); a
bf16 inbox would round each of those sums to 8 mantissa bits before Adam, the precision
fp32 masters are chosen for. At 8B parameters the 2 B would not rescue fp32 masters anyway
(16 B/param is 122 GiB before pinned rounding and activations): use `adam_bf16` there.

`pin_model="alloc"` puts the upload copies in the pinned allocator, which rounds every
buffer up to a power of two (`pinned_rounding`, up to +100% of a layer's weights);
`register` and `off` add nothing. Gradient inboxes are page-locked in place: a page of
slack per group. Activations parked between stages (`activation_host_bytes`) are an
estimate from the plan, not an exact count.

`meta_params` builds a model with its parameters on the meta device (and real buffers), so
a prediction costs no memory, and `RoundPipeEngine` materialises such a model straight
into its host store, layer by layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Literal, cast

import torch
from torch import nn

from laden.engine.roundpipe.host.layout import HostLayout
from laden.engine.roundpipe.host.store import STORE_KINDS, HostStore, PinMode, alloc_nbytes
from laden.engine.roundpipe.plan import ModelExecutePlan, default_memory_limit_gib

OPTIM_KINDS = ("optim.exp_avg", "optim.exp_avg_sq", "optim.comp", "optim.momentum_buffer")
HOST_KINDS = (*STORE_KINDS, *OPTIM_KINDS)
"""Kinds of host bytes; predictions with a token count add `activations`."""
NOT_PER_PARAM = ("buffers", "activations")
_POSITION_ID_BYTES = 8  # int64 position ids travel with the hidden states


def measured_host_bytes(store: HostStore, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Host bytes allocated now by `store` and `optimizer`'s tensor states, by kind (`HOST_KINDS`)."""
    out = {**dict.fromkeys(HOST_KINDS, 0), **store.nbytes_by_kind()}
    seen: set[int] = set()
    for state in optimizer.state.values() if optimizer is not None else ():
        for key, value in state.items():
            if key == "step" or not isinstance(value, torch.Tensor) or value.numel() == 0:
                continue
            storage = value.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                out[f"optim.{key}"] = out.get(f"optim.{key}", 0) + storage.nbytes()
    return out


def optimizer_state_keys(optimizer_type: str, momentum: float = 0.0) -> tuple[str, ...]:
    """The per-parameter tensor states the engine's optimizer allocates, at the master dtype."""
    if optimizer_type == "adam":
        return ("exp_avg", "exp_avg_sq")
    if optimizer_type == "adam_bf16":
        return ("exp_avg", "exp_avg_sq", "comp")
    if optimizer_type == "sgd":
        return ("momentum_buffer",) if momentum else ()
    raise ValueError(f"actor.optimizer.type={optimizer_type!r} is not supported; use adam, adam_bf16 or sgd")


def planned_host_bytes(
    layout: HostLayout,
    *,
    pin_mode: PinMode,
    pinned: bool,
    optim_step: Literal["sync", "async"],
    optimizer_states: Sequence[str],
    tied_staging: bool = True,
) -> dict[str, int]:
    """What the engine's store and optimizer will hold for `layout`, by kind, after the first step.

    `pinned`: whether a CUDA device makes the store page-lock (the GPU machine); `tied_staging`:
    whether a tied group's two uses land separately, so the second is staged and added on the
    host (two backward stages on several devices, or a given plan; one device with an automatic
    plan keeps the first use's gradient on the device instead).
    """
    out = dict.fromkeys(HOST_KINDS, 0)
    copies = 2 if optim_step == "async" else 1

    def take(kind: str, numel: int, dtype: torch.dtype, *, exact: bool) -> None:
        nbytes, rounding = alloc_nbytes(numel, dtype, pin_mode=pin_mode, pinned=pinned, exact=exact)
        out[kind] += nbytes
        out["pinned_rounding"] += rounding

    tied = {g.index for g in layout.tied_groups()}
    for g in layout.groups:
        if pin_mode == "alloc":
            take("weights", g.numel, g.compute_dtype, exact=False)
        else:
            out["weights"] += g.numel * g.compute_dtype.itemsize  # per tensor, page-locked in place
        if copies == 2:
            take("weights_stale", g.numel, g.compute_dtype, exact=False)
        if not g.trainable:
            continue
        if not g.shares_master:
            out["master"] += g.numel * g.grad_dtype.itemsize
        for _ in range(copies):
            take("grad", g.numel, g.grad_dtype, exact=True)
        if g.index in tied and tied_staging:
            take("grad_staging", g.numel, g.grad_dtype, exact=True)
        for key in optimizer_states:
            out[f"optim.{key}"] += g.numel * g.grad_dtype.itemsize
    buffers = {id(b): b for info in layout.layers for _, _, b in info.buffer_slots}
    out["buffers"] = sum(b.numel() * b.element_size() for b in buffers.values())
    return out


def activation_host_bytes(
    plan: ModelExecutePlan,
    *,
    recompute_grain: Literal["stage", "layer"],
    num_microbatches: int,
    tokens_per_microbatch: int,
    hidden_size: int,
    compute_dtype: torch.dtype,
    pinned: bool,
) -> int:
    """Estimated peak host bytes of stage inputs parked between stages during one step.

    The backward's saved inputs (each later backward stage's first layer, or every layer of
    them with `layer` grain) stay from forward until their backward, for every micro-batch;
    about two more boundaries are in flight (the forward's next input, the backward's input
    gradients). Each parked tensor is a pinned-allocator buffer on a GPU machine (rounded up).
    """
    later = plan.bwd_plan[1:]
    saved = [s.start for s in later] if recompute_grain == "stage" else [i for s in later for i in s]
    per_boundary = 0
    for numel, dtype in (
        (tokens_per_microbatch * hidden_size, compute_dtype),
        (tokens_per_microbatch, torch.int64),
    ):
        nbytes, rounding = alloc_nbytes(numel, dtype, pin_mode="alloc", pinned=pinned, exact=False)
        per_boundary += nbytes + rounding
    return (len(saved) + 2) * num_microbatches * per_boundary


def bytes_per_param(by_kind: dict[str, int], num_params: int) -> float:
    """Model-state bytes per parameter (module buffers and activations left out)."""
    return sum(v for k, v in by_kind.items() if k not in NOT_PER_PARAM) / num_params


def predict_engine_host_bytes(
    model: nn.Module,
    *,
    optim: Any,
    compute_dtype: torch.dtype = torch.bfloat16,
    optimizer_dtype: torch.dtype = torch.float32,
    pin_model: PinMode = "alloc",
    optim_step: Literal["sync", "async"] = "sync",
    pinned: bool,
    recompute_grain: Literal["stage", "layer"] = "stage",
    num_microbatches: int | None = None,
    max_tokens_per_mb: int | None = None,
    model_memory_limit: float | None = None,
    min_stages: int | None = None,
    num_devices: int = 1,
    execute_plan: ModelExecutePlan | None = None,
    loss_chunk_size: int | None = None,
) -> dict[str, int]:
    """Host bytes a `RoundPipeEngine` with these arguments will hold, by kind, without allocating.

    `model` may have its parameters on the meta device (`meta_params`). `optim` is the
    engine's `OptimSettings`. With `num_microbatches` and `max_tokens_per_mb`, the stage plan
    the engine would make (or `execute_plan`) gives an `activations` estimate too.
    """
    layout = _layout(model, optim, compute_dtype, optimizer_dtype)
    states = optimizer_state_keys(optim.type, getattr(optim, "momentum", 0.0))
    out = planned_host_bytes(
        layout, pin_mode=pin_model, pinned=pinned, optim_step=optim_step, optimizer_states=states,
        tied_staging=num_devices > 1 or execute_plan is not None,  # see `RoundPipeEngine.forward_backward`
    )  # fmt: skip
    if num_microbatches and max_tokens_per_mb:
        plan = execute_plan or ModelExecutePlan.auto(
            "fused", _LayoutPlanView(layout, num_devices, loss_chunk_size), model_memory_limit=model_memory_limit,
            min_stages=min_stages, tokens_per_microbatch=max_tokens_per_mb, recompute_grain=recompute_grain,
        )  # fmt: skip
        out["activations"] = activation_host_bytes(
            plan, recompute_grain=recompute_grain, num_microbatches=num_microbatches,
            tokens_per_microbatch=max_tokens_per_mb, hidden_size=int(cast(Any, model).config.hidden_size),
            compute_dtype=compute_dtype, pinned=pinned,
        )  # fmt: skip
    return out


def predict_engine_gpu_bytes(
    model: nn.Module,
    *,
    optim: Any,
    compute_dtype: torch.dtype = torch.bfloat16,
    optimizer_dtype: torch.dtype = torch.float32,
    recompute_grain: Literal["stage", "layer"] = "stage",
    max_tokens_per_mb: int | None = None,
    model_memory_limit: float | None = None,
    gpu_capacity: int | None = None,
    min_stages: int | None = None,
    num_devices: int = 1,
    loss_chunk_size: int | None = None,
) -> tuple[int, ModelExecutePlan]:
    """The device peak of one training step of a `RoundPipeEngine` with these arguments, and its plan.

    The plan is the one the engine makes (`ModelExecutePlan.auto("fused", ...)` over the same
    per-layer costs); its limit is `model_memory_limit`, else 60% of `gpu_capacity` bytes (the
    engine's default on that GPU), else of this machine's first device. The peak is
    `plan.device_peak_bytes`: two stages resident at once, from the same byte counts.
    """
    from laden.engine.roundpipe.plan import DEFAULT_MEMORY_FRACTION, device_peak_bytes

    view = _LayoutPlanView(
        _layout(model, optim, compute_dtype, optimizer_dtype), num_devices, loss_chunk_size
    )
    limit = model_memory_limit
    if limit is None and gpu_capacity is not None:
        limit = DEFAULT_MEMORY_FRACTION * gpu_capacity / (1 << 30)
    plan = ModelExecutePlan.auto(
        "fused", view, model_memory_limit=limit, min_stages=min_stages, tokens_per_microbatch=max_tokens_per_mb,
        recompute_grain=recompute_grain,
    )  # fmt: skip
    peak = device_peak_bytes(
        plan, view, tokens_per_microbatch=max_tokens_per_mb, recompute_grain=recompute_grain
    )
    return peak, plan


def _layout(
    model: nn.Module, optim: Any, compute_dtype: torch.dtype, optimizer_dtype: torch.dtype
) -> HostLayout:
    from laden.model.split import split_causal_lm
    from laden.optim import is_no_decay

    return HostLayout(
        list(split_causal_lm(model).layers), param_names={id(p): n for n, p in model.named_parameters()},
        compute_dtype=compute_dtype, master_dtype=optim.master_dtype(optimizer_dtype), group_key=is_no_decay,
    )  # fmt: skip


class _LayoutPlanView:
    """What `ModelExecutePlan.auto` asks of a pipeline, answered from a layout (nothing allocated)."""

    def __init__(self, layout: HostLayout, num_devices: int, loss_chunk_size: int | None) -> None:
        self.layout, self.num_devices, self.loss_chunk_size = layout, num_devices, loss_chunk_size

    @property
    def num_layers(self) -> int:
        return len(self.layout.layers)

    def layer_bytes(self, *, with_grads: bool) -> list[int]:
        return self.layout.layer_bytes(with_grads=with_grads)

    def default_memory_limit_gib(self) -> float:
        devices = (
            [torch.device("cuda", i) for i in range(self.num_devices)] if torch.cuda.is_available() else []
        )
        return default_memory_limit_gib(devices or [torch.device("cpu")])

    def layer_activation_bytes(self, num_tokens: int) -> list[tuple[int, int]]:
        from laden.engine.roundpipe.pipeline import layer_activation_bytes

        return layer_activation_bytes(self.layout.layers, num_tokens, self.loss_chunk_size)


@contextlib.contextmanager
def meta_params() -> Iterator[None]:
    """Inside: every parameter a module registers is moved to the meta device; buffers stay real.

    Builds a model skeleton (say `AutoModelForCausalLM.from_config`) without holding its
    weights: each parameter's storage is dropped as it is registered, and rotary tables and
    other buffers are computed as usual. Not thread-safe (it patches `nn.Module`).
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
