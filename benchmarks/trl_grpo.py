"""TRL's `GRPOTrainer` on the RL job a laden config describes, evaluated by laden's own held-out
evaluation, for `benchmarks/rl_compare.py`.

    python benchmarks/trl_grpo.py --config examples/rl_smollm2_arith.yaml --out runs/trl-arith/gen \\
        [--steps 200] [--eval-every 25] [--generation generate|static|paged] [--gradient-checkpointing] \\
        [--micro-batch 256] [overrides ...]

The same work as `laden rl --config X`: the model (`actor.path`), the training prompts, the prompts per
step (`train_dataset.batch_size`) and completions per prompt (`gconfig.n_samples`), `max_new_tokens`,
the sampling temperature, the learning rate, weight decay and gradient clipping, the clip (`eps_clip`,
`eps_clip_higher`), no KL term (`actor.kl_ctl` must be 0; TRL's `beta` then loads no reference model),
group-normalised advantages (TRL's `scale_rewards="group"`, laden's default `adv_norm`), losses
averaged over every token of the step (TRL's `loss_type="dapo"`, laden's `token-mean`), one optimizer
step a generation (on-policy, as laden's `max_head_offpolicyness: 0`), bf16 on a GPU. The reward is
the config's, called as TRL calls a reward function (`reward_func(prompts, completions, **columns) ->
list[float]`), and the prompt a chat turn rendered by the model's chat template, as laden renders it.

Held-out accuracy comes from `laden.rl.evaluate`, the code `laden rl` evaluates with: a native engine
of laden's takes the trainer's current weights before the first step and every `--eval-every` steps
(and after the last), and completes `valid_dataset` with `eval_gconfig` (greedy by default). Its time
is left out of `elapsed_s`, as `laden rl` leaves its evaluations out.

Writes `OUT/metrics.jsonl` with laden's names (`step`, `elapsed_s`, `reward_mean`, `reward_std`,
`response_length`, `gen_s`, `train_s`, `eval/...`) and prints one JSON line: the settings, seconds,
generation and training tokens/s, peak GPU memory, the first and last held-out accuracy.

`--generation`: TRL's transformers paths: `generate` (its default, a dynamic cache), `static`
(`cache_implementation="static"`), `paged` (`use_transformers_continuous_batching`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def trl_reward(cfg: Any):
    """The config's reward in TRL's form: lists in, a list out, one completion at a time through laden's
    own adapter (`laden.rl.reward_styles`), so both systems score with the same function."""
    from laden.rl.reward_setup import reward_specs
    from laden.rl.reward_styles import as_specs, load_rewards

    composite = load_rewards(as_specs(reward_specs(cfg)))

    def reward(prompts, completions, **columns) -> list[float]:
        out = []
        for i, completion in enumerate(completions):
            text = completion[0]["content"] if isinstance(completion, list) else completion
            # the data columns (TRL also passes completion_ids, trainer_state and logging hooks)
            fields = {k: v[i] for k, v in columns.items() if isinstance(v, list) and k != "completion_ids"}
            kwargs = dict(fields, prompt="", completion=text, prompt_ids=[], completion_ids=[])
            out.append(composite.score(kwargs)[0])
        return out

    reward.__name__ = "reward"
    return reward


def dataset(records: list[dict[str, Any]]):
    """laden's rows as TRL's conversational prompts (the chat template renders them, as laden does)."""
    from datasets import Dataset

    rows = [dict(r, prompt=[{"role": "user", "content": r["prompt"]}]) for r in records]
    return Dataset.from_list(rows)


class HeldOut:
    """laden's evaluation of the trainer's weights (see the module docstring)."""

    def __init__(self, cfg: Any, tokenizer: Any, model: Any, device: Any) -> None:
        from dataclasses import replace

        from laden.data import load_records
        from laden.rl.evaluate import eval_sampling
        from laden.rl.reward_setup import start_rewards
        from laden.rl.workflow import load_workflow
        from laden.rollout.factory import native_engine_from_weights

        self.rows = list(load_records(cfg.valid_dataset.path))
        self.loop = asyncio.new_event_loop()
        self.pool, _ = self.loop.run_until_complete(start_rewards(cfg, [self.rows], tokenizer))
        native = replace(cfg, rollout=replace(cfg.rollout, backend="native:d1"),
                         native=replace(cfg.native, mem_fraction_static=0.1))  # fmt: skip
        self.engine = native_engine_from_weights(
            native, model.named_parameters(), device=device, tokenizer=tokenizer
        )
        sampling, n = eval_sampling(cfg.gconfig, cfg.eval_gconfig)
        self.workflow = load_workflow(
            cfg.workflow, tokenizer=tokenizer, sampling=sampling, n_samples=n, reward=self.pool
        )

    def __call__(self, model: Any, step: int) -> dict[str, float]:
        from laden.rl.evaluate import evaluate

        t0 = time.perf_counter()
        self.engine.load_weights(model.named_parameters(), version=step)
        result = self.loop.run_until_complete(evaluate(self.engine, self.rows, self.workflow))
        metrics = {k: round(v, 6) for k, v in result.metrics.items()}
        metrics["eval/time_s"] = round(time.perf_counter() - t0, 3)
        return metrics

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.close())
        self.pool.close()
        self.loop.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the laden RL config whose job TRL runs")
    p.add_argument("--out", type=Path, required=True, help="output directory (metrics.jsonl)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: total_train_steps)")
    p.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="steps between evaluations (default: evaluator.freq_steps)",
    )
    p.add_argument("--generation", choices=["generate", "static", "paged"], default="generate")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument(
        "--micro-batch", type=int, default=None, help="completions per forward/backward (default: the step's)"
    )
    p.add_argument(
        "--time-budget-s", type=float, default=None,
        help="stop after the step that passes this many seconds of training (evaluated then); default: --steps",
    )  # fmt: skip
    p.add_argument("overrides", nargs="*", help="laden config overrides, e.g. actor.path=DIR")
    args = p.parse_args(argv)

    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from laden.config import load_config
    from laden.data import load_records
    from laden.model.hf.loading import load_causal_lm, load_tokenizer

    cfg = load_config(args.config, args.overrides, job="rl")
    if cfg.actor.kl_ctl:
        raise SystemExit("actor.kl_ctl > 0: this comparison runs without a KL term (TRL's beta=0)")
    steps = args.steps or cfg.total_train_steps
    every = args.eval_every or cfg.evaluator.freq_steps or steps
    cuda = torch.cuda.is_available()
    prompts, n = cfg.train_dataset.batch_size, cfg.gconfig.n_samples
    step_completions = prompts * n
    micro = args.micro_batch or step_completions
    if step_completions % micro:
        raise SystemExit(f"--micro-batch {micro} must divide the step's {step_completions} completions")
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(cfg.actor.path)
    tokenizer.padding_side = "left"
    # the weights laden starts from (`actor.init_from_config`: the same seeded random init), fp32 masters
    model = load_causal_lm(
        cfg.actor.path, dtype=torch.float32, init_from_config=cfg.actor.init_from_config, seed=cfg.seed
    )
    # laden's loader selects its own attention kernel; TRL's generation paths know transformers' (its paged
    # cache needs "paged|<kernel>"), so the model runs on PyTorch's SDPA as a stock one would
    model.set_attn_implementation("sdpa")
    generation: dict[str, Any] = {}
    if args.generation == "static":
        generation["cache_implementation"] = "static"
    elif args.generation == "paged":
        generation["use_transformers_continuous_batching"] = True
    opt = cfg.actor.optimizer
    config = GRPOConfig(
        output_dir=str(args.out / "trl"), max_steps=steps, per_device_train_batch_size=micro,
        gradient_accumulation_steps=step_completions // micro, num_generations=n,
        generation_batch_size=step_completions, max_completion_length=cfg.gconfig.max_new_tokens,
        temperature=cfg.gconfig.temperature, learning_rate=opt.lr, weight_decay=opt.weight_decay,
        adam_beta1=opt.beta1, adam_beta2=opt.beta2, adam_epsilon=opt.eps, max_grad_norm=opt.gradient_clipping,
        lr_scheduler_type="constant", warmup_steps=0, epsilon=cfg.actor.eps_clip,
        epsilon_high=cfg.actor.eps_clip_higher, beta=0.0, num_iterations=1, scale_rewards="group",
        loss_type="dapo", bf16=cuda, use_cpu=not cuda, gradient_checkpointing=args.gradient_checkpointing,
        logging_steps=1, save_strategy="no", report_to="none", seed=cfg.seed, shuffle_dataset=cfg.train_dataset.shuffle,
        disable_tqdm=True, **generation,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=trl_reward(cfg), args=config, processing_class=tokenizer,
        train_dataset=dataset(list(load_records(cfg.train_dataset.path))),
    )  # fmt: skip
    device = torch.device("cuda" if cuda else "cpu")
    held_out = HeldOut(cfg, tokenizer, trainer.accelerator.unwrap_model(trainer.model), device)
    clock = {"gen_s": 0.0, "eval_s": 0.0, "t0": 0.0, "gen_tokens": 0, "train_tokens": 0}
    generate = trainer._generate

    def timed_generate(batch_prompts):  # TRL's generation of a step's completions
        t = time.perf_counter()
        out = generate(batch_prompts)
        if cuda:
            torch.cuda.synchronize()
        clock["gen_s"] += time.perf_counter() - t
        return out

    trainer._generate = timed_generate
    metrics_file = (args.out / "metrics.jsonl").open("w")

    def elapsed() -> float:
        return time.perf_counter() - clock["t0"] - clock["eval_s"]

    def evaluate(step: int, model: Any) -> dict[str, Any]:
        t = time.perf_counter()
        at = elapsed()
        row = {"step": step, "elapsed_s": round(at, 3), **held_out(model, step)}
        clock["eval_s"] += time.perf_counter() - t
        return row

    class Rows(TrainerCallback):
        def on_train_begin(self, targs, state, control, model=None, **kw):
            clock["t0"] = time.perf_counter()
            metrics_file.write(
                json.dumps(evaluate(0, trainer.accelerator.unwrap_model(trainer.model))) + "\n"
            )

        def on_log(self, targs, state, control, logs=None, **kw):
            if not logs or "reward" not in logs:
                return
            length = float(logs.get("completions/mean_length", 0.0))
            clock["gen_tokens"] += length * step_completions
            row = {"step": state.global_step, "elapsed_s": round(elapsed(), 3), "reward_mean": logs["reward"],
                   "reward_std": logs.get("reward_std"), "response_length": length, "loss": logs.get("loss"),
                   "entropy": logs.get("entropy"), "gen_s": round(clock["gen_s"], 3)}  # fmt: skip
            if state.global_step % every == 0 or state.global_step == steps:
                row.update({k: v for k, v in evaluate(state.global_step, trainer.accelerator.unwrap_model(trainer.model)).items()
                            if k.startswith("eval/")})  # fmt: skip
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
            clock["last_eval_step"] = (
                state.global_step if "eval/accuracy" in row else clock.get("last_eval_step", 0)
            )

        def on_step_end(self, targs, state, control, **kw):
            if args.time_budget_s is not None and elapsed() >= args.time_budget_s:
                control.should_training_stop = True  # the held-out evaluation follows in on_train_end

        def on_train_end(self, targs, state, control, **kw):
            if clock.get("last_eval_step") != state.global_step:  # stopped by the time budget
                metrics_file.write(
                    json.dumps(evaluate(state.global_step, trainer.accelerator.unwrap_model(trainer.model)))
                    + "\n"
                )

    trainer.add_callback(Rows())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    total = elapsed()
    metrics_file.close()
    steps = trainer.state.global_step
    held_out.close()
    rows = [json.loads(x) for x in (args.out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    print(json.dumps({
        "bench": "trl_grpo", "trl": __import__("trl").__version__, "generation": args.generation,
        "gradient_checkpointing": args.gradient_checkpointing, "micro_batch": micro, "steps": steps,
        "seconds": round(total, 2), "gen_s": round(clock["gen_s"], 2), "train_s": round(total - clock["gen_s"], 2),
        "gen_tokens_per_s": round(clock["gen_tokens"] / max(clock["gen_s"], 1e-9), 1),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "accuracy_first": evals[0]["eval/accuracy"] if evals else None,
        "accuracy_last": evals[-1]["eval/accuracy"] if evals else None, "out": str(args.out),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
