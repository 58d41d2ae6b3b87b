"""The tests' own layout: tests/<area>/ mirrors laden/<area>, helpers live in tests/support, and no
test module imports another (what two tests share is a helper, not one test's internals).

pytest imports each test file by its base name with its directory on `sys.path` (the default
`prepend` import mode, no `__init__.py` in the test directories), so two test files of one name
in different directories would clash; and a helper named like a test would be collected.
"""

from __future__ import annotations

import ast
import collections
import re
import sys
from pathlib import Path

from repo_paths import ROOT, SUPPORT, TESTS

# Test directories that mirror no laden package: laden's top-level modules (cli.py, plots.py, ...),
# the scripts under benchmarks/, the README and docs/.
NOT_PACKAGES = {"cli", "benchmarks", "docs"}
PACKAGE_SUITES = {
    "roundpipe/compat"
}  # a package of its own (`__init__.py`): the RoundPipe compatibility suite


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            found.append((node.lineno, base))
            if node.level:  # `from . import test_x`
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) in {"import_module", "__import__"}
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def test_no_test_module_imports_another():
    offenders = []
    for path in [*_test_files(), *sorted(SUPPORT.glob("*.py")), TESTS / "conftest.py"]:
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, module in _imported_modules(tree):
            if any(part.startswith("test_") for part in module.split(".")):
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not offenders, (
        "a test module imports another test module; move what they share into a module in tests/support/ "
        "(importable by its bare name, e.g. `from tiny import tiny_qwen3_config`):\n" + "\n".join(offenders)
    )


def test_test_files_sit_in_the_directory_of_what_they_test():
    misplaced = []
    for path in _test_files():
        area = path.parent.relative_to(TESTS).as_posix()
        if path == Path(__file__).resolve() or area in NOT_PACKAGES | PACKAGE_SUITES:
            continue
        if area == ".":
            misplaced.append(
                f"{path.relative_to(ROOT)}: move it to tests/<area>/ (the laden package it tests)"
            )
        elif area == "support":
            misplaced.append(
                f"{path.relative_to(ROOT)}: tests/support holds helpers; pytest would collect it"
            )
        elif not (ROOT / "laden" / area / "__init__.py").is_file():
            misplaced.append(f"{path.relative_to(ROOT)}: tests/{area} mirrors no package laden/{area}")
    assert not misplaced, "\n".join(misplaced)


def test_module_names_are_unique():
    """Test files and helpers share one module namespace (each imported by its base name)."""
    by_name = collections.defaultdict(list)
    for path in _test_files():
        if not (path.parent / "__init__.py").exists():  # a package's modules are named package.module
            by_name[path.stem].append(path)
    for path in SUPPORT.glob("*.py"):
        by_name[path.stem].append(path)
    clashes = {
        name: [str(p.relative_to(ROOT)) for p in paths] for name, paths in by_name.items() if len(paths) > 1
    }
    assert not clashes, f"two files import as one module name; rename one: {clashes}"
    shadowing = sorted(set(by_name) & set(sys.stdlib_module_names) | {n for n in by_name if n == "laden"})
    assert not shadowing, f"test or helper modules named like standard library modules: {shadowing}"


def test_no_init_files_outside_package_suites():
    """An `__init__.py` in a test directory would rename its modules (rootdir-relative package names)."""
    stray = [
        str(p.relative_to(ROOT))
        for p in TESTS.rglob("__init__.py")
        if p.parent.relative_to(TESTS).as_posix() not in PACKAGE_SUITES
    ]
    assert not stray, f"remove: {stray}"


def test_paths_are_not_computed_from_a_test_files_place():
    """`Path(__file__).parents[1]` means the checkout only in one directory; tests/support/repo_paths.py
    has ROOT, TESTS, SUPPORT and ASSETS for every test wherever it sits."""
    pattern = re.compile(r"Path\(__file__\)(\.resolve\(\))?\.(parent|parents)\b")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in [*_test_files(), *SUPPORT.glob("*.py")]
        if path.name != "repo_paths.py" and path != Path(__file__).resolve()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, f"use repo_paths' ROOT / TESTS / SUPPORT instead: {found}"
