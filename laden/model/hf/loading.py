"""Loading Hugging Face causal LMs and tokenizers from local directories.

laden never talks to a model hub (the machines it runs on usually cannot reach one): every
path is a local directory, opened with `local_files_only=True`, and a missing directory is
reported as such instead of as a failed download. A directory with a `config.json` but no
weights is initialised from the config when `actor.init_from_config` is set, seeded so that
every rank (and every rerun) builds the same weights without touching the global RNG.

GGUF checkpoints load through transformers' own GGUF reader (dequantised to `dtype`), which
needs the optional `gguf` package. The whole model is materialised on the CPU first and then
moved to `device`: simple and exact, at the cost of one host copy of the weights at load time
(`actor.fsdp.memory_efficient_load` in the engines avoids that for sharded training).
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path

import torch

from laden.model.attention import AttnImpl, set_attention

log = logging.getLogger(__name__)

__all__ = ["has_weight_files", "load_causal_lm", "load_tokenizer", "skeleton_causal_lm"]

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


def has_weight_files(directory: str | Path) -> bool:
    """Whether `directory` holds Hugging Face weight files (safetensors or PyTorch bins)."""
    return _has_any(Path(directory), _WEIGHT_PATTERNS)


def _resolve(path: str | Path, gguf_file: str | None) -> tuple[Path, str | None]:
    """The model directory and GGUF file name; `path` may point at a `.gguf` file directly."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(
            f"actor.path={str(path)!r} does not exist; laden loads local directories only (model hubs "
            "are not reachable): download the model (e.g. `huggingface-cli download <repo> --local-dir "
            "<dir>`) and set actor.path to that directory"
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


def _init_from_config(directory: Path, dtype: torch.dtype, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    log.info("initialising %s from its config.json (seed %d, %s) on the host", directory, seed, dtype)
    t0 = time.perf_counter()
    # Seeded inside a forked RNG: same seed -> same weights, and the caller's RNG stream is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    log.info("initialised %.2fB parameters in %.1f s", sum(p.numel() for p in model.parameters()) / 1e9,
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
    from transformers import AutoConfig, AutoModelForCausalLM

    directory, gguf_file = _resolve(path, None)
    if gguf_file is not None or not (directory / "config.json").is_file():
        return load_causal_lm(path, dtype=dtype, attn_impl=attn_impl, gguf_file=gguf_file, device=device)
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    with _no_init_weights(), torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
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
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    set_attention(model, attn_impl)
    return model.to(device)  # type: ignore[arg-type]  # transformers wraps `to` with a narrower type


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
