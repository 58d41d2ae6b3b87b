"""The copies of AReaL's example configs (`areal_configs/`) and the path overrides that make them load here."""

from __future__ import annotations

from repo_paths import ASSETS, SUPPORT

AREAL = SUPPORT / "areal_configs"
TINY_MODEL = ASSETS / "tiny"  # config.json: 4 heads, 2 kv, no dropout


PATHS = [f"actor.path={TINY_MODEL}", "train_dataset.path=train.jsonl", "valid_dataset.path=valid.jsonl"]
