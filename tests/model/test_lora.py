"""LoRA (`actor.use_lora`): adapter steps equal peft + PyTorch, merged weights equal peft's merge, only
the adapters train, updates carry only the adapted projections, checkpoints hold the adapters."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_qwen3_config

from laden.config import ConfigError, load_config
from laden.data.batch import pack_samples
from laden.model.hf.export import hf_state_names
from laden.model.lora import LoraSettings, apply_lora
from laden.optim import OptimSettings

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 96
SEED = 7
LORA = LoraSettings(rank=4, alpha=8.0)
SETTINGS = OptimSettings(lr=2e-2, eps=1e-3, weight_decay=0.0, gradient_clipping=0.5, total_steps=10)


def base_model(family: str):
    """A seeded random-init fp32 model: Qwen3 with an untied head, or Llama with tied embeddings."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    if family == "qwen3":
        config = tiny_qwen3_config(vocab_size=VOCAB)
    else:
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                             pad_token_id=0, eos_token_id=3, bos_token_id=None)  # fmt: skip
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _docs(num: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(4, VOCAB, (n,), generator=g) for n in torch.randint(4, 13, (num,), generator=g).tolist()
    ]


STEPS = [_docs(4, seed=1), _docs(4, seed=2), _docs(4, seed=3)]


def _micro_batches(docs: list[torch.Tensor]):
    return [
        pack_samples([(d.tolist(), [1] * len(d)) for d in docs[i : i + 2]]) for i in range(0, len(docs), 2)
    ]


def build_engine(kind: str, model):
    if kind == "fsdp":
        from laden.engine.fsdp import FSDPEngine

        return FSDPEngine(model, dtype=torch.float32, optimizer_dtype=torch.float32, optim=SETTINGS)
    from laden.engine.roundpipe import RoundPipeEngine

    return RoundPipeEngine(model, optim=SETTINGS, compute_dtype=torch.float32, optimizer_dtype=torch.float32,
                           devices=[torch.device("cpu")])  # fmt: skip


def train(engine, steps) -> list[dict[str, float]]:
    metrics = []
    for docs in steps:
        mbs = _micro_batches(docs)
        out = engine.train_batch(mbs, global_num_loss_tokens=sum(mb.num_loss_tokens for mb in mbs))
        metrics.append({k: float(v) for k, v in out.items()})
    return metrics


def peft_reference(family: str, steps):
    """Plain peft + PyTorch: `get_peft_model` (adapters drawn under the same seed), per-document
    forward, token-mean cross-entropy over the step, clip, AdamW over the trainable parameters."""
    model = base_model(family)
    torch.manual_seed(SEED)
    ref = peft.get_peft_model(model, LORA.peft_config())
    trainable = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        trainable, lr=SETTINGS.lr, eps=SETTINGS.eps, weight_decay=0.0, betas=SETTINGS.betas
    )
    losses, norms, grads = [], [], {}
    for docs in steps:
        opt.zero_grad()
        num_tokens = sum(len(d) - 1 for d in docs)
        total = 0.0
        for d in docs:
            logits = ref(input_ids=d[None]).logits[0, :-1]  # [L - 1, V]
            loss = F.cross_entropy(logits.float(), d[1:], reduction="sum") / num_tokens
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(trainable, SETTINGS.gradient_clipping).item())
        grads = {_name(n): p.grad.clone() for n, p in ref.named_parameters() if p.requires_grad}
        opt.step()
        losses.append(total)
    return losses, norms, grads, ref


def _name(peft_name: str) -> str:
    return peft_name.removeprefix("base_model.model.")


CASES = [("fsdp", "qwen3"), ("roundpipe", "llama")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{e}-{f}" for e, f in CASES])
def trained(request):
    kind, family = request.param
    model = base_model(family)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert apply_lora(model, LORA, seed=SEED) == 14  # q, k, v, o, gate, up, down of two layers
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    engine = build_engine(kind, model)
    metrics = train(engine, STEPS)
    return kind, family, engine, metrics, initial, adapters, peft_reference(family, STEPS)


def _engine_adapters(engine) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in engine.state_dict()["model"].items()}


def test_adapter_steps_equal_peft_reference(trained):
    kind, family, engine, metrics, _, adapters, (losses, norms, grads, ref) = trained
    assert len(adapters) == len(grads) == 28
    torch.testing.assert_close([m["loss"] for m in metrics], losses, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close([m["grad_norm"] for m in metrics], norms, rtol=1e-4, atol=1e-5)
    if kind == "fsdp":  # the engine leaves the last step's clipped gradients on its parameters
        got = {n: p.grad for n, p in engine.model.named_parameters() if p.requires_grad}
        assert set(got) == set(grads)
        for name, g in grads.items():
            torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=f"grad {name}")
    trained_now = _engine_adapters(engine)
    ref_now = {_name(n): p for n, p in ref.named_parameters() if p.requires_grad}
    assert set(trained_now) == set(ref_now)
    for name, p in ref_now.items():
        torch.testing.assert_close(trained_now[name], p, rtol=1e-4, atol=1e-6, msg=name)


def test_adapters_start_as_peft_draws_them_and_the_model_as_the_base():
    model, ref_base = base_model("qwen3"), base_model("qwen3")
    apply_lora(model, LORA, seed=SEED)
    torch.manual_seed(SEED)
    ref = peft.get_peft_model(ref_base, LORA.peft_config())
    ref_params = {_name(n): p for n, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        assert torch.equal(p, ref_params[name]), name
    b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert b and all(torch.count_nonzero(p) == 0 for p in b)  # so the adapted model equals the base


def test_only_adapters_are_optimized_and_the_base_stays(trained):
    kind, _, engine, _, initial, adapters, _ = trained
    params = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    if kind == "fsdp":
        named = dict(engine.model.named_parameters())
        assert params == {id(named[n]) for n in adapters}
        frozen = {n: p for n, p in named.items() if not p.requires_grad}
    else:  # the host AdamW steps the masters, which exist for trainable parameters only
        masters = {hp.name: hp.master for hp in engine.pipe.store.params if hp.master is not None}
        assert set(masters) == set(adapters) and params == {id(m) for m in masters.values()}
        frozen = {n: p for n, p in engine.model.named_parameters() if not p.requires_grad}
    assert len(frozen) == len(initial)
    for name, p in frozen.items():  # `...q_proj.base_layer.weight` is the base's `...q_proj.weight`
        assert torch.equal(p, initial[name.replace(".base_layer", "")]), name
    assert all(state for state in engine.optimizer.state.values())  # Adam states: the adapters' only
    assert len(engine.optimizer.state) == len(adapters)


def test_merged_weights_equal_peft_merge_and_unload(trained):
    kind, family, engine, *_, (_, _, _, ref) = trained
    merged = copy.deepcopy(ref).merge_and_unload()
    want = {n: merged.state_dict()[n] for n in hf_state_names(merged)}
    got = dict(engine.named_weights(torch.float32))
    assert list(got) == list(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    changed = dict(engine.named_weights(torch.float32, trained_only=True))
    assert sorted(changed) == sorted(n for n in want if n.endswith("_proj.weight"))
    for name, value in changed.items():
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_partial_update_makes_the_native_engine_the_merged_model(trained, tmp_path):
    from laden.rollout.native import NativeEngine
    from laden.weights import PartialUpdate, fill_in_place, read_weights, write_weights

    kind, family, engine, *_, (_, _, _, ref) = trained
    merged = copy.deepcopy(ref).merge_and_unload()
    rollout = NativeEngine(base_model(family), max_model_len=64, max_concurrent=2)
    with pytest.raises(ValueError, match="gave no value for"):  # a plain source must be complete
        fill_in_place(engine.named_weights(trained_only=True), rollout.named_parameters())
    rollout.load_weights(PartialUpdate(engine.named_weights(trained_only=True)), version=1)
    _assert_holds(rollout, merged)
    on_disk = NativeEngine(base_model(family), max_model_len=64, max_concurrent=2)
    write_weights(PartialUpdate(engine.named_weights(trained_only=True)), tmp_path, 2)
    assert isinstance(read_weights(tmp_path, 2), PartialUpdate)
    on_disk.load_weights(tmp_path, version=2)  # a disk root: the version is read back as partial
    _assert_holds(on_disk, merged)


def _assert_holds(rollout, merged) -> None:
    want = merged.state_dict()
    for name, value in rollout.named_parameters().items():
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6, msg=name)


def _d2_worker(rank: int, world_size: int, export_dir: str) -> list:
    """One rank of `fsdp:d2`: half of every step's micro-batches; plain load, then rank 0 broadcasting
    the weights to a meta skeleton (`memory_efficient_load`, adapted as the runtime adapts it), and
    the export (gathered on every rank, written by rank 0)."""
    from laden.engine.fsdp import FSDPEngine
    from laden.engine.fsdp.load import release_params_to_meta

    torch.set_num_threads(1)
    out = []
    for memory_efficient_load in (False, True):
        model = base_model("qwen3")
        if memory_efficient_load and rank > 0:
            release_params_to_meta(model)
        apply_lora(model, LORA, seed=SEED)
        engine = FSDPEngine(model, dp=world_size, dtype=torch.float32, optimizer_dtype=torch.float32,
                            optim=SETTINGS, memory_efficient_load=memory_efficient_load)  # fmt: skip
        metrics = []
        for docs in STEPS:
            mbs = _micro_batches(docs)
            total = sum(mb.num_loss_tokens for mb in mbs)
            result = engine.train_batch(mbs[rank::world_size], global_num_loss_tokens=total)
            metrics.append({k: float(v) for k, v in result.items()})
        out.append((metrics, dict(engine.named_weights(torch.float32)), len(engine.optimizer.state)))
    engine.export_hf(Path(export_dir))
    return out


def test_d2_under_torchrun_equals_the_peft_reference(tmp_path):
    from transformers import AutoModelForCausalLM
    from workers import run_workers

    losses, norms, _, ref = peft_reference("qwen3", STEPS)
    merged = copy.deepcopy(ref).merge_and_unload().state_dict()
    exported = tmp_path / "hf"
    for per_rank in run_workers(_d2_worker, 2, str(exported)):
        for metrics, weights, num_states in per_rank:
            torch.testing.assert_close([m["loss"] for m in metrics], losses, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close([m["grad_norm"] for m in metrics], norms, rtol=1e-4, atol=1e-5)
            assert num_states == 28  # optimizer states for the adapters only
            for name, value in weights.items():
                torch.testing.assert_close(value, merged[name], rtol=1e-4, atol=1e-6, msg=name)
    rebuilt = peft.PeftModel.from_pretrained(base_model("qwen3"), exported / "adapter").merge_and_unload()
    plain = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    for name, value in rebuilt.state_dict().items():
        torch.testing.assert_close(value, merged[name], rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(plain[name], merged[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", ["fsdp", "roundpipe"])
def test_resumed_from_adapter_checkpoint_equals_uninterrupted(kind, tmp_path):
    from laden.engine.checkpoint import load_engine, save_engine

    def fresh():
        model = base_model("qwen3")
        apply_lora(model, LORA, seed=SEED)
        return build_engine(kind, model)

    straight = fresh()
    train(straight, STEPS)
    first = fresh()
    train(first, STEPS[:2])
    save_engine(first, tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())  # noqa: SIM118 - safe_open has no iterator
    with safe_open(str(tmp_path / "optimizer.safetensors"), framework="pt") as f:
        states = {k.rsplit("/", 1)[0] for k in f.keys()}  # noqa: SIM118
    assert saved == states and len(saved) == 28 and all(".lora_" in n for n in saved)
    resumed = fresh()
    load_engine(resumed, tmp_path)
    assert resumed.version == 2
    train(resumed, STEPS[2:])
    a, b = dict(straight.named_weights()), dict(resumed.named_weights())
    for name, value in a.items():
        torch.testing.assert_close(b[name], value, rtol=0, atol=0, msg=name)


def test_apply_lora_refuses_what_it_cannot_adapt():
    with pytest.raises(ValueError, match=r"actor.target_modules=\['nope'\] matches no layer"):
        apply_lora(base_model("qwen3"), LoraSettings(target_modules=("nope",)), seed=0)
    with pytest.raises(ValueError, match="adapts the output head"):
        apply_lora(base_model("qwen3"), LoraSettings(target_modules=("q_proj", "lm_head")), seed=0)
    with pytest.raises(ValueError, match="not linear layers"):
        apply_lora(base_model("qwen3"), LoraSettings(target_modules=("embed_tokens",)), seed=0)
    with pytest.raises(ValueError, match="actor.lora_rank=0 must be at least 1"):
        LoraSettings(rank=0)
    model = base_model("qwen3")
    assert apply_lora(model, LoraSettings(target_modules=("q_proj", "v_proj")), seed=0) == 4
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(model, LORA, seed=0)


# ---------------------------------------------------------------- the config and the jobs


def test_sft_with_lora_loss_falls_and_exports_the_merged_model(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from laden.model.hf.loading import load_causal_lm
    from laden.sft.trainer import run_sft

    cfg = load_config("laden/assets/sft_tiny.yaml", [
        f"cluster.fileroot={tmp_path}", "total_train_steps=32", "actor.use_lora=true", "actor.lora_rank=8",
        "actor.lora_alpha=16", "actor.optimizer.lr=1e-2", "checkpoint.save_freq_steps=null",
    ], job="sft")  # fmt: skip
    result = run_sft(cfg, progress=False)
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "loss" in r]  # not the held-out evaluation before training
    first, last = sum(r["loss"] for r in rows[:3]) / 3, sum(r["loss"] for r in rows[-3:]) / 3
    # From ln(104) = 4.6; frozen random embeddings and head bound what rank-8 adapters learn (~3.7).
    assert last < first - 0.5, (first, last)
    exported = AutoModelForCausalLM.from_pretrained(result.run_dir / "hf")
    assert not any("lora" in n or "base_layer" in n for n in exported.state_dict())
    base = load_causal_lm("laden/assets/tiny", dtype=torch.float32, init_from_config=True, seed=cfg.seed)
    assert torch.equal(exported.model.embed_tokens.weight, base.model.embed_tokens.weight)  # frozen
    assert torch.equal(exported.model.norm.weight, base.model.norm.weight)
    q = exported.model.layers[0].self_attn.q_proj.weight
    assert not torch.allclose(q, base.model.layers[0].self_attn.q_proj.weight)  # merged: W + s B A
    # The adapter directory, loaded by peft onto the base and merged, is the exported model.
    rebuilt = peft.PeftModel.from_pretrained(base, result.run_dir / "hf" / "adapter").merge_and_unload()
    want = exported.state_dict()
    for name, value in rebuilt.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6, msg=name)
    with safe_open(
        str(result.run_dir / "checkpoints" / "step_32" / "model.safetensors"), framework="pt"
    ) as f:
        assert all(".lora_" in n for n in f.keys())  # noqa: SIM118 - the adapters, not the base


def test_areal_lora_fields_load(caplog):
    from areal_copies import AREAL, PATHS

    lora = ["+rollout.use_lora=true", "+actor.use_lora=${rollout.use_lora}", "+actor.peft_type=lora",
            "+actor.lora_rank=16", "+actor.lora_alpha=16", "+actor.target_modules=[all-linear]",
            "+gconfig.lora_name=lora-gsm8k", "+sglang.enable_lora=${actor.use_lora}",
            "+sglang.max_lora_rank=${actor.lora_rank}"]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="laden.config.areal"):
        cfg = load_config(AREAL / "gsm8k_grpo.yaml", [*PATHS, *lora], job="rl")
    a = cfg.actor
    assert (a.use_lora, a.peft_type, a.lora_rank, a.lora_alpha, a.target_modules) == (
        True, "lora", 16, 16.0, ["all-linear"]
    )  # fmt: skip
    assert LoraSettings.from_actor(a) == LoraSettings(rank=16, alpha=16.0, target_modules=("all-linear",))
    (served,) = [r.getMessage() for r in caplog.records if "sglang.enable_lora" in r.getMessage()]
    assert "sglang.max_lora_rank=16" in served and "LoRA-merged weights" in served
    assert any("gconfig.lora_name='lora-gsm8k'" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError) as info:
        load_config(AREAL / "gsm8k_grpo.yaml", [*PATHS, "+rollout.use_lora=true"], job="rl")
    (error,) = info.value.errors
    assert error.startswith("rollout.use_lora=true differs from actor.use_lora=false")


def test_lora_config_errors_name_field_value_and_fix():
    with pytest.raises(ConfigError) as info:
        bad = ["actor.use_lora=true", "actor.peft_type=ia3", "actor.lora_rank=0", "actor.target_modules=['']",
               "actor.backend=fsdp:d2t2"]  # fmt: skip
        load_config("laden/assets/sft_tiny.yaml", bad, job="sft")
    errors = info.value.errors
    assert (
        "actor.peft_type='ia3': only 'lora' is implemented (peft's LoRA adapters); set actor.peft_type: lora"
        in errors
    )
    assert "actor.lora_rank=0 must be at least 1; set it to a positive integer" in errors
    assert any(e.startswith("actor.target_modules=['']") and "empty name" in e for e in errors)
    assert any(
        e.startswith("actor.use_lora=true with actor.backend='fsdp:d2t2'") and "fsdp:d4" in e for e in errors
    )
    with pytest.warns(UserWarning, match=r"actor.\{lora_rank\} are ignored without actor.use_lora: true"):
        load_config("laden/assets/sft_tiny.yaml", ["actor.lora_rank=8"], job="sft")


def _capture_updates(monkeypatch) -> dict:
    """After every weight update: the rollout engine's weights and the trainer's merged ones."""
    from laden.rl import trainer as rl_trainer

    captured: dict = {}
    original = rl_trainer._Run._push_weights

    async def push_and_capture(self, version):
        await original(self, version)
        captured["rollout"] = {k: v.clone() for k, v in self.rollout.named_parameters().items()}
        captured["merged"] = dict(self.engine.named_weights(torch.float32))

    monkeypatch.setattr(rl_trainer._Run, "_push_weights", push_and_capture)
    return captured


def _assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_rl_with_lora_sends_only_the_adapted_projections(tmp_path, monkeypatch):
    from rl_runs import tiny_rl_config

    from laden.rl.trainer import run_rl

    lora = ["total_train_steps=3", "actor.use_lora=true", "actor.lora_rank=8", "actor.lora_alpha=16"]
    captured = _capture_updates(monkeypatch)
    in_place = run_rl(tiny_rl_config(tmp_path / "a", *lora), progress=False)
    _assert_same(captured["rollout"], captured["merged"])  # the engine holds the merged policy
    disk = run_rl(tiny_rl_config(tmp_path / "b", *lora, "actor.weight_update_mode=disk"), progress=False)
    assert disk.rewards == in_place.rewards
    manifest = json.loads((disk.run_dir / "weight_updates" / "v00000003" / "manifest.json").read_text())
    assert manifest["partial"] is True
    names = [t["name"] for t in manifest["tensors"]]
    assert len(names) == 14 and all(n.endswith("_proj.weight") for n in names)  # no embedding, head, norms


def test_rl_with_lora_sends_everything_to_an_engine_that_released_its_weights(tmp_path, monkeypatch):
    """Colocated and synchronous under roundpipe the engine frees its weights while the trainer trains,
    so the update after the step must refill all of them, not only the adapted projections."""
    from rl_runs import tiny_rl_config

    from laden.rl import trainer as rl_trainer
    from laden.rl.trainer import run_rl

    monkeypatch.setattr(rl_trainer._Run, "_sleeps_while_training", lambda self: True)
    captured = _capture_updates(monkeypatch)
    cfg = tiny_rl_config(tmp_path, "total_train_steps=2", "actor.use_lora=true", "actor.backend=roundpipe:d1")
    run_rl(cfg, progress=False)
    _assert_same(captured["rollout"], captured["merged"])
