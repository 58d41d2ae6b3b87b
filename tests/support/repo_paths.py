"""Paths of the checkout, for tests and helpers wherever they sit under tests/."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: laden/, tests/, benchmarks/, docs/
TESTS = ROOT / "tests"
SUPPORT = TESTS / "support"  # the shared helpers (on sys.path, see tests/conftest.py) and their data
ASSETS = ROOT / "laden" / "assets"
