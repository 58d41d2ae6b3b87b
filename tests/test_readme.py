"""The README's configuration reference is the generated one, and its commands are the CI's."""

from __future__ import annotations

from pathlib import Path

from laden.config import config_reference_markdown

ROOT = Path(__file__).resolve().parents[1]


def _readme_reference() -> str:
    text = (ROOT / "README.md").read_text()
    begin = text.index("<!-- config-reference")
    body = text[text.index("\n", begin) + 1 : text.index("<!-- end config-reference -->")]
    return body.strip()


def test_readme_reference_matches_generated():
    # The reference sits one heading level deeper in the README than `laden config docs` prints it.
    expected = [
        "#" + line if line.startswith("#") else line
        for line in config_reference_markdown().strip().splitlines()
    ]
    assert _readme_reference() == "\n".join(expected), (
        "README is stale: regenerate it from `laden config docs`"
    )


def test_ci_runs_the_readme_test_command():
    command = (
        "pip install torch==2.13.0 && pip install -e '.[dev]' && python -m pytest -q -p no:cacheprovider"
    )
    assert command in (ROOT / "README.md").read_text()
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()
