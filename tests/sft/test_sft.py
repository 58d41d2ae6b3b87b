"""SFT loop: micro-batched == one batch, resumed == uninterrupted, export, CLI."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from laden.cli import main
from laden.config import load_config
from laden.data import build_sft_samples, load_records, pack_samples
from laden.engine.fsdp import FSDPEngine
from laden.model.attention import set_attention
from laden.optim import OptimSettings
from laden.sft.trainer import run_sft

pytestmark = pytest.mark.usefixtures("one_thread")

ASSETS_DATA = "laden/assets/sft_tiny.jsonl"


def _samples(tokenizer, n: int):
    samples, _ = build_sft_samples(
        load_records(ASSETS_DATA)[:n], tokenizer, max_length=64, length_policy="filter"
    )
    return samples


def _engine(model, lr: float = 0.1, **kw) -> FSDPEngine:
    set_attention(model, "auto")
    return FSDPEngine(
        model,
        device=torch.device("cpu"),
        dtype=torch.float32,
        optimizer_dtype=torch.float32,
        optim=OptimSettings(type="sgd", lr=lr, weight_decay=0.0, gradient_clipping=0.0, total_steps=4),
        loss_chunk_size=37,
        **kw,
    )


def _reference_loss_and_grads(model, samples):
    """Plain PyTorch: each document separately, eager attention, full logits, token mean."""
    model.zero_grad()
    total, count = 0.0, 0
    for ids, mask in samples:
        x = torch.tensor(ids)[None]
        logits = model(input_ids=x).logits[0, :-1].float()
        target = torch.tensor(ids[1:])
        keep = torch.tensor(mask[1:]).bool()
        total = total + torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum")
        count += int(keep.sum())
    loss = total / count
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("num_mbs", [1, 3, 8])
def test_micro_batched_equals_one_batch_and_reference(tiny_model, tiny_tokenizer, num_mbs):
    samples = _samples(tiny_tokenizer, 8)
    ref_model = AutoModelForCausalLM.from_config(tiny_model.config, attn_implementation="eager")
    ref_model.load_state_dict(tiny_model.state_dict())
    ref_loss, ref_grads = _reference_loss_and_grads(ref_model, samples)

    engine = _engine(tiny_model, lr=0.0)  # lr 0: the step leaves the gradients to compare
    bins = [list(range(i, 8, num_mbs)) for i in range(num_mbs)]
    mbs = [pack_samples([samples[j] for j in b]) for b in bins]
    total_loss_tokens = sum(mb.num_loss_tokens for mb in mbs)
    out = engine.train_batch(mbs, global_num_loss_tokens=total_loss_tokens)
    torch.testing.assert_close(out["loss"], ref_loss)
    for name, p in engine.model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], msg=name)


def test_gradient_checkpointing_matches(tiny_dir, tiny_tokenizer):
    samples = _samples(tiny_tokenizer, 6)
    mbs = [pack_samples(samples[:3]), pack_samples(samples[3:])]
    n = sum(mb.num_loss_tokens for mb in mbs)
    params = []
    for gc in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_dir))
        engine = _engine(model, gradient_checkpointing=gc)
        for _ in range(2):
            engine.train_batch(mbs, global_num_loss_tokens=n)
        params.append([p.detach().clone() for p in engine.model.parameters()])
    for a, b in zip(*params):
        torch.testing.assert_close(a, b)


def _cfg(tmp_path, trial: str, *extra: str):
    return load_config(
        "examples/sft_tiny.yaml",
        [
            f"cluster.fileroot={tmp_path}",
            f"trial_name={trial}",
            "total_train_steps=6",
            "train_dataset.batch_size=8",
            "checkpoint.save_freq_steps=3",
            *extra,
        ],
        job="sft",
    )


def _final_state(run_dir):
    from safetensors.torch import load_file

    step = run_dir / "checkpoints" / "step_6"
    return {
        "model": load_file(step / "model.safetensors"),
        "optimizer": load_file(step / "optimizer.safetensors"),
    }


def test_resumed_equals_uninterrupted_bitwise(tmp_path, monkeypatch):
    straight = run_sft(_cfg(tmp_path, "straight"), progress=False)

    # Interrupt the second run right after its step-3 checkpoint, then rerun the same command.
    original = FSDPEngine.train_batch
    calls = {"n": 0}

    def crash_after_three(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt("simulated interruption")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FSDPEngine, "train_batch", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        run_sft(_cfg(tmp_path, "resumed"), progress=False)
    monkeypatch.setattr(FSDPEngine, "train_batch", original)
    resumed = run_sft(_cfg(tmp_path, "resumed"), progress=False)

    a, b = _final_state(straight.run_dir), _final_state(resumed.run_dir)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for key, value in a["optimizer"].items():
        assert torch.equal(value, b["optimizer"][key]), key
    rows = [json.loads(x) for x in (resumed.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    straight_rows = [json.loads(x) for x in (straight.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == [r["loss"] for r in straight_rows]
    elapsed = [r["elapsed_s"] for r in rows]  # the rerun counts on from step 3's
    assert all(0 < a < b for a, b in zip(elapsed, elapsed[1:])), elapsed
    assert (resumed.run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_export_loads_with_transformers(tmp_path):
    result = run_sft(
        _cfg(tmp_path, "export", "actor.dtype=bfloat16", "checkpoint.save_freq_steps=null"), progress=False
    )
    model = AutoModelForCausalLM.from_pretrained(result.run_dir / "hf")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert [p.name for p in (result.run_dir / "checkpoints").iterdir()] == ["step_6"]  # the final one
    assert (result.run_dir / "hf" / "tokenizer_config.json").exists()
    written = json.loads((result.run_dir / "train_data_stats.json").read_text())
    assert written["num_kept"] == written["num_records"] == 400


def test_cli_embedded_default_loss_falls(tmp_path, capsys):
    code = main(["sft", "--no-progress", f"cluster.fileroot={tmp_path}", "total_train_steps=40"])
    assert code == 0
    rows = [
        json.loads(x) for x in (tmp_path / "sft-tiny" / "run0" / "metrics.jsonl").read_text().splitlines()
    ]
    rows = [r for r in rows if "loss" in r]  # not the held-out evaluation before training (step 0)
    assert len(rows) == 40
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    assert all(r["tokens_per_s"] > 0 for r in rows)


def test_cli_reports_every_config_error(tmp_path, capsys):
    code = main(
        [
            "sft",
            "--config",
            "examples/sft_tiny.yaml",
            "actor.mb_spec.max_tokens_per_mb=16",
            "actor.optimizer.type=adamw",
            "actor.mb_spec.max_token_per_mb=3",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "actor.mb_spec.max_tokens_per_mb=16 is smaller than train_dataset.max_length = 64" in err
    assert "adam_bf16" in err  # the valid choices are listed
    assert "did you mean" in err and "max_tokens_per_mb" in err


def test_oom_retry_equals_never_failed(tmp_path, monkeypatch):
    """oom_policy=auto: a step that OOMs at 512 tokens/mb is re-split to 256 and retried."""
    never = run_sft(_cfg(tmp_path, "small", "actor.mb_spec.max_tokens_per_mb=256"), progress=False)

    original = FSDPEngine.forward_backward
    failures = {"n": 0}

    def oom_on_big_microbatches(self, micro_batches, *args, **kwargs):
        if max(mb.input_ids.numel() for mb in micro_batches) > 256:
            failures["n"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return original(self, micro_batches, *args, **kwargs)

    monkeypatch.setattr(FSDPEngine, "forward_backward", oom_on_big_microbatches)
    retried = run_sft(_cfg(tmp_path, "retried", "oom_policy=auto"), progress=False)
    assert failures["n"] == 6  # every step first failed at 512 tokens per micro-batch
    a, b = _final_state(never.run_dir), _final_state(retried.run_dir)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key

    with pytest.raises(RuntimeError, match=r"max_tokens_per_mb=256 \(now 512"):
        run_sft(_cfg(tmp_path, "raised"), progress=False)


def test_validation_loss_is_logged(tmp_path):
    cfg = _cfg(
        tmp_path,
        "valid",
        f"valid_dataset.path={ASSETS_DATA}",
        "valid_dataset.batch_size=64",
        "valid_dataset.max_length=64",
        "checkpoint.save_freq_steps=null",
        "checkpoint.export_hf=false",
        "evaluator.freq_steps=2",
        "evaluator.freq_epochs=null",
        "log_freq_steps=3",
    )
    result = run_sft(cfg, progress=False)
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "eval_loss" in rows[-1] and 0 < rows[-1]["eval_loss"] < 10
    assert (result.run_dir / "valid_data_stats.json").exists()
    # the evaluator's schedule: before training (step 0), every 2 steps and at the end, each logged
    last = result.num_steps
    assert [r["step"] for r in rows if "eval_loss" in r] == sorted({0, *range(2, last + 1, 2), last})
    assert rows[0] == {"step": 0, "eval_loss": rows[0]["eval_loss"], "elapsed_s": 0.0}
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]


def _torchrun_sft(tmp_path, trial: str, nproc: int, *extra: str):
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}  # a crash shows its stacks
    cmd = [  # --standalone: torchrun picks a free local rendezvous port itself
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "laden.cli", "sft", "--config", "examples/sft_tiny.yaml", "--no-progress",
        f"cluster.fileroot={tmp_path}", f"trial_name={trial}", "total_train_steps=4",
        "train_dataset.batch_size=8", "checkpoint.save_freq_steps=2", *extra,  # cluster.*: from torchrun
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-12000:]
    assert proc.stdout.count("done: ") == 1  # rank 0 speaks for both ranks
    assert proc.stderr.count("laden.sft INFO model: ") == 1  # and logs for them
    return tmp_path / "sft-tiny" / trial


@pytest.mark.parametrize("backend", ["fsdp", "roundpipe"])
def test_torchrun_data_parallel_d2_equals_single_process(tmp_path, backend):
    """`laden sft` under torchrun with actor.backend=<backend>:d2 (gloo) == one process, same global batches."""
    from safetensors.torch import load_file

    extra = ("total_train_steps=4", "checkpoint.save_freq_steps=null", f"actor.backend={backend}:d1")
    single = run_sft(_cfg(tmp_path, "d1", *extra), progress=False)
    d2 = _torchrun_sft(tmp_path, "d2", 2, f"actor.backend={backend}:d2")
    a = load_file(single.run_dir / "hf" / "model.safetensors")
    b = load_file(d2 / "hf" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)
    assert [p.name for p in sorted((d2 / "checkpoints").iterdir())] == ["step_2", "step_4"]
    la = [json.loads(x)["loss"] for x in (single.run_dir / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (d2 / "metrics.jsonl").read_text().splitlines()]
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=1e-5, atol=1e-6)


def test_torchrun_archon_d1p2_equals_fsdp_single_process(tmp_path):
    """`laden sft` with actor.backend=archon:d1p2 (two pipeline stages, gloo) == fsdp:d1 in one process:
    the exported model, every step's loss, and its checkpoints (every stage's tensors written by rank 0)."""
    from safetensors.torch import load_file

    single = run_sft(
        _cfg(tmp_path, "d1", "total_train_steps=4", "checkpoint.save_freq_steps=2"), progress=False
    )
    p2 = _torchrun_sft(tmp_path, "p2", 2, "actor.backend=archon:d1p2")
    for a, b in (
        (single.run_dir / "hf", p2 / "hf"),
        (single.run_dir / "checkpoints" / "step_4", p2 / "checkpoints" / "step_4"),
    ):
        for stem in ("model", "optimizer"):
            if not (a / f"{stem}.safetensors").exists():
                continue
            want, got = load_file(a / f"{stem}.safetensors"), load_file(b / f"{stem}.safetensors")
            assert want.keys() == got.keys()
            for key in want:
                torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5, msg=key)
    la = [json.loads(x)["loss"] for x in (single.run_dir / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (p2 / "metrics.jsonl").read_text().splitlines()]
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=1e-5, atol=1e-6)


def test_activation_knobs_change_memory_not_the_model(tmp_path, caplog):
    """actor.lean_activations (the default), actor.tiled_mlp_tokens and actor.fused_elementwise change
    memory and kernels, not the model that comes out (Hugging Face's modules as the reference)."""
    import logging

    from safetensors.torch import load_file

    caplog.set_level(logging.INFO, logger="laden.runtime")
    extra = ("total_train_steps=3", "checkpoint.save_freq_steps=null")
    plain = run_sft(_cfg(tmp_path, "plain", *extra, "actor.lean_activations=false"), progress=False)
    runs = {
        "lean": run_sft(_cfg(tmp_path, "lean", *extra), progress=False),
        "tiled": run_sft(_cfg(tmp_path, "tiled", *extra, "actor.tiled_mlp_tokens=16"), progress=False),
        "fused": run_sft(_cfg(tmp_path, "fused", *extra, "actor.fused_elementwise=true"), progress=False),
    }
    assert "actor.lean_activations: 9 RMSNorms and 2 gated MLPs lean" in caplog.text
    assert "actor.tiled_mlp_tokens=16: 2 decoder MLPs tiled, 9 RMSNorms lean" in caplog.text
    assert (
        "actor.fused_elementwise: the lean modules' elementwise math and 2 attention layers' rotary embeddings "
        "run compiled" in caplog.text
    )
    want = load_file(plain.run_dir / "hf" / "model.safetensors")
    for name, run in runs.items():
        got = load_file(run.run_dir / "hf" / "model.safetensors")
        tol = {"rtol": 1e-4, "atol": 1e-5} if name == "fused" else {"rtol": 1e-5, "atol": 1e-6}
        for key in want:
            torch.testing.assert_close(got[key], want[key], msg=f"{name}: {key}", **tol)


def test_cli_config_show_and_doctor(capsys):
    assert main(["config", "show", "--job", "sft", "actor.mb_spec.max_tokens_per_mb=1024"]) == 0
    shown = capsys.readouterr().out
    assert "max_tokens_per_mb: 1024" in shown and "backend: fsdp:d1" in shown
    assert main(["doctor"]) == 0
    report = capsys.readouterr().out
    assert f"torch         {torch.__version__}" in report
    assert "host adam" in report
    assert (
        "attention     auto on cpu: equal-length documents through SDPA in one batch, others through SDPA per document"
        in report
    )


def test_backend_needing_more_processes_fails_before_loading(tmp_path, capsys):
    code = main(["sft", f"cluster.fileroot={tmp_path}", "actor.backend=fsdp:d2", "cluster.n_gpus_per_node=2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "actor.backend='fsdp:d2' needs 2 process(es) but 1 were launched" in err
    assert "torchrun --nproc_per_node 2" in err
    assert not (tmp_path / "sft-tiny").exists()  # nothing was written before the check


def test_fail_fast_trains_the_longest_batch_first(tmp_path):
    def tokens(trial, *extra):
        result = run_sft(_cfg(tmp_path, trial, "total_train_steps=3", *extra), progress=False)
        return [
            json.loads(x)["num_tokens"] for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()
        ]

    plain, fast = tokens("plain"), tokens("fast", "train_dataset.fail_fast=true")
    assert len(fast) == len(plain) == 3
    assert fast[0] > plain[0] and fast[0] == max(fast)  # step 1 holds the 8 longest samples


def test_valid_dataset_fail_fast_says_it_has_no_effect():
    from laden.config.usage import fields_without_effect

    cfg = load_config(
        "examples/sft_tiny.yaml",
        [f"valid_dataset={{path: {ASSETS_DATA}, fail_fast: true, max_length: 64}}"],
        job="sft",
    )
    (line,) = fields_without_effect(cfg, job="sft", engine="fsdp")
    assert line.startswith("valid_dataset.fail_fast=True has no effect") and "train_dataset.fail_fast" in line


def test_an_oom_at_one_sequence_per_micro_batch_is_retried_with_layer_recompute(tmp_path, monkeypatch):
    """oom_policy=auto: halving down to one longest sequence, then layer recompute; as if it ran so."""
    never = run_sft(
        _cfg(tmp_path, "small", "actor.mb_spec.max_tokens_per_mb=64", "actor.gradient_checkpointing=true"),
        progress=False,
    )
    original, failures = FSDPEngine.forward_backward, []

    def oom_without_recompute(self, micro_batches, *args, **kwargs):
        if not self.recomputes:
            failures.append(max(mb.num_tokens for mb in micro_batches))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return original(self, micro_batches, *args, **kwargs)

    monkeypatch.setattr(FSDPEngine, "forward_backward", oom_without_recompute)
    retried = run_sft(_cfg(tmp_path, "retried", "oom_policy=auto"), progress=False)
    # the first step only (recompute stays on): packed at 512, 256, 128 and 64 tokens, then at one longest
    # sequence (50 tokens) before recompute
    assert failures == [396, 250, 100, 50, 50]
    a, b = _final_state(never.run_dir), _final_state(retried.run_dir)
    for key in a["model"]:
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=1e-5, atol=1e-6)  # packed otherwise


def test_a_step_that_runs_out_of_memory_leaves_a_checkpoint_to_resume_from(tmp_path, monkeypatch):
    """oom_policy=raise: the error names the fixes, the steps before it are checkpointed, and a rerun
    resumes at the failed step and ends where a run that never failed ends (bitwise)."""
    from laden.engine.oom import TrainingOOMError

    never = run_sft(_cfg(tmp_path, "never"), progress=False)
    original, calls = FSDPEngine.forward_backward, []

    def oom_at_step_5(self, micro_batches, *args, **kwargs):
        calls.append(1)
        if self.version == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return original(self, micro_batches, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(FSDPEngine, "forward_backward", oom_at_step_5)
        with pytest.raises(TrainingOOMError, match="training step 5 ran out of GPU memory"):
            run_sft(_cfg(tmp_path, "failed"), progress=False)
    run_dir = tmp_path / "sft-tiny" / "failed"
    assert (run_dir / "checkpoints" / "step_4").is_dir()  # save_freq_steps=3 alone would have left step 3
    resumed = run_sft(_cfg(tmp_path, "failed"), progress=False)
    a, b = _final_state(never.run_dir), _final_state(resumed.run_dir)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
