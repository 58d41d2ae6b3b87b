"""`laden rl` you can trust: held-out evaluation during a run and `laden eval`, held-out data that is held
out, and rewards that fail loudly (at start-up, and in the middle of a run)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest
from repo_paths import ROOT
from rl_runs import ASSETS, tiny_rl_config

from laden.cli import main
from laden.data import load_records
from laden.data.overlap import normalized, prompt_overlap
from laden.rl.reward_setup import RewardCheckError, start_rewards
from laden.rl.trainer import run_rl

pytestmark = [pytest.mark.usefixtures("one_thread")]

EVAL_KEYS = ("eval/accuracy", "eval/reward_mean", "eval/response_length", "eval/completions")


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _overrides(tmp_path: Path, *more: str) -> list[str]:
    """The CLI's form of `tiny_rl_config`."""
    return [
        "--config", str(ASSETS / "rl_tiny.yaml"), f"actor.path={ASSETS / 'tiny'}",
        f"train_dataset.path={ASSETS / 'rl_tiny.jsonl'}", f"valid_dataset.path={ASSETS / 'rl_tiny_valid.jsonl'}",
        f"cluster.fileroot={tmp_path}", *more,
    ]  # fmt: skip


# --- evaluation during a run, and the same evaluation outside it ------------------------------------------


def test_logged_held_out_accuracy_equals_laden_eval_on_that_steps_checkpoint(tmp_path, capsys, caplog):
    args = ["total_train_steps=10", "evaluator.freq_steps=5", "evaluator.freq_epochs=null",
            "checkpoint.save_freq_steps=5"]  # fmt: skip
    result = run_rl(tiny_rl_config(tmp_path, *args), progress=False)
    rows = _rows(result.run_dir)
    evals = {r["step"]: r for r in rows if "eval/accuracy" in r}
    assert sorted(evals) == [0, 5, 10]  # before training, every 5 steps, at the end
    assert evals[0]["elapsed_s"] == 0.0 and evals[5]["eval/completions"] == 16  # 16 prompts, greedy, one each
    assert [s for s, _ in result.held_out] == [0, 5, 10]
    assert result.held_out[-1][1] > result.held_out[0][1]  # the tiny task is learnt, on prompts it never saw
    assert "also training prompts" not in caplog.text  # disjoint sets: no overlap warning
    # evaluation completions never reach the trainer: every trained completion is a training prompt's
    last = rows[-1]
    assert last["trained"] == 10 * 8 * 4 and last["episodes"] == 10 * 8
    capsys.readouterr()
    ckpt = result.run_dir / "checkpoints" / "step_5"
    assert main(["eval", "--checkpoint", str(ckpt), *_overrides(tmp_path, *args)]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["version"] == 5 and record["shared_with_train"] == 0
    for key in EVAL_KEYS:  # the same greedy completions, scored the same
        assert record[key] == evals[5][key], key


def test_evaluation_changes_nothing_in_training(tmp_path):
    """A synchronous run trains the same with evaluations as without: the engine's random draws are put back."""
    with_eval = run_rl(
        tiny_rl_config(tmp_path / "a", "total_train_steps=6", "evaluator.freq_steps=2"), progress=False
    )
    without = run_rl(tiny_rl_config(tmp_path / "b", "total_train_steps=6", "~valid_dataset"), progress=False)
    assert with_eval.rewards == without.rewards
    assert len(with_eval.held_out) == 4 and without.held_out == []
    a = _rows(with_eval.run_dir)
    b = _rows(without.run_dir)
    assert [r["loss"] for r in a if r["step"] > 0] == [r["loss"] for r in b]


def test_the_overlap_warning_fires_on_a_planted_shared_prompt(tmp_path, caplog):
    train = load_records(str(ASSETS / "rl_tiny.jsonl"))
    valid = tmp_path / "valid.jsonl"
    planted = train[3]["prompt"].upper().replace(": ", " :  ")  # the same prompt, other case and spacing
    valid.write_text(
        json.dumps({"prompt": planted, "letter": "a"})
        + "\n"
        + json.dumps({"prompt": "say a: q", "letter": "a"})
        + "\n"
    )
    result = run_rl(
        tiny_rl_config(tmp_path, "total_train_steps=1", f"valid_dataset.path={valid}"), progress=False
    )
    assert "1 of 2 held-out prompts are also training prompts" in caplog.text
    stats = json.loads((result.run_dir / "valid_data_stats.json").read_text())
    assert stats["shared_with_train"] == 1 and stats["kept"] == 2


def test_prompt_overlap_counts_exact_and_normalised_matches():
    train = [{"prompt": "What is 3 + 4?"}, {"messages": [{"role": "user", "content": "Hello  World"}]}]
    held = [{"prompt": "What is 3 + 4?"}, {"prompt": "what is 3+4"}, {"prompt": "hello world!"}, {"prompt": "3.5"},
            {"prompt": "Calculate 3 + 4"}, {"other": 1}]  # fmt: skip
    overlap = prompt_overlap(train, held)
    assert (overlap.num_held_out, overlap.num_shared, overlap.num_exact) == (5, 3, 1)
    assert normalized("3.5") != normalized("35") and normalized("x.") == normalized("x")


# --- held-out data that is held out -------------------------------------------------------------------------


def _prepare_arith():
    spec = importlib.util.spec_from_file_location("prepare_arith", ROOT / "examples" / "prepare_arith.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepare_arith_drops_every_test_problem_shared_with_train():
    arith = _prepare_arith()
    assert arith.expression_key("Calculate ( ( 4 + -4 ) ).") == arith.expression_key("What is -4 + 4?")
    assert arith.expression_key("(3 + 4) * 2") != arith.expression_key("3 + 4 * 2")
    entries = [{"question": f"Calculate {a} + {b}.", "answer": a + b} for a in range(12) for b in range(12)]
    negated = [
        {"question": "Calculate -3 / 1.", "answer": -3},
        {"question": "Calculate -( 3 / 1 ).", "answer": -3},
    ]
    train = list(arith.rows(entries[:100] + negated[:1]))
    # shifted copies of one sequence, as nearby seeds give, then commuted and new problems, and one that
    # differs from a training problem only by parentheses laden's overlap check drops
    candidates = list(arith.rows(entries[50:] + [{"question": "What is 3 + 1?", "answer": 4}] + negated[1:]))
    test, removed = arith.disjoint_test(train, candidates, size=40)
    assert arith.shared(train, test) == 0 and len(test) == 10  # fewer than asked: the space is used up
    assert removed == {
        "same_question_as_train": 50, "same_expression_as_train": 29, "same_normalised_text_as_train": 1,
        "duplicate_in_test": 6,
    }  # fmt: skip
    assert prompt_overlap(train, test).num_shared == 0


def test_prepare_arith_writes_disjoint_files(tmp_path, monkeypatch):
    pytest.importorskip("reasoning_gym")
    arith = _prepare_arith()
    monkeypatch.setattr(
        "sys.argv", ["prepare_arith.py", str(tmp_path), "--train-size", "512", "--test-size", "50"]
    )
    arith.main()
    train, test = (
        [json.loads(x) for x in (tmp_path / f).read_text().splitlines()]
        for f in ("train.jsonl", "test.jsonl")
    )
    assert len(test) == 50 and not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert arith.shared(train, test) == 0


# --- rewards that fail loudly ---------------------------------------------------------------------------------


def test_a_failing_reward_stops_the_run_after_a_checkpoint_and_the_fixed_one_resumes(
    tmp_path, monkeypatch, capsys
):
    calls = tmp_path / "calls"
    monkeypatch.setenv("LADEN_TEST_CALLS", str(calls))
    monkeypatch.setenv("LADEN_TEST_LIMIT", str(1 + 3 * 32))  # the start-up probe, then 3 steps of 8 x 4
    args = _overrides(
        tmp_path,
        "~valid_dataset",
        "total_train_steps=6",
        "reward_fn=reward_fixtures_runs:letter_reward_until",
    )
    assert main(["rl", "--no-progress", *args]) == 1
    err = capsys.readouterr().err
    assert "step 4: 32 of 32 training rewards failed" in err and "the reward service is down" in err
    assert "a checkpoint of step 3 was written" in err
    run_dir = tmp_path / "rl-tiny" / "run0"
    assert (run_dir / "checkpoints" / "step_3").is_dir() and [r["step"] for r in _rows(run_dir)] == [1, 2, 3]
    monkeypatch.setenv("LADEN_TEST_LIMIT", "-1")  # the reward fixed: the same import path, now working
    assert main(["rl", "--no-progress", *args]) == 0
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[-1]["reward_errors_total"] == 0
    assert "6 steps" in capsys.readouterr().out


def test_a_row_without_the_rewards_field_is_named_at_start_up(tmp_path, tiny_tokenizer):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [{"prompt": "1+1", "answer": "2"}, {"prompt": "x"},
                                                           {"prompt": "2+2"}, {"prompt": "3+3", "answer": "6"}]))  # fmt: skip
    cfg = tiny_rl_config(
        tmp_path, f"train_dataset.path={data}", "reward_fn=reward_fixtures_runs:needs_answer"
    )
    with pytest.raises(RewardCheckError, match=rf"{data}:2: the row has no 'answer' field.*2 of 4 rows"):
        asyncio.run(start_rewards(cfg, [load_records(str(data))], tiny_tokenizer))


def test_missing_math_verify_is_named_at_start_up(tmp_path, tiny_tokenizer, monkeypatch):
    fake = tmp_path / "no_math_verify" / "math_verify"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'math_verify'\", name='math_verify')\n"
    )
    monkeypatch.syspath_prepend(str(fake.parent))  # the spawned workers start from this import path
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1", "answer": "2"}) + "\n")
    cfg = tiny_rl_config(tmp_path, f"train_dataset.path={data}", "reward_fn=laden.rl.rewards:math_reward")
    with pytest.raises(ValueError, match=r"math-verify(.|\n)*pip install 'laden\[rl\]'"):
        asyncio.run(start_rewards(cfg, [load_records(str(data))], tiny_tokenizer))


def test_a_reward_module_that_hangs_at_import_stops_the_run_within_the_timeout(tmp_path, capsys):
    args = _overrides(tmp_path, "reward_fn=reward_fixtures_hang:score", "reward_import_timeout_s=2")
    assert main(["rl", "--no-progress", *args]) == 2
    assert "has not finished after 2 s" in capsys.readouterr().err
    assert not (tmp_path / "rl-tiny" / "run0" / "checkpoints").exists()  # stopped before anything was built


def test_laden_eval_of_a_lora_runs_checkpoint_equals_what_the_run_logged(tmp_path, capsys):
    """A LoRA run's checkpoint holds its adapters: `laden eval` merges them into the base as `laden export`
    does, and gets the run's own held-out metrics of that step; the wrong `actor.use_lora` is named."""
    pytest.importorskip("peft")
    args = ["total_train_steps=2", "evaluator.freq_steps=2", "evaluator.freq_epochs=null", "checkpoint.save_freq_steps=2",
            "actor.use_lora=true", "actor.lora_rank=4", "actor.lora_alpha=8", "actor.optimizer.lr=3e-2",
            "checkpoint.export_hf=false"]  # fmt: skip
    result = run_rl(tiny_rl_config(tmp_path, *args), progress=False)
    logged = next(r for r in _rows(result.run_dir) if r["step"] == 2 and "eval/accuracy" in r)
    capsys.readouterr()
    ckpt = result.run_dir / "checkpoints" / "step_2"
    assert main(["eval", "--checkpoint", str(ckpt), *_overrides(tmp_path, *args)]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in EVAL_KEYS:
        assert record[key] == logged[key], key
    assert main(["eval", "--checkpoint", str(ckpt), *_overrides(tmp_path, *args[:-5])]) == 2
    assert "written by a LoRA run" in capsys.readouterr().err
