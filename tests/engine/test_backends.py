"""Engines behind their backend objects: `actor.backend` / `rollout.backend` are read in one place each,
a fourth engine is one class and one registry line, the packages form no import cycle and the engines
never import the planner, and `laden plan` and the `auto` knobs give one answer for an engine the
planner has no memory model of."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from repo_paths import ROOT
from rl_runs import ASSETS, tiny_rl_config

from laden.cli import main
from laden.config import load_config
from laden.engine.backend import _REGISTRY, TrainBackend, register_train_backend, resolve_backend
from laden.engine.fsdp.backend import FsdpBackend
from laden.rollout.backend import resolve_rollout

pytestmark = pytest.mark.usefixtures("one_thread")

LADEN = ROOT / "laden"
RESOLVERS = {LADEN / "engine" / "backend.py", LADEN / "rollout" / "backend.py"}
PARSE = re.compile(
    r"AllocationMode\.parse\([^)]*\b(actor|rollout)\.backend"  # the allocation string parsed
    r"|\b(actor|rollout)\.backend\s*(\.(startswith|split|partition)\b|==|!=|\bin\b)"  # or picked apart
)


def test_the_backend_fields_are_parsed_by_the_two_resolvers_and_the_config_layer_only():
    sites = []
    for path in LADEN.rglob("*.py"):
        if path in RESOLVERS or path.is_relative_to(LADEN / "config"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if PARSE.search(line):
                sites.append(f"{path.relative_to(LADEN)}:{number}: {line.strip()}")
    assert sites == []


def test_the_pattern_finds_the_parse_sites_it_is_for():
    # the check above cannot pass by matching nothing
    for line in ('if cfg.actor.backend.startswith("roundpipe"):', "mode = AllocationMode.parse(cfg.rollout.backend)",
                 'cfg.rollout.backend.split(":", 1)[0]', 'if self.cfg.actor.backend == "fsdp:d1":'):  # fmt: skip
        assert PARSE.search(line), line
    assert not PARSE.search("backend = resolve_backend(cfg)")


def _imports(path: Path) -> set[str]:
    """Every laden module `path` imports, at its top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("laden.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("laden"):
            out |= {f"{node.module}.{a.name}" if node.module == "laden" else node.module for a in node.names}
    return out


def _package(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in LADEN.rglob("*.py"):
        src = _package("laden." + ".".join(path.relative_to(LADEN).with_suffix("").parts))
        graph.setdefault(src, set()).update(d for d in map(_package, _imports(path)) if d != src)
    return graph


def test_no_import_cycle_between_packages():
    graph = _package_graph()

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt == b:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    cycles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if reaches(b, a)})
    assert cycles == []
    assert "engine" in graph and "memory" in graph["cli"]  # the graph is read: cli plans


def test_the_engines_never_import_the_planner_and_the_foundation_imports_no_laden():
    engine = {str(p.relative_to(LADEN)): m for p in (LADEN / "engine").rglob("*.py") for m in _imports(p)
              if _package(m) == "memory"}  # fmt: skip
    assert engine == {}
    leaves = {"safe_io", "import_path"}  # modules of the foundation's own that import nothing of laden
    for leaf in leaves:
        assert _imports(LADEN / f"{leaf}.py") == set(), leaf
    for foundation in ("config", "data", "optim"):
        others = {m for p in (LADEN / foundation).rglob("*.py") for m in _imports(p)} - {""}
        assert {_package(m) for m in others} <= {foundation, *leaves}, foundation


def test_a_fourth_engine_is_one_class_and_one_registry_line(tmp_path, monkeypatch):
    """A toy engine registered from here trains `laden sft` (fsdp's engine under another name, counted)."""
    built = []

    class ToyBackend(FsdpBackend):
        name = "toy"

        def build(self, cfg, model, *, total_steps, device):
            built.append(self.mode.dp)
            return super().build(cfg, model, total_steps=total_steps, device=device)

    monkeypatch.setitem(_REGISTRY, "toy", lambda: ToyBackend)  # undone after the test, with the tables:
    from laden.config import alloc

    monkeypatch.setitem(alloc.BACKEND_DIMS, "actor", dict(alloc.BACKEND_DIMS["actor"]))
    monkeypatch.setitem(alloc.IMPLEMENTED_BACKENDS, "actor", alloc.IMPLEMENTED_BACKENDS["actor"])
    register_train_backend("toy", lambda: ToyBackend, dims="d")
    assert main(["sft", "--no-progress", "--config", str(ASSETS / "sft_tiny.yaml"), f"actor.path={ASSETS / 'tiny'}",
                 f"train_dataset.path={ASSETS / 'sft_tiny.jsonl'}", f"cluster.fileroot={tmp_path}",
                 "total_train_steps=2", "actor.backend=toy:d1", "valid_dataset=null"]) == 0  # fmt: skip
    assert built == [1]
    cfg = load_config(
        str(ASSETS / "sft_tiny.yaml"), [f"actor.path={ASSETS / 'tiny'}", "actor.backend=toy:d1"]
    )
    assert isinstance(resolve_backend(cfg), TrainBackend) and resolve_backend(cfg).name == "toy"


def test_each_backend_answers_for_its_engine(tmp_path):
    fsdp = resolve_backend(tiny_rl_config(tmp_path))
    roundpipe = resolve_backend(
        tiny_rl_config(tmp_path, "actor.backend=roundpipe:d1", "actor.roundpipe.num_microbatch=3")
    )
    archon = resolve_backend(tiny_rl_config(tmp_path, "actor.backend=megatron:d1"))
    assert (fsdp.name, roundpipe.name, archon.name) == (
        "fsdp",
        "roundpipe",
        "archon",
    )  # megatron runs on archon
    assert (fsdp.batches_on_host, roundpipe.batches_on_host) == (False, True)
    assert (fsdp.keeps_policy_on_host, roundpipe.keeps_policy_on_host) == (False, True)
    assert (
        roundpipe.min_micro_batches(
            tiny_rl_config(tmp_path, "actor.backend=roundpipe:d1", "actor.roundpipe.num_microbatch=3")
        )
        == 3
    )
    assert fsdp.training_estimator() is not None and archon.training_estimator() is None
    native = resolve_rollout(tiny_rl_config(tmp_path))
    servers = ("rollout.backend=vllm:d1", "cluster.n_gpus_per_node=2")
    server = resolve_rollout(tiny_rl_config(tmp_path, *servers, "actor.weight_update_mode=disk"))
    assert (native.in_process, server.in_process) == (True, False)
    assert (native.accepts_partial_updates, server.accepts_partial_updates) == (True, False)
    cpu = torch.device("cpu")
    assert native.placement(tiny_rl_config(tmp_path), cpu, world_size=1, train=fsdp) == cpu
    (xccl,) = server.refusals(tiny_rl_config(tmp_path, *servers), world_size=2)  # two processes are served
    assert "actor.weight_update_mode='xccl'" in xccl
    assert (
        server.refusals(tiny_rl_config(tmp_path, *servers, "actor.weight_update_mode=disk"), world_size=2)
        == []
    )


def test_plan_and_auto_give_one_answer_for_an_engine_without_an_estimator(tmp_path, capsys):
    """archon has no memory model: `laden plan` refuses it, and its `auto` knobs say the same and take
    their memory-saving values (before, `auto` sized them with fsdp's model while `plan` refused)."""
    from laden.memory.auto import resolve_auto

    args = [f"actor.path={ASSETS / 'tiny'}", f"train_dataset.path={ASSETS / 'rl_tiny.jsonl'}",
            "actor.backend=archon:d1", f"cluster.fileroot={tmp_path}"]  # fmt: skip
    assert main(["plan", "--config", str(ASSETS / "rl_tiny.yaml"), "--gpu-mem", "24GiB", *args]) != 0
    refused = capsys.readouterr().err
    assert "no memory estimator for the archon engine" in refused
    cfg = tiny_rl_config(tmp_path, "actor.backend=archon:d1", "actor.gradient_checkpointing=auto",
                         "actor.mb_spec.max_tokens_per_mb=auto")  # fmt: skip
    lines = resolve_auto(cfg, 24 * 2**30, host_budget=64 * 2**30, for_gpu=True)
    assert all("no memory estimator for the archon engine" in line for line in lines) and len(lines) == 2
    assert cfg.actor.gradient_checkpointing is True
    assert cfg.actor.mb_spec.max_tokens_per_mb == cfg.train_dataset.max_length + cfg.gconfig.max_new_tokens


@pytest.mark.parametrize("backend", ["fsdp:d1", "roundpipe:d1"])
def test_auto_still_plans_the_engines_with_an_estimator(tmp_path, backend):
    from laden.memory.auto import resolve_auto

    cfg = tiny_rl_config(tmp_path, f"actor.backend={backend}", "actor.mb_spec.max_tokens_per_mb=auto")
    (line,) = resolve_auto(cfg, 24 * 2**30, host_budget=64 * 2**30, for_gpu=True)
    assert line.startswith("actor.mb_spec.max_tokens_per_mb=auto -> ") and "estimator" not in line
