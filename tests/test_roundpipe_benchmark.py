"""benchmarks/train_throughput.py runs on the CPU with the tiny model and prints one JSON result."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "train_throughput.py"


def load_script():
    spec = importlib.util.spec_from_file_location("train_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.parametrize("system", ["laden", "plain"])
def test_train_throughput_runs_on_cpu_with_tiny_model(system, capsys):
    bench = load_script()
    result = bench.main(["--system", system, "--model", "tiny", "--steps", "1", "--warmup", "1",
                         "--seq-len", "32", "--num-seqs", "4", "--num-microbatch", "2"])  # fmt: skip
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == result
    for key in ("name", "model", "shape", "tokens_per_s", "mfu", "hfu", "peak_host_gib", "git_commit", "device",
                "torch", "transformers"):  # fmt: skip
        assert key in result, key
    assert result["name"] == f"train_throughput/{system}" and result["device"] == "cpu"
    assert result["tokens_per_s"] > 0 and math.isfinite(result["last_loss"])
    expected_mfu = 6 * result["num_params"] * result["tokens_per_s"] / 989e12
    assert result["mfu"] == pytest.approx(expected_mfu, abs=1e-4)
    assert result["hfu"] == pytest.approx(expected_mfu * 8 / 6, abs=1e-4)
