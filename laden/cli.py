"""`laden sft | rl | dpo | rw | eval | init | plan | config | doctor [RUN_DIR]`: parse arguments and call the library; nothing else lives here.

Errors about the user's input (a config, a data file, a model directory, the run directory)
and Ctrl-C end in one line on stderr and an exit status, never a traceback; anything else is
a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, Literal

EXIT_USAGE = 2
"""Exit status for invalid input (config, data, model directory)."""
EXIT_OS_ERROR = 1
"""Exit status when the run directory cannot be written."""
EXIT_FAILED = 1
"""Exit status of a run that stopped for a reason it reports (its rewards failed, say)."""
EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT), as shells report it."""

ASSETS = resources.files("laden") / "assets"


def _embedded_default() -> tuple[str, list[str]]:
    """The job `laden sft` runs with no --config: a tiny random-init Qwen3 on a bundled data set."""
    return str(ASSETS / "sft_tiny.yaml"), [
        f"actor.path={ASSETS / 'tiny'}",
        f"train_dataset.path={ASSETS / 'sft_tiny_train.jsonl'}",
        f"valid_dataset.path={ASSETS / 'sft_tiny_valid.jsonl'}",
    ]


def _embedded_rl_default() -> tuple[str, list[str]]:
    """The job `laden rl` (and `laden eval`) runs with no --config: the tiny Qwen3 learning to answer with one
    letter, evaluated on held-out prompts."""
    return str(ASSETS / "rl_tiny.yaml"), [
        f"actor.path={ASSETS / 'tiny'}",
        f"train_dataset.path={ASSETS / 'rl_tiny.jsonl'}",
        f"valid_dataset.path={ASSETS / 'rl_tiny_valid.jsonl'}",
    ]


def _load(args: argparse.Namespace, job: Literal["sft", "rl", "dpo", "rw", "any"]):
    from laden.config import load_config

    config, overrides = args.config, list(args.overrides)
    if config is None and job in ("dpo", "rw"):
        raise ValueError(
            f"laden {job} has no embedded example: pass --config with train_dataset.type: {job} and preference "
            f"pairs (prompt, chosen, rejected; docs/data.md), or write one with `laden init {job}` (bundled tiny "
            "pairs, or --model M --data D)"
        )
    if config is None:
        config, defaults = _embedded_rl_default() if job == "rl" else _embedded_default()
        overrides = defaults + overrides
    return load_config(config, overrides, job=job)


def _run_job(args: argparse.Namespace, job: Literal["sft", "rl", "dpo", "rw"]) -> Any:
    """Load the config and run the job; its result, or the exit status after Ctrl-C or an unusable
    run directory (said in one line)."""
    from laden.config import run_dir

    cfg = _load(args, job)
    directory = run_dir(cfg)
    from laden.align.task import PairTask
    from laden.rl.trainer import run_rl
    from laden.sft.trainer import run_sft

    def run_pairs(cfg: Any, *, progress: bool = True) -> Any:
        """`laden dpo` / `laden rw` (by `train_dataset.type`): `laden sft`'s loop with the pair task."""
        return run_sft(cfg, progress=progress, task=PairTask(cfg, cfg.train_dataset.type))

    jobs: dict[str, Callable[..., Any]] = {"sft": run_sft, "rl": run_rl, "dpo": run_pairs, "rw": run_pairs}
    run = jobs[job]
    try:
        return run(cfg, progress=not args.no_progress)
    except KeyboardInterrupt:
        _say(f"laden: interrupted; rerun the same command to resume from the last checkpoint in {directory}")
        return EXIT_INTERRUPTED
    except OSError as exc:
        from laden.safe_io import DiskFullError

        if isinstance(exc, DiskFullError):  # its message names the file, the bytes and the fix
            _say(f"laden: {exc}")
            return EXIT_OS_ERROR
        message = _run_dir_error(exc, directory)
        if message is None:
            raise
        _say(message)
        return EXIT_OS_ERROR


_FINISHED = "nothing was trained. Raise total_train_steps to train on, or set trial_name"


def cmd_sft(args: argparse.Namespace) -> int:
    result = _run_job(args, "sft")
    if isinstance(result, int):
        return result
    if result.already_finished:
        _done(f"run directory {result.run_dir} already holds a finished run ({result.num_steps} steps, last "
              f"loss {result.last_loss}); {_FINISHED}")  # fmt: skip
    else:
        # the held-out accuracy and sample completions before -> after (`evaluator.generate`), if any
        accuracy, *samples = result.before_after or [""]
        line = f"{result.num_steps} steps, loss {result.first_loss:.4g} -> {result.last_loss:.4g}"
        _done("\n".join([line + (f", {accuracy}" if accuracy else ""), *samples, _results(result.run_dir)]))
    return 0


def cmd_pairs(args: argparse.Namespace) -> int:
    """`laden dpo` and `laden rw`: the loss and the held-out pair accuracy, first -> last."""
    result = _run_job(args, args.command)
    if isinstance(result, int):
        return result
    if result.already_finished:
        _done(f"run directory {result.run_dir} already holds a finished run ({result.num_steps} steps, last "
              f"loss {result.last_loss}); {_FINISHED}")  # fmt: skip
        return 0
    line = f"{result.num_steps} steps, loss {result.first_loss:.4g} -> {result.last_loss:.4g}"
    if result.held_out:
        (s0, a0), (s1, a1) = result.held_out[0], result.held_out[-1]
        line += f", held-out pair accuracy {a0:.3f} (step {s0}) -> {a1:.3f} (step {s1})"
    _done(f"{line}\n{_results(result.run_dir)}")
    return 0


def cmd_rl(args: argparse.Namespace) -> int:
    result = _run_job(args, "rl")
    if isinstance(result, int):
        return result
    if result.already_finished:
        _done(
            f"run directory {result.run_dir} already holds a finished run ({result.num_steps} steps); {_FINISHED}"
        )
    else:
        first = sum(result.rewards[:5]) / max(1, len(result.rewards[:5]))
        last = sum(result.rewards[-5:]) / max(1, len(result.rewards[-5:]))
        line = f"{result.num_steps} steps, mean reward {first:.3f} (first 5) -> {last:.3f} (last 5)"
        if result.held_out:
            (s0, a0), (s1, a1) = result.held_out[0], result.held_out[-1]
            line += f", held-out accuracy {a0:.3f} (step {s0}) -> {a1:.3f} (step {s1})"
        if result.reward_errors:
            line += f"; {result.reward_errors} of {result.completions} rewards failed (scored 0; see error text in the log)"
        _done(f"{line}\n{_results(result.run_dir)}")
    return 0


def _results(run_dir: Path) -> str:
    """Where a finished run's results are: its directory and what it holds of metrics, curves and model."""
    held = [
        name for name in ("metrics.jsonl", "curves.png", "hf/") if (Path(run_dir) / name.rstrip("/")).exists()
    ]
    return f"results in {run_dir}: " + ", ".join(held or ["checkpoints/"])


def cmd_eval(args: argparse.Namespace) -> int:
    import json

    from laden.rl.eval_job import run_eval
    from laden.run_setup import resolve_model_paths

    cfg = resolve_model_paths(_load(args, "rl"))  # a Hub id in actor.path: its local snapshot
    record = run_eval(cfg, model_dir=args.model, checkpoint=args.checkpoint)
    print(json.dumps(record))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from laden.rollout.servers.serve import serve
    from laden.run_setup import resolve_model_paths

    cfg = resolve_model_paths(_load(args, "rl"))

    def announce(urls: list[str]) -> None:
        print(f"serving: {' '.join(urls)}", flush=True)

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how serving ends
        serve(cfg, announce=announce)
    _say("laden: servers ended")
    return 0


def _done(line: str) -> None:
    if _is_main_process():  # under torchrun rank 0 speaks for every rank
        print(f"done: {line}")


def _run_dir_error(exc: OSError, directory: Path) -> str | None:
    """One line for an OSError on the run directory or a path in it, else None (not about the user's input)."""
    root = Path(os.path.abspath(directory))
    for name in (exc.filename, exc.filename2):
        if not isinstance(name, (str, bytes, os.PathLike)):
            continue  # no name, or a file descriptor
        path = Path(os.path.abspath(os.fsdecode(name)))
        # Inside it, or an ancestor that creating it needs (`cluster.fileroot` and below).
        if path == root or root in path.parents or path in root.parents:
            return (
                f"laden: run directory {str(directory)!r}: {exc.strerror or exc} ({path}); free space "
                "or fix permissions there, or set cluster.fileroot / trial_name to use another directory"
            )
    return None


def _is_main_process() -> bool:
    # Under torchrun every rank runs this CLI; rank 0 speaks for all of them.
    return os.environ.get("RANK", "0") == "0"


def _say(line: str) -> None:
    if _is_main_process():
        print(line, file=sys.stderr)


def cmd_init(args: argparse.Namespace) -> int:
    from laden.init_config import init_config

    out = Path(args.out or f"laden_{args.job}.yaml")
    try:
        lines = init_config(args.job, model=args.model, data=args.data, valid=args.valid, out=out)
    except FileExistsError as exc:
        print(f"laden: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for line in lines:
        print(line)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from laden.config import config_reference_markdown, format_config

    text = (
        config_reference_markdown() + "\n" if args.action == "docs" else format_config(_load(args, args.job))
    )
    _print_to_pipe(text)
    return 0


def _print_to_pipe(text: str) -> None:
    """`text` on stdout; a reader that closes the pipe early (`| head`) ends the output quietly."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush cannot fail too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def cmd_plan(args: argparse.Namespace) -> int:
    from laden.memory.estimate import plan_phases
    from laden.memory.plan import default_budgets, parse_size, plot, render
    from laden.run_setup import resolve_model_paths

    # A Hub id: its config and tokenizer suffice for the plan (the weights too for --profile).
    cfg = resolve_model_paths(_load(args, args.job or "any"), weights=bool(args.profile))
    job = args.job or cfg.train_dataset.type  # the job a config is for: its training set's type
    gpu, host = default_budgets()
    if args.gpu_mem is not None:
        gpu = parse_size(args.gpu_mem, option="--gpu-mem")
    if args.host_mem is not None:
        host = parse_size(args.host_mem, option="--host-mem")
    from laden.memory.auto import resolve_auto

    for line in resolve_auto(
        cfg, gpu if gpu is not None else host or 0, host_budget=host, for_gpu=gpu is not None
    ):
        print(line)
    phases = plan_phases(cfg, gpu_capacity=gpu, job=job)
    text, fits = render(phases, cfg, gpu_budget=gpu, host_budget=host)
    print(text)
    if args.plot:
        plot(phases, args.plot, gpu_budget=gpu, host_budget=host)
        print(f"breakdown drawn in {args.plot}")
    if args.gpus:
        from laden.memory.plan import suggest_backends

        if gpu is None:
            raise SystemExit(
                "laden plan --gpus: give --gpu-mem too (this machine has no GPU to read it from)"
            )
        print("\n".join(suggest_backends(cfg, gpus=args.gpus, gpu_budget=gpu, host_budget=host, job=job)))
    measured = []
    if args.profile:
        from laden.memory.profile import profile_phases, render_profile
        from laden.profile_steps import training_step

        measured = profile_phases(cfg, job=job, training_step=training_step)
        print(render_profile(phases, measured))
    if args.json:
        from laden.memory.plan import write_json

        write_json(args.json, phases, measured, cfg)
    return 0 if fits else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.path is not None:
        from laden.memory.doctor import diagnose

        print(diagnose(args.path).report())
        return 0
    import platform

    import torch
    import transformers

    print(f"python        {platform.python_version()}")
    print(f"torch         {torch.__version__}")
    print(f"transformers  {transformers.__version__}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            print(f"cuda:{i}        {props.name}, {props.total_memory / 2**30:.1f} GiB")
    else:
        print("cuda          not available: laden runs on the CPU")
    from laden.model.attention import describe_auto

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    print(f"attention     auto on {device}: {describe_auto(device)}")
    try:
        from laden.optim.cpu_adam import backend_name

        print(f"host adam     {backend_name()}")
    except Exception as exc:  # doctor reports, it never fails on a probe
        print(f"host adam     unavailable ({exc})")
    return 0


HELP = """\
laden fine-tunes (SFT) and RL-tunes causal language models on one GPU or many, including models whose
training state does not fit on the GPU, and sets the memory knobs before a run instead of after a crash.

The commands you run:
  laden sft --config X.yaml [key=value ...]   supervised fine-tuning (no --config: a tiny example on this machine)
  laden rl  --config X.yaml [key=value ...]   RL (GRPO/PPO family) with held-out evaluation
  laden dpo --config X.yaml [key=value ...]   DPO on preference pairs (prompt, chosen, rejected)
  laden rw  --config X.yaml [key=value ...]   a reward model trained on preference pairs
  laden init sft|rl|dpo|rw --model M --data D       a commented config for your model and data, checked
  laden plan --config X.yaml                  predicted GPU and host memory per phase, and the fixes
  laden serve --config X.yaml                 the rollout servers of rollout.server_urls on this node
  laden doctor [RUN_DIR]                      what this machine has, or why a run failed

Where results go: cluster.fileroot/experiment_name/trial_name/ holds config.yaml, metrics.jsonl,
curves.png, checkpoints/ and hf/ (the trained model, loadable with transformers). Rerunning the same
command resumes from the newest checkpoint.
"""


def cmd_export(args: argparse.Namespace) -> int:
    from laden.run_export import export_run

    out = export_run(args.run_dir, step=args.step, out_dir=args.out)
    _done(f"exported to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from laden import __version__

    parser = argparse.ArgumentParser(
        prog="laden", description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"laden {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help="YAML config; omitted: the embedded tiny example")
        p.add_argument(
            "overrides", nargs="*", help="dotted key=value overrides, e.g. actor.optimizer.lr=1e-4"
        )

    sft = sub.add_parser("sft", help="supervised fine-tuning")
    with_config(sft)
    sft.add_argument("--no-progress", action="store_true", help="no progress bar")
    sft.set_defaults(func=cmd_sft)

    rl = sub.add_parser("rl", help="reinforcement learning (GRPO/PPO family)")
    with_config(rl)
    rl.add_argument("--no-progress", action="store_true", help="no progress bar")
    rl.set_defaults(func=cmd_rl)

    for name, text in (("dpo", "direct preference optimization on preference pairs"),
                       ("rw", "reward-model training on preference pairs")):  # fmt: skip
        pairs = sub.add_parser(name, help=text)
        with_config(pairs)
        pairs.add_argument("--no-progress", action="store_true", help="no progress bar")
        pairs.set_defaults(func=cmd_pairs)

    evaluate = sub.add_parser(
        "eval",
        help="held-out accuracy of a model or checkpoint on valid_dataset, as laden rl measures it (one JSON line)",
    )
    with_config(evaluate)
    group = evaluate.add_mutually_exclusive_group()
    group.add_argument("--model", default=None, help="a Hugging Face model directory (default: actor.path)")
    group.add_argument("--checkpoint", default=None, help="a run's checkpoint, RUN_DIR/checkpoints/step_N")
    evaluate.set_defaults(func=cmd_eval)

    serve = sub.add_parser(
        "serve",
        help="start the rollout servers rollout.server_urls names on this node, for laden rl elsewhere",
    )
    with_config(serve)
    serve.set_defaults(func=cmd_serve)

    init = sub.add_parser("init", help="write a short commented config for your model and data (checked)")
    init.add_argument("job", choices=["sft", "rl", "dpo", "rw"])
    init.add_argument(
        "--model", default=None, help="a model directory or Hub id (default: the bundled tiny model)"
    )
    init.add_argument(
        "--data", default=None, help="training data: a file, a directory, or hf:NAME (default: bundled)"
    )
    init.add_argument(
        "--valid",
        default=None,
        help="held-out data (rl: evaluated every epoch; dpo, rw: held-out pair accuracy)",
    )
    init.add_argument("--out", default=None, help="the config file to write (default: laden_<job>.yaml)")
    init.set_defaults(func=cmd_init)

    config = sub.add_parser("config", help="show the resolved config, or the field reference")
    config.add_argument(
        "action", nargs="?", choices=["show", "docs"], default="show",
        help="show (default): the resolved config; docs: the field reference (Markdown)",
    )  # fmt: skip
    config.add_argument("--job", choices=["sft", "rl", "any"], default="any", help="which rules to check")
    with_config(config)
    config.set_defaults(func=cmd_config)

    plan = sub.add_parser("plan", help="predicted GPU and host peaks per phase, against the budgets")
    with_config(plan)
    plan.add_argument(
        "--job", choices=["sft", "rl", "dpo", "rw"], default=None, help="default: train_dataset.type"
    )
    plan.add_argument("--gpu-mem", default=None, help="GPU budget per rank, e.g. 24GiB (default: this GPU)")
    plan.add_argument("--host-mem", default=None, help="host budget, e.g. 128GiB (default: this machine)")
    plan.add_argument("--plot", default=None, help="draw the breakdown into this PNG file (needs matplotlib)")
    plan.add_argument(
        "--profile", action="store_true",
        help="run one step of each phase at its worst case here and print the measured peaks beside the predicted",
    )  # fmt: skip
    plan.add_argument(
        "--gpus", type=int, default=None, help="suggest actor.backend / rollout.backend for this many GPUs"
    )
    plan.add_argument("--json", default=None, help="also write the plan (and the profile) to this JSON file")
    plan.set_defaults(func=cmd_plan)

    doctor = sub.add_parser(
        "doctor", help="report the environment laden sees, or diagnose a failed run (RUN_DIR or a log file)"
    )
    doctor.add_argument(
        "path", nargs="?", default=None, help="a failed run's directory, or a file with a traceback"
    )
    doctor.set_defaults(func=cmd_doctor)

    export = sub.add_parser(
        "export",
        help="write a Hugging Face model directory (and a LoRA run's adapter) from a run's checkpoint",
    )
    export.add_argument("run_dir", help="a laden run directory (holding checkpoints/step_N)")
    export.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    export.add_argument("--out", default=None, help="where to write it (default: RUN_DIR/hf_steps/step_N)")
    export.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Under torchrun rank 0 logs for every rank; the others report only errors.
    level = logging.INFO if _is_main_process() else logging.ERROR
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = build_parser()
    # Overrides may come before or after options (`config show --job sft a.b=1`): argparse stops
    # collecting a positional list at the first option, so the rest arrive as unknown arguments.
    args, extra = parser.parse_known_args(argv)

    def is_override(a: str) -> bool:  # key=value, +key=value, ++key=value, ~key (Hydra's forms)
        return (a.startswith("~") and len(a) > 1) or ("=" in a and not a.startswith("-"))

    bad = [a for a in extra if not is_override(a) or not hasattr(args, "overrides")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    from laden.config import ConfigError
    from laden.errors import RunFailedError

    try:
        return args.func(args)
    except RunFailedError as exc:  # `RunInterrupted` (a signal, after a checkpoint) carries 128 + the signal
        print(f"laden: {exc}", file=sys.stderr)
        return getattr(exc, "exit_status", EXIT_FAILED)
    except ConfigError as exc:
        print(f"laden: invalid configuration\n{exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, FileNotFoundError) as exc:
        print(f"laden: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        _say("laden: interrupted")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
