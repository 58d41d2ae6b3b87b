"""`laden doctor RUN_DIR`: a failed run's error.log (or a pasted traceback) diagnosed, with this run's fixes."""

from __future__ import annotations

import pytest
import torch
from rl_runs import ASSETS, tiny_rl_config

from laden.cli import main
from laden.config import load_config
from laden.engine.oom import PhaseOOMError, TrainingOOMError
from laden.memory.doctor import classify, diagnose

pytestmark = pytest.mark.usefixtures("one_thread")

GPU_OOM = """Traceback (most recent call last):
  File "/opt/laden/laden/rl/trainer.py", line 612, in _train_on
    loss = self.engine.forward_backward(mbs, self.objective, normalizer=n)
  File "/opt/laden/laden/engine/fsdp/engine.py", line 301, in forward_backward
    out = self.model(**inputs)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.50 GiB of \
which 100.00 MiB is free. Including non-PyTorch memory, this process has 23.40 GiB memory in use. Of the allocated \
memory 20.10 GiB is allocated by PyTorch, and 1.50 GiB is reserved by PyTorch but unallocated.
"""

GENERATION_OOM = """Traceback (most recent call last):
  File "/opt/laden/laden/rollout/native/engine.py", line 310, in _step
    logits = self.paged.decode(batch)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of 139.80 GiB \
of which 200.00 MiB is free. Of the allocated memory 130.00 GiB is allocated by PyTorch, and 10.00 MiB is reserved \
by PyTorch but unallocated.
"""

HOST_OOM = """Traceback (most recent call last):
  File "/opt/laden/laden/engine/roundpipe/host/store.py", line 150, in _allocate
    flat = torch.empty(n, dtype=dtype)
RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to \
allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)
"""


def test_a_training_gpu_oom_gets_the_allocator_figures_and_this_runs_values(tmp_path):
    d = classify(GPU_OOM, tiny_rl_config(tmp_path))
    assert (d.kind, d.phase) == ("GPU memory", "training")
    assert d.figures == pytest.approx({"tried to allocate": 2.0, "allocated by PyTorch": 20.1,
                                       "reserved but unallocated": 1.5, "GPU capacity": 23.5,
                                       "free at the failure": 100 / 1024})  # fmt: skip
    assert d.fixes[0].startswith(
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (1.50 GiB"
    )  # fragmentation
    assert any(
        f.startswith("actor.mb_spec.max_tokens_per_mb=256 (now 512") for f in d.fixes
    )  # half the budget
    assert d.fixes[-1].startswith("oom_policy=auto")
    assert (
        not classify(GPU_OOM, tiny_rl_config(tmp_path, "oom_policy=auto")).fixes[-1].startswith("oom_policy=")
    )


def test_a_generation_oom_names_the_rollout_knobs():
    d = classify(
        GENERATION_OOM,
        load_config(str(ASSETS / "rl_tiny.yaml"), ["native.mem_fraction_static=0.5"], job="rl"),
    )
    assert (d.kind, d.phase) == ("GPU memory", "generation")
    assert d.fixes == [
        "rollout.max_concurrent_rollouts=32 (now 64): fewer sequences' KV cache and logits at once",
        "native.mem_fraction_static=0.4 (now 0.5): a smaller KV cache leaves the trainer room",
    ]  # 10 MiB of slack is not fragmentation: no allocator advice


def test_a_host_oom_without_a_config_still_says_what_ran_out():
    d = classify(HOST_OOM)
    assert (d.kind, d.phase) == ("host memory", "model load")
    assert d.fixes and "config" in d.fixes[0]
    roundpipe = classify(
        HOST_OOM, load_config(str(ASSETS / "rl_tiny.yaml"), ["actor.backend=roundpipe:d1"], job="rl")
    )
    assert roundpipe.fixes[0].startswith("actor.roundpipe.pin_model=register")
    assert classify("ValueError: bad\n").kind == "not a memory error"


def test_a_failed_run_leaves_error_log_and_doctor_reads_it(tmp_path, monkeypatch, capsys):
    from laden.rl import trainer as rl_trainer
    from laden.rl.trainer import run_rl

    message = GPU_OOM.splitlines()[-3:]

    def out_of_memory(self, groups, shares):
        raise torch.OutOfMemoryError(" ".join(message).split("torch.OutOfMemoryError: ", 1)[1])

    monkeypatch.setattr(rl_trainer._Run, "_train_on", out_of_memory)
    cfg = tiny_rl_config(tmp_path, "total_train_steps=2")
    with pytest.raises(torch.OutOfMemoryError):
        run_rl(cfg, progress=False)
    run_dir = tmp_path / cfg.experiment_name / cfg.trial_name
    assert "CUDA out of memory" in (run_dir / "error.log").read_text()
    d = diagnose(run_dir)
    assert (d.kind, d.phase) == ("GPU memory", "training") and d.figures["tried to allocate"] == 2.0
    assert main(["doctor", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "GPU memory during training" in out and "actor.mb_spec.max_tokens_per_mb=256" in out
    assert main(["doctor", str(tmp_path)]) == 2  # no error.log there: one line, exit status 2
    assert "has no error.log" in capsys.readouterr().err


@pytest.mark.parametrize("phase", ["generation", "weight update"])
def test_generation_and_weight_update_ooms_stop_with_the_phase_and_its_fixes(tmp_path, monkeypatch, phase):
    from laden.rl import trainer as rl_trainer
    from laden.rl.trainer import run_rl

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")

    target = "_collect_batch" if phase == "generation" else "_push_weights"
    original = getattr(rl_trainer._Run, target)
    calls = []

    async def fail_later(self, *args):
        calls.append(1)
        if len(calls) == 2:  # the first update / batch (the engine's initial weights) goes through
            out_of_memory()
        return await original(self, *args)

    monkeypatch.setattr(rl_trainer._Run, target, fail_later)
    cfg = tiny_rl_config(tmp_path, "total_train_steps=3")
    with pytest.raises(PhaseOOMError) as err:
        run_rl(cfg, progress=False)
    assert err.value.phase == phase and err.value.where == "GPU"
    fix = (
        "rollout.max_concurrent_rollouts=32 (now 64)"
        if phase == "generation"
        else "actor.weight_update_mode=disk"
    )
    assert f"{phase} for step 2 ran out of GPU memory" in str(err.value) and fix in str(err.value)
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)
    log = (tmp_path / cfg.experiment_name / cfg.trial_name / "error.log").read_text()
    assert "CUDA out of memory" in log and "PhaseOOMError" in log


def test_an_in_place_update_that_runs_out_of_memory_is_made_again_through_disk(tmp_path, monkeypatch, caplog):
    """oom_policy=auto: retried == never failed (the rewards of every step, which the updates decide)."""
    import logging

    from laden.rl.trainer import run_rl
    from laden.rollout.native.engine import NativeEngine
    from laden.weights import WeightUpdateMeta

    steps = ("total_train_steps=4", "oom_policy=auto")
    never = run_rl(tiny_rl_config(tmp_path / "never", *steps), progress=False)
    original, failed = NativeEngine.update_weights, []

    async def once_out_of_memory(self, source, version):
        if version == 2 and not isinstance(source, WeightUpdateMeta) and not failed:
            failed.append(version)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB.")
        return await original(self, source, version)

    monkeypatch.setattr(NativeEngine, "update_weights", once_out_of_memory)
    with caplog.at_level(logging.WARNING, logger="laden.rl"):
        retried = run_rl(tiny_rl_config(tmp_path / "retried", *steps), progress=False)
    assert failed == [2] and "weight update 2 ran out of memory in place" in caplog.text
    assert retried.rewards == never.rewards
    assert (retried.run_dir / "weight_updates" / "v00000002").is_dir()
    with pytest.raises(PhaseOOMError):  # oom_policy=raise: the phase, its fixes, and a stop
        failed.clear()
        run_rl(tiny_rl_config(tmp_path / "raised", "total_train_steps=4"), progress=False)


def test_an_rl_step_that_runs_out_of_memory_is_made_again_on_split_micro_batches(
    tmp_path, monkeypatch, caplog
):
    """oom_policy=auto: the same documents in smaller micro-batches; rewards and weights as never failed."""
    import logging

    from laden.engine.fsdp import FSDPEngine
    from laden.rl.trainer import run_rl

    steps = ("total_train_steps=3", "oom_policy=auto")
    never = run_rl(tiny_rl_config(tmp_path / "never", *steps), progress=False)
    original, failures = FSDPEngine.forward_backward, []

    def out_of_memory_above_128_tokens(self, micro_batches, *args, **kwargs):
        if max(mb.num_tokens for mb in micro_batches) > 128:
            failures.append(max(mb.num_tokens for mb in micro_batches))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return original(self, micro_batches, *args, **kwargs)

    monkeypatch.setattr(FSDPEngine, "forward_backward", out_of_memory_above_128_tokens)
    with caplog.at_level(logging.WARNING, logger="laden.rl"):
        retried = run_rl(tiny_rl_config(tmp_path / "retried", *steps), progress=False)
    assert len(failures) >= 3 and "retrying the same documents in" in caplog.text  # every step split
    assert retried.rewards == never.rewards
    from safetensors.torch import load_file

    a, b = (load_file(r.run_dir / "checkpoints" / "step_3" / "model.safetensors") for r in (never, retried))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)  # the summation order differs
    with pytest.raises(TrainingOOMError, match="training step 1 ran out of GPU memory"):
        run_rl(tiny_rl_config(tmp_path / "raised", "total_train_steps=3"), progress=False)


def test_weight_update_fixes_follow_where_the_weights_go(tmp_path):
    from laden.memory.doctor import phase_fixes

    def fixes(*overrides):
        return phase_fixes(tiny_rl_config(tmp_path, *overrides), "weight update", host=False)

    native = fixes("actor.weight_chunked_mem_mb=1024")  # xccl into the engine in this process: in place
    assert not any(f.startswith("actor.weight_chunked_mem_mb") for f in native)
    assert any(f.startswith("actor.weight_update_mode=disk") for f in native)
    served = fixes(
        "rollout.backend=sglang:d1", "cluster.n_gpus_per_node=2", "actor.weight_chunked_mem_mb=1024"
    )
    assert served[0].startswith("actor.weight_chunked_mem_mb=256 (now 1024)")  # the broadcast's bucket
    assert any(f.startswith("actor.weight_update_mode=disk") for f in served)
