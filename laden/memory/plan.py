"""`laden plan`: the predicted GPU and host peaks of every phase of a config, against the budgets.

    laden plan --config X.yaml [--gpu-mem 24GiB] [--host-mem 128GiB] [--plot out.png] [--gpus N] [--profile]
               [--json out.json] [dotted overrides]

One table per phase (`laden.memory.estimate`): each component's bytes on one rank, marked
exact (what the engine allocates) or estimated, the phase's totals, and against each budget
(default: this machine's GPU and host memory; without a GPU, `--gpu-mem` or none) whether it
fits and, when it does not, the component that binds and the knob changes that fix it, with
values for this config (the engine's backend object, `laden.engine.backend`). Without a GPU to
plan for (none here and no `--gpu-mem`) the engines run on the CPU: one column, host, holding the
model states, the activations and the process's own baseline (`on_the_cpu`). `--plot` draws each
phase's GPU and host bytes as stacked bars, one segment per component, with the budgets as lines
(needs matplotlib). `--gpus N` suggests the fastest `actor.backend` / `rollout.backend` predicted
to fit N GPUs (`suggest_backends`); `--profile` runs each phase once at its worst case and prints
the measured peaks beside the predicted (`laden.memory.profile`); `--json` writes both.
"""

from __future__ import annotations

import re
from typing import Any

from laden.memory.estimate import GIB, PhaseEstimate, host_memory_bytes

_SIZE = re.compile(r"^\s*([\d.]+)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*$", re.IGNORECASE)
_UNIT = {
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_size(text: str, *, option: str) -> int:
    """`24GiB`, `80GB`, `512MiB`, `1.5TiB` (a bare number is GiB) -> bytes."""
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"{option}={text!r} is not a size; write e.g. 24GiB, 80GB or 512MiB")
    return int(float(m.group(1)) * _UNIT[(m.group(2) or "GiB").lower()])


def default_budgets() -> tuple[int | None, int | None]:
    """(this machine's first GPU, or None; its host memory)."""
    import torch

    from laden.memory.auto import process_gpu_bytes

    gpu = process_gpu_bytes(torch.device("cuda", 0)) if torch.cuda.is_available() else None
    return gpu, host_memory_bytes()


def render(
    phases: list[PhaseEstimate], cfg: Any, *, gpu_budget: int | None, host_budget: int | None
) -> tuple[str, bool]:
    """The plan as text, and whether every phase fits both budgets."""
    lines: list[str] = []
    fits = True
    largest = max((max(p.gpu, p.host) for p in phases), default=0)
    unit, scale = ("GiB", GIB) if largest >= GIB else ("MiB", 2**20)
    cpu = bool(phases) and all(p.on_cpu for p in phases)  # one column: the host holds everything

    def row(name: str, gpu: int, host: int) -> str:
        cells = f"{host / scale:>9.2f}" if cpu else f"{gpu / scale:>9.2f} {host / scale:>9.2f}"
        return f"  {name:<52} {cells}"

    for phase in phases:
        lines.append(f"{phase.phase} on {phase.engine}")
        header = f"{'host ' + unit:>9}" if cpu else f"{'GPU ' + unit:>9} {'host ' + unit:>9}"
        lines.append(f"  {'component':<52} {header}")
        lines += [row(c.name, c.gpu, c.host) + ("" if c.exact else "  (estimate)") for c in phase.components]
        lines.append(row("total", phase.gpu, phase.host))
        for where, budget, total in (("GPU", gpu_budget, phase.gpu), ("host", host_budget, phase.host)):
            if budget is None or total <= budget:
                continue
            fits = False
            binding = phase.largest("gpu" if where == "GPU" else "host")
            lines.append(
                f"  over the {where} budget of {budget / GIB:.2f} GiB by {(total - budget) / GIB:.2f} GiB; "
                f"the largest part: {binding.name if binding else '?'}"
            )
            lines += [f"    fix: {fix}" for fix in _fixes(phase, where, cfg)]
        lines.append("")
    budgets = ", ".join(
        f"{name} {b / GIB:.2f} GiB"
        for name, b in (("GPU", gpu_budget), ("host", host_budget))
        if b is not None
    )
    lines.append(
        ("fits" if fits else "does not fit") + (f" ({budgets})" if budgets else " (no budget given)")
    )
    return "\n".join(lines), fits


def _fixes(phase: PhaseEstimate, where: str, cfg: Any) -> list[str]:
    from laden.memory.doctor import phase_fixes

    if not phase.on_cpu:
        return phase_fixes(cfg, phase.phase, host=where == "host")
    # an engine on the CPU: the host holds the model states and activations, so the GPU's fixes apply,
    # except offloading to the host, where everything already is
    return [fix for fix in phase_fixes(cfg, phase.phase, host=False) if "offload" not in fix]


def plot(phases: list[PhaseEstimate], path: str, *, gpu_budget: int | None, host_budget: int | None) -> None:
    """Stacked bars per phase and side (GPU, host), one segment per component; budgets as lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ValueError(f"--plot {path}: needs matplotlib ({err}); pip install matplotlib") from None
    sides = (
        [("host", host_budget)]
        if phases and all(p.on_cpu for p in phases)
        else [("gpu", gpu_budget), ("host", host_budget)]
    )
    fig, axes = plt.subplots(1, len(sides), figsize=(5.5 * len(sides), 4.5), squeeze=False)
    for ax, (side, budget) in zip(axes[0], sides, strict=True):
        for x, phase in enumerate(phases):
            bottom = 0.0
            for c in phase.components:
                value = getattr(c, side) / GIB
                if value <= 0:
                    continue
                ax.bar(
                    x, value, bottom=bottom, label=f"{phase.phase}: {c.name}", hatch="" if c.exact else "//"
                )
                bottom += value
        if budget is not None:
            ax.axhline(budget / GIB, color="black", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(phases)), [p.phase for p in phases])
        ax.set_ylabel(f"{'GPU' if side == 'gpu' else 'host'} GiB (hatched: estimated)")
        ax.legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(path: str, phases: list[PhaseEstimate], measured: list[Any], cfg: Any) -> None:
    """The plan per phase (components, totals) and, with `--profile`, what was measured, as one object."""
    import json

    from laden.memory.profile import relative_error

    by_phase = {m.phase: m for m in measured}
    out = {"backend": cfg.actor.backend, "rollout": cfg.rollout.backend, "phases": []}
    for p in phases:
        m = by_phase.get(p.phase)
        entry: dict[str, Any] = {
            "phase": p.phase, "engine": p.engine, "on_cpu": p.on_cpu, "predicted_gpu": p.gpu, "predicted_host": p.host,
            "components": [{"name": c.name, "gpu": c.gpu, "host": c.host, "exact": c.exact} for c in p.components],
        }  # fmt: skip
        if m is not None:
            entry["measured"] = m.as_dict()
            entry["gpu_error"] = relative_error(p.gpu, m.gpu)
            entry["host_error"] = relative_error(p.host, m.host)
        out["phases"].append(entry)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def suggest_backends(cfg: Any, *, gpus: int, gpu_budget: int, host_budget: int | None, job: str) -> list[str]:
    """The fastest layout predicted to fit `gpus` GPUs of `gpu_budget` bytes (and the host), as lines.

    Training, in the order laden expects them to run fastest: `fsdp:dN` without recompute, with
    `actor.gradient_checkpointing`, then `roundpipe:dN` (the model in host memory, one host store per
    process). The first whose predicted peak per rank fits `HEADROOM` of the GPU (and whose processes'
    host peaks together fit the host) is suggested. For `laden rl`: on one GPU the native engine is
    colocated; on two or more, when the trainer fits one GPU, the engine gets the second
    (`cluster.n_gpus_per_node: 2`, generation and training at once), else one engine per trainer
    process (`native:dN`).
    """
    import copy

    from laden.memory.auto import HEADROOM
    from laden.memory.companions import training_phase
    from laden.memory.estimate import ModelShapes, patched_meta_model

    limit = int(HEADROOM * gpu_budget)
    host_limit = int(HEADROOM * host_budget) if host_budget else None

    def trial(backend: str, gc: bool) -> Any:
        c = copy.deepcopy(cfg)
        c.actor.backend, c.actor.gradient_checkpointing = backend, gc
        model = patched_meta_model(c)
        return training_phase(c, model, ModelShapes.from_model(model), gpu_budget, job)

    def fits(phase: Any, procs: int) -> bool:
        return phase.gpu <= limit and (host_limit is None or phase.host * procs <= host_limit)

    def first_fit(n: int) -> tuple[str, bool, Any] | None:
        for backend, gc in ((f"fsdp:d{n}", False), (f"fsdp:d{n}", True), (f"roundpipe:d{n}", False)):
            phase = trial(backend, gc)
            if fits(phase, n):
                return backend, gc, phase
        return None

    lines = [f"suggested for {gpus} GPU(s) of {gpu_budget / GIB:.1f} GiB:"]
    layouts = [(1, "second")] if job == "rl" and gpus >= 2 else []
    layouts.append((gpus, "colocated"))
    for n, rollout in layouts:
        found = first_fit(n)
        if found is None:
            continue
        backend, gc, phase = found
        knobs = [f"actor.backend={backend}", f"actor.gradient_checkpointing={str(gc).lower()}"]
        if job == "rl" and rollout == "second":
            knobs += ["rollout.backend=native:d1", "cluster.n_gpus_per_node=2"]
            why = "the trainer fits one GPU, the native engine generates on the second while it trains"
        elif job == "rl":
            knobs.append(f"rollout.backend=native:d{n}")
            why = "one native engine per trainer process, on its GPU"
        else:
            why = "the fastest layout predicted to fit"
        lines.append(f"  {' '.join(knobs)}")
        lines.append(
            f"    ({why}; training peak {phase.gpu / GIB:.2f} GiB per GPU, host {phase.host * n / GIB:.2f} GiB)"
        )
        return lines
    lines.append(
        "  nothing fits: every layout's predicted training peak exceeds the budget; see the fixes above"
    )
    return lines
