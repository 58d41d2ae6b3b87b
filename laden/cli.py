"""`laden sft | config | doctor`: parse arguments and call the library; nothing else lives here."""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import resources
from typing import Literal

ASSETS = resources.files("laden") / "assets"


def _embedded_default() -> tuple[str, list[str]]:
    """The job `laden sft` runs with no --config: a tiny random-init Qwen3 on a bundled data set."""
    return str(ASSETS / "sft_tiny.yaml"), [
        f"actor.path={ASSETS / 'tiny'}",
        f"train_dataset.path={ASSETS / 'sft_tiny.jsonl'}",
    ]


def _load(args: argparse.Namespace, job: Literal["sft", "rl", "any"]):
    from laden.config import load_config

    config, overrides = args.config, list(args.overrides)
    if config is None:
        config, defaults = _embedded_default()
        overrides = defaults + overrides
    return load_config(config, overrides, job=job)


def cmd_sft(args: argparse.Namespace) -> int:
    from laden.sft.trainer import run_sft

    cfg = _load(args, "sft")
    result = run_sft(cfg, progress=not args.no_progress)
    print(
        f"done: {result.num_steps} steps, loss {result.first_loss} -> {result.last_loss}; "
        f"run directory {result.run_dir}"
    )
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from laden.config import config_reference_markdown, format_config

    if args.action == "docs":
        print(config_reference_markdown())
        return 0
    print(format_config(_load(args, args.job)), end="")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="laden", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help="YAML config; omitted: the embedded tiny example")
        p.add_argument(
            "overrides", nargs="*", help="dotted key=value overrides, e.g. actor.optimizer.lr=1e-4"
        )

    sft = sub.add_parser("sft", help="supervised fine-tuning")
    with_config(sft)
    sft.add_argument("--no-progress", action="store_true", help="no progress bar")
    sft.set_defaults(func=cmd_sft)

    config = sub.add_parser("config", help="show the resolved config, or the field reference")
    config.add_argument("action", choices=["show", "docs"])
    config.add_argument("--job", choices=["sft", "rl", "any"], default="any", help="which rules to check")
    with_config(config)
    config.set_defaults(func=cmd_config)

    doctor = sub.add_parser("doctor", help="report the environment laden sees")
    doctor.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = build_parser()
    # Overrides may come before or after options (`config show --job sft a.b=1`): argparse stops
    # collecting a positional list at the first option, so the rest arrive as unknown arguments.
    args, extra = parser.parse_known_args(argv)
    bad = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    from laden.config import ConfigError

    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"laden: invalid configuration\n{exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as exc:
        print(f"laden: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
