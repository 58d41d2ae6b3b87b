"""The command line as a new user meets it: --version, --help naming the commands and where results go,
`laden init` configs that load and run, `laden config` without an action, output into a closed pipe."""

from __future__ import annotations

import subprocess
import sys

import pytest

from laden import __version__
from laden.cli import main
from laden.config import load_config
from laden.model.hf.loading import count_text

pytestmark = pytest.mark.usefixtures("one_thread")


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"laden {__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for command in (
        "laden sft",
        "laden rl",
        "laden init",
        "laden plan",
        "laden doctor",
        "metrics.jsonl",
        "hf/",
    ):
        assert command in text, command


@pytest.mark.parametrize("job", ["sft", "rl", "dpo", "rw"])
def test_init_writes_a_config_that_loads_and_runs_one_step(tmp_path, capsys, job):
    out = tmp_path / "cfg" / f"{job}.yaml"
    assert main(["init", job, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"laden {job} --config {out}" in said
    text = out.read_text()
    assert text.count("#") > 10  # commented
    cfg = load_config(str(out), [], job=job)
    assert cfg.checkpoint.export_hf and cfg.oom_policy == "auto"
    # the bundled rl data has held-out prompts, the bundled pairs held-out pairs
    assert (cfg.valid_dataset is not None) == (job != "sft") and cfg.train_dataset.type == job
    small = ["gconfig.max_new_tokens=4", "gconfig.n_samples=2"] if job == "rl" else []
    assert main([job, "--no-progress", "--config", str(out), "total_train_steps=1", f"cluster.fileroot={tmp_path}",
                 "checkpoint.export_hf=false", *small]) == 0  # fmt: skip
    assert "results in " in capsys.readouterr().out or job == "sft"
    assert main(["init", job, "--out", str(out)]) == 2  # never overwritten
    assert "exists" in capsys.readouterr().err


def test_init_takes_your_model_and_data_and_refuses_what_does_not_load(tmp_path, capsys):
    from laden.cli import ASSETS

    data = tmp_path / "mine.jsonl"
    data.write_text((ASSETS / "sft_tiny.jsonl").read_text())
    out = tmp_path / "mine.yaml"
    assert main(["init", "sft", "--model", str(ASSETS / "tiny"), "--data", str(data), "--out", str(out)]) == 0
    cfg = load_config(str(out), [], job="sft")
    assert cfg.train_dataset.path == str(data) and cfg.actor.path == str(ASSETS / "tiny")
    missing = tmp_path / "nothing.jsonl"
    assert main(["init", "sft", "--data", str(missing), "--out", str(tmp_path / "bad.yaml")]) == 2
    assert "nothing.jsonl" in capsys.readouterr().err and not (tmp_path / "bad.yaml").exists()


def test_config_shows_without_an_action_and_docs_survive_a_closed_pipe(capsys):
    assert main(["config"]) == 0
    assert "experiment_name:" in capsys.readouterr().out
    reader = subprocess.run(  # `laden config docs | head -1`: the reader closes the pipe after one line
        f"{sys.executable} -m laden.cli config docs | head -1", shell=True, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert reader.stdout.startswith("# Configuration reference")
    assert "Traceback" not in reader.stderr and "BrokenPipe" not in reader.stderr, reader.stderr


def test_parameter_counts_read_as_people_write_them():
    assert [count_text(n) for n in (1_720_000_000, 135_000_000, 270_000, 12)] == [
        "1.72B",
        "135.0M",
        "270.0K",
        "12",
    ]
