"""`laden.import_path`: one resolver for every field that names user code. Each failure says the field,
the value, the reason and the fix (the caller's last), for both path syntaxes, and a module of one's own
found on `sys.path` resolves like an installed one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from laden.import_path import (
    ImportPathError,
    import_path_error,
    is_import_path,
    resolve_import_path,
    split_import_path,
)

FIX = "set my.field to a function of x"


@pytest.fixture
def local_module(tmp_path, monkeypatch):
    """A module written into a folder put on sys.path (as a user's `my_code.py` next to the config)."""
    names = []

    def write(name: str, text: str) -> str:
        (tmp_path / f"{name}.py").write_text(text)
        names.append(name)
        return name

    monkeypatch.syspath_prepend(str(tmp_path))
    yield write
    for name in names:
        sys.modules.pop(name, None)


def _error(value, **kwargs) -> ImportPathError:
    with pytest.raises(ImportPathError) as info:
        resolve_import_path(value, field="my.field", fix=FIX, **kwargs)
    assert isinstance(info.value, ValueError)  # what every caller documents
    assert str(info.value).startswith(f"my.field={value!r}") and str(info.value).endswith(FIX)
    return info.value


@pytest.mark.parametrize("path", ["local_rows:Scorer.score", "local_rows.double"])
def test_both_syntaxes_resolve_a_module_on_sys_path(local_module, path):
    local_module(
        "local_rows", "def double(x):\n    return 2 * x\nclass Scorer:\n    score = staticmethod(double)\n"
    )
    function = resolve_import_path(path, field="my.field", fix=FIX, callable_as="a function")
    assert function(3) == 6


def test_colon_and_dotted_forms_name_the_same_object():
    colon = resolve_import_path("os.path:join", field="f", fix=FIX)
    assert colon is resolve_import_path("os.path.join", field="f", fix=FIX) is os.path.join
    assert split_import_path("a.b:C.d", field="f", fix=FIX) == ("a.b", "C.d")
    assert split_import_path("a.b.C", field="f", fix=FIX) == ("a.b", "C")


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("no_dots", "is not an import path (`package.module:name` or `package.module.name`)"),
        ("mod:", "is not an import path"),
        ("a b:c", "is not an import path"),
        ("mod:a..b", "is not an import path"),
        ("", "is empty, not an import path"),
        ("  ", "is empty, not an import path"),
        (3, "is a int, not an import path"),
    ],
)
def test_a_malformed_path_is_refused_before_anything_is_imported(value, reason):
    error = _error(value)
    assert error.reason.startswith(reason) and error.fix == FIX and error.missing is None
    assert str(error) == f"my.field={value!r} {error.reason}; {FIX}"
    assert not is_import_path(value)
    assert import_path_error(value, field="my.field", fix=FIX) == str(error)
    assert import_path_error("pkg.mod:name", field="my.field", fix=FIX) is None


def test_a_module_that_is_not_found_is_named_with_where_it_was_looked_for():
    error = _error("no_such_module_xyz.sub:f")
    assert error.reason == "cannot import 'no_such_module_xyz.sub': no module named 'no_such_module_xyz'"
    assert (
        f"check the spelling and that its folder is on PYTHONPATH (the working directory is {os.getcwd()})"
        in str(error)
    )
    assert error.missing == "no_such_module_xyz"


def test_a_missing_package_the_module_imports_is_named_with_what_to_install(local_module):
    local_module("needs_dep_rows", "import not_installed_dep_xyz.sub\n\ndef f(x):\n    return x\n")
    error = _error("needs_dep_rows:f")
    assert (
        error.reason
        == "cannot import 'needs_dep_rows': it imports the missing module 'not_installed_dep_xyz'"
    )
    assert "install it (pip install not_installed_dep_xyz, or the package that provides it)" in str(error)
    assert error.missing == "not_installed_dep_xyz"


@pytest.mark.parametrize(
    ("text", "raised", "line"),
    [
        ("x = 1\nraise RuntimeError('no config here')\n", "RuntimeError: no config here", 2),
        ("x = 1\ndef f(:\n", "SyntaxError", 2),
        ("import sys\nsys.exit(3)\n", "SystemExit: 3", 2),
        ("from os import no_such_name_xyz\n", "ImportError: cannot import name 'no_such_name_xyz'", 1),
    ],
)
def test_a_module_whose_import_raises_is_reported_with_the_line(local_module, text, raised, line):
    name = local_module(f"raising_rows_{abs(hash(text)) % 10**6}", text)
    error = _error(f"{name}:f")
    assert error.reason.startswith(f"cannot import {name!r}: importing it raised {raised}")
    assert error.reason.endswith(f"{name}.py, line {line})") and "fix that error in the module" in str(error)


def test_a_missing_attribute_names_its_owner_and_what_the_module_has(local_module):
    local_module("attr_rows", "import json\ndef to_prompt(row):\n    return row\nclass Rows:\n    pass\n")
    error = _error("attr_rows:to_promt")
    assert error.reason == "'attr_rows' has no attribute 'to_promt' (it has: Rows, to_prompt)"  # not json
    assert str(error).endswith(f"fix the name after the module; {FIX}")
    nested = _error("attr_rows:Rows.build")
    assert nested.reason == "'attr_rows.Rows' has no attribute 'build'"
    # without a colon the last dot splits module from name (AReaL's rule): attr_rows.Rows is taken for a module
    assert (
        _error("attr_rows.Rows.build").reason
        == "cannot import 'attr_rows.Rows': no module named 'attr_rows.Rows'"
    )


def test_an_object_that_is_not_callable_is_refused_only_when_a_callable_is_wanted(local_module):
    local_module("value_rows", "LIMIT = 3\n")
    assert resolve_import_path("value_rows:LIMIT", field="my.field", fix=FIX) == 3
    error = _error("value_rows:LIMIT", callable_as="a function")
    assert str(error) == f"my.field='value_rows:LIMIT' names a int, not a function; {FIX}"


def test_the_resolver_imports_nothing_heavy():
    """The config layer and reward worker processes import it: only the standard library comes with it."""
    code = (
        "import sys, laden.import_path\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'numpy', 'transformers', 'yaml'}"
        " or (m.startswith('laden.') and m != 'laden.import_path'))\n"
        "print(heavy)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
