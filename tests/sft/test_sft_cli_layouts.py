"""Two-process layouts of `laden sft`, run the way benchmarks/sft_cli.py measures them (torchrun, gloo):
every layout of one workload has the same per-step losses as `fsdp:d2`, dense and MoE, and each row
carries every rank's peaks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from benchmark_scripts import BENCH

LAYOUTS = {"tiny": ["fsdp:d2", "archon:d1p2"], "tiny-moe": ["fsdp:d2", "archon:d2e2"]}


def _run(model: str, backend: str) -> dict:
    cmd = [sys.executable, str(BENCH / "sft_cli.py"), "--model", model, "--seq-len", "64", "--batch-size", "4",
           "--steps", "3", "--warmup", "1", "--variants", "00", "--dtype", "float32", "--backend", backend,
           "--nproc", "2"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    (record,) = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert "error" not in record, record["error"]
    return record


@pytest.mark.parametrize(
    "model",
    # slow: the dense pair; the MoE pair runs the same script, launch and per-rank peaks in the default tier,
    # and archon:d1p2 under torchrun equal to fsdp is tests/sft/test_sft.py's
    # test_torchrun_archon_d1p2_equals_fsdp_single_process
    [pytest.param("tiny", marks=pytest.mark.slow), "tiny-moe"],
)
def test_layouts_have_the_losses_of_fsdp_d2(model):
    reference, other = (_run(model, backend) for backend in LAYOUTS[model])
    assert len(reference["losses"]) == 3 and reference["losses"][0] > reference["losses"][-1]
    assert other["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    for record in (reference, other):
        assert len(record["peak_host_gib_ranks"]) == 2 and min(record["peak_host_gib_ranks"]) > 0
