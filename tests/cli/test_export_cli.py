"""`laden export` and the periodic exports: a Hugging Face directory from any checkpoint, on the CPU.

The invariants: the export of step N holds checkpoint N's weights; the periodic export of step N equals
`laden export --step N`; the CLI's export of the final checkpoint equals the run's own `hf/`; `laden rl`
exports at the end by default; a LoRA export's adapter loads with peft and a run continued from it
(`actor.lora_path`) starts at its weights.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from laden.cli import main
from laden.config import load_config
from laden.engine.checkpoint import checkpoint_tensors

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_SFT = "laden/assets/sft_tiny.yaml"


def _sft(tmp_path, *overrides: str):
    from laden.sft.trainer import run_sft

    cfg = load_config(TINY_SFT, [f"cluster.fileroot={tmp_path}", "total_train_steps=6", "checkpoint.keep_last=10",
                                 "checkpoint.save_freq_steps=2", *overrides], job="sft")  # fmt: skip
    return cfg, run_sft(cfg, progress=False).run_dir


def _tensors(directory) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    return _sft(tmp_path_factory.mktemp("sft"), "checkpoint.export_hf_freq_steps=4")[1]


def test_export_of_a_step_holds_that_checkpoints_weights(sft_run, tmp_path):
    from transformers import AutoModelForCausalLM

    assert main(["export", str(sft_run), "--step", "2", "--out", str(tmp_path / "out")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).state_dict()
    for name, tensor in checkpoint_tensors(sft_run / "checkpoints" / "step_2"):
        assert torch.equal(exported[name], tensor), name
    trained_more = _tensors(sft_run / "hf")
    assert not torch.equal(trained_more["model.norm.weight"], exported["model.norm.weight"])


def test_periodic_export_equals_the_cli_export_of_that_step(sft_run):
    periodic = sft_run / "hf_steps" / "step_4"
    assert sorted(p.name for p in (sft_run / "hf_steps").iterdir()) == ["step_4"]  # the final one is hf/
    before = _tensors(periodic)
    assert main(["export", str(sft_run), "--step", "4"]) == 0  # default --out: the same directory
    after = _tensors(periodic)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_cli_export_of_the_final_checkpoint_equals_the_runs_export(sft_run, tmp_path):
    assert main(["export", str(sft_run), "--out", str(tmp_path / "final")]) == 0
    mine, theirs = _tensors(tmp_path / "final"), _tensors(sft_run / "hf")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_export_names_the_steps_it_has(sft_run, capsys):
    assert main(["export", str(sft_run), "--step", "3"]) == 2
    assert "its checkpoints: 2, 4, 6" in capsys.readouterr().err


def test_rl_exports_at_the_end_by_default(tmp_path):
    from laden.cli import _embedded_rl_default
    from laden.rl.trainer import run_rl

    path, defaults = _embedded_rl_default()
    cfg = load_config(path, [*defaults, f"cluster.fileroot={tmp_path}", "total_train_steps=2"], job="rl")
    assert cfg.checkpoint.export_hf
    result = run_rl(cfg, progress=False)
    assert (result.run_dir / "hf" / "laden_export.json").is_file()


def test_lora_export_loads_with_peft_and_continuing_starts_at_its_weights(tmp_path):
    peft = pytest.importorskip("peft")
    from laden.model.hf.loading import load_causal_lm
    from laden.model.lora import LoraSettings, apply_lora

    lora = ["actor.use_lora=true", "actor.lora_rank=4", "actor.lora_alpha=8", "actor.optimizer.lr=1e-2"]
    cfg, run_dir = _sft(tmp_path / "a", *lora)
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--step", "4", "--out", str(out)]) == 0
    base = load_causal_lm(cfg.actor.path, dtype=torch.float32, init_from_config=True, seed=cfg.seed)
    rebuilt = peft.PeftModel.from_pretrained(base, out / "adapter").merge_and_unload().state_dict()
    merged = _tensors(out)
    for name, value in merged.items():
        torch.testing.assert_close(rebuilt[name], value, rtol=1e-5, atol=1e-6, msg=name)
    saved = dict(checkpoint_tensors(run_dir / "checkpoints" / "step_4"))
    # Continuing: the adapters start at the exported ones, not at B = 0.
    model = load_causal_lm(cfg.actor.path, dtype=torch.float32, init_from_config=True, seed=cfg.seed)
    apply_lora(model, LoraSettings(rank=4, alpha=8, adapter_path=str(out / "adapter")), seed=cfg.seed + 1)
    params = dict(model.named_parameters())
    assert saved and all(torch.equal(params[name], t) for name, t in saved.items())
    _, continued = _sft(tmp_path / "b", *lora, f"actor.lora_path={out / 'adapter'}", "total_train_steps=1")
    first = [r for r in (continued / "metrics.jsonl").read_text().splitlines()][0]
    fresh = (run_dir / "metrics.jsonl").read_text().splitlines()[0]
    assert first != fresh  # a run from the adapter does not start where fresh adapters do
    with pytest.raises(ValueError, match="lora_rank=8"):
        apply_lora(load_causal_lm(cfg.actor.path, dtype=torch.float32, init_from_config=True, seed=0),
                   LoraSettings(rank=8, alpha=8, adapter_path=str(out / "adapter")), seed=0)  # fmt: skip
