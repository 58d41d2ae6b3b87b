"""Paths of the checkout, for tests and helpers wherever they sit under tests/."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: laden/, tests/, benchmarks/, docs/
TESTS = ROOT / "tests"
SUPPORT = TESTS / "support"  # the shared helpers (on sys.path, see tests/conftest.py) and their data
ASSETS = ROOT / "laden" / "assets"


def helpers_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the checkout and tests/support first on `PYTHONPATH`, for
    a Python process that a test starts and that imports laden and the helpers (a test file run as a
    script, which loads no conftest.py)."""
    env = dict(os.environ if env is None else env)
    paths = [str(ROOT), str(SUPPORT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env
