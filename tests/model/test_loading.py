"""Export -> `from_pretrained` round trips, seeded init from config, and loading errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from gguf_model import _write_tiny_gguf
from safetensors import safe_open

from laden.model.attention import LADEN_VARLEN
from laden.model.hf.export import export_hf, hf_state_names
from laden.model.hf.loading import load_causal_lm, load_tokenizer, skeleton_causal_lm


def _from_pretrained(path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs)


def _input_ids(vocab_size=100):
    return torch.arange(3, 3 + 20).remainder(vocab_size)[None]  # [1, 20]


def _logits(model):
    with torch.no_grad():
        return model(input_ids=_input_ids()).logits.float()


def _assert_same_state(loaded, original, dtype):
    got, want = loaded.state_dict(), original.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        expected = tensor.to(dtype) if tensor.is_floating_point() else tensor
        torch.testing.assert_close(got[name], expected, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def _saved_keys(out_dir):
    keys = set()
    for f in out_dir.glob("*.safetensors"):
        with safe_open(f, "pt") as handle:
            keys.update(handle.keys())
    return keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_round_trip(tiny_model, tiny_tokenizer, tmp_path, dtype):
    out = export_hf(tiny_model, tmp_path / "export", dtype=dtype, tokenizer=tiny_tokenizer)
    loaded = _from_pretrained(out)
    assert next(loaded.parameters()).dtype == dtype
    _assert_same_state(loaded, tiny_model, dtype)
    # Reference: the fp32 original, cast to `dtype` by transformers itself at load time (a plain
    # `.to(dtype)` would also cast the fp32 rotary buffers and change the logits).
    fp32_out = export_hf(tiny_model, tmp_path / "fp32", dtype=torch.float32)
    reference = _from_pretrained(fp32_out, dtype=dtype)
    torch.testing.assert_close(_logits(loaded), _logits(reference), rtol=0, atol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(_logits(loaded), _logits(tiny_model), rtol=0, atol=0)
    assert (out / "generation_config.json").is_file()
    assert load_tokenizer(str(out)).get_vocab() == tiny_tokenizer.get_vocab()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "fp32"]  # no temporary directory left


def test_export_tied_model_writes_embedding_once(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).float()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    out = export_hf(model, tmp_path / "tied", dtype=torch.float32)
    assert "lm_head.weight" not in _saved_keys(out)
    assert "model.embed_tokens.weight" in _saved_keys(out)
    loaded = _from_pretrained(out, attn_implementation="eager")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    model.set_attn_implementation("eager")
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=0)

    # A gathered state dict holds separate copies of the tied tensors: its names still list them once.
    gathered = {name: t.clone() for name, t in model.state_dict().items()}
    assert "lm_head.weight" not in hf_state_names(model)
    weights = ((name, gathered[name]) for name in hf_state_names(model))
    out = export_hf(model, tmp_path / "gathered", dtype=torch.float32, weights=weights)
    assert "lm_head.weight" not in _saved_keys(out)
    torch.testing.assert_close(_logits(_from_pretrained(out, attn_implementation="eager")), _logits(model))


def test_untied_model_keeps_its_lm_head(tiny_model, tmp_path):
    out = export_hf(tiny_model, tmp_path / "untied", dtype=torch.float32)
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= _saved_keys(out)


def test_sharded_export_writes_an_index(tiny_model, tmp_path):
    out = export_hf(tiny_model, tmp_path / "sharded", dtype=torch.float32, max_shard_size_bytes=40_000)
    shard_files = sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert len(shard_files) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shard_files)
    assert set(index["weight_map"]) == _saved_keys(out)
    loaded = _from_pretrained(out)
    _assert_same_state(loaded, tiny_model, torch.float32)


def test_export_replaces_previous_export_and_refuses_foreign_dirs(tiny_model, tmp_path):
    out = tmp_path / "export"
    export_hf(tiny_model, out, dtype=torch.float32)
    with torch.no_grad():
        for p in tiny_model.parameters():
            p.add_(1.0)
    export_hf(tiny_model, out, dtype=torch.float32)
    _assert_same_state(_from_pretrained(out), tiny_model, torch.float32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]

    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a model export"):
        export_hf(tiny_model, foreign, dtype=torch.float32)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_load_causal_lm_reads_an_export(tiny_model, tmp_path):
    out = export_hf(tiny_model, tmp_path / "export", dtype=torch.float32)
    model = load_causal_lm(str(out), dtype=torch.float32, attn_impl="auto")
    assert model.config._attn_implementation == LADEN_VARLEN
    _assert_same_state(model, tiny_model, torch.float32)
    model.set_attn_implementation("eager")
    tiny_model.set_attn_implementation("eager")
    torch.testing.assert_close(_logits(model), _logits(tiny_model), rtol=0, atol=0)


def test_init_from_config_is_seeded(tiny_dir):
    rng_before = torch.get_rng_state()
    a = load_causal_lm(str(tiny_dir), dtype=torch.float32, init_from_config=True, seed=3)
    b = load_causal_lm(str(tiny_dir), dtype=torch.float32, init_from_config=True, seed=3)
    c = load_causal_lm(str(tiny_dir), dtype=torch.float32, init_from_config=True, seed=4)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's RNG stream is untouched
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    bf16 = load_causal_lm(
        str(tiny_dir), dtype=torch.bfloat16, init_from_config=True, seed=3, attn_impl="sdpa"
    )
    assert next(bf16.parameters()).dtype == torch.bfloat16
    assert bf16.config._attn_implementation == "sdpa"


def test_config_without_weights_needs_init_from_config(tiny_dir):
    with pytest.raises(ValueError) as info:
        load_causal_lm(str(tiny_dir), dtype=torch.float32)
    message = str(info.value)
    assert "actor.path" in message and str(tiny_dir) in message
    assert "actor.init_from_config: true" in message


def test_missing_path_that_is_no_hub_id_says_it_does_not_exist(tmp_path):
    missing = tmp_path / "Qwen" / "Qwen3-8B"
    with pytest.raises(ValueError, match="does not exist and is not a Hub id") as info:
        load_causal_lm(str(missing), dtype=torch.float32)
    assert str(missing) in str(info.value) and "hf download <id> --local-dir DIR" in str(info.value)


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_causal_lm(str(tmp_path), dtype=torch.float32)


def test_unknown_attn_impl_is_rejected(tiny_dir):
    with pytest.raises(ValueError, match="attn_impl='flash'"):
        load_causal_lm(str(tiny_dir), dtype=torch.float32, init_from_config=True, attn_impl="flash")


def test_gguf_without_the_gguf_package_names_it(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    gguf_path = tmp_path / "model.gguf"
    gguf_path.write_bytes(b"GGUF")
    with pytest.raises(ImportError, match="pip install gguf"):
        load_causal_lm(str(gguf_path), dtype=torch.float32)


def test_tokenizer_pad_token_falls_back_to_eos(tiny_dir, tmp_path):
    from transformers import AutoTokenizer

    no_pad = tmp_path / "no_pad"
    shutil.copytree(tiny_dir, no_pad)
    tok = AutoTokenizer.from_pretrained(no_pad)
    tok.pad_token = None
    tok.save_pretrained(no_pad)
    assert AutoTokenizer.from_pretrained(no_pad).pad_token is None
    loaded = load_tokenizer(str(no_pad))
    assert loaded.pad_token == loaded.eos_token == "<|im_end|>"


def test_tokenizer_missing_files_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="tokenizer"):
        load_tokenizer(str(tmp_path))


def test_gguf_model_loads_and_exports(tmp_path):
    """`save_pretrained` refuses GGUF-loaded models; export_hf writes them anyway (gguf is a dev dependency)."""
    original = _write_tiny_gguf(tmp_path / "tiny.gguf")
    model = load_causal_lm(str(tmp_path / "tiny.gguf"), dtype=torch.float32, attn_impl="sdpa")
    _assert_same_state(model, original, torch.float32)
    assert getattr(model.config, "quantization_config", None) is not None  # transformers' GGUF marker
    out = export_hf(model, tmp_path / "export", dtype=torch.bfloat16)
    # dequantized tensors: the export is a plain model (trainers refuse one that says it is quantized)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    loaded = _from_pretrained(out, attn_implementation="sdpa")
    _assert_same_state(loaded, original, torch.bfloat16)
    reference = _from_pretrained(
        export_hf(original, tmp_path / "ref", dtype=torch.float32), dtype=torch.bfloat16
    )
    torch.testing.assert_close(_logits(loaded), _logits(reference), rtol=0, atol=0)


def test_skeleton_has_zero_weights_real_buffers_and_loads_to_the_model():
    from importlib import resources

    tiny = str(resources.files("laden") / "assets" / "tiny")
    model = load_causal_lm(tiny, dtype=torch.float32, init_from_config=True, seed=3)
    skeleton = skeleton_causal_lm(tiny, dtype=torch.float32)
    assert all(not p.any() for p in skeleton.parameters())  # a memset, no random init
    buffers = dict(model.named_buffers())
    assert all(torch.equal(b, buffers[n]) for n, b in skeleton.named_buffers())  # rotary frequencies
    skeleton.load_state_dict(model.state_dict())
    torch.testing.assert_close(_logits(skeleton), _logits(model))


def test_a_tied_skeleton_is_tied_and_named_parameters_fill_it(tmp_path):
    """A `tie_word_embeddings` model's skeleton shares its head with the embedding, as a loaded one
    does, so an update naming the embedding alone (`named_parameters`) sets the logits too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from laden.weights.inplace import fill_in_place

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(tmp_path / "tied")
    skeleton = skeleton_causal_lm(str(tmp_path / "tied"), dtype=torch.float32)
    assert skeleton.lm_head.weight is skeleton.model.embed_tokens.weight
    names = [name for name, _ in model.named_parameters()]
    assert "lm_head.weight" not in names
    fill_in_place(iter(model.named_parameters()), dict(skeleton.named_parameters()))
    model.set_attn_implementation("sdpa")
    skeleton.set_attn_implementation("sdpa")
    torch.testing.assert_close(_logits(skeleton), _logits(model), rtol=0, atol=0)
