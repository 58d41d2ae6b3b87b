"""On-policy distillation from a teacher (AReaL's `teacher` section): the combined loss and its gradients
against a plain fp64 reference written here, the teacher's log-probs on every engine against the Hugging
Face model, its vocabulary check, AReaL's distillation example loading, and a tiny `laden rl` run whose
distillation term is what it optimises (the exact KL to the teacher falls)."""

from __future__ import annotations

import json
import logging
from importlib import resources

import pytest
import torch
from areal_copies import AREAL
from areal_copies import PATHS as AREAL_PATHS
from repo_paths import ROOT
from rl_runs import tiny_rl_config
from tiny import write_tiny_teacher
from torch.testing import assert_close

from laden.config import ConfigError, load_config
from laden.data.batch import IGNORE_INDEX, pack_samples
from laden.rl.objectives import DistillSettings, PPOObjective, PPOSettings

pytestmark = pytest.mark.usefixtures("one_thread")

ASSETS = resources.files("laden") / "assets"
V, H = 11, 6

# ---------------------------------------------------------------- the loss against a plain reference


def _reference(hidden, weight, labels, f, s: PPOSettings, d: DistillSettings):
    """Summed loss, token by token in fp64: the clipped PPO loss with the decoupled weight and the k1 KL
    term, then AReaL's teacher term (joint: w_rl * rl + w_d * (logp - t); pure: w_d * r * (sg(logp) - t))."""
    logits = hidden.double() @ weight.double().T / s.temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    total = hidden.new_zeros((), dtype=torch.float64)
    for j in range(labels.numel()):
        if labels[j] == IGNORE_INDEX:
            continue
        lp = logp_all[j, labels[j]]
        behav, prox = f["old_logprobs"][j].double(), f["prox_logprobs"][j].double()
        adv, teacher = f["advantages"][j].double(), f["teacher_logprobs"][j].double()
        ratio = torch.exp(lp - prox)
        rl = -torch.min(ratio * adv, ratio.clamp(1 - s.eps_clip, 1 + s.eps_clip) * adv)
        rl = rl * torch.exp(prox - behav) + s.kl_ctl * (lp - f["ref_logprobs"][j].double())
        if d.rl_loss_weight == 0:
            total = total + d.distill_loss_weight * torch.exp(lp - behav) * (lp.detach() - teacher)
        else:
            total = total + d.rl_loss_weight * rl + d.distill_loss_weight * (lp - teacher)
    return total


def _problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    samples = [(torch.randint(0, V, (n,), generator=g).tolist(), [0] * p + [1] * (n - p))
               for n, p in ((6, 2), (4, 1), (7, 3))]  # fmt: skip
    batch = pack_samples(samples)
    mask = batch.labels != IGNORE_INDEX
    hidden = torch.randn(batch.num_tokens, H, generator=g, dtype=torch.float64)
    weight = 0.5 * torch.randn(V, H, generator=g, dtype=torch.float64)
    logp = (
        torch.log_softmax(hidden @ weight.T, -1).gather(1, batch.labels.clamp(min=0)[:, None])[:, 0].float()
    )

    def near(scale: float) -> torch.Tensor:
        return torch.where(mask, logp + scale * torch.randn(batch.num_tokens, generator=g), 0.0)

    batch = batch.with_fields(
        advantages=torch.where(mask, torch.randn(batch.num_tokens, generator=g), 0.0), old_logprobs=near(0.4),
        prox_logprobs=near(0.2), ref_logprobs=near(0.5), teacher_logprobs=near(1.5),
    )  # fmt: skip
    return hidden, weight, batch


@pytest.mark.parametrize(
    ("rl_loss_weight", "distill_loss_weight"), [(1.0, 0.005), (0.7, 2.0), (0.0, 1.0), (0.0, 0.3)]
)
def test_combined_loss_and_gradients_equal_a_plain_reference(rl_loss_weight, distill_loss_weight):
    settings = PPOSettings(use_decoupled_loss=True, kl_ctl=0.1, temperature=0.8)
    distill = DistillSettings(rl_loss_weight=rl_loss_weight, distill_loss_weight=distill_loss_weight)
    hidden, weight, batch = _problem(seed=int(10 * distill_loss_weight + rl_loss_weight))
    objective = PPOObjective(settings, chunk_size=4, distill=distill)
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    loss = objective(h, w, batch)
    loss.backward()
    rh, rw = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    reference = _reference(rh, rw, batch.labels, batch.fields, settings, distill)
    reference.backward()
    assert_close(loss.double(), reference.detach(), rtol=2e-5, atol=2e-6)
    assert_close(h.grad.double(), rh.grad, rtol=2e-4, atol=2e-6)
    assert_close(w.grad.double(), rw.grad, rtol=2e-4, atol=2e-6)
    # the metric is the term without its weight, a mean over the loss tokens (AReaL's rkl_loss)
    mask = batch.labels != IGNORE_INDEX
    logp = torch.log_softmax(hidden @ weight.T / 0.8, -1).gather(1, batch.labels.clamp(min=0)[:, None])[:, 0]
    f = batch.fields
    term = logp - f["teacher_logprobs"].double()
    if rl_loss_weight == 0:
        term = torch.exp(logp - f["old_logprobs"].double()) * term
    assert_close(objective.pop_stats()["rkl_loss"].double(), term[mask].mean(), rtol=1e-4, atol=1e-6)


def test_distill_settings_refuse_meaningless_weights():
    with pytest.raises(ValueError, match=r"teacher.distill_loss_weight=-1.0 must be a finite number >= 0"):
        DistillSettings(distill_loss_weight=-1.0)
    with pytest.raises(ValueError, match="leave no loss"):
        DistillSettings(rl_loss_weight=0.0, distill_loss_weight=0.0)


# ---------------------------------------------------------------- the teacher on every engine


@pytest.mark.parametrize("backend", ["fsdp:d1", "roundpipe:d1", "archon:d1"])
def test_teacher_scores_like_the_hugging_face_model_on_every_engine(tmp_path, backend):
    """The teacher, built as the reference model is (`laden.rl.scoring`), on the actor's engine: its log-probs
    of the labels equal the Hugging Face model's, and they land in the micro-batches as `teacher_logprobs`."""
    from laden.engine.backend import resolve_backend
    from laden.engine.runtime import Runtime
    from laden.model.hf.loading import load_causal_lm, load_tokenizer
    from laden.rl.scoring import build_teacher, score

    teacher_dir = write_tiny_teacher(tmp_path / "teacher", ASSETS / "tiny", seed=5, head_scale=4.0)
    cfg = tiny_rl_config(
        tmp_path, f"actor.backend={backend}", f"teacher.path={teacher_dir}", "teacher.temperature=0.7"
    )
    rt = Runtime(rank=0, world_size=1, device=torch.device("cpu"))
    engine = build_teacher(cfg, rt, resolve_backend(cfg), load_tokenizer(cfg.actor.path), total_steps=1)
    samples = [([4, 5, 6, 7, 8], [0, 0, 1, 1, 1]), ([9, 10, 11], [0, 1, 1])]
    mbs = [pack_samples(samples)]
    score(engine, mbs, "teacher_logprobs", temperature=0.7)
    got = mbs[0].fields["teacher_logprobs"]
    plain = load_causal_lm(str(teacher_dir), dtype=torch.float32, attn_impl="sdpa")
    want = []
    for ids, loss in samples:
        logits = plain(input_ids=torch.tensor([ids])).logits[0].detach() / 0.7
        logp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        want += [*(lp if on else 0.0 for lp, on in zip(logp.tolist(), loss[1:])), 0.0]
    assert_close(got, torch.tensor(want), rtol=1e-4, atol=1e-5)


def test_a_frozen_model_holds_its_weights_in_the_compute_dtype_and_nothing_else(tmp_path):
    """The teacher (and the reference model, built alike) keeps no fp32 masters beside its bf16 weights and no
    optimizer state: on roundpipe 2 bytes of host memory per parameter, on fsdp bf16 parameters and SGD."""
    from laden.engine.backend import resolve_backend
    from laden.engine.runtime import Runtime
    from laden.model.hf.loading import load_tokenizer
    from laden.rl.scoring import build_teacher

    teacher_dir = write_tiny_teacher(tmp_path / "teacher", ASSETS / "tiny", seed=5)
    rt = Runtime(rank=0, world_size=1, device=torch.device("cpu"))
    for backend in ("fsdp:d1", "roundpipe:d1"):
        cfg = tiny_rl_config(
            tmp_path, f"actor.backend={backend}", f"teacher.path={teacher_dir}", "teacher.dtype=bfloat16"
        )
        engine = build_teacher(cfg, rt, resolve_backend(cfg), load_tokenizer(cfg.actor.path), total_steps=1)
        if backend.startswith("fsdp"):
            assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
            assert type(engine.optimizer).__name__ == "SGD"
        else:
            held = {kind: n for kind, n in engine.host_bytes_by_kind().items() if n}
            assert held.keys() <= {"weights", "buffers"} and held["weights"] == 2 * 87_424, held


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path):
    from laden.rl.scoring import check_teacher_vocab

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return dict(self.vocab)

    actor = Tok({"a": 0, "b": 1, "c": 2})
    assert check_teacher_vocab(actor, Tok({"a": 0, "b": 1, "c": 2, "d": 3}), 4, path="t") == ""
    assert "head has 2 rows but the actor's tokenizer has token ids up to 2" in check_teacher_vocab(
        actor, None, 2, path="t"
    )
    moved = check_teacher_vocab(actor, Tok({"a": 0, "c": 1, "b": 2}), 8, path="t")
    assert "2 tokens have other ids in the teacher's tokenizer" in moved and "'b': 1 vs 2" in moved


# ---------------------------------------------------------------- the config


def test_areal_distillation_example_loads_as_the_teacher_section(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = load_config(AREAL / "gsm8k_grpo_distill.yaml", AREAL_PATHS, job="rl")
    t = cfg.teacher
    assert t is not None
    assert (t.path, t.rl_loss_weight, t.distill_loss_weight, t.dtype) == (
        "Qwen/Qwen2.5-14B-Instruct", 1.0, 0.005, "bfloat16"
    )  # fmt: skip
    said = caplog.text
    assert "teacher.backend='fsdp:d1p1t4': an AReaL setting without effect in laden; laden's teacher runs on " \
           "the actor's engine" in said  # fmt: skip
    assert "teacher.mb_spec.max_tokens_per_mb=10240" in said
    assert "teacher.experiment_name" not in said and "teacher.disable_dropout" not in said


def test_areal_teacher_config_forms_map_or_are_refused(caplog):
    """AReaL 1.0.4's TeacherConfig: `engine_type: train` with the engine under `train`, or `rollout` (an
    inference server there): both score on the actor's engine here; the rollout section is named as dropped."""
    train = load_config(
        AREAL / "gsm8k_grpo_distill.yaml",
        [*AREAL_PATHS, "~teacher", "+teacher={engine_type: train, rl_loss_weight: 0.0, distill_loss_weight: 0.5, "
         "train: {path: Qwen/Qwen3-1.7B, init_from_scratch: false, temperature: 0.9}}"],
        job="rl",
    )  # fmt: skip
    assert train.teacher is not None
    assert (train.teacher.path, train.teacher.temperature, train.teacher.rl_loss_weight) == (
        "Qwen/Qwen3-1.7B", 0.9, 0.0
    )  # fmt: skip
    with caplog.at_level(logging.WARNING):
        rollout = load_config(
            AREAL / "gsm8k_grpo_distill.yaml",
            [*AREAL_PATHS, "~teacher", "+teacher={engine_type: rollout, path: Qwen/Qwen3-1.7B, offload: true, "
             "rollout: {backend: 'sglang:d1'}}"],
            job="rl",
        )  # fmt: skip
    assert rollout.teacher is not None and rollout.teacher.path == "Qwen/Qwen3-1.7B"
    assert "teacher.rollout.backend='sglang:d1': an AReaL setting without effect in laden" in caplog.text
    assert "teacher.offload=true: an AReaL setting without effect in laden" in caplog.text
    with pytest.raises(ConfigError) as err:
        load_config(
            AREAL / "gsm8k_grpo_distill.yaml",
            [*AREAL_PATHS, "teacher.rl_loss_weight=0", "teacher.distill_loss_weight=0", "teacher.path=''",
             "+teacher.engine_type=server"],
            job="rl",
        )  # fmt: skip
    text = str(err.value)
    assert "teacher.engine_type='server': expected train or rollout" in text
    assert "teacher.path='': the teacher section needs the teacher model" in text
    assert "teacher.rl_loss_weight=0 and teacher.distill_loss_weight=0: the actor's loss would be 0" in text


def test_teacher_in_sft_is_named_as_without_effect():
    from laden.config.usage import fields_without_effect

    cfg = load_config(ROOT / "examples" / "sft_tiny.yaml", [f"teacher.path={ASSETS / 'tiny'}"], job="sft")
    lines = fields_without_effect(cfg, job="sft", engine="fsdp")
    assert any(
        line.startswith("teacher.path=") and "distillation from a teacher" in line for line in lines
    ), lines


# ---------------------------------------------------------------- `laden rl` with a teacher


def _first_token_kl(policy, teacher, tokenizer, prompts) -> float:
    """Mean exact KL(policy || teacher) of the first completion token's distribution over `prompts`."""
    total = 0.0
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        p = torch.log_softmax(policy(input_ids=ids).logits[0, -1].double(), -1)
        q = torch.log_softmax(teacher(input_ids=ids).logits[0, -1].double(), -1)
        total += float((p.exp() * (p - q)).sum())
    return total / len(prompts)


def test_pure_distillation_pulls_the_policy_to_the_teacher(tmp_path):
    """rl_loss_weight 0: the loss is the teacher term alone, and the policy's exact KL to the teacher (on the
    training prompts' first completion token) falls; the metrics carry the term and the teacher's time."""
    from laden.model.hf.loading import load_causal_lm, load_tokenizer
    from laden.rl.trainer import run_rl
    from laden.trackers.names import tracker_row

    teacher_dir = write_tiny_teacher(tmp_path / "teacher", ASSETS / "tiny", seed=7, head_scale=5.0)
    cfg = tiny_rl_config(
        tmp_path, f"teacher.path={teacher_dir}", "teacher.rl_loss_weight=0", "teacher.distill_loss_weight=1.0",
        "total_train_steps=20", "valid_dataset=null", "checkpoint.save_freq_steps=100",
    )  # fmt: skip
    result = run_rl(cfg, progress=False)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and all(r["rkl_loss"] == pytest.approx(r["loss"], rel=1e-5) for r in rows)
    assert all(r["teacher_logp_s"] >= 0 for r in rows)
    named = tracker_row(rows[0], "rl")
    assert "ppo_actor/update/rkl_loss/avg" in named and "timeperf/teacher_logp" in named

    tokenizer = load_tokenizer(cfg.actor.path)
    prompts = [json.loads(line)["prompt"] for line in (ASSETS / "rl_tiny.jsonl").read_text().splitlines()][
        :16
    ]
    teacher = load_causal_lm(str(teacher_dir), dtype=torch.float32, attn_impl="sdpa")
    initial = load_causal_lm(cfg.actor.path, dtype=torch.float32, init_from_config=True, seed=cfg.seed,
                             attn_impl="sdpa")  # fmt: skip
    trained = load_causal_lm(str(result.run_dir / "hf"), dtype=torch.float32, attn_impl="sdpa")
    with torch.no_grad():
        before = _first_token_kl(initial, teacher, tokenizer, prompts)
        after = _first_token_kl(trained, teacher, tokenizer, prompts)
    assert after < 0.6 * before, (before, after)  # 0.278 -> 0.096 when written
