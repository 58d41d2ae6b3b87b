"""The example agents learning on the CPU, in a few minutes: SFT teaches the tiny model the tool format, then GRPO
with the agent raises its reward.

    PYTHONPATH=examples python -m math_agents.tiny_run tir runs/tiny_tir
    PYTHONPATH=examples python -m math_agents.tiny_run calculator runs/tiny_calculator

The model is the tiny random-init one laden embeds (`laden/assets/tiny`: two layers, a character tokenizer). The
problems are products of two two-digit numbers ("37*45="), which it cannot learn to compute in its head from a
few hundred examples, but can copy into a tool call and copy back from the tool's output. The held-out problems
share no pair of operands with the training ones (either order), checked when the files are written.

1. `laden sft` on traces written in the agent's format: for about half of the training problems, the reply
   calls the tool (the calculator's `<tool_call>` or a ```` ```python ```` block), the tool's output follows
   as it will at run time, and the next reply is the number; for the others, the reply is the number
   straight away. The model comes out calling the tool on about half of the problems.
2. `laden rl` with the agent (`math_agents.calculator:CalculatorAgent` or `math_agents.tir:TIRAgent`, code run
   in `laden.tools.sandbox`), reward 1 for a correct final answer, `export_style: concat`. The held-out
   problems are evaluated before and after with the same sampling as training (temperature 1), so that
   what is measured is what the policy does, not its single most likely reply.

What rises: the share of replies that use the tool, and how cleanly the tool call and the copied answer are
written. The printed summary gives the training reward, first steps against last steps, and the held-out
accuracy before and after.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from laden.config import load_config
from laden.data.overlap import prompt_overlap
from laden.rl.trainer import run_rl
from laden.sft.trainer import run_sft
from math_agents.calculator import CALCULATOR_TOOL, call_calculator

AGENTS = {"calculator": "math_agents.calculator:CalculatorAgent", "tir": "math_agents.tir:TIRAgent"}
ASSETS = resources.files("laden") / "assets"


@dataclass(frozen=True, slots=True)
class Settings:
    """What a run uses; the defaults are the figures in benchmarks/RESULTS.md."""

    train_problems: int = 400
    held_out_problems: int = 100
    tool_share: float = 0.5
    """Share of the SFT traces that use the tool."""
    sft_steps: int = 400
    sft_lr: float = 5e-3
    rl_steps: int = 16
    rl_lr: float = 3e-4
    rl_batch_size: int = 16
    """Prompts per RL step (each run `n_samples` times: one GRPO group)."""
    n_samples: int = 4
    seed: int = 0


def problems(settings: Settings) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(training, held-out) operand pairs: distinct unordered pairs of two-digit numbers, none in both sets."""
    rng = random.Random(settings.seed)
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < settings.train_problems + settings.held_out_problems:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        pairs.add((min(a, b), max(a, b)))
    ordered = sorted(pairs)
    rng.shuffle(ordered)
    shown = [(a, b) if rng.random() < 0.5 else (b, a) for a, b in ordered]  # either order in the prompt
    return shown[: settings.train_problems], shown[settings.train_problems :]


def question(a: int, b: int) -> str:
    return f"{a}*{b}="


def tool_turns(agent: str, a: int, b: int) -> list[dict[str, Any]]:
    """The reply that calls the tool and the tool's output, as the agent's run shows them to the model."""
    if agent == "calculator":
        name = CALCULATOR_TOOL["function"]["name"]
        arguments = {"expression": f"{a}*{b}"}
        call = "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
        return [
            {"role": "assistant", "content": call},
            {"role": "tool", "content": call_calculator(name, json.dumps(arguments))},
        ]
    # TIRAgent: the first ```python block runs in the sandbox, whose output (stdout without its final newline,
    # laden.tools.sandbox.SandboxResult.text) is the next turn.
    return [
        {"role": "assistant", "content": f"```python\nprint({a}*{b})\n```"},
        {"role": "tool", "content": str(a * b)},
    ]


def write_data(agent: str, out: Path, settings: Settings) -> dict[str, Path]:
    """sft.jsonl (traces), train.jsonl and valid.jsonl (`prompt`, `answer`) under `out`; ValueError if a held-out
    prompt is a training prompt."""
    train, held_out = problems(settings)
    rng = random.Random(settings.seed + 1)
    traces = []
    for a, b in train:
        messages = [{"role": "user", "content": question(a, b)}]
        if rng.random() < settings.tool_share:
            messages += tool_turns(agent, a, b)
        traces.append({"messages": [*messages, {"role": "assistant", "content": str(a * b)}]})
    rows = {split: [{"prompt": question(a, b), "answer": str(a * b)} for a, b in pairs]
            for split, pairs in (("train", train), ("valid", held_out))}  # fmt: skip
    overlap = prompt_overlap(rows["train"], rows["valid"])
    unordered = {frozenset(p) for p in train} & {frozenset(p) for p in held_out}
    if overlap.num_shared or unordered:
        raise ValueError(
            f"held-out problems shared with training: {overlap.num_shared} prompts, {len(unordered)} pairs"
        )
    out.mkdir(parents=True, exist_ok=True)
    paths = {"sft": out / "sft.jsonl", "train": out / "train.jsonl", "valid": out / "valid.jsonl"}
    for name, records in (("sft", traces), ("train", rows["train"]), ("valid", rows["valid"])):
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in records))
    return paths


def sft_config(out: Path, paths: dict[str, Path], settings: Settings) -> Any:
    """The embedded SFT job on the traces."""
    return load_config(str(ASSETS / "sft_tiny.yaml"), [
        f"actor.path={ASSETS / 'tiny'}", f"train_dataset.path={paths['sft']}", "valid_dataset=null",
        f"cluster.fileroot={out}", "experiment_name=warm-start", "train_dataset.max_length=192",
        "train_dataset.batch_size=32", f"total_train_steps={settings.sft_steps}", "evaluator.generate=false",
        "checkpoint.save_freq_steps=null", f"actor.optimizer.lr={settings.sft_lr}",
    ], job="sft")  # fmt: skip


def rl_config(agent: str, out: Path, model: Path, paths: dict[str, Path], settings: Settings) -> Any:
    """The embedded RL job with the agent as its workflow, from the SFT model."""
    max_tokens = 96 if agent == "calculator" else 48
    feedback = ", feedback: false" if agent == "calculator" else ""  # one answer: no second try
    run_args = f"{{system_prompt: null, max_tokens: {max_tokens}{feedback}}}"
    return load_config(str(ASSETS / "rl_tiny.yaml"), [
        f"actor.path={model}", "actor.init_from_config=false", f"train_dataset.path={paths['train']}",
        f"valid_dataset.path={paths['valid']}", f"cluster.fileroot={out}", f"experiment_name=rl-{agent}",
        f"workflow={AGENTS[agent]}", f"agent_run_args={run_args}", "max_turns=2", "export_style=concat",
        "rollout.agent.tool_call_parser=hermes",  # the tiny chat template does not render tools
        f"total_train_steps={settings.rl_steps}", f"train_dataset.batch_size={settings.rl_batch_size}",
        f"gconfig.n_samples={settings.n_samples}", f"gconfig.max_new_tokens={max_tokens}",
        "train_dataset.max_length=256", "valid_dataset.max_length=256",
        f"eval_gconfig={{temperature: 1.0, max_new_tokens: {max_tokens}}}", f"evaluator.freq_steps={settings.rl_steps}",
        f"actor.optimizer.lr={settings.rl_lr}", "checkpoint.save_freq_steps=null", "checkpoint.export_hf=false",
    ], job="rl")  # fmt: skip


@dataclass(frozen=True, slots=True)
class Summary:
    sft_loss: tuple[float, float]
    rewards: list[float]
    """Mean training reward of each RL step."""
    held_out: tuple[float, float]
    """Held-out accuracy (temperature 1) before the first RL step and after the last."""
    held_out_overlap: int

    def text(self) -> str:
        k = min(3, len(self.rewards))
        first, last = sum(self.rewards[:k]) / k, sum(self.rewards[-k:]) / k
        return (f"SFT loss {self.sft_loss[0]:.3f} -> {self.sft_loss[1]:.3f}; RL reward (mean of {k} steps) "
                f"{first:.3f} -> {last:.3f}; held-out accuracy {self.held_out[0]:.2f} -> {self.held_out[1]:.2f} "
                f"({self.held_out_overlap} held-out prompts in training)")  # fmt: skip


def run(agent: str, out: Path, settings: Settings = Settings(), *, progress: bool = True) -> Summary:
    """SFT then GRPO (module docstring) under `out`."""
    if agent not in AGENTS:
        raise ValueError(f"agent={agent!r} must be one of {sorted(AGENTS)}")
    paths = write_data(agent, out / "data", settings)
    sft = run_sft(sft_config(out, paths, settings), progress=progress)
    rl = run_rl(rl_config(agent, out, sft.run_dir / "hf", paths, settings), progress=progress)
    rows = [json.loads(line) for line in (rl.run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    held_out = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    # laden rl's own count of held-out prompts that are training prompts too, on the files it read
    overlap = json.loads((rl.run_dir / "valid_data_stats.json").read_text())["shared_with_train"]
    return Summary(sft_loss=(sft.first_loss or 0.0, sft.last_loss or 0.0), rewards=rewards,
                   held_out=(held_out[0], held_out[-1]), held_out_overlap=overlap)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("agent", choices=sorted(AGENTS))
    parser.add_argument("out", type=Path, help="directory for the data, both runs and their metrics")
    args = parser.parse_args(argv)
    summary = run(args.agent, args.out)
    print(summary.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
