"""Load every run config of AReaL's `examples/` through laden's loader and say which load and why the rest do not.

    git clone --branch v1.0.4 https://github.com/inclusionAI/AReaL /tmp/AReaL
    python benchmarks/areal_examples.py /tmp/AReaL/examples

Model and dataset paths are replaced by the tiny model and placeholder files (the Hub is not needed); the job
is read from the file name (`dpo`, `_rw`, `sft`, else `rl`). SkyPilot cluster files and `environ_ref.yaml`
are not run configs and are skipped. Prints one line per file, then the counts.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from pathlib import Path

from laden.config import ConfigError, load_config

TINY = Path(__file__).resolve().parents[1] / "laden" / "assets" / "tiny"
PATHS = [f"actor.path={TINY}", "train_dataset.path=train.jsonl", "valid_dataset.path=valid.jsonl"]


def job_of(name: str) -> str:
    return "dpo" if "dpo" in name else "rw" if "_rw" in name else "sft" if "sft" in name else "rl"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("examples", type=Path, help="AReaL's examples/ directory")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the warnings of keys without effect are not what this counts
    warnings.simplefilter("ignore")
    loaded = refused = 0
    for path in sorted(args.examples.rglob("*.yaml")):
        name = str(path.relative_to(args.examples))
        if ".sky." in name or name == "environ_ref.yaml":
            continue
        try:
            load_config(path, PATHS, job=job_of(name))
        except ConfigError as e:
            refused += 1
            first = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
            print(f"refused {name}: {first[:300]}")
        else:
            loaded += 1
            print(f"loads   {name}")
    print(f"{loaded} of {loaded + refused} load, {refused} refused")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
