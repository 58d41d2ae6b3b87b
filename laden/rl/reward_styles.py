"""How reward functions are found and called: import paths, four calling conventions, weighted sums.

Reward functions come written for one of four systems, each with its own calling convention (a
"style"); laden adapts its call to the function instead of asking for a wrapper:
- `laden`: `fn(prompt, completion, prompt_ids, completion_ids, **data_fields) -> float`, keywords.
- `areal`: AReaL's `reward_fn(prompt, completions, prompt_ids, completion_ids, **data) -> float`: the
  four first positionally (AReaL passes one completion string as `completions`), data as keywords.
- `trl`: TRL's batched `reward_func(prompts, completions, completion_ids, **kwargs) -> list[float |
  None]`. laden scores each completion as it finishes, so every argument is a list of ONE element:
  `prompts=[raw prompt]`, `completions=[completion]`, `completion_ids=[ids]`, each data field
  `[value]`. Conversational rows (the raw prompt is a list of `{"role", "content"}` turns) get
  `prompts=[turns]` and `completions=[[{"role": "assistant", "content": completion}]]`, as TRL does.
  A returned `None` means "not applicable" (TRL's meaning): that function is left out of the sum.
  What it costs: a TRL function that amortises work over a batch (one model forward for all
  completions) pays that work once per completion here.
- `verl`: `compute_score(data_source, solution_str, ground_truth, extra_info=None)`: `ground_truth`
  is the row's `ground_truth` field, else `reward_model["ground_truth"]` (verl's parquet layout), else
  `answer`; `extra_info` is passed only to a function that takes it. A dict result gives its `"score"`.

`auto` picks the style from the parameter names (`detect_style`); every style, picked or forced, is
checked against the signature when the function is loaded, so a function that cannot take the call
fails at start-up with the signature it needs, never on every call of a run.

Several functions (`RewardSpec`s, TRL's `reward_funcs` with `reward_weights`) score a completion as
`sum(weight * reward)` over the functions that did not return None; `CompositeReward` loads and calls
them. The raw prompt travels in the reserved keyword `RAW_PROMPT_KEY`, which every style removes.

A reward is a number: a `str` ("1.0"), a `bool` or a non-finite value is a failed call, never coerced;
numpy and torch scalars convert. Import paths are resolved by `laden.import_path`. This module imports
only the standard library and that module (which imports only the standard library too): reward
worker processes import it before the reward module.
"""

from __future__ import annotations

import inspect
import math
import numbers
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from laden.import_path import resolve_import_path, split_import_path

RewardFn = Callable[..., float]
"""`fn(prompt, completion, prompt_ids, completion_ids, **data_fields) -> float` (laden's style)."""

RewardStyle = Literal["auto", "laden", "areal", "trl", "verl"]
STYLES = ("laden", "areal", "trl", "verl")
STYLE_SIGNATURES = {
    "laden": "fn(prompt, completion, prompt_ids, completion_ids, **data_fields) -> float",
    "areal": "reward_fn(prompt, completions, prompt_ids, completion_ids, **data) -> float",
    "trl": "reward_func(prompts, completions, completion_ids, **kwargs) -> list[float | None]",
    "verl": "compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict",
}
"""What a function of each style looks like, for messages."""

RAW_PROMPT_KEY = "_raw_prompt"
"""The keyword that carries the row's prompt as it is in the data (text or chat turns) to the styles
that need it (TRL's `prompts`); removed before any reward function is called."""

_OWN_ARGS = {
    "laden": ("prompt", "completion", "prompt_ids", "completion_ids"),
    "areal": ("prompt", "completions", "prompt_ids", "completion_ids"),
    "trl": ("prompts", "completions", "completion_ids"),
    "verl": ("data_source", "solution_str", "ground_truth"),
}
_CALL_ARGS = frozenset(
    {"prompt", "completion", "prompt_ids", "completion_ids", "prompts", "completions", "solution_str"}
)
"""Some style's call arguments, never data fields: a parameter so named must be filled by the call."""
_VERL_GROUND_TRUTH = ("ground_truth", "reward_model.ground_truth", "answer")
_SIGNATURE_HINT = (
    "a reward function takes (prompt, completion, prompt_ids, completion_ids, **data_fields) "
    "and returns a float"
)
_PATH_HINT = "write 'package.module:function' (or 'package.module.function')"


class RewardSetupError(ValueError):
    """A reward cannot be loaded (its import fails or hangs, its signature fits no style); says how to fix it."""


class RewardCallError(RuntimeError):
    """One call of a reward function failed; the message names the function and carries its traceback."""


# --- loading a reward function by name --------------------------------------------------


def load_reward_fn(spec: str, field: str = "reward_fn") -> RewardFn:
    """Import the reward function named by `spec`: "pkg.module:func" or "pkg.module.func".

    After a colon, a dotted name (`"pkg.module:Scorer.score"`) walks attributes. Raises `ValueError`
    (`laden.import_path.ImportPathError`) naming what is missing: the module, a package it imports,
    an attribute, or a callable (the object is something else).
    """
    return resolve_import_path(spec, field=field, fix=_SIGNATURE_HINT, callable_as="a callable")


def split_spec(spec: str, field: str = "reward_fn") -> tuple[str, str]:
    """`(module, attribute path)` of an import path; `ValueError` when it is not one."""
    return split_import_path(spec, field=field, fix=_PATH_HINT)


# --- specs and what the workers report ---------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardSpec:
    """One reward function of a run and its weight in the completion's reward."""

    fn: str
    """Import path "pkg.module:function" (or "pkg.module.function")."""
    weight: float = 1.0
    """Its reward's weight in the sum (TRL's `reward_weights`); a negative weight penalises."""
    style: RewardStyle = "auto"
    """How it is called (see the module docstring); `auto` reads its parameter names."""
    name: str | None = None
    """Its metrics name (`reward/<name>`); None: the function's attribute name. Duplicates get _2, _3."""

    def __post_init__(self) -> None:
        problems = []
        try:
            split_spec(self.fn)
        except ValueError as exc:
            problems.append(str(exc))
        if (
            isinstance(self.weight, bool)
            or not isinstance(self.weight, numbers.Real)
            or not math.isfinite(self.weight)
        ):
            problems.append(f"weight={self.weight!r} must be a finite number")
        if self.style not in ("auto", *STYLES):
            problems.append(f"style={self.style!r} must be one of 'auto', {', '.join(map(repr, STYLES))}")
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            problems.append(f"name={self.name!r} must be a non-empty string or None (the function's name)")
        if problems:
            raise ValueError(f"invalid RewardSpec for {self.fn!r}: " + "; ".join(problems))


def as_specs(reward: str | Sequence[RewardSpec]) -> tuple[RewardSpec, ...]:
    """The specs a pool scores with: a plain import path is one function, style auto, weight 1."""
    if isinstance(reward, str):
        return (RewardSpec(fn=reward),)
    specs = [s for s in reward if isinstance(s, RewardSpec)] if isinstance(reward, Sequence) else []
    if not specs or len(specs) != len(reward):
        raise ValueError(
            f"reward={reward!r:.200} must be an import path 'pkg.module:function' or a non-empty list of RewardSpec"
        )
    return tuple(specs)


def metric_names(specs: Sequence[RewardSpec]) -> list[str]:
    """Each spec's metrics name: its `name`, else its function's attribute name; repeats get _2, _3."""
    names: list[str] = []
    for spec in specs:
        base = spec.name or split_spec(spec.fn)[1].split(".")[-1]
        name, count = base, 1
        while name in names:
            count += 1
            name = f"{base}_{count}"
        names.append(name)
    return names


def describe(specs: Sequence[RewardSpec]) -> str:
    """The functions of `specs` for messages: 'a:f' or 'a:f' + 'b:g'."""
    return " + ".join(repr(spec.fn) for spec in specs)


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardInfo:
    """What a reward worker found when it loaded the reward functions (sent with its "ready")."""

    names: list[str]
    """Each function's metrics name, in spec order."""
    styles: list[str]
    """Each function's style (the detected one for `auto`)."""
    required_fields: dict[str, list[tuple[str, ...]]]
    """Per name, the data fields it needs; a tuple is satisfied by ANY of its names (dotted: nested)."""


def missing_fields(info: RewardInfo, row: Mapping[str, Any]) -> list[str]:
    """The required fields `row` lacks (None counts as absent), e.g. `["answer"]` or
    `["ground_truth|reward_model.ground_truth|answer"]`; `[]` when it has them all."""
    missing: list[str] = []
    for needs in info.required_fields.values():
        for alternatives in needs:
            label = "|".join(alternatives)
            if label not in missing and all(_lookup(row, name) is None for name in alternatives):
                missing.append(label)
    return missing


def _lookup(row: Mapping[str, Any], dotted: str) -> Any:
    """`row["a"]["b"]` for "a.b"; None where a level is missing or not a dict."""
    value: Any = row
    for key in dotted.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


# --- styles: detection and checks at load time ---------------------------------------------


def detect_style(fn: Callable[..., Any]) -> str:
    """The style `fn`'s parameter names say (see the module docstring); `RewardSetupError` when none fits."""
    params = _signature(fn).parameters.values()
    names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if "solution_str" in names:
        return "verl"
    if "prompts" in names or ("completions" in names and "prompt" not in names):
        return "trl"
    if "completions" in names:
        return "areal"
    if "completion" in names or (not names and any(p.kind == p.VAR_KEYWORD for p in params)):
        return "laden"
    forms = "; ".join(f"{style}: {sig}" for style, sig in STYLE_SIGNATURES.items())
    raise RewardSetupError(
        f"{_named(fn)} fits none of the four reward forms ({forms}); name its parameters as one of "
        "them, or set its style"
    )


def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise RewardSetupError(
            f"cannot read the signature of {fn!r} ({exc}); wrap it in a Python function"
        ) from exc


def _named(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__qualname__', type(fn).__name__)}{_signature(fn)}"


def _data_params(sig: inspect.Signature, style: str) -> list[str]:
    """The parameters without a default that the data fields fill (not the style's own arguments)."""
    if style == "verl":
        return []  # verl passes no data fields
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    filled = {p.name for p in positional[:4]} if style == "areal" else set(_OWN_ARGS[style])
    return [
        p.name
        for p in params
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in filled
        and p.name not in _CALL_ARGS
    ]


def _check_fits(fn: Callable[..., Any], sig: inspect.Signature, style: str, detected: bool) -> None:
    """`RewardSetupError` unless `fn` can take a `style` call (with placeholders for its data fields)."""
    data = dict.fromkeys(_data_params(sig, style))
    try:
        if style == "areal":
            sig.bind(None, None, None, None, **data)
        elif style == "verl":
            sig.bind(
                **dict.fromkeys(_OWN_ARGS["verl"]),
                **({"extra_info": None} if _takes(sig, "extra_info") else {}),
            )
        else:
            sig.bind(**dict.fromkeys(_OWN_ARGS[style]), **data)
    except TypeError as exc:
        how = "detected from its parameter names" if detected else "as set"
        raise RewardSetupError(
            f"{_named(fn)} cannot take a {style}-style call ({how}): {exc}; a {style} reward is "
            f"{STYLE_SIGNATURES[style]}. Fix the signature or set the style it is written for"
        ) from None


def _takes(sig: inspect.Signature, name: str) -> bool:
    params = sig.parameters.values()
    return name in sig.parameters or any(p.kind == p.VAR_KEYWORD for p in params)


def _required(sig: inspect.Signature, style: str) -> list[tuple[str, ...]]:
    if style == "verl":
        return [("data_source",), _VERL_GROUND_TRUTH]
    return [(name,) for name in _data_params(sig, style)]


# --- calling one function in its style ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Part:
    """One loaded reward function."""

    name: str
    spec: RewardSpec
    fn: Callable[..., Any]
    style: str
    required: list[tuple[str, ...]]
    takes_extra_info: bool

    @property
    def label(self) -> str:
        return f"{self.name!r} ({self.spec.fn}, {self.style} style)"


def _call_laden(part: _Part, kwargs: Mapping[str, Any]) -> Any:
    fields = dict(kwargs)
    fields.pop(RAW_PROMPT_KEY, None)
    return part.fn(**fields)


def _call_areal(part: _Part, kwargs: Mapping[str, Any]) -> Any:
    fields = dict(kwargs)
    fields.pop(RAW_PROMPT_KEY, None)
    args = [fields.pop(key) for key in _OWN_ARGS["laden"]]
    return part.fn(*args, **fields)


def _call_trl(part: _Part, kwargs: Mapping[str, Any]) -> Any:
    fields = dict(kwargs)
    prompt, completion = fields.pop("prompt"), fields.pop("completion")
    raw = fields.pop(RAW_PROMPT_KEY, prompt)
    fields.pop("prompt_ids")
    ids = fields.pop("completion_ids")
    if _is_conversation(raw):
        completion = [{"role": "assistant", "content": completion}]
    batch = {key: [value] for key, value in fields.items()}  # a batch of one completion
    result = part.fn(prompts=[raw], completions=[completion], completion_ids=[ids], **batch)
    if not isinstance(result, (list, tuple)) or len(result) != 1:
        raise RewardCallError(
            f"reward function {part.label} returned {result!r:.200}; a TRL reward returns a list with one "
            "reward (or None) per completion, and laden passes one completion per call"
        )
    return result[0]


def _call_verl(part: _Part, kwargs: Mapping[str, Any]) -> Any:
    found = {name: _lookup(kwargs, name) for name in ("data_source", *_VERL_GROUND_TRUTH)}
    truth = next((found[name] for name in _VERL_GROUND_TRUTH if found[name] is not None), None)
    if found["data_source"] is None or truth is None:
        need = "data_source" if found["data_source"] is None else "|".join(_VERL_GROUND_TRUTH)
        raise RewardCallError(
            f"reward function {part.label} needs the data field {need}, which the row lacks"
        )
    call = {"data_source": found["data_source"], "solution_str": kwargs["completion"], "ground_truth": truth}
    if part.takes_extra_info:
        call["extra_info"] = kwargs.get("extra_info")
    result = part.fn(**call)
    if isinstance(result, Mapping):
        if "score" not in result:
            raise RewardCallError(
                f"reward function {part.label} returned a dict without 'score' ({sorted(result)}); verl reads "
                "the reward from result['score']"
            )
        return result["score"]
    return result


def _is_conversation(prompt: Any) -> bool:
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and all(isinstance(turn, Mapping) and "role" in turn for turn in prompt)
    )


_CALLERS: dict[str, Callable[[_Part, Mapping[str, Any]], Any]] = {
    "laden": _call_laden,
    "areal": _call_areal,
    "trl": _call_trl,
    "verl": _call_verl,
}


def _as_number(value: Any, part: _Part) -> float:
    """The reward as a float (NaN for a TRL None); `RewardCallError` for anything not a finite number."""
    if value is None and part.style == "trl":
        return math.nan  # TRL's "not applicable"
    why = ""
    if isinstance(value, (str, bytes)):
        why = "a string is not a reward, even one that reads as a number; return float(...)"
    elif _is_bool(value):
        why = "a bool is not a reward; return 1.0 or 0.0"
    elif not hasattr(type(value), "__float__"):
        why = f"not a number; a {part.style} reward is {STYLE_SIGNATURES[part.style]}"
    else:
        try:
            number = float(value)
        except (TypeError, ValueError) as exc:
            why = f"not one number ({exc})"
        else:
            if math.isfinite(number):
                return number
            why = "rewards must be finite"
    raise RewardCallError(f"reward function {part.label} returned {value!r:.200}: {why}")


def _is_bool(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)  # numpy.bool_ and torch's bool tensors
    return isinstance(value, bool) or getattr(dtype, "kind", None) == "b" or str(dtype) == "torch.bool"


# --- several functions -----------------------------------------------------------------------


class CompositeReward:
    """The loaded reward functions of a spec list; `score(kwargs)` returns `(total, parts)`.

    `kwargs` are laden's reward arguments (`prompt`, `completion`, `prompt_ids`, `completion_ids`,
    `RAW_PROMPT_KEY`, the data fields); `parts` maps each name to its reward (NaN for a TRL None)
    and `total` is the weighted sum of the parts that are not NaN. A failed call raises
    `RewardCallError` naming the function, with its traceback.
    """

    def __init__(self, parts: list[_Part]) -> None:
        self._parts = parts

    @property
    def functions(self) -> list[Callable[..., Any]]:
        """The loaded functions, in spec order."""
        return [part.fn for part in self._parts]

    def info(self) -> RewardInfo:
        """Names, styles and required fields (see `RewardInfo`)."""
        return RewardInfo(
            names=[p.name for p in self._parts],
            styles=[p.style for p in self._parts],
            required_fields={p.name: list(p.required) for p in self._parts},
        )

    def score(self, kwargs: Mapping[str, Any]) -> tuple[float, dict[str, float]]:
        """Call every function in its style; see the class docstring."""
        parts: dict[str, float] = {}
        for part in self._parts:
            try:
                result = _CALLERS[part.style](part, kwargs)
            except RewardCallError:
                raise
            except Exception as exc:
                raise RewardCallError(f"reward function {part.label} raised {_failure_text(exc)}") from None
            parts[part.name] = _as_number(result, part)
        scored = [
            (part.spec.weight, parts[part.name]) for part in self._parts if not math.isnan(parts[part.name])
        ]
        if not scored:
            raise RewardCallError(
                f"every reward function returned None (TRL's 'not applicable'): {', '.join(parts)}; at least one "
                "must score each completion"
            )
        return math.fsum(weight * value for weight, value in scored), parts


def load_rewards(
    specs: Sequence[RewardSpec], on_import: Callable[[str], None] | None = None
) -> CompositeReward:
    """Import and check every function of `specs` (style detected or checked against its signature).

    `on_import(module_name)` is called before each import (the pool's workers report progress with
    it). Raises `RewardSetupError` saying which function and why.
    """
    parts = []
    for spec, name in zip(specs, metric_names(specs)):
        if on_import is not None:
            on_import(split_spec(spec.fn)[0])
        try:
            fn = load_reward_fn(spec.fn)
        except ValueError as exc:
            raise RewardSetupError(str(exc)) from exc
        parts.append(_load_part(spec, name, fn))
    return CompositeReward(parts)


def _load_part(spec: RewardSpec, name: str, fn: Callable[..., Any]) -> _Part:
    try:
        style = detect_style(fn) if spec.style == "auto" else spec.style
        sig = _signature(fn)
        _check_fits(fn, sig, style, detected=spec.style == "auto")
    except RewardSetupError as exc:
        raise RewardSetupError(f"reward_fn {spec.fn!r}: {exc}") from None
    return _Part(name, spec, fn, style, _required(sig, style), _takes(sig, "extra_info"))


def _failure_text(exc: BaseException, *, frames: int = 6) -> str:
    """What the reward function raised, then where: its innermost `frames` frames from the reward
    function's own frame on (this module's adapter frames dropped), one line each, innermost last."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    where = traceback.extract_tb(tb or exc.__traceback__)[-frames:]
    lines = [f"{type(exc).__name__}: {exc}".rstrip(": ")]
    lines += [f"  at {f.filename}:{f.lineno} in {f.name}" + (f": {f.line}" if f.line else "") for f in where]
    return "\n".join(lines)
