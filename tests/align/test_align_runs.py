"""`laden dpo` and `laden rw` on the tiny model on the CPU: the loss falls and the training pair accuracy
rises, held-out pair accuracy is reported on a disjoint valid set (the overlap counted in code), the reward
model's export loads back and scores text; AReaL's two alignment configs load; bad input is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from areal_copies import AREAL, PATHS, TINY_MODEL

from laden.align.data import build_pairs
from laden.cli import main
from laden.config import ConfigError, load_config
from laden.data.overlap import prompt_overlap


def _rows(sums) -> list[dict]:
    # the preference: the sum itself over a refusal (one pattern across prompts, so it generalises)
    return [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": "no idea"} for a, b in sums]


TRAIN = _rows([(a, b) for a in range(1, 7) for b in range(1, 5)])  # 24 pairs
VALID = _rows([(a, b) for a in (7, 8) for b in range(5, 9)])  # 8 pairs, disjoint prompts


def _config(tmp_path: Path, job: str, valid: list[dict] = VALID, **extra) -> Path:
    for name, rows in (("train", TRAIN), ("valid", valid)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "experiment_name": job, "trial_name": "t", "seed": 1, "total_train_epochs": 3,
        "cluster": {"fileroot": str(tmp_path / "runs")},
        "train_dataset": {"path": "train.jsonl", "type": job, "batch_size": 8, "max_length": 32},
        "valid_dataset": {"path": "valid.jsonl", "type": job, "batch_size": 8, "max_length": 32},
        "evaluator": {"freq_epochs": None},
        "actor": {"path": str(TINY_MODEL), "init_from_config": True, "dtype": "float32",
                  "optimizer": {"type": "adam", "lr": 1e-2, "gradient_clipping": 1.0}, **extra},
    }  # fmt: skip
    path = tmp_path / f"{job}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _rows_of(tmp_path: Path, job: str, trial: str = "t") -> list[dict]:
    lines = (tmp_path / "runs" / job / trial / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_held_out_pairs_share_no_prompt_with_training_pairs():
    overlap = prompt_overlap(TRAIN, VALID)
    assert overlap.num_held_out == len(VALID) and overlap.num_shared == 0, overlap.summary()


@pytest.mark.parametrize("job", ["dpo", "rw"])
def test_tiny_run_learns_the_training_pairs_and_reports_held_out_accuracy(tmp_path, job, capsys):
    assert main([job, "--config", str(_config(tmp_path, job)), "--no-progress"]) == 0
    rows = _rows_of(tmp_path, job)
    before, steps = rows[0], [r for r in rows if "loss" in r]
    assert before["step"] == 0 and "eval/accuracy" in before and "eval/loss" in before
    assert len(steps) == 9 and steps[-1]["loss"] < steps[0]["loss"]
    assert steps[-1]["accuracy"] > steps[0]["accuracy"]
    if job == "dpo":  # the policy starts as the reference: every pair's log-ratio is 0
        assert steps[0]["loss"] == pytest.approx(0.6931, abs=1e-3) and steps[0]["accuracy"] == 0
        assert {"chosen_reward", "rejected_reward", "margin"} <= set(steps[-1])
    else:
        assert {"chosen_score", "rejected_score", "margin"} <= set(steps[-1])
    assert steps[-1]["eval/accuracy"] >= before["eval/accuracy"]
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "9 steps, loss" in out and "held-out pair accuracy" in out, out


@pytest.mark.slow
def test_reward_model_export_loads_back_and_scores_text(tmp_path):
    from laden.align.reward_model import load_reward_model, score_texts

    assert main(["rw", "--config", str(_config(tmp_path, "rw")), "--no-progress", "total_train_steps=2"]) == 0
    run = tmp_path / "runs" / "rw" / "t"
    model, tokenizer = load_reward_model(run / "hf")
    texts = ["<|im_start|>user\n7+5=<|im_end|>\n<|im_start|>assistant\n12",
             "<|im_start|>user\n7+5=<|im_end|>\n<|im_start|>assistant\nno idea"]  # fmt: skip
    chosen, rejected = score_texts(model, tokenizer, texts)
    assert chosen != rejected
    # `laden export` of the final checkpoint writes the same classifier
    assert main(["export", str(run), "--step", "2"]) == 0
    again = score_texts(*load_reward_model(run / "hf_steps" / "step_2"), texts)
    assert again == pytest.approx([chosen, rejected], rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_dpo_resumes_with_the_reference_log_probs_of_its_start(tmp_path):
    config = _config(tmp_path, "dpo")
    assert main(["dpo", "--config", str(config), "--no-progress", "total_train_steps=2",
                 "checkpoint.save_freq_steps=1"]) == 0  # fmt: skip
    assert (tmp_path / "runs" / "dpo" / "t" / "ref_logprobs.pt").exists()
    assert main(["dpo", "--config", str(config), "--no-progress", "total_train_steps=3"]) == 0
    steps = [r for r in _rows_of(tmp_path, "dpo") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # with the reference recomputed from the trained weights, step 3 would start at log 2 again
    assert steps[-1]["loss"] < 0.69


@pytest.mark.slow
@pytest.mark.parametrize("job", ["dpo", "rw"])
def test_data_parallel_d2_equals_one_process_with_a_last_batch_smaller_than_the_ranks(tmp_path, job):
    """Under torchrun with fsdp:d2 the ranks' micro-batch counts differ (the engine pads the shorter rank) and
    the validation set's last batch of one pair leaves rank 1 without a pair: the metrics equal one process's."""
    import os
    import subprocess
    import sys

    config = _config(tmp_path, job, valid=[*VALID, *_rows([(9, 9)])])
    common = [str(config), "--no-progress", "total_train_steps=2"]
    assert main([job, "--config", *common, "trial_name=d1"]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "laden.cli",
           job, "--config", *common, "trial_name=d2", "actor.backend=fsdp:d2"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-12000:]
    one, two = (_rows_of(tmp_path, job, trial) for trial in ("d1", "d2"))
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2]
    for a, b in zip(one, two):
        for name in ("loss", "accuracy", "margin", "eval/loss", "eval/accuracy", "eval/margin"):
            if name in a:
                assert b[name] == pytest.approx(a[name], rel=1e-5, abs=1e-6), (a["step"], name)


def test_sft_row_columns_set_in_a_pair_job_are_said_to_do_nothing(tmp_path):
    """`laden dpo` / `laden rw` read prompt_key, chosen_key and rejected_key; completion_key and messages_key
    are `laden sft`'s, and a run that sets them is told so at start-up."""
    from laden.config.usage import fields_without_effect

    for job in ("dpo", "rw"):
        cfg = load_config(_config(tmp_path, job), ["train_dataset.completion_key=answer",
                          "valid_dataset.messages_key=turns", "train_dataset.prompt_key=question"], job=job)  # fmt: skip
        lines = fields_without_effect(cfg, job=job, engine="fsdp")
        assert [line.split(" has no effect")[0] for line in lines] == [
            "train_dataset.completion_key='answer'", "valid_dataset.messages_key='turns'"
        ], lines  # fmt: skip
        assert all("it takes effect in `laden sft`" in line for line in lines)


def test_a_resumed_dpo_run_refuses_reference_log_probs_of_other_pairs(tmp_path, tiny_tokenizer, monkeypatch):
    """The reference log-probs are kept for the pairs they were computed on: a resume whose data has as many pairs
    but other tokens (an edited row) stops and says so instead of training against another pair's reference."""
    from types import SimpleNamespace

    from laden.align.task import REF_FILE, PairTask

    task = PairTask(load_config(_config(tmp_path, "dpo"), [], job="dpo"), "dpo")

    def reference(rt, engine, pairs):  # stands for the engine's forward pass
        for k, pair in enumerate(pairs):
            pair.ref = ([float(k)] * len(pair.chosen[0]), [-float(k)] * len(pair.rejected[0]))

    monkeypatch.setattr(task, "_reference_logprobs", reference)
    rt = SimpleNamespace(is_main=True, barrier=lambda: None)
    pairs, _ = build_pairs(TRAIN, tiny_tokenizer, max_length=32)
    task.setup(rt, None, tmp_path, 0, {"train": pairs})
    assert (tmp_path / REF_FILE).exists()
    again, _ = build_pairs(TRAIN, tiny_tokenizer, max_length=32)
    task.setup(rt, None, tmp_path, 3, {"train": again})  # the same data: read back
    assert [p.ref for p in again] == [p.ref for p in pairs]
    edited, _ = build_pairs([*TRAIN[:-1], {**TRAIN[-1], "chosen": "11"}], tiny_tokenizer, max_length=32)
    with pytest.raises(ValueError, match=r"ref_logprobs\.pt holds the reference log-probs of other train pairs than the "
                       r"train data's 24 \(their tokens differ.*start over with a new trial_name"):  # fmt: skip
        task.setup(rt, None, tmp_path, 3, {"train": edited})


@pytest.mark.parametrize(("job", "unread"), [("dpo", ["actor.chunked_loss"]),
                                             ("rw", ["actor.chunked_loss", "actor.loss_chunk_size"])])  # fmt: skip
def test_loss_chunking_settings_a_pair_job_does_not_read_are_named(tmp_path, job, unread):
    """DPO's log-probs are always chunked (by loss_chunk_size); the reward model's one-row head reads neither."""
    from laden.config.usage import fields_without_effect

    cfg = load_config(
        _config(tmp_path, job), ["actor.chunked_loss=false", "actor.loss_chunk_size=64"], job=job
    )
    lines = fields_without_effect(cfg, job=job, engine="fsdp")
    assert [line.split("=")[0] for line in lines] == unread, lines


def test_the_pair_budget_holds_the_validation_pairs_too(tmp_path):
    """Validation pairs share the micro-batch budget: a valid_dataset.max_length above the training one sets
    the default budget, and a budget set too small for it is refused at load time naming valid_dataset."""
    from laden.align.task import PairTask

    config = _config(tmp_path, "dpo")
    cfg = load_config(config, ["valid_dataset.max_length=48"], job="dpo")
    assert (
        PairTask(cfg, "dpo").budget() == 96
        and PairTask(load_config(config, [], job="dpo"), "dpo").budget() == 64
    )
    with pytest.raises(ConfigError, match=r"max_tokens_per_mb=64 cannot hold a pair of two valid_dataset\.max_length=48 "
                       r"sides .*set it to at least 96"):  # fmt: skip
        load_config(config, ["valid_dataset.max_length=48", "actor.mb_spec.max_tokens_per_mb=64"], job="dpo")


def test_areal_alignment_configs_load():
    dpo = load_config(AREAL / "hhrlhf_dpo.yaml", PATHS, job="dpo")
    assert dpo.train_dataset.type == "dpo" and dpo.actor.beta == 0.1 and dpo.actor.loss_type == "sigmoid"
    assert dpo.actor.mb_spec.max_tokens_per_mb == 4096 and dpo.train_dataset.max_length == 2048
    rw = load_config(AREAL / "hhrlhf_rw.yaml", PATHS, job="rw")
    assert rw.train_dataset.type == "rw" and rw.actor.optimizer.lr == 2e-5


def test_is_critic_belongs_to_the_reward_model_job():
    with pytest.raises(ConfigError, match=r"actor.is_critic=true trains the actor as a reward model"):
        load_config(AREAL / "hhrlhf_rw.yaml", [*PATHS, "train_dataset.type=dpo", "valid_dataset.type=dpo"],
                    job="dpo")  # fmt: skip


@pytest.mark.parametrize(
    ("override", "message"),
    [("actor.beta=0", r"actor.beta=0.* must be a finite number greater than 0"),
     ("actor.beta=-1", r"actor.beta=-1.* must be a finite number greater than 0"),
     ("actor.mb_spec.max_tokens_per_mb=2048", r"cannot hold a pair"),
     ("actor.backend=fsdp:d1c2", r"context-parallel")],
)  # fmt: skip
def test_bad_pair_settings_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(AREAL / "hhrlhf_dpo.yaml", [*PATHS, override], job="dpo")


@pytest.mark.parametrize(
    ("row", "message"),
    [({"prompt": "1+1=", "chosen": "2"}, r"no 'rejected' field"),
     ({"prompt": "1+1=", "rejected": "3"}, r"no 'chosen' field"),
     ({"chosen": "2", "rejected": ["x"]}, r"must be whole texts")],
)  # fmt: skip
def test_rows_without_a_pair_are_named(tiny_tokenizer, row, message):
    with pytest.raises(ValueError, match=message):
        build_pairs([row], tiny_tokenizer, max_length=32)


def test_rows_without_a_prompt_take_the_common_prefix_as_prompt(tiny_tokenizer):
    pairs, _ = build_pairs(
        [{"chosen": "Q: 1+1? A: 2", "rejected": "Q: 1+1? A: 3"}], tiny_tokenizer, max_length=64
    )
    (ids, mask), (rids, rmask) = pairs[0].chosen, pairs[0].rejected
    assert (
        mask.index(1) == rmask.index(1) == len("Q: 1+1? A: ")
    )  # a character tokenizer: one token a character
    assert ids[-1] == rids[-1] == tiny_tokenizer.eos_token_id


@pytest.mark.parametrize("shared", [0, 3])
def test_the_overlap_report_reads_each_datasets_own_prompt_key(tmp_path, tiny_tokenizer, caplog, shared):
    """Training rows under `prompt`, held-out rows under `question`: the report compares each set by its own key."""
    import logging

    from laden.align.task import PairTask

    held_out = [*TRAIN[:shared], *VALID]
    valid = [{"question": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]} for r in held_out]
    config = _config(tmp_path, "dpo", valid=valid)
    task = PairTask(load_config(config, ["valid_dataset.prompt_key=question"], job="dpo"), "dpo")
    with caplog.at_level(logging.INFO, logger="laden.align"):
        task.prepare(task.cfg.train_dataset, tiny_tokenizer, "train")
        task.prepare(task.cfg.valid_dataset, tiny_tokenizer, "valid")
    (line,) = [r.getMessage() for r in caplog.records if "held-out prompts" in r.getMessage()]
    assert f"{shared} of {len(held_out)} held-out prompts are also training prompts" in line
