"""The configuration reference (docs/config.md) is the generated one, the README's commands are the CI's,
and the README's quick start runs from a directory other than the checkout."""

from __future__ import annotations

import os
import subprocess
import sys

from repo_paths import ROOT

from laden.config import config_reference_markdown


def test_the_config_reference_is_the_generated_one():
    assert (ROOT / "docs" / "config.md").read_text().strip() == config_reference_markdown().strip(), (
        "docs/config.md is stale: regenerate it with `laden config docs > docs/config.md`"
    )


def test_ci_runs_the_readme_test_command():
    command = (
        "pip install torch==2.13.0 && pip install -e '.[dev]' && python -m pytest -q -p no:cacheprovider"
    )
    readme = (ROOT / "README.md").read_text()
    assert command in readme
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()
    assert "pip install torch==2.13.0 && pip install -e . && laden sft" in readme


def test_the_readme_and_the_docs_link_files_that_exist():
    import re

    pages = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken, count = [], 0
    for page in pages:
        for link in re.findall(r"\]\(((?!https?:)[^)#]+)\)", page.read_text()):
            count += 1
            if not (page.parent / link).exists():
                broken.append(f"{page.relative_to(ROOT)}: {link}")
    assert count > 10 and broken == []


def test_the_quick_start_runs_from_another_directory(tmp_path):
    """`laden rl` with its embedded default, from a directory that is not the checkout (few steps)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "laden.cli", "rl", "--no-progress", "total_train_steps=2", "gconfig.n_samples=2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "results in " in done.stdout and (tmp_path / "runs").is_dir()
