"""Loading Hugging Face causal LMs and tokenizers from local directories.

transformers never talks to a model hub here: every path is a local directory, opened with
`local_files_only=True`, and a missing directory is reported as such instead of as a failed download.
A Hub id (`org/name`) that is not a local path is first fetched into the Hugging Face cache by
`laden.model.hf.hub` (the trainers do that once when the run starts, so here it is already local).
A directory with a `config.json` but no weights is initialised from the config when
`actor.init_from_config` is set, seeded so that every rank (and every rerun) builds the same weights
without touching the global RNG.

GGUF checkpoints load through transformers' own GGUF reader (dequantised to `dtype`), which
needs the optional `gguf` package. The whole model is materialised on the CPU first and then
moved to `device`: simple and exact, at the cost of one host copy of the weights at load time
(`actor.fsdp.memory_efficient_load` in the engines avoids that for sharded training).

A damaged model directory is a `ValueError` naming the file, the field or the problem, and the fix,
never a traceback from deep inside transformers: `config.json` is read as JSON and its sizes checked
(positive integers; heads that divide `hidden_size` where no `head_dim` is given, key/value heads that
divide the heads) before transformers sees it, and what transformers then refuses while reading the
config or building the model is reported against `config.json`. Every weight file's header is opened
before loading (safetensors checks that its tensors cover the file exactly, so a truncated download
fails here; a sharded index must name shards that exist): a few reads of kilobytes per file.
"""

from __future__ import annotations

import json
import logging
import pickle
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from laden.model.attention import AttnImpl, set_attention
from laden.model.hf.hub import resolve_model_path

log = logging.getLogger(__name__)

__all__ = [
    "check_weight_files",
    "has_weight_files",
    "load_causal_lm",
    "load_model_config",
    "load_tokenizer",
    "skeleton_causal_lm",
]

_WEIGHT_PATTERNS = ("*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin")
_VOCAB_PATTERNS = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "*.model",
    "*.tiktoken",
    "tekken.json",
)
"""Files that carry a tokenizer's vocabulary (fast, SentencePiece, BPE, WordPiece, tiktoken, Mistral)."""
_ATTN_IMPLS = ("auto", "varlen", "sdpa", "eager")
_SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
"""config.json fields that must be positive integers where present (and not null)."""
_RESTORE = (
    "restore the model's original config.json (e.g. `hf download <repo> config.json --local-dir <dir>`) or "
    "correct the field"
)
_REDOWNLOAD = (
    "the file is damaged or incomplete (an interrupted download or copy): download it again (e.g. "
    "`hf download <repo> --local-dir <dir>`, which resumes and checks what it fetches)"
)


def has_weight_files(directory: str | Path) -> bool:
    """Whether `directory` holds Hugging Face weight files (safetensors or PyTorch bins)."""
    return _has_any(Path(directory), _WEIGHT_PATTERNS)


def _resolve(path: str | Path, gguf_file: str | None) -> tuple[Path, str | None]:
    """The model directory and GGUF file name; `path` may point at a `.gguf` file directly."""
    p = Path(resolve_model_path(str(path))).expanduser()  # a Hub id: its snapshot in the HF cache
    if not p.exists():
        raise ValueError(
            f"actor.path={str(path)!r} does not exist and is not a Hub id (org/name); set it to a Hugging "
            "Face model directory, a .gguf file or a Hub id (or download one first: `hf download <id> "
            "--local-dir DIR`, then actor.path=DIR)"
        )
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(
                f"actor.path={str(path)!r} is a file; set it to a Hugging Face model directory "
                "(config.json + weights) or to a .gguf file"
            )
        return p.parent, p.name
    return p, gguf_file


def _require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "loading a GGUF checkpoint needs the optional `gguf` package: pip install gguf"
        ) from err


def load_model_config(directory: str | Path) -> Any:
    """`AutoConfig` of `directory`/config.json, checked first (see the module docstring); a config that
    cannot be read or describes an impossible model is a `ValueError` naming the file, field and fix."""
    from transformers import AutoConfig

    config_file = Path(directory) / "config.json"
    problems = config_problems(_read_config_json(config_file))
    if problems:
        raise ValueError(
            f"{config_file}: {'; '.join(problems)}; the model cannot be built from it: {_RESTORE}"
        )
    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    except _refusals(OSError) as err:
        raise ValueError(
            f"{config_file}: transformers cannot read it ({_one_line(err)}); {_RESTORE}"
        ) from err


def _read_config_json(config_file: Path) -> dict[str, Any]:
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_file} cannot be read ({err}); {_RESTORE}") from err
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{config_file}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno}); {_RESTORE}"
        ) from err
    if not isinstance(data, dict):
        raise ValueError(f"{config_file} holds a JSON {type(data).__name__}, expected an object; {_RESTORE}")
    return data


def config_problems(config: dict[str, Any], prefix: str = "") -> list[str]:
    """What in a config.json's fields (and its `text_config`) cannot describe a model: sizes that are not
    positive integers, heads that do not divide `hidden_size` without a `head_dim`, key/value heads that
    do not divide the heads."""
    sizes = {name: config[name] for name in _SIZE_FIELDS if config.get(name) is not None}
    valid = {k: v for k, v in sizes.items() if isinstance(v, int) and not isinstance(v, bool) and v >= 1}
    problems = [f"{prefix}{k}={v!r} must be a positive integer" for k, v in sizes.items() if k not in valid]
    heads, kv_heads, hidden = (
        valid.get(k) for k in ("num_attention_heads", "num_key_value_heads", "hidden_size")
    )
    if heads and hidden and "head_dim" not in sizes and hidden % heads:
        problems.append(
            f"{prefix}hidden_size={hidden} is not divisible by {prefix}num_attention_heads={heads} (with no head_dim, "
            "each head gets hidden_size / num_attention_heads)"
        )
    if heads and kv_heads and heads % kv_heads:
        problems.append(
            f"{prefix}num_attention_heads={heads} is not divisible by {prefix}num_key_value_heads={kv_heads} "
            "(each key/value head serves a whole number of query heads)"
        )
    text_config = config.get("text_config")
    if isinstance(text_config, dict):
        problems += config_problems(text_config, prefix=f"{prefix}text_config.")
    return problems


def _build_from_config(config: Any, directory: Path, **kwargs: Any) -> Any:
    """`AutoModelForCausalLM.from_config`, with what transformers refuses reported against config.json."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config, **kwargs)
    except _refusals() as err:
        raise ValueError(
            f"{directory / 'config.json'}: transformers cannot build a model from it ({_one_line(err)}); {_RESTORE}"
        ) from err


def check_weight_files(directory: str | Path) -> None:
    """Open every weight file's header in `directory` (a few KiB each); one that cannot be read (truncated,
    not safetensors, a sharded index naming a missing shard) is a `ValueError` naming it and the fix."""
    directory = Path(directory)
    safetensors = sorted(directory.glob("*.safetensors"))
    problems = [problem for f in safetensors if (problem := _safetensors_problem(f)) is not None]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        problems += _index_problems(index)
    if not safetensors:  # transformers reads PyTorch bins only where there are no safetensors
        problems += [
            problem for f in sorted(directory.glob("pytorch_model*.bin")) if (problem := _bin_problem(f))
        ]
    if problems:
        raise ValueError(
            f"weight file(s) in {str(directory)!r} cannot be read: {'; '.join(problems)}; {_REDOWNLOAD}"
        )


def _safetensors_problem(file: Path) -> str | None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt"):
            return None
    except (SafetensorError, OSError) as err:
        return f"{file.name}: {_one_line(err)} ({file.stat().st_size} bytes)"


def _index_problems(index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        return [f"{index.name}: not a sharded-checkpoint index with a 'weight_map' ({_one_line(err)})"]
    return [
        f"{index.name} names {shard}, which is missing"
        for shard in shards
        if not (index.parent / shard).is_file()
    ]


def _bin_problem(file: Path) -> str | None:
    with file.open("rb") as f:
        if f.read(2) != b"PK":
            return None  # the pre-zip `torch.save` format: nothing cheap to check
    try:
        with zipfile.ZipFile(file):  # reads the central directory at the end: a truncated file has none
            return None
    except (zipfile.BadZipFile, OSError) as err:
        return f"{file.name}: {_one_line(err)}"


_BUILD_ERRORS = (ValueError, TypeError, KeyError, AttributeError, IndexError, ZeroDivisionError)
"""What transformers raises for a config value it cannot build (an unknown activation or rope type, a
dtype name torch lacks); the integer fields are checked before, so these are the rest."""


def _refusals(*extra: type[Exception]) -> tuple[type[Exception], ...]:
    """`_BUILD_ERRORS`, `extra` and huggingface_hub's config validation errors."""
    return (*_BUILD_ERRORS, *extra, *_strict_errors())


def _strict_errors() -> tuple[type[Exception], ...]:
    """huggingface_hub's config validation errors (transformers 5 configs are strict dataclasses)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:500]}"


def _init_from_config(directory: Path, dtype: torch.dtype, seed: int):
    config = load_model_config(directory)
    log.info("initialising %s from its config.json (seed %d, %s) on the host", directory, seed, dtype)
    t0 = time.perf_counter()
    # Seeded inside a forked RNG: same seed -> same weights, and the caller's RNG stream is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _build_from_config(config, directory, dtype=dtype)
    log.info("initialised %s parameters in %.1f s", count_text(sum(p.numel() for p in model.parameters())),
             time.perf_counter() - t0)  # fmt: skip
    return model.eval()


def skeleton_causal_lm(
    path: str, *, dtype: torch.dtype, attn_impl: AttnImpl = "auto", device: str | torch.device = "cpu"
):
    """The model of `path`/config.json with zero parameters: no weight file read and no random init
    (a memset instead), for a copy whose every parameter the caller fills next, such as the rollout
    engine's policy, which the trainer's weights overwrite. Buffers computed from the config (rotary
    frequencies) are real. Built on `device` directly (an 8B copy for the GPU never occupies 16 GB of
    host memory). A `.gguf` path falls back to `load_causal_lm`."""
    directory, gguf_file = _resolve(path, None)
    if gguf_file is not None or not (directory / "config.json").is_file():
        return load_causal_lm(path, dtype=dtype, attn_impl=attn_impl, gguf_file=gguf_file, device=device)
    config = load_model_config(directory)
    with _no_init_weights(), torch.device(device):
        model = _build_from_config(config, directory, dtype=dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    # `from_config` under `no_init_weights` leaves a tied head (`tie_word_embeddings`) as a second,
    # zero matrix that no update names; tie it as a loaded model is
    model.tie_weights()
    set_attention(model.eval(), attn_impl)
    return model


def _no_init_weights():
    """transformers' context that skips weight initialisation (its module moved in version 5)."""
    import contextlib

    for module in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            return __import__(module, fromlist=["no_init_weights"]).no_init_weights()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


def load_causal_lm(
    path: str,
    *,
    dtype: torch.dtype,
    init_from_config: bool = False,
    seed: int = 0,
    attn_impl: AttnImpl = "auto",
    device: str | torch.device = "cpu",
    gguf_file: str | None = None,
):
    """Load a causal LM from a local directory (or .gguf file) in `dtype` with attention `attn_impl`.

    Returns a transformers `PreTrainedModel` in eval mode on `device`.
    """
    from transformers import AutoModelForCausalLM

    if attn_impl not in _ATTN_IMPLS:
        raise ValueError(f"attn_impl={attn_impl!r} is not one of {_ATTN_IMPLS}; use 'auto'")
    directory, gguf_file = _resolve(path, gguf_file)
    if gguf_file is not None:
        _require_gguf()
        model = AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=gguf_file, dtype=dtype, local_files_only=True
        )
    elif not (directory / "config.json").is_file():
        raise ValueError(
            f"actor.path={str(path)!r} has no config.json; it must be a Hugging Face model directory "
            "(config.json plus *.safetensors), or pass a .gguf file"
        )
    elif init_from_config:
        if has_weight_files(directory):
            warnings.warn(
                f"actor.init_from_config is true: the weight files in {str(directory)!r} are ignored and "
                f"the model is initialised from config.json with seed {seed}",
                stacklevel=2,
            )
        model = _init_from_config(directory, dtype, seed)
    elif not has_weight_files(directory):
        raise ValueError(
            f"actor.path={str(path)!r} has a config.json but no weight files (*.safetensors or "
            "pytorch_model*.bin); to train from a random initialisation set actor.init_from_config: true, "
            "otherwise point actor.path at a directory with weights"
        )
    else:
        model = _from_pretrained(directory, dtype)
    set_attention(model, attn_impl)
    return model.to(device)  # type: ignore[arg-type]  # transformers wraps `to` with a narrower type


def _from_pretrained(directory: Path, dtype: torch.dtype) -> Any:
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    config = load_model_config(directory)
    check_weight_files(directory)
    try:
        return AutoModelForCausalLM.from_pretrained(
            directory, config=config, dtype=dtype, local_files_only=True
        )
    except (SafetensorError, OSError, EOFError, pickle.UnpicklingError) as err:
        # What the header checks cannot see: a damaged tensor inside a PyTorch bin, a file gone meanwhile.
        raise ValueError(
            f"the weights in {str(directory)!r} cannot be read ({_one_line(err)}); {_REDOWNLOAD}"
        ) from err
    except _refusals() as err:
        raise ValueError(
            f"transformers cannot build the model of {str(directory)!r} from its config.json and weights "
            f"({_one_line(err)}); {_RESTORE}, or download the model again if its files do not belong together"
        ) from err


def load_tokenizer(path: str, *, gguf_file: str | None = None):
    """`AutoTokenizer.from_pretrained` on a local directory (or .gguf file), with a pad token ensured.

    Without a pad token, the EOS (else UNK) token pads; padding positions never carry loss.
    """
    from transformers import AutoTokenizer

    directory, gguf_file = _resolve(path, gguf_file)
    kwargs = {"gguf_file": gguf_file} if gguf_file is not None else {}
    if gguf_file is not None:
        _require_gguf()
    elif not _has_any(directory, _VOCAB_PATTERNS):
        # transformers would build an empty tokenizer from config.json alone (every text -> unk).
        raise ValueError(_no_tokenizer_message(directory))
    elif (Path(directory) / "config.json").is_file():
        load_model_config(directory)  # AutoTokenizer reads it too: its problems named by field, not theirs
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True, **kwargs)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"no tokenizer could be loaded from {str(directory)!r} ({err}); the directory needs the "
            "tokenizer files (tokenizer.json / tokenizer_config.json) saved by `save_pretrained`"
        ) from err
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
        if fallback is None:
            raise ValueError(
                f"the tokenizer in {str(directory)!r} has no pad, eos or unk token to pad with; "
                "set pad_token in its tokenizer_config.json"
            )
        tokenizer.pad_token = fallback
    if len(tokenizer) <= len(set(tokenizer.all_special_tokens)):
        raise ValueError(_no_tokenizer_message(directory, loaded=len(tokenizer)))
    return tokenizer


def _has_any(directory: Path, patterns: tuple[str, ...]) -> bool:
    return any(next(directory.glob(pattern), None) is not None for pattern in patterns)


def _no_tokenizer_message(directory: Path, *, loaded: int | None = None) -> str:
    found = "its tokenizer files hold no vocabulary" if loaded is not None else "it has no tokenizer files"
    if loaded is not None:
        found += f" ({loaded} token(s), all special)"
    return (
        f"actor.path={str(directory)!r}: {found}; expected tokenizer.json (or tokenizer_config.json with "
        "vocab.json + merges.txt, vocab.txt or a SentencePiece tokenizer.model) next to config.json. Save "
        "the model's tokenizer there (`AutoTokenizer.from_pretrained(<repo>).save_pretrained(<dir>)`, or "
        "download the repository's tokenizer files into it)"
    )


def count_text(n: int) -> str:
    """A parameter count as people write it: 1.72B, 135.0M, 270K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'B' else 1}f}{unit}"
    return str(n)
