"""`laden doctor PATH`: what a crashed run ran out of, and the knob changes that fix it.

PATH is a run directory (its `error.log`, which a failed `laden sft` / `laden rl` writes, and
its `config.yaml`) or a text file holding a traceback: laden's own, or a plain PyTorch one
pasted from another tool's log. The diagnosis reads the error (GPU out of memory with the
allocator's figures, host allocation failure, page-locking failure, the OOM killer's exit
status), the phase from the traceback's frames (generation, training, weight update, model
load), and, given the run's config, names the fields to change with values for this run (the
same advice `oom_policy` reports at the crash: the engine's backend object, `laden.engine.backend`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laden.rollout.backend import resolve_rollout

ERROR_LOG = "error.log"

_UNITS = {"B": 1 / 2**30, "KiB": 1 / 2**20, "MiB": 1 / 2**10, "GiB": 1.0, "TiB": 2**10}
_SIZE = r"([\d.]+) (B|KiB|MiB|GiB|TiB)"
_GPU_OOM = re.compile(r"CUDA out of memory\. Tried to allocate " + _SIZE)
_CAPACITY = re.compile(r"total capacity of " + _SIZE + r" of which " + _SIZE + r" is free")
_ALLOCATED = re.compile(_SIZE + r" is allocated by PyTorch")
_UNALLOCATED = re.compile(_SIZE + r" is reserved by PyTorch but unallocated")
_HOST_OOM = (
    "DefaultCPUAllocator: can't allocate memory",
    "std::bad_alloc",
    "MemoryError",
    "Cannot allocate memory",
)
_PINNING = ("cudaHostRegister failed", "cudaHostAlloc", "pin_memory", "CUDA error: out of memory")
_KILLED = re.compile(r"(exit(?:ed)? (?:code|status)[ =:]*(?:137|-9)|Killed|signal 9|SIGKILL)")
# traceback frames -> the phase: the first match from the innermost frame outwards wins
_PHASES = (
    ("weight update", ("laden/weights/", "update_weights", "_push_weights", "write_weights")),
    ("generation", ("laden/rollout/", "generate(", "arun_episode")),
    ("model load", ("load_causal_lm", "from_pretrained", "load_model", "build_engine", "_allocate")),
    (
        "training",
        ("forward_backward", "train_batch", "optimizer_step", "backward(", "_train_on", "laden/engine/"),
    ),
)


@dataclass
class Diagnosis:
    """What ran out, in which phase, the allocator's figures, and the fixes (most effective first)."""

    kind: str
    """`GPU memory`, `host memory`, `page-locked host memory`, `killed (likely the OOM killer)` or `not a memory error`."""
    phase: str | None
    figures: dict[str, float] = field(default_factory=dict)
    fixes: list[str] = field(default_factory=list)
    source: str = ""

    def report(self) -> str:
        lines = [f"{self.source}: {self.kind}" + (f" during {self.phase}" if self.phase else "")]
        for name, gib in self.figures.items():
            lines.append(f"  {name:<28} {gib:.2f} GiB")
        if self.fixes:
            lines.append("fixes, most effective first:")
            lines += [f"  - {fix}" for fix in self.fixes]
        return "\n".join(lines)


def diagnose(path: str | Path) -> Diagnosis:
    """Read `path` (a run directory or a log file) and diagnose its failure; see the module docstring."""
    path = Path(path)
    if path.is_dir():
        log_path = path / ERROR_LOG
        if not log_path.is_file():
            raise FileNotFoundError(
                f"{path} has no {ERROR_LOG}: laden writes one when a run fails; pass the run directory of a "
                "failed run, or a file holding the traceback"
            )
        config_path = path / "config.yaml"
    elif path.is_file():
        log_path, config_path = path, path.parent / "config.yaml"
    else:
        raise FileNotFoundError(f"{path} is neither a run directory nor a log file")
    text = log_path.read_text(errors="replace")
    cfg = _load_config(config_path)
    diagnosis = classify(text, cfg)
    diagnosis.source = str(log_path)
    return diagnosis


def classify(text: str, cfg: Any = None) -> Diagnosis:
    """The diagnosis of an error text, with fixes for `cfg` (a `LadenConfig`; generic without one)."""
    phase = _phase(text)
    gpu = _GPU_OOM.search(text)
    if gpu:
        figures = {"tried to allocate": _gib(gpu.group(1), gpu.group(2))}
        for name, pattern in (
            ("allocated by PyTorch", _ALLOCATED),
            ("reserved but unallocated", _UNALLOCATED),
        ):
            m = pattern.search(text)
            if m:
                figures[name] = _gib(m.group(1), m.group(2))
        cap = _CAPACITY.search(text)
        if cap:
            figures["GPU capacity"] = _gib(cap.group(1), cap.group(2))
            figures["free at the failure"] = _gib(cap.group(3), cap.group(4))
        return Diagnosis("GPU memory", phase, figures, _gpu_fixes(cfg, phase, figures))
    if any(marker in text for marker in _PINNING) and "cudaHost" in text:
        return Diagnosis("page-locked host memory", phase, {}, _pinning_fixes(cfg))
    if any(marker in text for marker in _HOST_OOM):
        return Diagnosis("host memory", phase, {}, _host_fixes(cfg))
    if _KILLED.search(text):
        return Diagnosis("killed (likely the OOM killer: host memory)", phase, {}, _host_fixes(cfg))
    return Diagnosis("not a memory error", phase, {}, [])


def _gib(value: str, unit: str) -> float:
    return float(value) * _UNITS[unit]


def _phase(text: str) -> str | None:
    frames = re.findall(r'File "([^"]+)", line \d+, in (\S+)\n\s*(.*)', text)
    for filename, func, code in reversed(frames):  # innermost first
        where = f"{filename} {func} {code}"
        for phase, markers in _PHASES:
            if any(m in where for m in markers):
                return phase
    return None


def _load_config(path: Path) -> Any:
    if not path.is_file():
        return None
    from laden.config import load_config

    try:
        return load_config(str(path), [], job="any")
    except Exception:  # a config from another version: generic advice
        return None


def phase_fixes(cfg: Any, phase: str | None, *, host: bool) -> list[str]:
    """The knob changes for running out of host or GPU memory in `phase`, with values for `cfg`."""
    return _host_fixes(cfg) if host else _gpu_fixes(cfg, phase, {})


def _gpu_fixes(cfg: Any, phase: str | None, figures: dict[str, float]) -> list[str]:
    fixes: list[str] = []
    slack = figures.get("reserved but unallocated", 0.0)
    if slack >= max(0.5, 0.05 * figures.get("allocated by PyTorch", 0.0)):
        fixes.append(
            f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ({slack:.2f} GiB was reserved but unallocated: "
            "fragmentation)"
        )
    if cfg is None:
        return fixes + [
            "give the run's config (run directory with config.yaml) for values; in general: fewer tokens per "
            "micro-batch, recompute (gradient checkpointing), chunked loss, a bf16 optimizer, offloading"
        ]
    if phase == "generation":
        fixes.append(
            f"rollout.max_concurrent_rollouts={max(1, (cfg.rollout.max_concurrent_rollouts or 64) // 2)} "
            f"(now {cfg.rollout.max_concurrent_rollouts}): fewer sequences' KV cache and logits at once"
        )
        fixes.append(
            f"native.mem_fraction_static={round(cfg.native.mem_fraction_static * 0.8, 2)} (now "
            f"{cfg.native.mem_fraction_static}): a smaller KV cache leaves the trainer room"
        )
        return fixes
    if phase == "weight update":
        chunk = cfg.actor.weight_chunked_mem_mb
        if not (cfg.actor.weight_update_mode == "xccl" and resolve_rollout(cfg).in_process):
            # (the native engine in the trainer's process is filled tensor by tensor: no buckets)
            fixes.append(
                f"actor.weight_chunked_mem_mb={max(64, chunk // 4)} (now {chunk}): smaller update buckets"
            )
        if cfg.actor.weight_update_mode != "disk":
            fixes.append(
                "actor.weight_update_mode=disk (the engine reads the update from files, no GPU buckets)"
            )
        return fixes
    from laden.engine.backend import resolve_backend
    from laden.memory.estimate import longest_sequence, sequences_per_sample, tokens_per_microbatch

    backend = resolve_backend(cfg)
    budget = tokens_per_microbatch(cfg)  # the job's: a pair job's holds a pair's two sides
    longest = min(budget, sequences_per_sample(cfg) * longest_sequence(cfg))
    fixes += backend.oom_fixes(cfg, tokens_per_mb=budget, longest_seq=longest)
    if phase == "model load":
        fixes += backend.host_oom_fixes(cfg)[-1:]
    if cfg.oom_policy != "auto":
        fixes.append("oom_policy=auto (a failing step is re-split and retried with the same samples)")
    return fixes


def _host_fixes(cfg: Any) -> list[str]:
    if cfg is None:
        return ["give the run's config (run directory with config.yaml) for values; in general: pin less "
                "(roundpipe pin_model register or off), bf16 optimizer states, fewer parked micro-batches"]  # fmt: skip
    from laden.engine.backend import resolve_backend

    return resolve_backend(cfg).host_oom_fixes(cfg) or [
        "more host memory: the model's states are already at their smallest settings"
    ]


def _pinning_fixes(cfg: Any) -> list[str]:
    fixes = ["the locked-memory limit (ulimit -l) or the host's free memory is below what pinning asks for"]
    if cfg is not None and _backend_name(cfg) == "roundpipe":
        fixes.append(
            f"actor.roundpipe.pin_model={'register' if cfg.actor.roundpipe.pin_model == 'alloc' else 'off'} "
            f"(now {cfg.actor.roundpipe.pin_model})"
        )
    return fixes


def _backend_name(cfg: Any) -> str:
    from laden.engine.backend import resolve_backend

    return resolve_backend(cfg).name
