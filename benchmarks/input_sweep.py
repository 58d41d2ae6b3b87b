"""Bad inputs and damaged run directories through the `laden` command, as a new user meets them: every one
must end in a clear message (the file or field, and the fix) and an exit status, never a traceback, a hang,
or a run that takes the input silently.

    python benchmarks/input_sweep.py --out /tmp/sweep [--only NAME ...] [--timeout 120]

Each case builds its inputs in a directory of its own (the tiny model and data of `laden/assets`, one
thing broken), runs one command in a subprocess under a timeout and classifies the outcome:
- `clear`: it stopped with a non-zero status and a message on stderr that names what the case expects
  (a file name, a field, a line), no traceback;
- `warned`: it ran (status 0) and said what it did with the input (a case that expects a warning);
- `traceback`: Python's traceback reached the user;
- `hang`: the timeout passed;
- `silent`: status 0 where the case expects an error, or no warning where it expects one;
- `misleading`: a clear-looking message that does not name what the case expects.
One JSON line per case on stdout (name, group, outcome, status, seconds, the message's last line), then a
summary line with the count of each outcome. Exit status 1 when any case is not `clear` or `warned`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "laden" / "assets"


@dataclass(frozen=True)
class Case:
    name: str
    group: str
    args: list[str]
    """The `laden` arguments; `{d}` is replaced by the case's directory."""
    expect: str
    """A substring the message must contain (`clear`), or the warning (`warned`); `{d}` replaced."""
    setup: Callable[[Path], None] = lambda d: None
    warns: bool = False
    """The input is acceptable with a warning (status 0) rather than an error."""
    env: dict[str, str] = field(default_factory=dict)


def _write(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)


def _rows(n: int, bad: dict[int, str] | None = None, key: str = "prompt") -> str:
    """n RL rows of the tiny task, with row i (1-based) replaced by `bad[i]`."""
    lines = [json.dumps({key: f"say a: w{i}", "letter": "a"}) for i in range(1, n + 1)]
    for i, text in (bad or {}).items():
        lines[i - 1] = text
    return "\n".join(lines) + "\n"


def _sft_rows(n: int, bad: dict[int, str] | None = None) -> str:
    lines = [json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) for i in range(1, n + 1)]
    for i, text in (bad or {}).items():
        lines[i - 1] = text
    return "\n".join(lines) + "\n"


TINY = [f"actor.path={ASSETS / 'tiny'}"]
RL = ["rl", "--no-progress", "--config", str(ASSETS / "rl_tiny.yaml"), *TINY, "cluster.fileroot={d}/runs",
      f"valid_dataset.path={ASSETS / 'rl_tiny_valid.jsonl'}", "total_train_steps=2"]  # fmt: skip
RL_DATA = [*RL, f"train_dataset.path={ASSETS / 'rl_tiny.jsonl'}"]
SFT = ["sft", "--no-progress", "--config", str(ASSETS / "sft_tiny.yaml"), *TINY, "cluster.fileroot={d}/runs",
       "total_train_steps=2"]  # fmt: skip
SFT_DATA = [*SFT, f"train_dataset.path={ASSETS / 'sft_tiny.jsonl'}"]
MODEL_DIR = ["actor.init_from_config=false"]


def _tiny_model(d: Path) -> None:
    """A saved tiny model (weights and tokenizer) in d/model, to break one of its files."""
    code = (
        "import sys; from laden.model.hf.loading import load_causal_lm; from transformers import AutoTokenizer; "
        "import torch; m = load_causal_lm(sys.argv[1], dtype=torch.float32, init_from_config=True, seed=1); "
        "m.save_pretrained(sys.argv[2]); AutoTokenizer.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2])"
    )
    subprocess.run([sys.executable, "-c", code, str(ASSETS / "tiny"), str(d / "model")], check=True, cwd=ROOT)


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _finished_run(d: Path, job: str = "sft") -> Path:
    """A finished tiny run under d/runs with checkpoints at steps 1 and 2; its run directory."""
    base = SFT_DATA if job == "sft" else RL_DATA
    args = [a.replace("{d}", str(d)) for a in base] + [
        "checkpoint.save_freq_steps=1",
        "checkpoint.keep_last=5",
    ]
    subprocess.run([sys.executable, "-m", "laden.cli", *args], check=True, cwd=ROOT, capture_output=True)
    return d / "runs" / ("sft-tiny" if job == "sft" else "rl-tiny") / "run0"


def _damaged(path_in_run: str, damage: Callable[[Path], None], job: str = "sft") -> Callable[[Path], None]:
    """A finished run with total_train_steps raised by the case's args, whose newest checkpoint has one file damaged."""

    def setup(d: Path) -> None:
        run = _finished_run(d, job)
        damage(run / path_in_run)

    return setup


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(255 - b for b in data[mid : mid + 64])
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])


CASES: list[Case] = []


def case(*args, **kwargs) -> None:
    CASES.append(Case(*args, **kwargs))


# --- configuration -------------------------------------------------------------------------------------------
case("config_missing", "config", ["sft", "--config", "{d}/nope.yaml"], "nope.yaml")
case("config_is_a_directory", "config", ["sft", "--config", "{d}"], "is a directory")
case("config_not_yaml", "config", ["sft", "--config", "{d}/c.yaml"], "not valid YAML",
     setup=lambda d: _write(d / "c.yaml", "a: [1, 2\n"))  # fmt: skip
case("config_a_list", "config", ["sft", "--config", "{d}/c.yaml"], "holds a list",
     setup=lambda d: _write(d / "c.yaml", "- a\n- b\n"))  # fmt: skip
case("config_not_utf8", "config", ["sft", "--config", "{d}/c.yaml"], "UTF-8",
     setup=lambda d: _write(d / "c.yaml", b"a: \xff\xfe\n"))  # fmt: skip
case("config_unknown_key", "config", [*SFT_DATA, "actor.lrr=1"], "actor.lrr")
case("config_misspelled_section", "config", [*SFT_DATA, "actr.path=x"], "actr")
case("config_bad_type", "config", [*SFT_DATA, "actor.optimizer.lr=fast"], "actor.optimizer.lr")
case(
    "config_negative_batch", "config", [*SFT_DATA, "train_dataset.batch_size=-1"], "train_dataset.batch_size"
)
case("config_zero_steps", "config", [*SFT_DATA, "total_train_steps=0"], "total_train_steps")
case("config_bad_literal", "config", [*SFT_DATA, "actor.optimizer.type=adamw"], "actor.optimizer.type")
case("config_bad_backend", "config", [*SFT_DATA, "actor.backend=fsdp:x2"], "actor.backend")
case("config_too_many_gpus", "config", [*SFT_DATA, "actor.backend=fsdp:d8"], "actor.backend")
case("config_bad_override", "config", [*SFT_DATA, "=1"], "override")
case("config_mb_too_small", "config", [*SFT_DATA, "actor.mb_spec.max_tokens_per_mb=4"], "max_tokens_per_mb")
case("config_bad_interpolation", "config", [*SFT_DATA, "trial_name=${nope}"], "nope")
case("config_slash_in_name", "config", [*SFT_DATA, "trial_name=a/b"], "trial_name")
case("config_lr_nan", "config", [*SFT_DATA, "actor.optimizer.lr=.nan"], "actor.optimizer.lr")
case("config_temperature_zero", "config", [*RL_DATA, "gconfig.temperature=0"], "gconfig.temperature")
case("config_tolerance_over_one", "config", [*RL_DATA, "reward_error_tolerance=2"], "reward_error_tolerance")
case("config_reward_fns_bad", "config", [*RL_DATA, "reward_fns=[{fn: nodots}]"], "reward_fns[0].fn")
case("config_reward_fns_not_list", "config", [*RL_DATA, "reward_fns=3"], "reward_fns")
case("config_rl_with_sft_data_type", "config", [*RL_DATA, "train_dataset.type=sft"], "train_dataset.type")
case(
    "config_ignored_field_warns",
    "config",
    [*SFT_DATA, "gconfig.n_samples=4"],
    "gconfig.n_samples",
    warns=True,
)

# --- data ------------------------------------------------------------------------------------------------------
case("data_missing", "data", [*SFT, "train_dataset.path={d}/nope.jsonl"], "nope.jsonl")
case("data_empty", "data", [*SFT, "train_dataset.path={d}/e.jsonl"], "e.jsonl",
     setup=lambda d: _write(d / "e.jsonl", ""))  # fmt: skip
case("data_blank_lines_only", "data", [*SFT, "train_dataset.path={d}/e.jsonl"], "e.jsonl",
     setup=lambda d: _write(d / "e.jsonl", "\n\n"))  # fmt: skip
case("data_bad_json_line", "data", [*SFT, "train_dataset.path={d}/t.jsonl"], "t.jsonl:53",
     setup=lambda d: _write(d / "t.jsonl", _sft_rows(80, {53: '{"prompt": "x", '})))  # fmt: skip
case("data_not_an_object", "data", [*SFT, "train_dataset.path={d}/t.jsonl"], "t.jsonl:53",
     setup=lambda d: _write(d / "t.jsonl", _sft_rows(80, {53: "[1, 2]"})))  # fmt: skip
case("data_sft_row_without_completion", "data", [*SFT, "train_dataset.path={d}/t.jsonl"], "t.jsonl:53",
     setup=lambda d: _write(d / "t.jsonl", _sft_rows(80, {53: json.dumps({"prompt": "x"})})))  # fmt: skip
case("data_sft_bad_messages", "data", [*SFT, "train_dataset.path={d}/t.jsonl"], "t.jsonl:53",
     setup=lambda d: _write(d / "t.jsonl", _sft_rows(80, {53: json.dumps({"messages": "hello"})})))  # fmt: skip
case("data_sft_number_prompt", "data", [*SFT, "train_dataset.path={d}/t.jsonl"], "t.jsonl:53",
     setup=lambda d: _write(d / "t.jsonl", _sft_rows(80, {53: json.dumps({"prompt": 5, "completion": "x"})})))  # fmt: skip
case("data_sft_bad_row_skipped", "data", [*SFT, "train_dataset.path={d}/t.jsonl", "train_dataset.on_bad_row=skip"],
     "1", warns=True, setup=lambda d: _write(d / "t.jsonl", _sft_rows(80, {53: json.dumps({"prompt": "x"})})))  # fmt: skip
case("data_rl_row_without_prompt", "data", [*RL, "train_dataset.path={d}/t.jsonl"], "t.jsonl:53",
     setup=lambda d: _write(d / "t.jsonl", _rows(64, {53: json.dumps({"letter": "a"})})))  # fmt: skip
case("data_rl_prompt_a_number", "data", [*RL, "train_dataset.path={d}/t.jsonl"], "t.jsonl:53",
     setup=lambda d: _write(d / "t.jsonl", _rows(64, {53: json.dumps({"prompt": 7, "letter": "a"})})))  # fmt: skip
case("data_rl_row_without_reward_field", "data", [*RL, "train_dataset.path={d}/t.jsonl"], "t.jsonl:53",
     setup=lambda d: _write(d / "t.jsonl", _rows(64, {53: json.dumps({"prompt": "say a: q"})})))  # fmt: skip
case("data_valid_row_without_reward_field", "data", [*RL_DATA, "valid_dataset.path={d}/v.jsonl"], "v.jsonl:2",
     setup=lambda d: _write(d / "v.jsonl", _rows(4, {2: json.dumps({"prompt": "say a: q"})})))  # fmt: skip
case("data_unknown_extension", "data", [*SFT, "train_dataset.path={d}/t.csvx"], "t.csvx",
     setup=lambda d: _write(d / "t.csvx", "a,b\n"))  # fmt: skip
case("data_not_utf8", "data", [*SFT, "train_dataset.path={d}/t.jsonl"], "t.jsonl:3",
     setup=lambda d: _write(d / "t.jsonl", _sft_rows(5).encode().replace(b'"3+1=', b'"\xff+1=')))  # fmt: skip
case("data_parquet_garbage", "data", [*SFT, "train_dataset.path={d}/t.parquet"], "t.parquet",
     setup=lambda d: _write(d / "t.parquet", b"not a parquet file"))  # fmt: skip
case("data_json_not_a_list", "data", [*SFT, "train_dataset.path={d}/t.json"], "t.json",
     setup=lambda d: _write(d / "t.json", '{"a": 1}'))  # fmt: skip
case("data_all_too_long", "data", [*RL_DATA, "train_dataset.max_length=2", "actor.mb_spec.max_tokens_per_mb=512"],
     "max_length")  # fmt: skip
case("data_valid_overlaps_train_warns", "data", [*RL_DATA, "valid_dataset.path={d}/v.jsonl"],
     "also training prompts", warns=True,
     setup=lambda d: shutil.copy(ASSETS / "rl_tiny.jsonl", d / "v.jsonl"))  # fmt: skip

# --- model directories -------------------------------------------------------------------------------------------
case("model_missing", "model", [*SFT_DATA, "actor.path={d}/nope", *MODEL_DIR], "nope")
case("model_dir_without_config", "model", [*SFT_DATA, "actor.path={d}", *MODEL_DIR], "config.json")
case("model_config_garbage", "model", [*SFT_DATA, "actor.path={d}/model", *MODEL_DIR], "config.json",
     setup=lambda d: (_tiny_model(d), _write(d / "model" / "config.json", "{not json")))  # fmt: skip
case("model_negative_layers", "model", [*SFT_DATA, "actor.path={d}/model", *MODEL_DIR], "num_hidden_layers",
     setup=lambda d: (_tiny_model(d), _edit_json(d / "model" / "config.json", num_hidden_layers=-2)))  # fmt: skip
case("model_heads_do_not_divide", "model", [*SFT_DATA, "actor.path={d}/model", *MODEL_DIR, "actor.backend=fsdp:t3"],
     "actor.backend")  # fmt: skip
case("model_truncated_weights", "model", [*SFT_DATA, "actor.path={d}/model", *MODEL_DIR], "model.safetensors",
     setup=lambda d: (_tiny_model(d), _truncate(d / "model" / "model.safetensors")))  # fmt: skip
case("model_empty_weights", "model", [*SFT_DATA, "actor.path={d}/model", *MODEL_DIR], "model.safetensors",
     setup=lambda d: (_tiny_model(d), _write(d / "model" / "model.safetensors", b"")))  # fmt: skip
case("model_no_weights", "model", [*SFT_DATA, "actor.path={d}/model", *MODEL_DIR], "weights",
     setup=lambda d: (_tiny_model(d), (d / "model" / "model.safetensors").unlink()))  # fmt: skip
case("model_no_tokenizer", "model", [*SFT_DATA, "actor.path={d}/model", *MODEL_DIR], "tokenizer",
     setup=lambda d: (_tiny_model(d), (d / "model" / "tokenizer.json").unlink()))  # fmt: skip

# --- rewards -------------------------------------------------------------------------------------------------------
REWARDS = "import time\n\ndef ok(prompt, completion, prompt_ids, completion_ids, **f):\n    return 1.0\n"
case("reward_bad_path", "reward", [*RL_DATA, "reward_fn=nodots"], "reward_fn")
case("reward_missing_module", "reward", [*RL_DATA, "reward_fn=no_such_module:f"], "no_such_module")
case("reward_missing_function", "reward", [*RL_DATA, "reward_fn=laden.rl.rewards:nope"], "nope")
case("reward_module_imports_missing", "reward", [*RL_DATA, "reward_fn=rw:ok"], "not_installed_xyz",
     setup=lambda d: _write(d / "rw.py", "import not_installed_xyz\n" + REWARDS), env={"PYTHONPATH": "{d}"})  # fmt: skip
case("reward_import_hangs", "reward", [*RL_DATA, "reward_fn=rw:ok", "reward_import_timeout_s=3"], "has not finished",
     setup=lambda d: _write(d / "rw.py", "import time\ntime.sleep(10**6)\n" + REWARDS), env={"PYTHONPATH": "{d}"})  # fmt: skip
case("reward_import_raises", "reward", [*RL_DATA, "reward_fn=rw:ok"], "ZeroDivisionError",
     setup=lambda d: _write(d / "rw.py", "1/0\n" + REWARDS), env={"PYTHONPATH": "{d}"})  # fmt: skip
case("reward_bad_signature", "reward", [*RL_DATA, "reward_fn=rw:two"], "rw:two",
     setup=lambda d: _write(d / "rw.py", "def two(a, b):\n    return 1.0\n"), env={"PYTHONPATH": "{d}"})  # fmt: skip


def reward_case(name: str, fn: str, body: str, expect: str) -> None:
    """A case whose reward `rw:<fn>` takes the laden signature and runs the one line `body`."""
    source = f"def {fn}(prompt, completion, prompt_ids, completion_ids, **f):\n    {body}\n"
    case(name, "reward", [*RL_DATA, f"reward_fn=rw:{fn}"], expect,
         setup=lambda d: _write(d / "rw.py", source), env={"PYTHONPATH": "{d}"})  # fmt: skip


reward_case("reward_always_raises", "boom", "raise RuntimeError('boom')", "boom")
reward_case("reward_returns_string", "s", "return '1.0'", "'1.0'")
reward_case("reward_returns_bool", "b", "return True", "True")
reward_case("reward_returns_nan", "n", "return float('nan')", "nan")
case("reward_math_without_answer", "reward", [*RL_DATA, "reward_fn=laden.rl.rewards:math_reward"], "answer")
case("reward_areal_style_runs", "reward", [*RL_DATA, "reward_fn=rw:areal"], "done", warns=True,
     setup=lambda d: _write(d / "rw.py", "def areal(prompt, completions, prompt_ids, completion_ids, **data):\n"
                                         "    return float('a' in completions)\n"), env={"PYTHONPATH": "{d}"})  # fmt: skip
case("reward_trl_style_runs", "reward", [*RL_DATA, "reward_fn=rw:trl"], "done", warns=True,
     setup=lambda d: _write(d / "rw.py", "def trl(prompts, completions, **kw):\n"
                                         "    return [float('a' in c) for c in completions]\n"), env={"PYTHONPATH": "{d}"})  # fmt: skip

# --- run directories ---------------------------------------------------------------------------------------------


def _link(name: str) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        run = d / "runs" / "sft-tiny" / "run0"
        run.mkdir(parents=True)
        _write(d / "victim.sh", "#!/bin/sh\necho untouched\n")
        (run / name).symlink_to(d / "victim.sh")

    return setup


for member in (".lock", "config.yaml", "train_data_stats.json", "metrics.jsonl", "metrics.jsonl.tmp"):
    case(f"rundir_symlink_{member.strip('.')}", "rundir", SFT_DATA, "symbolic link", setup=_link(member))
case("rundir_lock_a_directory", "rundir", SFT_DATA, ".lock",
     setup=lambda d: (d / "runs" / "sft-tiny" / "run0" / ".lock").mkdir(parents=True))  # fmt: skip
case("rundir_fileroot_a_file", "rundir", [*SFT_DATA, "cluster.fileroot={d}/f"], "cluster.fileroot",
     setup=lambda d: _write(d / "f", "x"))  # fmt: skip
case("rundir_resume_never_on_history", "rundir", [*SFT_DATA, "checkpoint.resume=never"], "trial_name",
     setup=lambda d: _finished_run(d))  # fmt: skip
case("rundir_changed_seed", "rundir", [*SFT_DATA, "seed=7", "total_train_steps=4"], "seed",
     setup=lambda d: _finished_run(d))  # fmt: skip
case("rundir_finished_rerun_warns", "rundir", SFT_DATA, "already holds a finished run", warns=True,
     setup=lambda d: _finished_run(d))  # fmt: skip
case("rundir_metrics_cut_off_warns", "rundir", [*SFT_DATA, "total_train_steps=4"], "metrics.jsonl", warns=True,
     setup=_damaged("metrics.jsonl", lambda p: p.write_text(p.read_text() + '{"step": 3, "lo')))  # fmt: skip
case("rundir_metrics_garbage_line", "rundir", [*SFT_DATA, "total_train_steps=4"], "metrics.jsonl", warns=True,
     setup=_damaged("metrics.jsonl", lambda p: p.write_text("garbage\n" + p.read_text())))  # fmt: skip

# --- damaged checkpoints (the newest, step 2; on_damage previous resumes from step 1 with a warning) ---------------
DAMAGE = {
    "model_bitflip": ("checkpoints/step_2/model.safetensors", _flip),
    "model_truncated": ("checkpoints/step_2/model.safetensors", _truncate),
    "model_empty": ("checkpoints/step_2/model.safetensors", lambda p: p.write_bytes(b"")),
    "optimizer_header": ("checkpoints/step_2/optimizer.safetensors", lambda p: p.write_bytes(b"\xff" * 16 + p.read_bytes()[16:])),
    "rng_truncated": ("checkpoints/step_2/rng_rank0.pt", _truncate),
    "config_garbage": ("checkpoints/step_2/config.yaml", lambda p: p.write_text("a: [")),
    "trainer_truncated": ("checkpoints/step_2/trainer.json", _truncate),
    "scheduler_truncated": ("checkpoints/step_2/scheduler.json", _truncate),
    "meta_missing": ("checkpoints/step_2/meta.json", lambda p: p.unlink()),
    "version_missing": ("checkpoints/step_2/version.json", lambda p: p.unlink()),
    "groups_missing": ("checkpoints/step_2/optimizer_groups.json", lambda p: p.unlink()),
}  # fmt: skip
for label, (member, damage) in DAMAGE.items():
    file = member.rsplit("/", 1)[1]
    case(f"checkpoint_{label}_stop", "checkpoint", [*SFT_DATA, "total_train_steps=4", "checkpoint.on_damage=stop"],
         file, setup=_damaged(member, damage))  # fmt: skip
    case(f"checkpoint_{label}_previous", "checkpoint", [*SFT_DATA, "total_train_steps=4"], file, warns=True,
         setup=_damaged(member, damage))  # fmt: skip

# --- laden eval -------------------------------------------------------------------------------------------------------
case("eval_without_valid_dataset", "eval", ["eval", "~valid_dataset"], "valid_dataset")
case("eval_checkpoint_not_a_step", "eval", ["eval", "--checkpoint", "{d}"], "checkpoint")
case("eval_model_missing", "eval", ["eval", "--model", "{d}/nope"], "nope")
case("eval_lora_checkpoint", "eval", ["eval", "--checkpoint", "{d}/runs/rl-tiny/run0/checkpoints/step_2",
                                      "actor.use_lora=true"], "LoRA", setup=lambda d: _finished_run(d, "rl"))  # fmt: skip


def classify(c: Case, status: int | None, err: str, expect: str) -> str:
    if status is None:
        return "hang"
    if "Traceback (most recent call last)" in err:
        return "traceback"
    if c.warns:
        return (
            "warned" if status == 0 and expect in err + "\n" else ("silent" if status == 0 else "misleading")
        )
    if status == 0:
        return "silent"
    return "clear" if expect in err else "misleading"


def run_case(c: Case, root: Path, timeout: float) -> dict:
    d = root / c.name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    c.setup(d)
    args = [a.replace("{d}", str(d)) for a in c.args]
    env = {**os.environ, **{k: v.replace("{d}", str(d)) for k, v in c.env.items()}}
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "laden.cli", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip
        status, err = done.returncode, done.stderr + done.stdout
    except subprocess.TimeoutExpired as exc:
        status, err = (
            None,
            (exc.stderr or b"").decode(errors="replace")
            if isinstance(exc.stderr, bytes)
            else (exc.stderr or ""),
        )
    expect = c.expect.replace("{d}", str(d))
    outcome = classify(c, status, err, expect)
    last = next((line for line in reversed(err.strip().splitlines()) if line.strip()), "")
    return {"name": c.name, "group": c.group, "outcome": outcome, "status": status,
            "seconds": round(time.perf_counter() - t0, 1), "expect": expect, "message": last[:300]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="a scratch directory for the cases")
    p.add_argument("--only", nargs="*", default=None, help="case names (default: all)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    args = p.parse_args(argv)
    cases = [c for c in CASES if args.only is None or c.name in args.only]
    if args.list:
        for c in cases:
            print(f"{c.group:10} {c.name}")
        print(f"{len(cases)} cases")
        return 0
    counts: dict[str, int] = {}
    for c in cases:
        record = run_case(c, args.out, args.timeout)
        counts[record["outcome"]] = counts.get(record["outcome"], 0) + 1
        print(json.dumps(record), flush=True)
    print(json.dumps({"summary": True, "cases": len(cases), **counts}), flush=True)
    return 0 if set(counts) <= {"clear", "warned"} else 1


if __name__ == "__main__":
    sys.exit(main())
