"""`rollout.backend` and the generation knobs reach the engine `build_rollout_engine` returns."""

from __future__ import annotations

from pathlib import Path

import pytest

from laden.config.loader import load_config
from laden.rollout import GenerationRequest, SamplingParams
from laden.rollout.factory import build_rollout_engine, max_concurrent_rollouts
from laden.rollout.native import NativeEngine

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(tiny_dir, *overrides):
    return load_config(
        None, [f"actor.path={tiny_dir}", "actor.init_from_config=true", "actor.dtype=float32", *overrides]
    )


def test_native_engine_from_the_config(tiny_dir, tiny_tokenizer):
    cfg = _cfg(
        tiny_dir, "max_concurrent_rollouts=3", "native.mem_fraction_static=0.5", "gconfig.max_new_tokens=7"
    )
    assert max_concurrent_rollouts(cfg) == 3
    engine = build_rollout_engine(cfg, device="cpu")
    assert isinstance(engine, NativeEngine)
    assert engine.core.max_concurrent == 3 and engine.mem_fraction_static == 0.5
    assert engine.paged.max_model_len == cfg.train_dataset.max_length + 7
    assert engine.core.eos_token_ids == (tiny_tokenizer.eos_token_id,)  # from the model directory's tokenizer
    prompt = tuple(tiny_tokenizer.encode("hi"))
    params = SamplingParams.from_config(cfg.gconfig, greedy=True)
    (result,) = engine.generate_sync([GenerationRequest(rid="a", input_ids=prompt, sampling=params)])
    assert 1 <= len(result.output_ids) <= 7


def test_default_concurrency_and_the_refused_modes(tiny_dir):
    assert max_concurrent_rollouts(_cfg(tiny_dir)) == 256
    with pytest.raises(ValueError, match="each copy on 2 processes.*torchrun --nproc-per-node 2"):
        build_rollout_engine(_cfg(tiny_dir, "rollout.backend=native:d1t2"), device="cpu")
    with pytest.raises(ValueError, match="one copy per process.*torchrun --nproc-per-node 2"):
        build_rollout_engine(
            _cfg(tiny_dir, "rollout.backend=native:d2", "cluster.n_gpus_per_node=2"), device="cpu"
        )


def test_a_server_backend_that_is_not_installed_names_native(tiny_dir, monkeypatch):
    from laden.rollout.servers import ServerNotInstalledError

    monkeypatch.delenv("LADEN_VLLM_PYTHON", raising=False)
    with pytest.raises(ServerNotInstalledError, match="native:d1"):
        build_rollout_engine(_cfg(tiny_dir, "rollout.backend=vllm:d1", "cluster.n_gpus_per_node=2"))


def test_each_engine_of_a_data_parallel_rollout_samples_with_its_own_seed(tiny_dir, monkeypatch):
    """native:d2 under two processes: engine i samples with seed + i, so the two shares of a batch
    do not draw the same random numbers row for row."""
    import torch

    cfg = _cfg(tiny_dir, "rollout.backend=native:d2", "cluster.n_gpus_per_node=2", "seed=5")
    states = []
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        engine = build_rollout_engine(cfg, device="cpu", kv_cache_tokens=256)
        states.append(engine.core.generator.get_state())
    for i, state in enumerate(states):
        assert torch.equal(state, torch.Generator().manual_seed(5 + i).get_state())


@pytest.fixture
def bare(tmp_path, tiny_dir):
    """A model directory with config.json alone: no tokenizer files."""
    import shutil

    path = tmp_path / "bare"
    path.mkdir()
    shutil.copy(Path(tiny_dir) / "config.json", path / "config.json")
    return path


def test_a_server_model_directory_without_a_tokenizer_gives_none(bare, tiny_dir, caplog):
    """The server engines' stop-string tokenizer: the model directory's, or None (with a warning)
    where it has only config and weights, not an empty tokenizer built from config.json."""
    from laden.rollout.factory import tokenizer_or_none

    assert tokenizer_or_none(tiny_dir, without="x") is not None
    with caplog.at_level("WARNING"):
        assert tokenizer_or_none(bare, without="stop strings split by a pause will not be found") is None
    assert "no tokenizer in" in caplog.text and "split by a pause" in caplog.text


def test_a_native_model_directory_without_a_tokenizer_refuses_stop_strings(bare, caplog):
    """The native engine built from a directory with config.json alone has no tokenizer (and says
    so), and a request with stop strings is refused by name. transformers would have built an
    empty tokenizer there, which decodes every token to unk, so a stop string never matched."""
    with caplog.at_level("WARNING"):
        engine = build_rollout_engine(_cfg(bare, "gconfig.max_new_tokens=4"), device="cpu")
    assert engine.tokenizer is None
    assert "no tokenizer in" in caplog.text and "stop strings are refused" in caplog.text
    greedy = SamplingParams(max_new_tokens=4, greedy=True, ignore_eos=True)
    (result,) = engine.generate_sync([GenerationRequest(rid="ids", input_ids=(1, 2, 3), sampling=greedy)])
    assert len(result.output_ids) == 4  # token ids and lengths need no tokenizer
    stop = SamplingParams(max_new_tokens=4, greedy=True, stop=("ab",))
    with pytest.raises(ValueError, match="stop strings.*no tokenizer"):
        engine.generate_sync([GenerationRequest(rid="s", input_ids=(1, 2, 3), sampling=stop)])


def test_a_native_engine_on_a_gguf_file_takes_the_files_tokenizer(tmp_path):
    """`actor.path` at a .gguf file: the model and the tokenizer both come from the file (transformers'
    GGUF tokenizer), so the engine ends sequences at the file's EOS and matches stop strings."""
    from gguf_model import GGUF_EOS, _write_tiny_gguf
    from native_cases import fresh_stop_string

    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, tokenizer=True)
    cfg = load_config(None, [f"actor.path={path}", "actor.dtype=float32", "gconfig.max_new_tokens=16"])
    engine = build_rollout_engine(cfg, device="cpu")
    tokenizer = engine.tokenizer
    assert tokenizer is not None and tokenizer.eos_token == GGUF_EOS
    assert engine.core.eos_token_ids == (tokenizer.eos_token_id,)
    prompt = tuple(tokenizer.encode("abcd hi efg"))
    assert len(prompt) == 5  # the file's merges: abcd, Ġ, hi, Ġ, efg

    def generate(**sampling):
        params = SamplingParams(max_new_tokens=16, greedy=True, **sampling)
        return engine.generate_sync([GenerationRequest(rid="r", input_ids=prompt, sampling=params)])[0]

    free = generate()
    stop = fresh_stop_string(tokenizer.decode(free.output_ids))  # the random model's bytes: not all UTF-8
    cut = generate(stop=(stop,))
    assert cut.stop_reason == "stop" and cut.output_ids == free.output_ids[: len(cut.output_ids)]
    assert tokenizer.decode(cut.output_ids).endswith(stop) and len(cut.output_ids) < len(free.output_ids)
