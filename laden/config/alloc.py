"""Allocation modes: `<backend>:<dims>`, e.g. `fsdp:d2c2`, `sglang:d2t2`, `archon:d2p2e2`.

A mode names an engine backend and how its GPUs are split: `d` data, `t` tensor,
`c` Ulysses context, `p` pipeline and `e` expert parallel. `e` overlays `d` (experts are
sharded across data-parallel ranks) and adds no GPUs, so `num_gpus = d * t * c * p`.

Design: parsing is purely syntactic and accepts every backend name, so a mode such as
`archon:d2p2e2` parses, formats back exactly and passes the structural checks (dims the
backend supports, `e` divides `d`) even though `archon` is not implemented yet. Whether a
backend is implemented is a separate check, reported with the list of those that are.
The cost is two tables to keep in sync (capabilities, implemented), which is why both
live here side by side.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

Role = Literal["actor", "rollout"]

DIM_LETTERS = "dtcpe"
"""Canonical order of the dimension letters (used when a mode is built without an order)."""

DIM_NAMES = {"d": "data", "t": "tensor", "c": "context", "p": "pipeline", "e": "expert"}
_DIM_ATTRS = {"d": "dp", "t": "tp", "c": "cp", "p": "pp", "e": "ep"}

BACKEND_DIMS: dict[Role, dict[str, str]] = {
    "actor": {"fsdp": "dtc", "roundpipe": "d", "archon": "dtcpe", "megatron": "dtcpe"},
    "rollout": {"native": "dt", "sglang": "dt", "vllm": "dt"},
}
"""Dimension letters each backend supports, per role."""

IMPLEMENTED_BACKENDS: dict[Role, tuple[str, ...]] = {
    "actor": ("fsdp", "roundpipe"),
    "rollout": ("native", "vllm", "sglang"),
}
"""Backends that laden can run today, per role: the two training engines; the embedded native
engine (`native:d1`) and the vLLM and SGLang servers (started when installed)."""

_SYNTAX_HINT = (
    "expected '<backend>:<dims>' with dims from d (data), t (tensor), c (context), "
    "p (pipeline), e (expert), each followed by a size >= 1, e.g. 'fsdp:d2t2' or 'sglang:d4'"
)
_BACKEND_RE = re.compile(r"[a-z][a-z0-9_]*")
_DIM_RE = re.compile(r"([a-zA-Z])(\d+)")


@dataclass(frozen=True, kw_only=True, slots=True)
class AllocationMode:
    """A parsed allocation mode; `str(mode)` gives back the string it was parsed from."""

    backend: str
    """Engine backend name, e.g. `fsdp` or `sglang`."""
    dp: int = 1
    """Data-parallel size (`d`)."""
    tp: int = 1
    """Tensor-parallel size (`t`)."""
    cp: int = 1
    """Ulysses context-parallel size (`c`)."""
    pp: int = 1
    """Pipeline-parallel size (`p`)."""
    ep: int = 1
    """Expert-parallel size (`e`); overlays `d` and adds no GPUs."""
    dim_order: tuple[str, ...] = field(default=(), compare=False)
    """Dimension letters in the order they were written, so formatting round-trips exactly."""

    @classmethod
    def parse(cls, text: str) -> AllocationMode:
        """Parse `<backend>:<dims>`; raise ValueError naming the string, the reason and the syntax."""
        if not isinstance(text, str):
            raise ValueError(f"invalid allocation mode {text!r}: not a string; {_SYNTAX_HINT}")
        stripped = text.strip()
        if not stripped:
            raise ValueError(f"invalid allocation mode {text!r}: it is empty; {_SYNTAX_HINT}")
        backend, sep, dims = stripped.partition(":")
        if not sep or not backend:
            raise ValueError(f"invalid allocation mode {text!r}: the backend is missing; {_SYNTAX_HINT}")
        if not _BACKEND_RE.fullmatch(backend):
            raise ValueError(
                f"invalid allocation mode {text!r}: backend {backend!r} must be lower-case letters, "
                f"digits or '_'; {_SYNTAX_HINT}"
            )
        sizes = _parse_dims(text, dims)
        return cls(backend=backend, dim_order=tuple(sizes), **{_DIM_ATTRS[k]: v for k, v in sizes.items()})

    def size(self, letter: str) -> int:
        """Size of the dimension named by `letter` (one of `dtcpe`)."""
        return getattr(self, _DIM_ATTRS[letter])

    @property
    def num_gpus(self) -> int:
        """GPUs this mode occupies: d * t * c * p (e overlays d)."""
        return self.dp * self.tp * self.cp * self.pp

    def format(self) -> str:
        """The mode as `<backend>:<dims>`, in the order it was written."""
        order = self.dim_order or tuple(k for k in DIM_LETTERS if self.size(k) != 1) or ("d",)
        return self.backend + ":" + "".join(f"{k}{self.size(k)}" for k in order)

    def __str__(self) -> str:
        return self.format()


def _parse_dims(text: str, dims: str) -> dict[str, int]:
    """Dims string -> {letter: size} in written order; raise ValueError on any grammar error."""
    if not dims:
        raise ValueError(f"invalid allocation mode {text!r}: no dimensions after ':'; {_SYNTAX_HINT}")
    sizes: dict[str, int] = {}
    pos = 0
    for match in _DIM_RE.finditer(dims):
        if match.start() != pos:
            break
        letter, digits = match.group(1), match.group(2)
        reason = None
        if letter not in DIM_LETTERS:
            reason = f"unknown dimension letter {letter!r}"
        elif letter in sizes:
            reason = f"dimension {letter!r} is repeated"
        elif int(digits) == 0:
            reason = f"dimension {letter!r} has size 0; sizes must be at least 1"
        elif digits.startswith("0"):
            reason = f"size {digits!r} of dimension {letter!r} has a leading zero"
        if reason:
            raise ValueError(f"invalid allocation mode {text!r}: {reason}; {_SYNTAX_HINT}")
        sizes[letter] = int(digits)
        pos = match.end()
    if pos != len(dims):
        raise ValueError(
            f"invalid allocation mode {text!r}: cannot read {dims[pos:]!r} as <letter><size>; {_SYNTAX_HINT}"
        )
    return sizes


def check_alloc(
    mode: AllocationMode | str, *, role: Role, field: str, require_implemented: bool = True
) -> list[str]:
    """Errors for `mode` used as `field` (e.g. `actor.backend`) of an engine with `role`.

    Structural checks: the string parses, the backend is known for the role, every dim of
    size > 1 is supported by the backend, `e` divides `d`. With `require_implemented`, a
    structurally valid mode whose backend is not implemented yet is an error too.
    """
    text = mode if isinstance(mode, str) else mode.format()
    if isinstance(mode, str):
        try:
            mode = AllocationMode.parse(mode)
        except ValueError as err:
            return [f"{field}={text!r}: {err}"]
    backends = BACKEND_DIMS[role]
    if mode.backend not in backends:
        return [_unknown_backend_error(mode, role=role, field=field, text=text)]
    errors = _dim_errors(mode, role=role, field=field, text=text)
    if require_implemented and not errors and mode.backend not in IMPLEMENTED_BACKENDS[role]:
        errors.append(
            f"{field}={text!r}: backend {mode.backend!r} is not implemented yet; implemented "
            f"{role} backends: {', '.join(IMPLEMENTED_BACKENDS[role]) or 'none yet'}"
        )
    if require_implemented and not errors and mode.backend == "native" and mode.tp > 1:
        errors.append(
            f"{field}={text!r}: the native engine runs one copy on one GPU per process (native:dN: one per "
            "process of the run); its tensor parallel mode (t) is not implemented yet. Use "
            f"native:d{mode.dp}, or a server for tensor parallel generation: vllm:d{mode.dp}t{mode.tp} / "
            f"sglang:d{mode.dp}t{mode.tp}"
        )
    return errors


def _unknown_backend_error(mode: AllocationMode, *, role: Role, field: str, text: str) -> str:
    known = ", ".join(BACKEND_DIMS[role])
    other: Role = "rollout" if role == "actor" else "actor"
    hint = ""
    if mode.backend in BACKEND_DIMS[other]:
        hint = f" ({mode.backend!r} is a {other} backend; it belongs in {other}.backend)"
    return f"{field}={text!r}: unknown {role} backend {mode.backend!r}{hint}; {role} backends: {known}"


def _dim_errors(mode: AllocationMode, *, role: Role, field: str, text: str) -> list[str]:
    supported = BACKEND_DIMS[role][mode.backend]
    errors = []
    for letter in DIM_LETTERS:
        size = mode.size(letter)
        if size == 1 or letter in supported:
            continue
        capable = [b for b, dims in BACKEND_DIMS[role].items() if letter in dims]
        where = f"backends that support it: {', '.join(capable)}" if capable else "no backend supports it"
        errors.append(
            f"{field}={text!r}: backend {mode.backend!r} does not support {DIM_NAMES[letter]} "
            f"parallelism ({letter}{size}); {where}; remove {letter}{size} or switch backend"
        )
    if mode.dp % mode.ep != 0:
        valid = [e for e in range(1, mode.dp + 1) if mode.dp % e == 0]
        errors.append(
            f"{field}={text!r}: expert parallel size e={mode.ep} must divide data parallel size "
            f"d={mode.dp} (e overlays d); use e in {{{', '.join(map(str, valid))}}}"
        )
    return errors


def valid_head_sizes(num_attention_heads: int, num_key_value_heads: int | None) -> list[int]:
    """Split sizes that satisfy the head rule (see `head_rule_errors`)."""
    kv = num_key_value_heads or num_attention_heads
    return [
        s
        for s in range(1, num_attention_heads + 1)
        if num_attention_heads % s == 0 and (kv % s == 0 or s % kv == 0)
    ]


def head_rule_errors(
    size: int,
    num_attention_heads: int,
    num_key_value_heads: int | None,
    *,
    field: str,
    axis_name: str,
) -> list[str]:
    """Errors when splitting attention heads `size` ways (tensor or Ulysses context axis).

    `size` must divide the attention heads, and either divide the KV heads or be a
    multiple of them (KV heads are then replicated).
    """
    kv = num_key_value_heads or num_attention_heads
    if num_attention_heads % size == 0 and (kv % size == 0 or size % kv == 0):
        return []
    valid = ", ".join(map(str, valid_head_sizes(num_attention_heads, kv)))
    return [
        f"{field}: {axis_name} size {size} must divide num_attention_heads={num_attention_heads} and "
        f"either divide or be a multiple of num_key_value_heads={kv}; valid {axis_name} sizes for "
        f"this model: {valid}"
    ]
