"""`laden sft`'s micro-batch budget holds the validation samples too: unset, it is the longer `max_length`
of the training and validation sets; set too small for either, the config is refused naming the field."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from laden.config import ConfigError, load_config
from laden.sft.trainer import budget, run_sft

pytestmark = pytest.mark.usefixtures("one_thread")

ASSETS = resources.files("laden") / "assets"


def _config(tmp_path, *extra):
    """A short training set (32 tokens) and a validation set of longer samples (up to 128)."""
    train = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(8) for b in range(4)]
    valid = [{"prompt": f"What is the sum of {a} and {b}, written out?", "completion": f"It is {a + b}."}
             for a, b in ((1, 2), (3, 4), (5, 6), (7, 8))]  # fmt: skip
    for name, rows in (("train", train), ("valid", valid)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config(str(ASSETS / "sft_tiny.yaml"), [
        f"actor.path={ASSETS / 'tiny'}", f"cluster.fileroot={tmp_path}", f"train_dataset.path={tmp_path / 'train.jsonl'}",
        "train_dataset.max_length=32", "train_dataset.batch_size=8", f"valid_dataset.path={tmp_path / 'valid.jsonl'}",
        "valid_dataset.max_length=128", "valid_dataset.batch_size=4", "~actor.mb_spec.max_tokens_per_mb",
        "evaluator.generate=false", "total_train_steps=1", "checkpoint.save_freq_steps=null", "checkpoint.export_hf=false",
        *extra,
    ], job="sft")  # fmt: skip


def test_the_default_budget_holds_the_longer_validation_samples(tmp_path):
    cfg = _config(tmp_path)
    assert budget(cfg) == 128
    # it evaluates before and after its step: the validation samples of over 32 tokens fit
    result = run_sft(cfg, progress=False)
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_loss" in r] == [0, 1]


def test_a_budget_too_small_for_the_validation_samples_is_refused_at_load(tmp_path):
    with pytest.raises(ConfigError, match=r"actor.mb_spec.max_tokens_per_mb=64 is smaller than "
                                          r"valid_dataset.max_length = 128; set it to at least 128"):  # fmt: skip
        _config(tmp_path, "actor.mb_spec.max_tokens_per_mb=64")
    assert budget(_config(tmp_path, "actor.mb_spec.max_tokens_per_mb=128")) == 128
