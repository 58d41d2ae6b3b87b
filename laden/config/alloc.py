"""Allocation modes: `<backend>:<dims>`, e.g. `fsdp:d2c2`, `sglang:d2t2`, `archon:d2p2e2`.

A mode names an engine backend and how its GPUs are split: `d` data, `t` tensor,
`c` Ulysses context, `p` pipeline and `e` expert parallel. `e` adds no GPUs, so
`num_gpus = d * t * c * p`; as in AReaL, the experts of one pipeline stage are spread over
that stage's `d * t * c` GPUs, so `e` must divide `d * t * c` (`megatron:d2p2t4e4` is valid).
MoE models may split attention and expert (FFN) layers differently, AReaL's hybrid form
`megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)`: both halves cover the same GPUs with the same `p`,
and an `ffn` without `d` takes the data-parallel size that fills them.

Design: parsing is purely syntactic and accepts every backend name, so a mode such as
`archon:d2p2e2` parses, formats back exactly and passes the structural checks (dims the
backend supports, `e` divides `d * t * c`) even though `archon` is not implemented yet.
Whether a backend is implemented is a separate check, reported with the list of those that
are. The cost is two tables to keep in sync (capabilities, implemented), which is why both
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
    "rollout": {"native": "dt", "sglang": "dtp", "vllm": "dtp"},
}
"""Dimension letters each backend supports, per role (AReaL's table; `p` on a rollout server is
accepted with size 1 only, see `check_alloc`)."""

HYBRID_BACKENDS = ("megatron", "archon")
"""Training backends whose MoE hybrid form `(attn:...|ffn:...)` AReaL accepts."""

ATTN_LETTERS = "dtcp"
"""Dimension letters of the `attn:` half of the hybrid form."""
FFN_LETTERS = "dtpe"
"""Dimension letters of the `ffn:` half of the hybrid form."""

IMPLEMENTED_BACKENDS: dict[Role, tuple[str, ...]] = {
    "actor": ("fsdp", "roundpipe", "archon", "megatron"),
    "rollout": ("native", "vllm", "sglang"),
}
"""Backends that laden can run today, per role: the training engines (`megatron:` modes run on the
archon engine, with a warning: laden has no Megatron-Core); the embedded native
engine (`native:dN`, `native:dNtM` tensor parallel) and the vLLM and SGLang servers (started when
installed)."""

_SYNTAX_HINT = (
    "expected '<backend>:<dims>' with dims from d (data), t (tensor), c (context), "
    "p (pipeline), e (expert), each followed by a size >= 1, e.g. 'fsdp:d2t2' or 'sglang:d4'"
)
_BACKEND_RE = re.compile(r"[a-z][a-z0-9_]*")
_DIM_RE = re.compile(r"([a-zA-Z])(\d+)")
_HYBRID_RE = re.compile(r"(\(?)attn:([^|()]*)\|ffn:([^|()]*)(\)?)")


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertSplit:
    """The `ffn:` half of the MoE hybrid form: how the expert (FFN) layers are split."""

    dp: int | None = None
    """Expert data-parallel size (`d`); None = the size that fills the attention half's GPUs."""
    tp: int = 1
    """Expert tensor-parallel size (`t`)."""
    pp: int | None = None
    """Pipeline-parallel size (`p`); None = the attention half's (they must be equal)."""
    ep: int = 1
    """Expert-parallel size (`e`)."""
    dim_order: tuple[str, ...] = field(default=(), compare=False)
    """Dimension letters in the order they were written, so formatting round-trips exactly."""

    def format(self) -> str:
        """The dims as written, e.g. `d2p2t4e2`."""
        sizes = {"d": self.dp, "t": self.tp, "p": self.pp, "e": self.ep}
        order = self.dim_order or tuple(k for k in FFN_LETTERS if sizes[k] not in (None, 1)) or ("e",)
        return "".join(f"{k}{sizes[k]}" for k in order)


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
    """Expert-parallel size (`e`; in the hybrid form the `ffn` half's); adds no GPUs."""
    dim_order: tuple[str, ...] = field(default=(), compare=False)
    """Dimension letters in the order they were written, so formatting round-trips exactly."""
    ffn: ExpertSplit | None = None
    """The `ffn:` half of the MoE hybrid form (the other sizes are then the `attn:` half's); None = one split."""
    parenthesized: bool = field(default=True, compare=False)
    """Whether the hybrid form was written in parentheses (AReaL accepts both), for round-tripping."""

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
        hybrid = _HYBRID_RE.fullmatch(dims)
        if hybrid is not None:
            return cls._parse_hybrid(text, backend, hybrid)
        if "|" in dims or "(" in dims:
            raise ValueError(
                f"invalid allocation mode {text!r}: cannot read {dims!r} as the MoE hybrid form; {_HYBRID_HINT}"
            )
        sizes = _parse_dims(text, dims)
        return cls(backend=backend, dim_order=tuple(sizes), dp=sizes.get("d", 1), tp=sizes.get("t", 1),
                   cp=sizes.get("c", 1), pp=sizes.get("p", 1), ep=sizes.get("e", 1))  # fmt: skip

    @classmethod
    def _parse_hybrid(cls, text: str, backend: str, match: re.Match[str]) -> AllocationMode:
        opening, attn_dims, ffn_dims, closing = match.groups()
        if bool(opening) != bool(closing):
            raise ValueError(f"invalid allocation mode {text!r}: unbalanced parentheses; {_HYBRID_HINT}")
        attn = _parse_dims(text, attn_dims, letters=ATTN_LETTERS, part="attn")
        ffn = _parse_dims(text, ffn_dims, letters=FFN_LETTERS, part="ffn")
        split = ExpertSplit(dp=ffn.get("d"), tp=ffn.get("t", 1), pp=ffn.get("p"), ep=ffn.get("e", 1),
                            dim_order=tuple(ffn))  # fmt: skip
        return cls(backend=backend, dim_order=tuple(attn), dp=attn.get("d", 1), tp=attn.get("t", 1),
                   cp=attn.get("c", 1), pp=attn.get("p", 1), ep=split.ep, ffn=split,
                   parenthesized=bool(opening))  # fmt: skip

    def size(self, letter: str) -> int:
        """Size of the dimension named by `letter` (one of `dtcpe`)."""
        return getattr(self, _DIM_ATTRS[letter])

    @property
    def num_gpus(self) -> int:
        """GPUs this mode occupies: d * t * c * p (`e` adds none; the hybrid form: its attn half's)."""
        return self.dp * self.tp * self.cp * self.pp

    def format(self) -> str:
        """The mode as `<backend>:<dims>`, in the order it was written."""
        letters = ATTN_LETTERS if self.ffn is not None else DIM_LETTERS
        order = self.dim_order or tuple(k for k in letters if self.size(k) != 1) or ("d",)
        dims = "".join(f"{k}{self.size(k)}" for k in order)
        if self.ffn is not None:
            dims = f"attn:{dims}|ffn:{self.ffn.format()}"
            dims = f"({dims})" if self.parenthesized else dims
        return self.backend + ":" + dims

    def __str__(self) -> str:
        return self.format()


_HYBRID_HINT = (
    "the MoE hybrid form is '<backend>:(attn:<dims>|ffn:<dims>)' with attn dims from d, t, c, p and ffn "
    "dims from d, t, p, e, e.g. 'megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)'"
)


def _parse_dims(text: str, dims: str, *, letters: str = DIM_LETTERS, part: str = "") -> dict[str, int]:
    """Dims string -> {letter: size} in written order; raise ValueError on any grammar error.

    `part` names the half of the hybrid form being read ('attn', 'ffn'), whose letters are `letters`.
    """
    hint = _HYBRID_HINT if part else _SYNTAX_HINT
    if not dims:
        where = f"after '{part}:'" if part else "after ':'"
        raise ValueError(f"invalid allocation mode {text!r}: no dimensions {where}; {hint}")
    sizes: dict[str, int] = {}
    pos = 0
    for match in _DIM_RE.finditer(dims):
        if match.start() != pos:
            break
        letter, digits = match.group(1), match.group(2)
        reason = None
        if part and letter in DIM_LETTERS and letter not in letters:
            reason = f"dimension {letter!r} is not allowed in the {part} part"
        elif letter not in letters:
            reason = f"unknown dimension letter {letter!r}"
        elif letter in sizes:
            reason = f"dimension {letter!r} is repeated"
        elif int(digits) == 0:
            reason = f"dimension {letter!r} has size 0; sizes must be at least 1"
        elif digits.startswith("0"):
            reason = f"size {digits!r} of dimension {letter!r} has a leading zero"
        if reason:
            raise ValueError(f"invalid allocation mode {text!r}: {reason}; {hint}")
        sizes[letter] = int(digits)
        pos = match.end()
    if pos != len(dims):
        raise ValueError(
            f"invalid allocation mode {text!r}: cannot read {dims[pos:]!r} as <letter><size>; {hint}"
        )
    return sizes


_INFERENCE_BACKENDS = ("sglang", "vllm")
_COMPONENT_RE = re.compile(r"(?:(?P<backend>[a-z]+)(?:\[\w+\]|\(\w+\))?[:.])?(?P<dims>.+)")
_AREAL_HYBRID_RE = re.compile(r"\(?attn:.*\|ffn:.*")


def split_areal_allocation(text: str) -> tuple[str | None, str | None, bool]:
    """AReaL's combined `allocation_mode` -> (rollout mode, actor mode, whether the actor's backend was
    chosen from its dims); raise ValueError with the reason.

    `sglang:d4p1t1+fsdp:d4p1t1` -> ('sglang:d4p1t1', 'fsdp:d4p1t1', False). Older forms parse too:
    `sglang.d4` for `sglang:d4`, `[name]` tags, and training dims without a backend, which AReaL
    ran on megatron when they hold p or e > 1 (or are the hybrid form) and on fsdp otherwise.
    Colocation (`|` between engines) is refused: laden runs rollout servers on GPUs of their own.
    """
    rollout = actor = None
    auto = False
    for part in text.replace(" ", "").split("+"):
        hybrid = _AREAL_HYBRID_RE.search(part) is not None
        if "|" in part and not hybrid:
            raise ValueError(
                f"'{part}' colocates engines on the same GPUs, but laden runs rollout servers on GPUs of their "
                "own: write '<rollout>+<actor>' (e.g. sglang:d4+fsdp:d4), or rollout.backend: native:d<N> to "
                "generate on the training GPUs"
            )
        match = _COMPONENT_RE.fullmatch(part)
        backend = match.group("backend") if match else None
        if match is None or part in ("eval", "cpu"):
            raise ValueError(
                f"cannot read '{part}'; expected '<rollout>:<dims>+<actor>:<dims>', e.g. {_EXAMPLE}"
            )
        dims = match.group("dims")
        if backend == "attn":  # the hybrid form without a backend: `attn:...|ffn:...`
            backend, dims = None, part
        if backend in _INFERENCE_BACKENDS:
            rollout = f"{backend}:{dims}"
        elif backend is None:
            actor, auto = f"{_areal_train_backend(dims, hybrid)}:{dims}", True
        else:
            actor = f"{backend}:{dims}"
    return rollout, actor, auto


_EXAMPLE = "sglang:d4p1t1+fsdp:d4p1t1"


def _areal_train_backend(dims: str, hybrid: bool) -> str:
    if hybrid:
        return "megatron"
    try:
        mode = AllocationMode.parse(f"fsdp:{dims}")
    except ValueError:
        return "fsdp"  # the loader reports the dims
    return "megatron" if mode.pp > 1 or mode.ep > 1 else "fsdp"


def check_alloc(
    mode: AllocationMode | str, *, role: Role, field: str, require_implemented: bool = True
) -> list[str]:
    """Errors for `mode` used as `field` (e.g. `actor.backend`) of an engine with `role`.

    Structural checks (AReaL's rules): the string parses, the backend is known for the role,
    every dim of size > 1 is supported by the backend, `e` divides `d * t * c`, and the hybrid
    form's halves agree. With `require_implemented`, a structurally valid mode that laden cannot
    run yet is an error too: a backend not implemented, the hybrid form, `p` > 1 on a rollout
    server.
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
    if mode.ffn is not None and (role != "actor" or mode.backend not in HYBRID_BACKENDS):
        return [
            f"{field}={text!r}: the MoE hybrid form (attn:...|ffn:...) is for the training backends "
            f"{', '.join(HYBRID_BACKENDS)}; write {mode.backend}:<dims> instead"
        ]
    errors = _dim_errors(mode, role=role, field=field, text=text)
    if mode.ffn is not None:
        errors += _hybrid_errors(mode, field=field, text=text)
    if require_implemented and not errors:
        errors += _not_implemented_errors(mode, role=role, field=field, text=text)
    return errors


def _not_implemented_errors(mode: AllocationMode, *, role: Role, field: str, text: str) -> list[str]:
    implemented = ", ".join(IMPLEMENTED_BACKENDS[role]) or "none yet"
    if mode.backend in HYBRID_BACKENDS:
        return _archon_errors(mode, field=field, text=text)
    if mode.ffn is not None:
        return [
            f"{field}={text!r}: the MoE hybrid form (attn:...|ffn:...) of backend {mode.backend!r} is not "
            f"implemented yet; implemented {role} backends: {implemented}"
        ]
    if mode.backend not in IMPLEMENTED_BACKENDS[role]:
        return [
            f"{field}={text!r}: backend {mode.backend!r} is not implemented yet; implemented "
            f"{role} backends: {implemented}"
        ]
    if role == "rollout" and mode.pp > 1:
        return [
            f"{field}={text!r}: pipeline parallel generation (p{mode.pp}) is not supported: laden starts "
            f"each {mode.backend} server on t GPUs with tensor parallelism only; use "
            f"{mode.backend}:d{mode.dp}t{mode.tp * mode.pp} (the same GPUs as t), or p1"
        ]
    return []


def archon_layout(mode: AllocationMode) -> tuple[int, int, int]:
    """(d, p, e) of an `archon:` / `megatron:` mode the archon engine runs (the hybrid form's attention
    half gives d and p, its ffn half e)."""
    return mode.dp, mode.pp, mode.ffn.ep if mode.ffn is not None else mode.ep


def _archon_errors(mode: AllocationMode, *, field: str, text: str) -> list[str]:
    """The archon engine runs data, pipeline, tensor, context and expert parallel, the experts spread
    over data-parallel ranks and whole on each tensor rank; not experts split over tensor ranks (the
    hybrid form's ffn t) or spread over tensor or context ranks (e not dividing d) yet."""
    dp, pp, ep = archon_layout(mode)
    ffn_tp = mode.ffn.tp if mode.ffn is not None else 1
    missing = [f"tensor-parallel experts (ffn:...t{ffn_tp})"] if ffn_tp > 1 else []
    if dp % ep:
        missing.append(f"experts spread over tensor or context ranks (e{ep} does not divide d{dp})")
    if not missing:
        return []
    same = (
        f"{mode.backend}:d{mode.num_gpus // pp}" + (f"p{pp}" if pp > 1 else "") + (f"e{ep}" if ep > 1 else "")
    )
    return [
        f"{field}={text!r}: the archon engine (which runs {mode.backend}: modes) implements data, pipeline, "
        f"tensor, context and expert parallel, not {' or '.join(missing)} yet; use the same GPUs as data parallel "
        f"({same}), or fsdp:dXtYcZ without p and e"
    ]


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
    stage = mode.dp * mode.tp * mode.cp  # the GPUs of one pipeline stage
    if mode.ffn is None and stage % mode.ep != 0:
        valid = [e for e in range(1, stage + 1) if stage % e == 0]
        others = (
            f" times tensor and context sizes t*c={mode.tp * mode.cp} (d*t*c={stage})"
            if stage != mode.dp
            else ""
        )
        errors.append(
            f"{field}={text!r}: expert parallel size e={mode.ep} must divide data parallel size "
            f"d={mode.dp}{others}: the experts of a pipeline stage are spread over its GPUs; use e in "
            f"{{{', '.join(map(str, valid))}}}"
        )
    return errors


def _hybrid_errors(mode: AllocationMode, *, field: str, text: str) -> list[str]:
    """AReaL's rules of the MoE hybrid form: same `p` in both halves, same number of GPUs."""
    assert mode.ffn is not None
    ffn, world = mode.ffn, mode.num_gpus
    pp = mode.pp if ffn.pp is None else ffn.pp
    if pp != mode.pp:
        return [
            f"{field}={text!r}: pipeline parallel sizes differ (attn p{mode.pp}, ffn p{ffn.pp}); both halves "
            f"run the same pipeline stages: set ffn p{mode.pp} or leave p out of ffn"
        ]
    rest = ffn.tp * pp * ffn.ep
    if ffn.dp is None:
        if world % rest == 0:
            return []
        return [
            f"{field}={text!r}: the ffn half's t*p*e={rest} does not divide the attn half's {world} GPUs, so no "
            "expert data-parallel size fills them; choose t, e so that t*p*e divides d*t*c*p of attn"
        ]
    if ffn.dp * rest == world:
        return []
    return [
        f"{field}={text!r}: the halves cover different numbers of GPUs (attn d*t*c*p={world}, ffn "
        f"d*t*p*e={ffn.dp * rest}); they split the same GPUs: make them equal, or leave d out of ffn"
    ]


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
