"""One `laden rl` run, measured: seconds per step by phase, tokens/s, GPU and host peaks; one JSON line.

    python benchmarks/rl_gpu.py --config examples/rl_smollm2_arith.yaml [--gpu-mem-cap-gib 24] \
        [--shape qwen3-8b --tokenizer runs/smollm2-135m-instruct] [--skip-steps 1] -- key=value ...

`--shape` trains a random-init Qwen3 shape (bench_common.QWEN3_SHAPES): a model directory with its
config.json and the tokenizer of `--tokenizer` is written under runs/ and used as `actor.path` with
`actor.init_from_config: true` (ids the tokenizer lacks decode to nothing, so a reward still runs).
`--gpu-mem-cap-gib` caps this process's GPU memory as on a card of that size
(`torch.cuda.set_per_process_memory_fraction`). Host peak: the largest resident set of this process
(the reward workers are separate processes), sampled every 0.2 s. The per-step figures are means over
the steps after the first `--skip-steps` (the warm-up: compilation, CUDA graphs); `wall_s` is the
whole run, set-up included.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import QWEN3_SHAPES, git_commit  # noqa: E402

GIB = 1 << 30
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def shape_dir(shape: str, tokenizer: Path, root: Path = Path("runs")) -> Path:
    """runs/shape-<shape>: config.json of the Qwen3 shape and the files of `tokenizer`."""
    from transformers import Qwen3Config

    out = root / f"shape-{shape}"
    out.mkdir(parents=True, exist_ok=True)
    Qwen3Config(**QWEN3_SHAPES[shape], max_position_embeddings=40960).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, out / name)
    return out


class HostPeak:
    """The largest RSS of this process, sampled in a daemon thread."""

    def __init__(self, every_s: float = 0.2) -> None:
        import psutil

        self.peak, self._proc, self._every = 0, psutil.Process(), every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            self._stop.wait(self._every)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self._proc.memory_info().rss)


def summarise(metrics: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    """Means of the per-step phase seconds and counts over the steps after the first `skip`."""
    steady = [m for m in metrics if m.get("trained", 1)][skip:] or metrics
    out: dict[str, Any] = {"steps": len(metrics), "steady_steps": len(steady)}
    for key in ("gen_s", "wait_s", "train_s", "update_s", "response_length", "completions"):
        values = [float(m[key]) for m in steady if key in m]
        if values:
            out[key] = round(sum(values) / len(values), 3)
    if "gen_s" in out and "completions" in out and "response_length" in out:
        out["gen_tokens_per_s"] = round(out["completions"] * out["response_length"] / max(out["gen_s"], 1e-9))
    step_s = [m.get("wait_s", 0) + m.get("train_s", 0) + m.get("update_s", 0) for m in steady]
    out["step_s"] = round(sum(step_s) / max(len(step_s), 1), 3)
    rewards = [m["reward_mean"] for m in metrics if m.get("reward_mean") == m.get("reward_mean")]
    if rewards:
        k = max(1, min(5, len(rewards) // 4))
        out["reward_first"] = round(sum(rewards[:k]) / k, 4)
        out["reward_last"] = round(sum(rewards[-k:]) / k, 4)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--gpu-mem-cap-gib", type=float, default=None)
    p.add_argument("--shape", choices=sorted(QWEN3_SHAPES), default=None)
    p.add_argument("--tokenizer", type=Path, default=Path("laden/assets/tiny"))
    p.add_argument("--skip-steps", type=int, default=1)
    p.add_argument("--label", default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    import logging

    import torch

    from laden.config import load_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    from laden.rl.trainer import run_rl

    overrides = list(args.overrides)
    if args.shape:
        overrides += [f"actor.path={shape_dir(args.shape, args.tokenizer)}", "actor.init_from_config=true"]
    cfg = load_config(args.config, overrides, job="rl")
    cuda = torch.cuda.is_available()
    if cuda and args.gpu_mem_cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_mem_cap_gib * GIB / total), 0)
    host = HostPeak()
    t0 = time.perf_counter()
    result = run_rl(cfg, progress=True)
    wall = time.perf_counter() - t0
    host_peak = host.stop()
    metrics = [json.loads(line) for line in (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()]
    record: dict[str, Any] = {
        "bench": "rl", "label": args.label or Path(args.config).stem, "shape": args.shape,
        "overrides": args.overrides, "actor": cfg.actor.backend, "optimizer": cfg.actor.optimizer.type,
        "rollout": cfg.rollout.backend, "offpolicyness": cfg.rollout.max_head_offpolicyness,
        "batch": cfg.train_dataset.batch_size, "n_samples": cfg.gconfig.n_samples,
        "max_new_tokens": cfg.gconfig.max_new_tokens, "wall_s": round(wall, 1),
        **summarise(metrics, args.skip_steps),
        "host_peak_gib": round(host_peak / GIB, 2), "gpu_cap_gib": args.gpu_mem_cap_gib,
        "git_commit": git_commit(), "run_dir": str(result.run_dir),
    }  # fmt: skip
    if cuda:
        record["gpu_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
        record["gpu_peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 2)
        record["device"] = torch.cuda.get_device_name(0)
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
