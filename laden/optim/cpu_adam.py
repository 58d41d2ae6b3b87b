"""Host (CPU) AdamW for the offloaded engines: fp32 master weights, or bf16 + Kahan states.

The roundpipe engine keeps master weights, gradients and Adam states in host memory and
updates them on the CPU layer by layer while the GPU runs the backward of earlier layers.
Two backends compute the same math:

- "cpp": the fused, vectorized, OpenMP kernels of `csrc/cpu_adam.cpp`, built lazily on first
  use (`cpu_adam_ext.py`). One pass over memory per tensor; it can also write the bf16 upload
  copy of the updated fp32 param in that pass. The GIL is released while it runs.
- "torch": used when the build fails (no compiler, no ninja; a warning says why, once) or
  when `LADEN_CPU_ADAM=torch`. fp32 states run PyTorch's fused CPU AdamW
  (`torch._fused_adamw_`, what `torch.optim.AdamW(fused=True)` calls): as fast as the cpp
  kernel and its params equal the cpp kernel's bit for bit, where the `torch._foreach_*` math
  (`adamw_foreach.py`) is 5-10x slower (`benchmarks/RESULTS.md`, "Host AdamW: fused"). A bf16
  grad costs one fp32 copy first; the bf16 upload copy a second pass. bf16 + Kahan states
  have no fused PyTorch kernel and keep the foreach math (about 30x slower than cpp).
  `LADEN_CPU_ADAM=cpp` makes a failed build an error instead of a fallback.

The cpp and fused kernels take contiguous CPU tensors (the fused one silently computes wrong
values on a strided view); a call with anything else (a strided view, a CUDA tensor) takes
the foreach path for that call, so the functional API works everywhere.

`HostAdamW` keeps one step counter per parameter, so `step_params(layer_params)` can update
a layer as soon as its gradients are complete, in any order, and a full round of partial
steps equals one `step()` bit for bit.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch

from laden.optim import cpu_adam_ext
from laden.optim.adam_bf16 import normalize_step_state, validate_adamw_hparams
from laden.optim.adamw_foreach import adamw_foreach_, adamw_kahan_foreach_, adamw_scalars

Backend = Literal["cpp", "torch"]
_ENV = "LADEN_CPU_ADAM"
_logger = logging.getLogger(__name__)
_warned_fallback = False


def _requested_backend(backend: str | None) -> str:
    requested = backend if backend is not None else os.environ.get(_ENV, "auto")
    if requested not in ("auto", "cpp", "torch"):
        source = "backend" if backend is not None else _ENV
        raise ValueError(f"{source}={requested!r} is not a CPU Adam backend; use 'auto', 'cpp' or 'torch'")
    return requested


def resolve_backend(backend: str | None = None) -> Backend:
    """The backend a call will use: `backend` if given, else `$LADEN_CPU_ADAM`, else auto."""
    global _warned_fallback
    requested = _requested_backend(backend)
    if requested == "torch":
        return "torch"
    library, error = cpu_adam_ext.load_library()
    if library is not None:
        return "cpp"
    if requested == "cpp":
        raise RuntimeError(
            f"the CPU Adam extension could not be built ({error}); use backend 'torch' or 'auto' "
            f"(unset {_ENV}) to fall back to the PyTorch implementation"
        )
    if not _warned_fallback:
        _warned_fallback = True
        _logger.warning("CPU Adam extension unavailable (%s); using the slower torch backend", error)
    return "torch"


def backend_name() -> Backend:
    """Return "cpp" when the extension is in use, else "torch" (builds the extension if needed)."""
    return resolve_backend(None)


def _kernel_ready(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _check_aligned(names: Sequence[str], tensors: Sequence[torch.Tensor], dtypes: Sequence[tuple]) -> None:
    numel, device = tensors[0].numel(), tensors[0].device
    for name, t, allowed in zip(names, tensors, dtypes):
        if t.dtype not in allowed:
            raise ValueError(f"{name} has dtype {t.dtype}; expected one of {allowed}")
        if t.numel() != numel or t.device != device:
            raise ValueError(
                f"{name} has {t.numel()} elements on {t.device}; expected {numel} on {device} like {names[0]}"
            )


def _run_kernel(fn: Any, *args: Any) -> None:
    if fn(*args) != 0:
        raise RuntimeError("CPU Adam kernel rejected its arguments (unsupported grad dtype)")


_F32 = (torch.float32,)
_BF16 = (torch.bfloat16,)
_GRAD = (torch.float32, torch.bfloat16)


@torch.no_grad()
def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    param_out_bf16: torch.Tensor | None = None,
    num_threads: int | None = None,
    backend: Backend | None = None,
) -> None:
    """One AdamW step in place on an fp32 param and fp32 moments; `grad` fp32 or bf16.

    `step` is the step number after incrementing (1 on the first update). When
    `param_out_bf16` is given it receives `param.to(torch.bfloat16)` after the update.
    """
    tensors = [param, grad, exp_avg, exp_avg_sq]
    names = ["param", "grad", "exp_avg", "exp_avg_sq"]
    dtypes = [_F32, _GRAD, _F32, _F32]
    if param_out_bf16 is not None:
        tensors, names, dtypes = tensors + [param_out_bf16], names + ["param_out_bf16"], dtypes + [_BF16]
    _check_aligned(names, tensors, dtypes)
    s = adamw_scalars(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    if resolve_backend(backend) == "cpp" and _kernel_ready(*tensors):
        library, _ = cpu_adam_ext.load_library()
        out_ptr = param_out_bf16.data_ptr() if param_out_bf16 is not None else None
        _run_kernel(
            library.laden_adamw_fp32,  # type: ignore[union-attr]
            param.data_ptr(), grad.data_ptr(), int(grad.dtype == torch.bfloat16),
            exp_avg.data_ptr(), exp_avg_sq.data_ptr(), out_ptr, param.numel(),
            *s, num_threads or torch.get_num_threads(),
        )  # fmt: skip
        return
    outs = [param_out_bf16] if param_out_bf16 is not None else None
    if _kernel_ready(*tensors):
        h = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
        adamw_fused_cpu_([param], [grad], [exp_avg], [exp_avg_sq], step=step, **h, params_out_bf16=outs)
        return
    adamw_foreach_([param], [grad], [exp_avg], [exp_avg_sq], s, params_out_bf16=outs)


@torch.no_grad()
def adamw_fused_cpu_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    params_out_bf16: Sequence[torch.Tensor] | None = None,
) -> None:
    """One AdamW step on contiguous fp32 CPU params and moments with PyTorch's fused CPU kernel.

    Grads fp32 or bf16 (a bf16 grad is copied to fp32 first: the kernel takes the param's
    dtype); `params_out_bf16` receives the updated params in bf16 after the update.
    """
    steps = [torch.tensor(float(step))] * len(params)  # read, not incremented, by the kernel
    fp32_grads = [g.float() for g in grads]
    torch._fused_adamw_(
        list(params), fp32_grads, list(exp_avgs), list(exp_avg_sqs), [], steps, amsgrad=False,
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, maximize=False,
    )  # fmt: skip
    if params_out_bf16:
        torch._foreach_copy_(list(params_out_bf16), list(params))


@torch.no_grad()
def adamw_bf16_kahan_step_(
    param_bf16: torch.Tensor,
    comp_bf16: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_bf16: torch.Tensor,
    exp_avg_sq_bf16: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    num_threads: int | None = None,
    backend: Backend | None = None,
) -> None:
    """One Kahan-compensated AdamW step on bf16 storage (same math as `AdamWBF16`)."""
    tensors = [param_bf16, comp_bf16, grad, exp_avg_bf16, exp_avg_sq_bf16]
    names = ["param_bf16", "comp_bf16", "grad", "exp_avg_bf16", "exp_avg_sq_bf16"]
    _check_aligned(names, tensors, [_BF16, _BF16, _GRAD, _BF16, _BF16])
    s = adamw_scalars(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    if resolve_backend(backend) == "cpp" and _kernel_ready(*tensors):
        library, _ = cpu_adam_ext.load_library()
        _run_kernel(
            library.laden_adamw_bf16_kahan,  # type: ignore[union-attr]
            param_bf16.data_ptr(), comp_bf16.data_ptr(), grad.data_ptr(),
            int(grad.dtype == torch.bfloat16), exp_avg_bf16.data_ptr(), exp_avg_sq_bf16.data_ptr(),
            param_bf16.numel(), *s, num_threads or torch.get_num_threads(),
        )  # fmt: skip
        return
    adamw_kahan_foreach_([param_bf16], [comp_bf16], [grad], [exp_avg_bf16], [exp_avg_sq_bf16], s)


def _pinning_available() -> bool:
    return torch.cuda.is_available()


class HostAdamW(torch.optim.Optimizer):
    """AdamW over host-resident params, with per-parameter partial steps (`step_params`).

    `state_dtype=torch.float32`: fp32 params, fp32 `exp_avg`/`exp_avg_sq` (16 B/param with the
    grad), grads fp32 or bf16. `state_dtype=torch.bfloat16`: bf16 params, bf16 moments and a
    bf16 Kahan buffer `comp` (8 B/param), the `adam_bf16` math. `pin_memory=True` allocates the
    states in page-locked memory (ignored with a warning when no CUDA device is present).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        state_dtype: torch.dtype = torch.float32,
        pin_memory: bool = False,
        num_threads: int | None = None,
        backend: Backend | None = None,
    ) -> None:
        validate_adamw_hparams(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"state_dtype={state_dtype} is not supported; use torch.float32 or torch.bfloat16"
            )
        if pin_memory and not _pinning_available():
            _logger.warning("HostAdamW(pin_memory=True) ignored: no CUDA device to pin memory for")
            pin_memory = False
        self.state_dtype = state_dtype
        self.pin_memory = pin_memory
        self.num_threads = num_threads
        self.backend: Backend = resolve_backend(backend)
        self._group_of: dict[int, dict[str, Any]] = {}
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for i, p in enumerate(group["params"]):
            if p.device.type != "cpu" or p.dtype != self.state_dtype:
                raise ValueError(
                    f"HostAdamW param {i} of group {len(self.param_groups) - 1} is {p.dtype} on {p.device}; "
                    f"with state_dtype={self.state_dtype} params must be {self.state_dtype} CPU tensors"
                )
            self._group_of[id(p)] = group

    def _new_buffer(self, p: torch.Tensor) -> torch.Tensor:
        return torch.zeros(p.shape, dtype=self.state_dtype, pin_memory=self.pin_memory)

    def init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = self._new_buffer(p)
            state["exp_avg_sq"] = self._new_buffer(p)
            if self.state_dtype == torch.bfloat16:
                state["comp"] = self._new_buffer(p)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # torch replaces every group dict on load: re-point params at the live groups, or
        # step_params would keep reading the old hyper-parameters (an LR schedule's included).
        self._group_of = {id(p): group for group in self.param_groups for p in group["params"]}
        normalize_step_state(self.state)
        if self.pin_memory:
            for param_state in self.state.values():
                for key, value in param_state.items():
                    if isinstance(value, torch.Tensor) and not value.is_pinned():
                        param_state[key] = value.pin_memory()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_params(p for group in self.param_groups for p in group["params"])
        return loss

    @torch.no_grad()
    def step_params(
        self,
        params: Iterable[torch.Tensor],
        grads: Sequence[torch.Tensor | None] | None = None,
        params_out_bf16: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        """Update only `params` (each at most once per call), with their group's hyper-parameters.

        `grads` defaults to each param's `.grad` (a bf16 grad for an fp32 param must be passed
        here: `.grad` must match the param's dtype); params whose grad is None are skipped.
        `params_out_bf16[i]`, for fp32 state only, receives the updated param in bf16.
        """
        params = list(params)
        grads = [p.grad for p in params] if grads is None else list(grads)
        outs = [None] * len(params) if params_out_bf16 is None else list(params_out_bf16)
        if not len(grads) == len(outs) == len(params):
            raise ValueError(
                f"step_params got {len(params)} params, {len(grads)} grads and {len(outs)} "
                "params_out_bf16; pass one of each per param"
            )
        if self.state_dtype == torch.bfloat16 and any(o is not None for o in outs):
            raise ValueError(
                "params_out_bf16 needs state_dtype=torch.float32: bf16 params are their own copy"
            )
        work = []
        for p, g, out in zip(params, grads, outs):
            if g is None:
                continue
            group = self._group_of.get(id(p))
            if group is None:
                raise ValueError("step_params got a tensor that is not a param of this HostAdamW")
            _check_aligned(["param", "grad"], [p, g], [(p.dtype,), _GRAD])
            if out is not None:
                _check_aligned(["param", "param_out_bf16"], [p, out], [_F32, _BF16])
            state = self.init_state(p)
            state["step"] += 1
            work.append((p, g, out, group, state))
        if self.backend == "cpp":
            self._step_cpp(work)
        else:
            self._step_torch(work)

    def _hparams(self, group: dict[str, Any], step: int) -> dict[str, Any]:
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        return {"step": step, "lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": wd}

    def _step_cpp(self, work: list[tuple]) -> None:
        for p, g, out, group, state in work:
            h = self._hparams(group, state["step"])
            m, v = state["exp_avg"], state["exp_avg_sq"]
            if self.state_dtype == torch.bfloat16:
                adamw_bf16_kahan_step_(
                    p, state["comp"], g, m, v, **h, num_threads=self.num_threads, backend="cpp"
                )
            else:
                adamw_step_(p, g, m, v, **h, param_out_bf16=out, num_threads=self.num_threads, backend="cpp")

    def _step_torch(self, work: list[tuple]) -> None:
        # One call per (group, step count, has bf16 copy, contiguous): the scalars are shared.
        batches: dict[tuple[int, int, bool, bool], list[tuple]] = {}
        for item in work:
            p, g, out, group, state = item
            ready = _kernel_ready(
                p, g, state["exp_avg"], state["exp_avg_sq"], *([out] if out is not None else [])
            )
            batches.setdefault((id(group), state["step"], out is not None, ready), []).append(item)
        for (_, step, has_out, ready), items in batches.items():
            h = self._hparams(items[0][3], step)
            params = [it[0] for it in items]
            grads = [it[1] for it in items]
            m = [it[4]["exp_avg"] for it in items]
            v = [it[4]["exp_avg_sq"] for it in items]
            outs = [it[2] for it in items] if has_out else None
            if self.state_dtype == torch.bfloat16:
                comps = [it[4]["comp"] for it in items]
                adamw_kahan_foreach_(params, comps, grads, m, v, adamw_scalars(**h))
            elif ready:
                adamw_fused_cpu_(params, grads, m, v, **h, params_out_bf16=outs)
            else:
                adamw_foreach_(params, grads, m, v, adamw_scalars(**h), params_out_bf16=outs)
