"""AdamW over parameter shards with host-resident states: a host step, or a per-layer streamed device step.

Two uses, one state layout (`exp_avg`, `exp_avg_sq`, and `comp` for the Kahan bf16
variant, each shaped like the rank's local shard, in host memory, page-locked on a GPU
machine):

- host step (`actor.fsdp.offload_params` without `per_layer_optim_step`): parameters and
  gradients are already on the host (FSDP's CPU offload policy); the update runs there with
  the vectorized C++ kernel of `laden.optim` (`HostAdamW`'s kernels), one tensor at a time.
- streamed step (`actor.fsdp.per_layer_optim_step`): the CPU Adam is memory-bound and slow
  for billions of parameters, so the update runs on the device instead, one layer group at a
  time: a side stream uploads the states of the next `prefetch_layers` groups (and their
  parameters and gradients when those are offloaded) while the current group is updated
  with foreach kernels, and another side stream copies the results back. The device holds
  at most `prefetch_layers + 1` groups of states. With `offload_params: false` only states
  travel; with `true` parameters and gradients travel too.

On a CPU-only machine the "device" is the host and the copies are no-ops, so the streamed
code path runs (and is tested) unchanged. The same path with `states_on_host=False` is a
plain device-resident AdamW over local shards, which is how the Kahan bf16 variant runs
under FSDP (its foreach kernels need plain tensors, not DTensors).

States are exported keyed by parameter FQN, wrapped as DTensors like their parameters, so
`torch.distributed.checkpoint` reshards them exactly as it does `torch.optim` states.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from laden.optim.adamw_foreach import adamw_foreach_, adamw_kahan_foreach_, adamw_scalars
from laden.optim.cpu_adam import adamw_bf16_kahan_step_, adamw_step_
from laden.optim.state import load_named_state, named_state

_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's shard of a (possibly) DTensor, sharing storage."""
    return t._local_tensor if isinstance(t, DTensor) else t


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW (or Kahan bf16 AdamW) with host states; see the module docstring."""

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        kahan_bf16: bool = False,
        streamed: bool = False,
        states_on_host: bool = True,
        device: torch.device,
        layer_groups: list[list[nn.Parameter]] | None = None,
        prefetch_layers: int = 1,
    ) -> None:
        if prefetch_layers < 0:
            raise ValueError(
                f"actor.fsdp.optim_step_prefetch_layers={prefetch_layers} must be >= 0 (1 is the default)"
            )
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.kahan_bf16 = kahan_bf16
        self.streamed = streamed
        self.states_on_host = states_on_host
        self.device = device
        self.prefetch_layers = prefetch_layers
        self._pin = device.type == "cuda" and states_on_host
        all_params = [p for g in self.param_groups for p in g["params"]]
        self.layer_groups = layer_groups if layer_groups is not None else [all_params]
        self._group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        expected = {id(p) for p in all_params}
        listed = {id(p) for layer in self.layer_groups for p in layer}
        if listed != expected:
            raise RuntimeError("layer_groups must list every optimized parameter exactly once")

    # ---------------------------------------------------------------- states

    def init_state(self, p: nn.Parameter) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            local = _local(p)
            dtype = torch.bfloat16 if self.kahan_bf16 else torch.float32
            keys = _STATE_KEYS + (("comp",) if self.kahan_bf16 else ())
            state["step"] = 0
            for key in keys:
                device = "cpu" if self.states_on_host else local.device
                state[key] = torch.zeros(local.shape, dtype=dtype, device=device, pin_memory=self._pin)
        return state

    def _hparams(self, p: nn.Parameter, step: int) -> dict[str, Any]:
        g = self._group_of[id(p)]
        beta1, beta2 = g["betas"]
        return {
            "step": step,
            "lr": g["lr"],
            "beta1": beta1,
            "beta2": beta2,
            "eps": g["eps"],
            "weight_decay": g["weight_decay"],
        }

    # ----------------------------------------------------------------- steps

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardedAdamW.step takes no closure")
        if self.streamed:
            self._streamed_step()
        else:
            self._host_step()

    def _host_step(self) -> None:
        for layer in self.layer_groups:
            for p in layer:
                if p.grad is None or not _local(p).numel():
                    continue
                param, grad = _local(p), _local(p.grad)
                if param.device.type != "cpu":
                    raise RuntimeError(
                        "the host AdamW step needs parameters on the host; use offload_params or "
                        "per_layer_optim_step"
                    )
                state = self.init_state(p)
                state["step"] += 1
                h = self._hparams(p, state["step"])
                if self.kahan_bf16:
                    adamw_bf16_kahan_step_(
                        param, state["comp"], grad, state["exp_avg"], state["exp_avg_sq"], **h
                    )
                else:
                    adamw_step_(param, grad, state["exp_avg"], state["exp_avg_sq"], **h)

    def _streamed_step(self) -> None:
        # Ranks whose shard of a small tensor is empty (FSDP pads unevenly) have nothing to update.
        layers = [
            [p for p in layer if p.grad is not None and _local(p).numel()] for layer in self.layer_groups
        ]
        layers = [layer for layer in layers if layer]
        streams = _Streams(self.device)
        uploads: dict[int, _Resident] = {}
        for i in range(len(layers)):
            for j in range(i, min(i + 1 + self.prefetch_layers, len(layers))):
                if j not in uploads:
                    uploads[j] = self._upload(layers[j], streams)
            resident = uploads.pop(i)
            streams.wait_upload(resident)
            self._update_on_device(layers[i], resident)
            self._download(resident, streams)
        # Deliberate sync: host states (and offloaded params) must be final before the
        # next forward or the next step reads them.
        streams.synchronize()

    def _upload(self, layer: list[nn.Parameter], streams: _Streams) -> _Resident:
        resident = _Resident(layer)
        with streams.upload():
            for p in layer:
                state = self.init_state(p)
                keys = _STATE_KEYS + (("comp",) if self.kahan_bf16 else ())
                assert p.grad is not None  # filtered by the caller
                resident.host.append([_local(p), _local(p.grad)] + [state[k] for k in keys])
                resident.device.append([t.to(self.device, non_blocking=True) for t in resident.host[-1]])
            resident.event = streams.record_upload()
        return resident

    def _update_on_device(self, layer: list[nn.Parameter], resident: _Resident) -> None:
        batches: dict[tuple[int, int], list[int]] = {}
        for k, p in enumerate(layer):
            state = self.init_state(p)
            state["step"] += 1
            batches.setdefault((id(self._group_of[id(p)]), state["step"]), []).append(k)
        for idx in batches.values():
            h = self._hparams(layer[idx[0]], self.state[layer[idx[0]]]["step"])
            scalars = adamw_scalars(
                step=h["step"],
                lr=h["lr"],
                beta1=h["beta1"],
                beta2=h["beta2"],
                eps=h["eps"],
                weight_decay=h["weight_decay"],
            )
            cols = list(zip(*(resident.device[k] for k in idx)))
            if self.kahan_bf16:
                param, grad, m, v, comp = cols
                adamw_kahan_foreach_(param, comp, grad, m, v, scalars)
            else:
                param, grad, m, v = cols
                adamw_foreach_(param, grad, m, v, scalars)

    def _download(self, resident: _Resident, streams: _Streams) -> None:
        with streams.download():
            for host, device in zip(resident.host, resident.device):
                # The grad (index 1) is consumed, not written back.
                for k, (h, d) in enumerate(zip(host, device)):
                    if k != 1 and h is not d:
                        h.copy_(d, non_blocking=True)
                streams.keep_alive(device)

    # ------------------------------------------------------------ checkpoint

    def fqn_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """`laden.optim.state.named_state` with DTensor states laid out like their parameters (DCP's format)."""
        names = {id(p): n for n, p in model.named_parameters()}
        return named_state(self, names, wrap=_like_param)

    def load_fqn_state_dict(self, model: nn.Module, state_dict: dict[str, Any]) -> None:
        load_named_state(self, {id(p): n for n, p in model.named_parameters()}, state_dict)


def _like_param(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Wrap a host state shard as a DTensor laid out like parameter `p` (storage shared)."""
    if not isinstance(p, DTensor):
        return value
    return DTensor.from_local(
        value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


class _Resident:
    """One layer group's tensors: host originals and their device copies (same order)."""

    def __init__(self, layer: list[nn.Parameter]) -> None:
        self.layer = layer
        self.host: list[list[torch.Tensor]] = []
        self.device: list[list[torch.Tensor]] = []
        self.event: Any = None


class _Streams:
    """Upload/download side streams on CUDA; plain in-order execution elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.up = torch.cuda.Stream(device)
            self.down = torch.cuda.Stream(device)

    def upload(self):
        return torch.cuda.stream(self.up) if self.cuda else contextlib.nullcontext()

    def record_upload(self):
        return self.up.record_event() if self.cuda else None

    def wait_upload(self, resident: _Resident) -> None:
        if self.cuda:
            self.compute.wait_event(resident.event)
            for tensors in resident.device:
                for t in tensors:
                    t.record_stream(self.compute)  # allocated on the upload stream, used here

    def download(self):
        if not self.cuda:
            return contextlib.nullcontext()
        self.down.wait_stream(self.compute)  # the update must finish before copying back
        return torch.cuda.stream(self.down)

    def keep_alive(self, tensors: list[torch.Tensor]) -> None:
        if self.cuda:
            for t in tensors:
                t.record_stream(self.down)

    def synchronize(self) -> None:
        if self.cuda:
            self.down.synchronize()
