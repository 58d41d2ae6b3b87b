"""Generate the configuration reference from the dataclasses' attribute docstrings.

The one-line string literal after each field in `schema.py` (and `schema_agent.py`, `schema_rl.py`, `schema_rollout.py`, `schema_teacher.py`, `schema_trackers.py`) is the only description a
field has; this module reads it back with `ast` so the reference cannot drift from the
code. Types are shown as written in the source (e.g. `Literal['ffd', 'kk']`), defaults
as YAML. Trade-off: attribute docstrings are not kept by Python at run time, so the
source file must be readable (it is, for an installed package).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import typing

from laden.config import schema, schema_agent, schema_rl, schema_rollout, schema_teacher, schema_trackers
from laden.config.loader import list_section_type, section_type, yaml_scalar
from laden.config.schema import LadenConfig


@dataclasses.dataclass(kw_only=True, slots=True)
class FieldDoc:
    """One row of the reference."""

    name: str
    """Field name."""
    type: str
    """Annotation as written in the source."""
    doc: str
    """The field's attribute docstring ('' when missing)."""


@functools.cache
def _class_docs() -> dict[str, list[FieldDoc]]:
    """Class name -> its annotated fields, in order, with their attribute docstrings."""
    out: dict[str, list[FieldDoc]] = {}
    for module in (schema, schema_agent, schema_rl, schema_rollout, schema_teacher, schema_trackers):
        for node in ast.parse(inspect.getsource(module)).body:
            if isinstance(node, ast.ClassDef):
                out[node.name] = _fields_of(node)
    return out


def _fields_of(node: ast.ClassDef) -> list[FieldDoc]:
    rows = []
    body = node.body
    for i, stmt in enumerate(body):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        nxt = body[i + 1] if i + 1 < len(body) else None
        doc = ""
        if (
            isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            doc = " ".join(nxt.value.value.split())
        rows.append(FieldDoc(name=stmt.target.id, type=ast.unparse(stmt.annotation), doc=doc))
    return rows


def _rows(cls: type) -> list[FieldDoc]:
    """The documented fields of `cls`, its own first, then those it inherits (`LadenConfig`'s `AgentFields`)."""
    docs = _class_docs()
    return [row for klass in cls.__mro__ if klass.__name__ in docs for row in docs[klass.__name__]]


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> attribute docstring for a config dataclass of `schema`."""
    return {row.name: row.doc for row in _rows(cls)}


def sections() -> list[tuple[str, type]]:
    """(dotted section name, dataclass) for the whole tree, top level first ('' = top level)."""
    out: list[tuple[str, type]] = []

    def walk(cls: type, name: str) -> None:
        out.append((name, cls))
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            sub = section_type(hint)
            if sub is not None:
                walk(sub, f"{name}.{f.name}" if name else f.name)
            item = list_section_type(hint)
            if item is not None:  # a list of sections: one table for its items (`reward_fns[]`)
                walk(item, f"{name}.{f.name}[]" if name else f"{f.name}[]")

    walk(LadenConfig, "")
    return out


def missing_docstrings() -> list[str]:
    """Dotted names of fields without an attribute docstring (should be empty)."""
    missing = []
    for name, cls in sections():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if not docs.get(f.name):
                missing.append(f"{name}.{f.name}" if name else f.name)
    return missing


def config_reference_markdown() -> str:
    """The configuration reference: one markdown table per section (field, type, default, description)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `laden/config/schema.py` (and `schema_agent.py`, `schema_rl.py`, `schema_rollout.py`, `schema_teacher.py`, `schema_trackers.py`). Set fields in YAML or as `dotted.key=value` overrides.",
    ]
    for name, cls in sections():
        title = f"`{name}`" if name else "Top level"
        lines += ["", f"## {title}", "", (cls.__doc__ or "").strip(), ""]
        lines += ["| Field | Type | Default | Description |", "| --- | --- | --- | --- |"]
        rows = {row.name: row for row in _rows(cls)}
        defaults = cls()
        hints = typing.get_type_hints(cls)
        for row in rows.values():
            f = next(f for f in dataclasses.fields(cls) if f.name == row.name)
            dotted = f"{name}.{f.name}" if name else f.name
            default = getattr(defaults, f.name)
            if section_type(hints[f.name]) is not None and default is not None:
                shown = f"see `{dotted}`"
            else:
                shown = f"`{yaml_scalar(default)}`"
            lines.append(f"| `{dotted}` | `{_escape(row.type)}` | {shown} | {_escape(row.doc)} |")
    return "\n".join(lines) + "\n"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")
