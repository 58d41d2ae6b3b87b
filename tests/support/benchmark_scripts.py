"""The benchmark scripts under benchmarks/, loaded as modules by the tests of them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from repo_paths import ROOT

BENCH = ROOT / "benchmarks"
SCRIPT = BENCH / "train_throughput.py"


def load_script(path: Path = SCRIPT):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module
