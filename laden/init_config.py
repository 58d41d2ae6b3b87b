"""`laden init sft|rl|dpo|rw [--model M] [--data D] [--valid V] [--out FILE]`: a short commented config for
your model and data, checked the way `laden sft` / `laden rl` / `laden dpo` / `laden rw` will check it, so
that "my model and my data" is this command and then `laden sft --config FILE` (or `laden rl`, ...).
Without `--data`, the bundled tiny data: additions for sft, prompts rewarded for one letter for rl, and
preference pairs (the sum over a refusal, held-out pairs with other prompts) for dpo and rw.

The config names the fields a first run changes, each with a comment; every other field keeps its
default (`laden config docs` lists them all). Model and data paths are written absolute, so the file
works from any directory; a Hub id (`org/name`) is written as given.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from laden.config import load_config
from laden.config.validate_model import is_hub_id

ASSETS = resources.files("laden") / "assets"

_SFT = """\
# laden sft --config {out}
# Every field not named here keeps its default: `laden config docs` lists them all.
experiment_name: {name}
trial_name: run0             # results: cluster.fileroot/experiment_name/trial_name/
total_train_epochs: 1        # passes over the data (or stop sooner with total_train_steps: N)
train_dataset:
  path: {data}               # .jsonl / .json / .parquet / .csv, or hf:NAME; rows {{"prompt", "completion"}} or {{"messages"}}
  max_length: 1024           # tokens per example; longer ones are dropped and counted
  batch_size: 16             # examples per optimizer step
{valid}actor:
  path: {model}{init}
  backend: "fsdp:d1"         # one process; fsdp:dN for N GPUs (torchrun), roundpipe:d1 when the model does not fit
  gradient_checkpointing: auto   # laden decides from the predicted peak (laden plan shows it)
  mb_spec:
    max_tokens_per_mb: auto  # the largest micro-batch predicted to fit this GPU
  optimizer:
    lr: 2.0e-5
    lr_scheduler_type: cosine
    warmup_steps_proportion: 0.03
oom_policy: auto             # a step that runs out of memory is split and retried with the same examples
checkpoint:
  save_freq_steps: 100       # a rerun of the same command resumes from the newest checkpoint
  export_hf: true            # the trained model in hf/, loadable with transformers
"""

_RL = """\
# laden rl --config {out}
# Every field not named here keeps its default: `laden config docs` lists them all.
experiment_name: {name}
trial_name: run0             # results: cluster.fileroot/experiment_name/trial_name/
total_train_epochs: 1
reward_fn: "{reward}"  # module:function scoring each completion (AReaL, TRL and verl signatures work)
train_dataset:
  type: rl
  path: {data}               # rows {{"prompt": ..., plus the fields your reward reads, e.g. "answer"}}
  max_length: 512            # prompt tokens; longer prompts are dropped and counted
  batch_size: 8              # prompts per step
{valid}gconfig:
  n_samples: 8               # completions per prompt (GRPO's group)
  max_new_tokens: 512
  temperature: 1.0
rollout:
  backend: "native:d1"       # the embedded engine, on the training GPU (vllm:d1 / sglang:d1: servers on GPUs of their own)
  max_head_offpolicyness: 0  # 0: each batch from the latest weights; k > 0: generate up to k steps ahead
actor:
  path: {model}{init}
  backend: "fsdp:d1"
  gradient_checkpointing: auto
  mb_spec:
    max_tokens_per_mb: auto
  optimizer:
    lr: 1.0e-6
native:
  mem_fraction_static: auto  # the KV cache's share of the GPU, from the predicted training peak
oom_policy: auto
checkpoint:
  save_freq_steps: 25
  export_hf: true
"""

_PAIRS = """\
# laden {job} --config {out}
# Every field not named here keeps its default: `laden config docs` lists them all.
experiment_name: {name}
trial_name: run0             # results: cluster.fileroot/experiment_name/trial_name/
total_train_epochs: 1        # passes over the pairs (or stop sooner with total_train_steps: N)
train_dataset:
  type: {job}
  path: {data}               # rows {{"prompt", "chosen", "rejected"}} (texts or chat messages; no prompt: the sides' common start)
  max_length: 1024           # tokens per side; a pair with a longer side is dropped and counted
  batch_size: 16             # pairs per optimizer step
{valid}actor:
  path: {model}{init}
  backend: "fsdp:d1"         # one process; fsdp:dN for N GPUs (torchrun), roundpipe:d1 when the model does not fit
  gradient_checkpointing: auto   # laden decides from the predicted peak (laden plan shows it)
  mb_spec:
    max_tokens_per_mb: auto  # the largest micro-batch predicted to fit (a pair's two sides share one)
  optimizer:
    lr: {lr}
    lr_scheduler_type: cosine
    warmup_steps_proportion: 0.03{beta}
oom_policy: auto             # a step that runs out of memory is split and retried with the same pairs
checkpoint:
  save_freq_steps: 100       # a rerun of the same command resumes from the newest checkpoint
  export_hf: true            # {export}
"""

_PAIR_JOB = {
    "dpo": {"lr": "5.0e-7", "beta": "\n  beta: 0.1                  # DPO's beta: how far the policy may move from the reference (the initial weights)",
            "export": "the tuned causal LM in hf/"},
    "rw": {"lr": "1.0e-5", "beta": "", "export": "a one-label sequence classifier in hf/ (AutoModelForSequenceClassification)"},
}  # fmt: skip

_VALID = """\
valid_dataset:               # held-out data, never trained on (laden reports its overlap with train_dataset)
  {type}path: {valid}
  max_length: {length}
{evaluator}"""


def init_config(job: str, *, model: str | None, data: str | None, valid: str | None, out: Path) -> list[str]:
    """Write the config for `job` ("sft", "rl", "dpo" or "rw") to `out` (refusing to overwrite), check it, and return the
    lines to show. Without `model` / `data`: the bundled tiny model and data (a config that runs here)."""
    if out.exists():
        raise FileExistsError(f"{out} exists; choose another --out, or delete it to write a new config")
    tiny = model is None
    model_text = _path(model) if model else str(ASSETS / "tiny")
    if data is None:  # the bundled data of the job, with its held-out set where it has one
        pairs = (str(ASSETS / "pairs_tiny.jsonl"), str(ASSETS / "pairs_tiny_valid.jsonl"))
        bundled = {
            "rl": (str(ASSETS / "rl_tiny.jsonl"), str(ASSETS / "rl_tiny_valid.jsonl")),
            "dpo": pairs,
            "rw": pairs,
        }
        data, held = bundled.get(job, (str(ASSETS / "sft_tiny.jsonl"), None))
        valid = valid or held
    for flag, given in (("--data", data), ("--valid", valid)):
        if given and not given.startswith("hf:") and not Path(given).expanduser().exists():
            raise FileNotFoundError(
                f"{flag} {given} does not exist (a data file or directory, relative to {Path.cwd()}); "
                "give an existing path or hf:NAME"
            )
    held_out = ""
    if valid:
        held_out = _VALID.format(
            type="" if job == "sft" else f"type: {job}\n  ", valid=_path(valid), length=512 if job == "rl" else 1024,
            evaluator="evaluator:\n  freq_epochs: 1             # held-out accuracy every epoch, before the first step and after the last\n"
            if job == "rl" else "",
        )  # fmt: skip
    template = {"rl": _RL, "dpo": _PAIRS, "rw": _PAIRS}.get(job, _SFT)
    text = template.format(
        out=out, name=f"{job}-{Path(model_text).name or 'model'}".replace("/", "-"), data=_path(data),
        model=model_text, valid=held_out, job=job, **_PAIR_JOB.get(job, {}),
        init="\n  init_from_config: true   # the bundled tiny model is random-init (remove for real weights)" if tiny else "",
        reward="laden.rl.rewards:letter_reward" if tiny else "laden.rl.rewards:math_reward",
    )  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    try:
        load_config(str(out), [], job=job)  # type: ignore[arg-type]
    except BaseException:
        out.unlink()  # a config that does not load is not left behind
        raise
    command = f"laden {job} --config {out}"
    return [f"wrote {out} (checked for laden {job})", f"next: {command}", "      laden plan --config " + str(out)
            + "   (predicted memory first, optional)"]  # fmt: skip


def _path(text: str) -> str:
    """A local path made absolute (the config then works from any directory); `hf:` data and Hub ids as given."""
    if text.startswith("hf:"):
        return text
    path = Path(text).expanduser()
    return str(path.resolve()) if path.exists() or not is_hub_id(text) else text
