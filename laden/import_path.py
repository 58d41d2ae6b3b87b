"""Objects named in a config by import path: `package.module:name` or AReaL's `package.module.name`.

Every field that names user code (`transform_fn`, `workflow`, `eval_workflow`, `agent_builder_path`,
`reward_fn`) is resolved here, so a bad path reads the same whichever field it is in: the field, its
value, the reason and the fix, with the caller's own fix (what the field must name) last:

- the form: not `module:name` / `module.name` (checked at config load time too, without importing);
- the module is not found (misspelt, or its folder not on `PYTHONPATH`: the working directory is named);
- the module imports a package that is not installed (which one, and `pip install` it);
- importing the module raised (the exception's last line and the file and line it came from);
- an attribute is missing (the callables the module does define are listed, to spot a typo);
- the object is not callable, where the caller needs a callable.

After a colon the name may be dotted (`pkg.mod:Scorer.score` walks attributes); without a colon the
last dot splits module from name (AReaL's rule: `pkg.mod.Scorer.score` is the module `pkg.mod.Scorer`). Imports only the standard library: the config layer checks a
path's form with it, and reward worker processes import it before the reward module.
"""

from __future__ import annotations

import importlib
import os
import re
import traceback
import types
from typing import Any

__all__ = [
    "ImportPathError",
    "import_path_error",
    "is_import_path",
    "resolve_import_path",
    "split_import_path",
]

_FORM = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*)?")
_FORMS = "`package.module:name` or `package.module.name`"


class ImportPathError(ValueError):
    """An import path that gives no object. `str()` is the whole message; `field`, `value`, `reason`
    and `fix` are its parts, and `missing` the module that could not be found (None otherwise)."""

    def __init__(self, field: str, value: Any, reason: str, fix: str, *, missing: str | None = None) -> None:
        self.field, self.value, self.reason, self.fix, self.missing = field, value, reason, fix, missing
        separator = " " if reason.startswith(("is ", "names ")) else ": "
        super().__init__(f"{field}={value!r}{separator}{reason}; {fix}")


def is_import_path(value: object) -> bool:
    """Whether `value` has the form `module:name` or `module.name` (nothing is imported)."""
    return isinstance(value, str) and bool(_FORM.fullmatch(value)) and ("." in value or ":" in value)


def import_path_error(value: object, *, field: str, fix: str) -> str | None:
    """The form error of `value` as one line (for config validation), or None when it is an import path."""
    try:
        split_import_path(value, field=field, fix=fix)
    except ImportPathError as exc:
        return str(exc)
    return None


def split_import_path(value: object, *, field: str, fix: str) -> tuple[str, str]:
    """`(module, attribute path)` of an import path; `ImportPathError` when `value` is not one."""
    if not is_import_path(value):
        what = (
            f"is a {type(value).__name__}, not an import path" if not isinstance(value, str)
            else "is empty, not an import path" if not value.strip() else "is not an import path"
        )  # fmt: skip
        raise ImportPathError(field, value, f"{what} ({_FORMS})", fix)
    text = str(value)
    module, _, attribute = text.partition(":") if ":" in text else text.rpartition(".")
    return module, attribute


def resolve_import_path(value: object, *, field: str, fix: str, callable_as: str | None = None) -> Any:
    """The object `value` names, imported. `field` and `fix` (what the field must name, e.g. "set
    reward_fn to a function (prompt, completion, ...) -> float") go into every error; with
    `callable_as` (e.g. "a callable", "a class or factory") an object that is not callable is one.

    Raises `ImportPathError` (a `ValueError`) saying which of the failures of the module docstring it was."""
    module_name, attribute = split_import_path(value, field=field, fix=fix)
    module = _import(module_name, value, field=field, fix=fix)
    target: Any = module
    parts = attribute.split(".")
    for depth, part in enumerate(parts):
        if not hasattr(target, part):
            owner = ".".join([module_name, *parts[:depth]])
            raise ImportPathError(
                field, value, f"{owner!r} has no attribute {part!r}{_known_names(target)}",
                f"fix the name after the module; {fix}",
            )  # fmt: skip
        target = getattr(target, part)
    if callable_as is not None and not callable(target):
        raise ImportPathError(field, value, f"names a {type(target).__name__}, not {callable_as}", fix)
    return target


def _import(module_name: str, value: object, *, field: str, fix: str) -> types.ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        parts = module_name.split(".")
        if exc.name in {".".join(parts[: i + 1]) for i in range(len(parts))} or not exc.name:
            raise ImportPathError(
                field, value, f"cannot import {module_name!r}: no module named {exc.name or module_name!r}",
                f"check the spelling and that its folder is on PYTHONPATH (the working directory is "
                f"{os.getcwd()}); {fix}", missing=exc.name or module_name,
            ) from exc  # fmt: skip
        package = exc.name.split(".")[0]
        raise ImportPathError(
            field, value, f"cannot import {module_name!r}: it imports the missing module {exc.name!r}",
            f"install it (pip install {package}, or the package that provides it); {fix}", missing=exc.name,
        ) from exc  # fmt: skip
    except (Exception, SystemExit) as exc:  # the module's own code failed (SystemExit: it exits at import)
        raise ImportPathError(
            field, value, f"cannot import {module_name!r}: importing it raised {_last_line(exc)}{_where(exc)}",
            f"fix that error in the module; {fix}",
        ) from exc  # fmt: skip


def _last_line(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def _where(exc: BaseException) -> str:
    """ " (at file, line n)": where the exception was raised (for a SyntaxError: the line that has it)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" (at {exc.filename}, line {exc.lineno})"
    frames = traceback.extract_tb(exc.__traceback__)
    return f" (at {frames[-1].filename}, line {frames[-1].lineno})" if frames else ""


def _known_names(obj: Any) -> str:
    """ " (it has: f, g)": the public callables `obj` defines, to spot a misspelled name."""
    namespace = getattr(obj, "__dict__", {})
    home = obj.__name__ if isinstance(obj, types.ModuleType) else None
    names = sorted(
        name
        for name, value in namespace.items()
        if not name.startswith("_")
        and callable(value)
        and (home is None or getattr(value, "__module__", home) == home)  # not what it imports
    )
    if not names:
        return ""
    shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    return f" (it has: {shown})"
