"""Supervised fine-tuning: a thin loop over the shared runtime (`laden.engine.runtime`).

One optimizer step = one global batch of `train_dataset.batch_size` sequences, split into
token-budget micro-batches (`actor.mb_spec`; at least `actor.roundpipe.num_microbatch` of them
under the roundpipe engine), handed to the engine with the global loss-token count. Processes,
model loading and patching, the engine, data-parallel sharding and the OOM retry are the
runtime's; the run directory (one owner, one history, resume policy) is `laden.engine.rundir`'s;
the checkpoint layout is `laden.engine.checkpoint`'s. The loop syncs with the device once per
logged step, to read the metrics. Each logged step is a row of `metrics.jsonl` (with `elapsed_s`, the
training loop's seconds, summed over resumes); `curves.png` (`laden.plots`) is redrawn from it at
every checkpoint and at the end, on rank 0, and a figure that cannot be drawn never fails the run.
Rank 0 also hands each row to the experiment trackers of `stats_logger` (`laden.trackers`), under
AReaL's names.

Nothing is lost on failure: checkpoints are atomic, a final one is written at the end (so a
rerun of a finished run says so and trains nothing), an interrupted single-process run
(Ctrl-C) writes one for its last completed step before it stops, and resume restores the data
position and every RNG.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm.auto import tqdm

from laden.config import DatasetConfig, LadenConfig, dump_config, format_config
from laden.config.validate_actor import longest_max_length
from laden.data import (
    GlobalBatchIterator,
    PackedBatch,
    build_sft_samples,
    longest_first,
    pack_samples,
    partition_microbatches,
    read_dataset,
)
from laden.engine import signals
from laden.engine.checkpoint import (
    checkpoint_meta,
    keep_new_hyperparameters,
    load_checkpoint,
    save_checkpoint,
)
from laden.engine.oom import TrainingOOMError
from laden.engine.rundir import History, RunDirectory
from laden.engine.runtime import (
    OOMRetry,
    Runtime,
    batch_device,
    load_model,
    loss_tokens,
    seed_everything,
    shard_for_rank,
)
from laden.engine.signals import StopRequests, agree_to_stop_or_save
from laden.model.hf.loading import load_tokenizer
from laden.optim import OptimSettings
from laden.plots import CHECKPOINT_INTERVAL_S, write_curves
from laden.run_export import step_export_dir
from laden.run_setup import in_run_directory, start_run
from laden.safe_io import atomic_write_text
from laden.schedule import evaluation_due
from laden.sft.generate_eval import HeldOutAccuracy
from laden.trackers import Trackers, check_trackers

log = logging.getLogger("laden.sft")


@dataclass(kw_only=True, slots=True)
class SFTResult:
    """What a finished run reports."""

    run_dir: Path
    """Directory with config, metrics, checkpoints and the exported model."""
    num_steps: int
    """Optimizer steps taken in total (including those before a resume)."""
    first_loss: float | None
    """Loss of the first step this process ran (None when it ran none)."""
    last_loss: float | None
    """Loss of the last step."""
    already_finished: bool = False
    """The run directory held a finished run: nothing was trained or exported."""
    held_out: list[tuple[int, float]] = field(default_factory=list)
    """(step, held-out accuracy) of each `evaluator.generate` evaluation this process ran (rank 0)."""
    before_after: list[str] = field(default_factory=list)
    """The held-out accuracy and sample completions before -> after training (`evaluator.generate`)."""


def budget(cfg: LadenConfig) -> int:
    """Tokens per micro-batch: `actor.mb_spec.max_tokens_per_mb` or, unset, the longer `max_length` of the
    training and validation sets (the evaluation packs the validation samples under the same budget)."""
    return cfg.actor.mb_spec.max_tokens_per_mb or longest_max_length(cfg)


def prepare_data(ds: DatasetConfig, tokenizer: Any, name: str):
    """Tokenize a dataset and apply its length policy: (samples, statistics)."""
    field = f"{name}_dataset"
    records = read_dataset(ds, field=field)
    samples, stats = build_sft_samples(
        records,
        tokenizer,
        max_length=ds.max_length,
        length_policy=ds.length_policy,
        prompt_key=ds.prompt_key,
        completion_key=ds.completion_key,
        messages_key=ds.messages_key,
        on_bad_row=ds.on_bad_row,
        field=field,
    )
    log.info("%s_dataset: %s", name, stats.to_dict())
    if len(samples) < ds.batch_size:
        raise ValueError(
            f"{name}_dataset.batch_size={ds.batch_size} but only {len(samples)} samples remain after the "
            f"length policy; lower {name}_dataset.batch_size or raise {name}_dataset.max_length"
        )
    return samples, stats


def write_data_stats(ds: DatasetConfig, stats: Any, out_dir: Path, name: str) -> None:
    """`<name>_data_stats.json`: how many samples the length policy filtered or truncated."""
    stats_path = out_dir / f"{name}_data_stats.json"
    atomic_write_text(stats_path, json.dumps(stats.to_dict(), indent=2) + "\n")
    if stats.num_filtered or stats.num_truncated:
        log.warning(
            "%s_dataset.max_length=%d: %d samples filtered, %d truncated (policy %r); see %s",
            name, ds.max_length, stats.num_filtered, stats.num_truncated, ds.length_policy, stats_path,
        )  # fmt: skip


def step_micro_batches(
    cfg: LadenConfig, rt: Runtime, samples, indices: Sequence[int], tokens_per_mb: int
) -> list[PackedBatch]:
    """Pack the given samples into token-budget micro-batches where the engine takes them."""
    seqlens = [len(samples[i][0]) for i in indices]
    bins = partition_microbatches(
        seqlens,
        max_tokens_per_mb=tokens_per_mb,
        n_mbs=rt.backend.min_micro_batches(cfg),
        algorithm=cfg.actor.mb_spec.packing_algorithm,
    )
    packed = [pack_samples([samples[indices[j]] for j in b]) for b in bins]
    return [p.to(batch_device(rt.backend, rt), non_blocking=True) for p in packed]


def train_step(cfg: LadenConfig, rt: Runtime, engine, samples, indices: list[int], *, step: int):
    """One optimizer step, through the runtime's OOM retry. Returns (metrics, micro-batches, tokens).

    Each data-parallel rank packs its share of the global batch; the loss is normalised by the
    loss tokens of the whole global batch, which every rank computes from host data. The retry
    uses the same samples, so nothing is dropped, and the engine starts every attempt with
    fresh gradients, so a retried step equals one that never failed.
    """
    global_loss_tokens = loss_tokens(samples, indices)
    mine = shard_for_rank(samples, indices, engine.dp_rank, engine.dp_size)
    retry = OOMRetry(cfg=cfg, rt=rt, recompute=engine.enable_recompute)
    out, mbs = retry(
        lambda tokens: step_micro_batches(cfg, rt, samples, mine, tokens),
        lambda mbs: engine.train_batch(mbs, global_num_loss_tokens=global_loss_tokens),
        step=step,
        tokens_per_mb=budget(cfg),
        longest=max(len(samples[i][0]) for i in mine),
    )
    return out, len(mbs), sum(len(samples[i][0]) for i in indices)


def evaluate(cfg: LadenConfig, rt: Runtime, engine, valid) -> torch.Tensor:
    """Token-mean loss over the whole validation set, `valid_dataset.batch_size` samples at a time."""
    assert cfg.valid_dataset is not None
    size = cfg.valid_dataset.batch_size
    total_loss_tokens = loss_tokens(valid, list(range(len(valid))))
    loss = torch.zeros((), device=rt.device)
    for start in range(0, len(valid), size):
        indices = shard_for_rank(
            valid, list(range(start, min(start + size, len(valid)))), engine.dp_rank, engine.dp_size
        )
        mbs = step_micro_batches(cfg, rt, valid, indices, budget(cfg))
        loss += engine.eval_batch(mbs, global_num_loss_tokens=total_loss_tokens)["loss"].to(rt.device)
    return loss


class SFTTask:
    """What the loop runs for `laden sft`: token samples, the cross-entropy step, the validation loss.

    Another job of the same loop (`laden.align.task.PairTask`: `laden dpo`, `laden rw`) gives the same
    methods: `prepare` (samples and their length statistics), `lengths` (tokens per sample), `model` (the
    model before the engine wraps it), `setup` (after the engine is built and resumed), `step` (one
    optimizer step: metrics with `loss`, micro-batches, tokens), `evaluate` (the validation metrics) and
    `export`.
    """

    job = "sft"

    def __init__(self, cfg: LadenConfig) -> None:
        self.cfg = cfg

    def prepare(self, ds: DatasetConfig, tokenizer: Any, name: str):
        return prepare_data(ds, tokenizer, name)

    @staticmethod
    def lengths(samples) -> list[int]:
        return [len(ids) for ids, _ in samples]

    @staticmethod
    def model(model: Any) -> Any:
        return model

    def setup(self, rt: Runtime, engine: Any, run_path: Path, start_step: int, data: dict[str, Any]) -> None:
        pass

    def step(self, rt: Runtime, engine: Any, samples, indices: list[int], *, step: int):
        return train_step(self.cfg, rt, engine, samples, indices, step=step)

    def evaluate(self, rt: Runtime, engine: Any, valid) -> dict[str, torch.Tensor]:
        return {"eval_loss": evaluate(self.cfg, rt, engine, valid)}

    @staticmethod
    def export(engine: Any, out_dir: Path, tokenizer: Any) -> None:
        engine.export_hf(out_dir, tokenizer=tokenizer)


def run_sft(cfg: LadenConfig, *, progress: bool = True, task: Any = None) -> SFTResult:
    """Train `cfg.actor.path` on `cfg.train_dataset` and return where everything was written.

    `task`: the job the loop runs (default `SFTTask`; see it for what a task gives)."""
    task = task if task is not None else SFTTask(cfg)
    check_trackers(cfg)
    rt = start_run(cfg, task.job)
    return in_run_directory(cfg, rt, lambda run: _run(cfg, rt, run, progress, task))


def _run(cfg: LadenConfig, rt: Runtime, run: RunDirectory, progress: bool, task: Any) -> SFTResult:
    history = rt.share(rt.on_main(lambda: run.history(on_damage=cfg.checkpoint.on_damage)))
    assert history is not None, "rank 0 shares the run's history"
    config_dict = yaml.safe_load(format_config(cfg))
    changes = rt.on_main(lambda: run.check_resume(history, config_dict, resume=cfg.checkpoint.resume)) or []
    seed_everything(cfg.seed)
    tokenizer = load_tokenizer(cfg.actor.path)
    samples, stats = task.prepare(cfg.train_dataset, tokenizer, "train")
    valid, valid_stats = (
        task.prepare(cfg.valid_dataset, tokenizer, "valid") if cfg.valid_dataset else (None, None)
    )
    first = (
        longest_first(task.lengths(samples), cfg.train_dataset.batch_size)
        if cfg.train_dataset.fail_fast else []
    )  # fmt: skip
    batches = GlobalBatchIterator(len(samples), batch_size=cfg.train_dataset.batch_size,
                                  shuffle=cfg.train_dataset.shuffle, seed=cfg.seed, first=first)  # fmt: skip
    total_steps = min(cfg.total_train_steps or batches.steps_per_epoch * cfg.total_train_epochs,
                      batches.steps_per_epoch * cfg.total_train_epochs)  # fmt: skip
    if history.checkpoint is not None and history.checkpoint_step >= total_steps:
        if cfg.checkpoint.export_hf and not rt.share(run.export_done() if rt.is_main else False):
            _export_finished(cfg, rt, run, history, total_steps, tokenizer, task)
        return _already_finished(cfg, run, history, total_steps)
    if rt.is_main:  # only now, once the directory may continue this history, is anything written
        dump_config(cfg, run.path / "config.yaml")
        write_data_stats(cfg.train_dataset, stats, run.path, "train")
        if cfg.valid_dataset is not None:
            write_data_stats(cfg.valid_dataset, valid_stats, run.path, "valid")
    model = task.model(load_model(cfg, rt, rt.backend))
    engine = rt.backend.build(cfg, model, total_steps=total_steps, device=rt.device)
    log.info(
        "model: %.1fM parameters, engine %s on %s", engine.num_params / 1e6, type(engine).__name__, rt.device
    )
    settings = OptimSettings.from_config(cfg.actor.optimizer, total_steps)
    start_step = _resume(cfg, rt, run, engine, batches, history, settings, changes)
    task.setup(rt, engine, run.path, start_step, {"train": samples, **({"valid": valid} if valid else {})})
    accuracy = (
        HeldOutAccuracy.from_config(cfg, tokenizer, is_main=rt.is_main)
        if valid is not None and cfg.evaluator.generate and task.job == "sft" else None
    )  # fmt: skip
    loop = _Loop(cfg=cfg, rt=rt, run=run, engine=engine, samples=samples, valid=valid, batches=batches,
                 total_steps=total_steps, tokenizer=tokenizer, accuracy=accuracy, task=task)  # fmt: skip
    losses = loop.train(start_step, progress)
    before_after = accuracy.before_after() if accuracy is not None else []
    if start_step < total_steps and cfg.checkpoint.save_at_end:
        loop.save(total_steps)
    if cfg.checkpoint.export_hf:
        task.export(engine, run.path / "hf", tokenizer)
    if rt.is_main:
        _write_curves(run, task.job)
    rt.barrier()
    held_out = loop.held_out
    return SFTResult(run_dir=run.path, num_steps=total_steps, first_loss=losses[0], last_loss=losses[1],
                     held_out=held_out, before_after=before_after)  # fmt: skip


def _export_finished(cfg: LadenConfig, rt: Runtime, run: RunDirectory, history: History, total_steps: int,
                     tokenizer: Any, task: Any) -> None:  # fmt: skip
    """The export of a finished run that stopped before it was in place (killed, or the disk filled)."""
    log.warning(
        "run directory %s holds a finished run without its export: exporting %s", run.path, history.checkpoint
    )
    model = task.model(load_model(cfg, rt, rt.backend))
    engine = rt.backend.build(cfg, model, total_steps=total_steps, device=rt.device)
    assert history.checkpoint is not None, "a finished run has its final checkpoint"
    load_checkpoint(history.checkpoint, engine, rank=rt.rank)
    task.export(engine, run.hf_path, tokenizer)
    rt.barrier()


def _already_finished(cfg: LadenConfig, run: RunDirectory, history: History, total_steps: int) -> SFTResult:
    last = run.last_logged()
    loss = None if last is None else last.get("loss")
    log.warning(
        "run directory %s already holds a finished run (step %d of %d, last loss %s); nothing to train. "
        "Raise total_train_steps to train on, or set trial_name to a new name for a new run",
        run.path, history.checkpoint_step, total_steps, loss,
    )  # fmt: skip
    return SFTResult(run_dir=run.path, num_steps=history.checkpoint_step, first_loss=None, last_loss=loss,
                     already_finished=True)  # fmt: skip


def _resume(cfg, rt: Runtime, run: RunDirectory, engine, batches, history: History, settings, changes) -> int:
    """Load the newest checkpoint (keeping the new config's schedule and hyper-parameters); its step."""
    if history.checkpoint is None or cfg.checkpoint.resume == "never":
        for line in changes:  # only "starting over" can be said without a checkpoint
            log.warning("%s", line)
        run.keep_metrics_through(-1)  # the evaluation before training (step 0) runs again too
        return 0
    step = history.checkpoint_step
    trainer_state = load_checkpoint(
        history.checkpoint, engine, rank=rt.rank, keep=keep_new_hyperparameters(engine, settings, step)
    )
    batches.load_state_dict(trainer_state["data"])
    for line in changes:
        log.warning("%s (takes effect from step %d)", line, step + 1)
    run.keep_metrics_through(step)
    log.info("resumed from %s", history.checkpoint)
    return step


@dataclass(kw_only=True, slots=True)
class _Loop:
    """The optimizer steps of one run; rank 0 logs metrics and drives the progress bar."""

    cfg: LadenConfig
    rt: Runtime
    run: RunDirectory
    engine: Any
    samples: Any
    valid: Any
    batches: GlobalBatchIterator
    total_steps: int
    tokenizer: Any = None
    accuracy: HeldOutAccuracy | None = None
    """`evaluator.generate`'s held-out accuracy, taken at every evaluation."""
    task: Any = None
    """The job's data, step and evaluation (`SFTTask`, `laden.align.task.PairTask`)."""
    held_out: list[tuple[int, float]] = field(default_factory=list)
    """(step, `eval/accuracy`) of every evaluation this process logged (rank 0)."""

    def train(self, start_step: int, progress: bool) -> tuple[float | None, float | None]:
        """Steps `start_step + 1 .. total_steps`; returns the (first, last) logged loss."""
        cfg, rt = self.cfg, self.rt
        first_loss = last_loss = None
        bar = tqdm(total=self.total_steps, initial=start_step, disable=not (progress and rt.is_main), desc=self.task.job,
                   unit="step")  # fmt: skip
        window_tokens, window_start = 0, time.perf_counter()
        # `elapsed_s`: seconds of training loop up to each logged step's end, counted on across resumes
        # (the time between a failure and its rerun is not training time), as in `laden.rl.trainer`;
        # validation and checkpoints are counted in (leaving them out would take a device sync each).
        last = self.run.last_logged() if rt.is_main and start_step > 0 else None
        t_start = time.perf_counter() - float((last or {}).get("elapsed_s", 0.0))
        metrics = self.run.open_metrics() if rt.is_main else None
        done = saved = start_step
        data_state = self.batches.state_dict()  # the data position after the last completed step
        last_eval_s = float((last or {}).get("elapsed_s", 0.0))
        before: list[dict[str, Any]] = []
        if start_step == 0 and self.valid is not None and cfg.evaluator.eval_before_train:
            evaluated = self.task.evaluate(rt, self.engine, self.valid)  # where the run starts from
            before.append({"step": 0, **{k: float(v) for k, v in evaluated.items()}, **self._accuracy(0),
                           "elapsed_s": 0.0})  # fmt: skip
            self._note_held_out(before[0])
            if metrics is not None:
                metrics.append_line(json.dumps(before[0]))
            t_start = time.perf_counter()
        stops = StopRequests()
        last_save_t = signals.now()
        trackers = Trackers.open(cfg, self.run.path, job=self.task.job, main=rt.is_main)
        try:
            stops.__enter__()
            for row in before:
                trackers.log(row)
            for step in range(start_step, self.total_steps):
                indices = next(self.batches)
                out, num_mbs, num_tokens = self.task.step(
                    rt, self.engine, self.samples, indices, step=step + 1
                )
                data_state = self.batches.state_dict()
                window_tokens += num_tokens
                done = step + 1
                evaluated = self.valid is not None and self._eval_due(
                    done, time.perf_counter() - t_start - last_eval_s
                )
                if evaluated:
                    out |= self.task.evaluate(rt, self.engine, self.valid)
                    out |= self._accuracy(done)
                    last_eval_s = time.perf_counter() - t_start
                if done % cfg.log_freq_steps == 0 or done == self.total_steps or evaluated:
                    record = _log_record(out, done, num_mbs, num_tokens, window_tokens, window_start, rt)
                    record["elapsed_s"] = round(time.perf_counter() - t_start, 3)
                    window_tokens, window_start = 0, time.perf_counter()
                    if metrics is not None:
                        metrics.append_line(json.dumps(record))
                    trackers.log(record)
                    self._note_held_out(record)
                    first_loss = record["loss"] if first_loss is None else first_loss
                    last_loss = record["loss"]
                    bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
                bar.update(1)
                freq = cfg.checkpoint.save_freq_steps
                stop, overdue = agree_to_stop_or_save(rt, stops.requested, last_save_t, cfg.checkpoint)
                if done < self.total_steps and ((freq and done % freq == 0) or overdue or stop):
                    self.save(done)
                    saved, last_save_t = done, signals.now()
                export_freq = cfg.checkpoint.export_hf_freq_steps
                if export_freq and done % export_freq == 0 and done < self.total_steps:  # the last: hf/
                    self.task.export(self.engine, step_export_dir(self.run.path, done), self.tokenizer)
                if stop and done < self.total_steps:
                    raise stops.interrupted(done, self.run.path)
        except (KeyboardInterrupt, TrainingOOMError) as stop:
            # one process: nothing waits in a collective. A step that runs out of memory fails before it
            # changes a parameter (in packing, forward, backward, or the optimizer's first allocation
            # of its states), so the engine still holds step `done`'s state: a rerun resumes at the
            # failed step with the knobs the error names.
            if rt.world_size == 1 and done > saved:
                why = (
                    "interrupted" if isinstance(stop, KeyboardInterrupt) else "out of memory in the next step"
                )
                log.warning("%s after step %d: writing a checkpoint before stopping", why, done)
                self.save(done, data_state=data_state)
            raise
        finally:
            stops.__exit__()
            bar.close()
            if metrics is not None:
                metrics.close()
            trackers.close(failed=sys.exc_info()[0] is not None)
        return first_loss, last_loss

    def _note_held_out(self, record: dict[str, Any]) -> None:
        if "eval/accuracy" in record:
            self.held_out.append((int(record["step"]), float(record["eval/accuracy"])))

    def _accuracy(self, step: int) -> dict[str, float]:
        """`eval/accuracy` after `step` when `evaluator.generate` is on (rank 0's metrics row)."""
        accuracy = self.accuracy(self.engine, step) if self.accuracy is not None else None
        return {} if accuracy is None else {"eval/accuracy": accuracy}

    def _eval_due(self, step: int, seconds_since_last: float) -> bool:
        """`evaluator`'s rule after `step`, rank 0's answer on every rank (`freq_secs` reads each one's clock)."""
        due = evaluation_due(
            self.cfg.evaluator, step=step, total_steps=self.total_steps,
            steps_per_epoch=self.batches.steps_per_epoch, seconds_since_last=seconds_since_last,
        )  # fmt: skip
        return bool(self.rt.gather_floats(float(due))[0]) if self.rt.world_size > 1 else due

    def save(self, step: int, *, data_state: dict[str, Any] | None = None) -> None:
        """Checkpoint `step`; `data_state`: the data position after it (default: the iterator's now)."""
        cfg, rt = self.cfg, self.rt
        meta = checkpoint_meta(cfg, self.engine)
        save_checkpoint(
            self.run.ckpt_root, step=step, engine=self.engine, trainer_state={"data": data_state or self.batches.state_dict()},
            meta=meta, config_yaml=format_config(cfg), keep_last=cfg.checkpoint.keep_last, rank=rt.rank,
            barrier=rt.barrier, any_rank=rt.any_rank,
        )  # fmt: skip
        if rt.is_main:
            _write_curves(self.run, self.task.job, min_interval_s=CHECKPOINT_INTERVAL_S)


def _write_curves(run: RunDirectory, job: str, *, min_interval_s: float = 0.0) -> None:
    """`curves.png` in the run directory (`laden.plots`); a figure that cannot be drawn never fails the run."""
    try:
        write_curves(run.path, job, min_interval_s=min_interval_s)
    except Exception as exc:  # the curves are a view of metrics.jsonl, which is kept whatever happens here
        log.warning("curves.png was not written: %s: %s", type(exc).__name__, exc)


def _log_record(out, step, num_mbs, num_tokens, window_tokens, window_start, rt: Runtime) -> dict[str, Any]:
    """A step's metrics row. Every rank calls it: with several ranks, the peaks of each are gathered
    (`peak_gpu_gib_ranks`, `peak_host_gib_ranks`; `peak_gpu_gib` is then the largest, the GPU
    nearest its limit, as pipeline stages differ; `peak_host_gib` stays this process's)."""
    device = rt.device
    # The one deliberate host sync per logged step: read the metric tensors.
    values = {k: float(v) for k, v in out.items()}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = max(time.perf_counter() - window_start, 1e-9)
    record = {"step": step, **values, "num_mbs": num_mbs, "num_tokens": num_tokens}
    record["tokens_per_s"] = window_tokens / elapsed
    if device.type == "cuda":
        gpu = rt.gather_floats(torch.cuda.max_memory_allocated(device) / 2**30)
        record["peak_gpu_gib"] = max(gpu)
        if rt.world_size > 1:
            record["peak_gpu_gib_ranks"] = gpu
    record["peak_host_gib"] = peak_rss_bytes() / 2**30
    if rt.world_size > 1:
        record["peak_host_gib_ranks"] = rt.gather_floats(record["peak_host_gib"])
    if not math.isfinite(record["loss"]):
        raise RuntimeError(f"loss became {record['loss']} at step {step}; lower actor.optimizer.lr")
    return record


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
