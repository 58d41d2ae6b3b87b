"""The pair task of `laden dpo` and `laden rw`: data, optimizer step, evaluation and export in `laden sft`'s loop.

One optimizer step = `train_dataset.batch_size` pairs, each data-parallel rank packing its share
(balanced by tokens) into micro-batches that hold whole pairs (chosen and rejected in one
micro-batch, so a micro-batch's budget `actor.mb_spec.max_tokens_per_mb` must hold the longest pair;
unset: twice `max_length`). The engine's normalizer is the global number of pairs, so the loss is
the mean over the step's pairs. Statistics are the pair means over every rank (an all-reduce of their
sums: pipeline stages without the head add nothing, tensor-parallel copies add alike).

DPO's reference model is the initial weights of `actor.path` (AReaL's `ref.path: ${actor.path}`): its
log-probs of every training and validation pair are computed once, on the actor's own engine before
the first step (no second model in memory), and kept in the run directory as `ref_logprobs.pt`, which
a resumed run reads back (its weights are no longer the reference's). Cost: one forward pass over the
data at the start, on every rank (each rank computes every pair: the calls are the same on all, as
pipeline and tensor parallel need), and the per-token log-probs in host memory. The file keeps a digest of
each dataset's pair tokens too, so a resumed run whose data now tokenizes otherwise stops and says so.

The reward model is the actor's architecture with a one-row head (`laden.model.value_head`), its export
a Hugging Face sequence classifier (`laden.align.reward_model`).

Metrics per logged step (laden's names; the trackers get AReaL's, `laden.trackers.names`): `loss`,
`accuracy`, `margin` and `chosen_reward` / `rejected_reward` (DPO) or `chosen_score` /
`rejected_score` (reward model), `grad_norm`, `lr`; each evaluation adds the same over the whole
validation set as `eval/<name>`.
"""

from __future__ import annotations

import hashlib
import io
import logging
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from laden.align.data import Pair, build_pairs, pack_pairs
from laden.align.objectives import DPOObjective, DPOSettings, PairwiseRewardObjective
from laden.config import DatasetConfig, LadenConfig
from laden.config.validate_actor import longest_max_length
from laden.data import partition_microbatches, read_dataset, unpack
from laden.data.overlap import prompt_overlap
from laden.engine.runtime import OOMRetry, Runtime, batch_device, shard_for_rank
from laden.safe_io import atomic_write_bytes

log = logging.getLogger("laden.align")

STATS = {
    "dpo": ("loss", "accuracy", "margin", "chosen_reward", "rejected_reward"),
    "rw": ("loss", "accuracy", "margin", "chosen_score", "rejected_score"),
}
"""The per-pair statistics each job logs (pair means)."""
REF_FILE = "ref_logprobs.pt"
DIGESTS = "digests"
"""The key of `REF_FILE` that holds each dataset's `pairs_digest`, checked on resume."""


class PairTask:
    """`laden dpo` / `laden rw` inside `laden.sft.trainer`'s loop (the `Task` it runs; see the module docstring)."""

    def __init__(self, cfg: LadenConfig, job: str) -> None:
        if job not in STATS:
            raise ValueError(f"job={job!r} is not a pair job; use 'dpo' or 'rw'")
        self.cfg, self.job = cfg, job
        self.objective: Any = (
            DPOObjective(DPOSettings(beta=cfg.actor.beta, loss_type=cfg.actor.loss_type),
                         chunk_size=cfg.actor.loss_chunk_size)
            if job == "dpo" else PairwiseRewardObjective()
        )  # fmt: skip
        self.records: dict[str, Any] = {}

    # ------------------------------------------------------------------ data
    def prepare(self, ds: DatasetConfig, tokenizer: Any, name: str) -> tuple[list[Pair], Any]:
        field = f"{name}_dataset"
        records = read_dataset(ds, field=field)
        self.records[name] = records
        pairs, stats = build_pairs(
            records, tokenizer, max_length=ds.max_length, length_policy=ds.length_policy,
            prompt_key=ds.prompt_key, chosen_key=ds.chosen_key, rejected_key=ds.rejected_key,
            on_bad_row=ds.on_bad_row, field=field,
        )  # fmt: skip
        log.info("%s_dataset: %s", name, stats.to_dict())
        if len(pairs) < ds.batch_size:
            raise ValueError(
                f"{field}.batch_size={ds.batch_size} pairs but only {len(pairs)} pairs remain after the length "
                f"policy; lower {field}.batch_size or raise {field}.max_length"
            )
        if name == "valid" and "train" in self.records:
            self._report_overlap()
        return pairs, stats

    def _report_overlap(self) -> None:
        """Held-out pairs whose prompt (or, without a prompt column, chosen text) is also a training one."""
        train, valid = self.records["train"], self.records["valid"]
        assert self.cfg.valid_dataset is not None
        keys = [
            _prompt_column(ds, rows)
            for ds, rows in ((self.cfg.train_dataset, train), (self.cfg.valid_dataset, valid))
        ]
        overlap = prompt_overlap(train, valid, prompt_key=keys[0], held_out_key=keys[1])
        if overlap.num_shared:
            log.warning("valid_dataset: %s; held-out pair accuracy on them measures memory, not "
                        "generalisation", overlap.summary())  # fmt: skip
        else:
            log.info("valid_dataset: %s", overlap.summary())

    @staticmethod
    def lengths(samples: Sequence[Pair]) -> list[int]:
        return [p.num_tokens for p in samples]

    def model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.job == "rw":
            from laden.model.value_head import to_value_model

            return to_value_model(model)
        return model

    def budget(self) -> int:
        """Tokens per micro-batch: `actor.mb_spec.max_tokens_per_mb`, unset twice the longer `max_length` of the
        training and validation sets (a pair's two sides share a micro-batch)."""
        return self.cfg.actor.mb_spec.max_tokens_per_mb or 2 * longest_max_length(self.cfg)

    # ------------------------------------------------------------------ reference log-probs (DPO)
    def setup(
        self, rt: Runtime, engine: Any, run_path: Path, start_step: int, data: dict[str, list[Pair]]
    ) -> None:
        """DPO: every pair's reference log-probs, computed now (step 0) or read back from the run directory."""
        if self.job != "dpo":
            return
        path = run_path / REF_FILE
        if start_step > 0:
            if not path.exists():
                raise FileNotFoundError(
                    f"{path} is missing: a DPO run resumed at step {start_step} needs the reference log-probs it "
                    "computed before its first step (its weights are no longer the reference's); start over with "
                    "checkpoint.resume: never, or a new trial_name"
                )
            saved = torch.load(path, weights_only=True)
            for name, pairs in data.items():
                refs = saved.get(name)
                if refs is None or len(refs) != len(pairs):
                    raise ValueError(
                        f"{path} holds {0 if refs is None else len(refs)} {name} pairs' reference log-probs and the "
                        f"{name} data has {len(pairs)} pairs: the data changed since the run started; restore it, "
                        "or start over with a new trial_name"
                    )
                digest = saved.get(DIGESTS, {}).get(name)  # absent in a file written before digests were kept
                if digest is not None and digest != pairs_digest(pairs):
                    raise ValueError(
                        f"{path} holds the reference log-probs of other {name} pairs than the {name} data's "
                        f"{len(pairs)} (their tokens differ: the data, its transform or the tokenizer changed since "
                        "the run started); restore them, or start over with a new trial_name"
                    )
                for pair, (c, r) in zip(pairs, refs):
                    pair.ref = (c.tolist(), r.tolist())
            log.info("reference log-probs read from %s", path)
            return
        for pairs in data.values():
            self._reference_logprobs(rt, engine, pairs)
        if rt.is_main:
            buffer = io.BytesIO()
            written: dict[str, Any] = {name: [(torch.tensor(p.ref[0]), torch.tensor(p.ref[1])) for p in pairs]  # type: ignore[index]
                                       for name, pairs in data.items()}  # fmt: skip
            written[DIGESTS] = {name: pairs_digest(pairs) for name, pairs in data.items()}
            torch.save(written, buffer)
            atomic_write_bytes(path, buffer.getvalue())
        rt.barrier()

    def _reference_logprobs(self, rt: Runtime, engine: Any, pairs: list[Pair]) -> None:
        order = list(range(len(pairs)))
        for mbs, bins in self._pack(rt, engine, pairs, order, with_ref=False):
            outs = engine.forward(mbs, outputs=("logprobs",))
            for mb, indices, out in zip(mbs, bins, outs):
                docs = unpack(mb, out["logprobs"].to(mb.labels.device))
                for k, i in enumerate(indices):
                    # position j holds token j+1's log-prob; per input token t it is position t-1's
                    c, r = docs[2 * k], docs[2 * k + 1]
                    pairs[i].ref = ([0.0, *c[:-1].tolist()], [0.0, *r[:-1].tolist()])

    # ------------------------------------------------------------------ steps
    def _pack(self, rt: Runtime, engine: Any, pairs: Sequence[Pair], indices: Sequence[int], *, with_ref: bool,
              tokens_per_mb: int | None = None):  # fmt: skip
        """Yields (micro-batches, their pair indices) once, packed under the budget; none for no pairs (a
        data-parallel rank without a share of a small last batch: the engine runs padding in their place)."""
        budget = tokens_per_mb or self.budget()
        longest = max((pairs[i].num_tokens for i in indices), default=0)
        if longest > budget:
            raise ValueError(
                f"a pair of {longest} tokens (chosen + rejected, which share a micro-batch) exceeds "
                f"actor.mb_spec.max_tokens_per_mb={budget}; raise it to at least {longest} (2 * the datasets' "
                f"max_length holds every pair: {2 * longest_max_length(self.cfg)})"
            )
        bins = partition_microbatches(
            [pairs[i].num_tokens for i in indices], max_tokens_per_mb=budget,
            n_mbs=rt.backend.min_micro_batches(self.cfg), algorithm=self.cfg.actor.mb_spec.packing_algorithm,
        )  # fmt: skip
        device = batch_device(rt.backend, rt)
        groups = [[indices[j] for j in b] for b in bins]
        mbs = [
            pack_pairs([pairs[i] for i in g], with_ref=with_ref).to(device, non_blocking=True) for g in groups
        ]
        yield mbs, groups

    def _mine(self, engine: Any, pairs: Sequence[Pair], indices: Sequence[int]) -> list[int]:
        sized = [(range(p.num_tokens), None) for p in pairs]
        return shard_for_rank(sized, indices, engine.dp_rank, engine.dp_size)

    def step(self, rt: Runtime, engine: Any, pairs: Sequence[Pair], indices: list[int], *, step: int):
        """One optimizer step on the pairs `indices`: (metrics, micro-batches, tokens)."""
        mine = self._mine(engine, pairs, indices)
        with_ref = self.job == "dpo"

        def run(mbs):
            self.objective.sums.pop()  # a failed attempt's partial statistics
            return engine.train_batch(mbs, global_num_loss_tokens=len(indices), objective=self.objective)

        retry = OOMRetry(cfg=self.cfg, rt=rt, recompute=engine.enable_recompute)
        out, mbs = retry(
            lambda tokens: next(self._pack(rt, engine, pairs, mine, with_ref=with_ref, tokens_per_mb=tokens))[0],
            run, step=step, tokens_per_mb=self.budget(), longest=max((pairs[i].num_tokens for i in mine), default=0),
        )  # fmt: skip
        stats = self._global_means(rt)
        stats.pop("loss", None)  # the engine's `loss` is the same mean
        return {**out, **stats}, len(mbs), sum(pairs[i].num_tokens for i in indices)

    def evaluate(self, rt: Runtime, engine: Any, valid: Sequence[Pair]) -> dict[str, torch.Tensor]:
        """The pair means over the whole validation set, `valid_dataset.batch_size` pairs at a time: `eval/<name>`."""
        assert self.cfg.valid_dataset is not None
        size = self.cfg.valid_dataset.batch_size
        self.objective.sums.pop()
        for start in range(0, len(valid), size):
            mine = self._mine(engine, valid, list(range(start, min(start + size, len(valid)))))
            mbs, _ = next(self._pack(rt, engine, valid, mine, with_ref=self.job == "dpo"))
            engine.eval_batch(mbs, global_num_loss_tokens=len(valid), objective=self.objective)
        return {f"eval/{name}": torch.tensor(value) for name, value in self._global_means(rt).items()}

    def _global_means(self, rt: Runtime) -> dict[str, float]:
        """The objective's statistics since the last call, as pair means over every rank."""
        sums = self.objective.sums.pop()
        names = ("pairs", *STATS[self.job])
        local = torch.tensor([float(sums[n]) if n in sums else 0.0 for n in names], dtype=torch.float64)
        if rt.world_size > 1:
            torch.distributed.all_reduce(local, group=rt.host_group)
        count = max(float(local[0]), 1.0)
        return {name: float(v) / count for name, v in zip(names[1:], local[1:].tolist())}

    def export(self, engine: Any, out_dir: Path, tokenizer: Any) -> None:
        if self.job == "rw":
            from laden.align.reward_model import as_classifier

            engine.export_hf(out_dir, tokenizer=tokenizer, convert=as_classifier)
        else:
            engine.export_hf(out_dir, tokenizer=tokenizer)


def _prompt_column(ds: DatasetConfig, rows: Sequence[Any]) -> str:
    """The column a dataset's pairs are compared by: its own `prompt_key`, or without one its `chosen_key`."""
    return ds.prompt_key if any(ds.prompt_key in r for r in rows[:1]) else ds.chosen_key


def pairs_digest(pairs: Sequence[Pair]) -> str:
    """A SHA-256 of the pairs' tokens and loss masks, in order: what the reference log-probs were computed for
    (a resumed run whose data tokenizes differently would otherwise train against another pair's reference)."""
    digest = hashlib.sha256()
    for pair in pairs:
        for ids, mask in (pair.chosen, pair.rejected):
            digest.update(array("q", [len(ids), *ids, *mask]).tobytes())
    return digest.hexdigest()
