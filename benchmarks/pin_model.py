"""`pin_model` modes of the roundpipe engine: build time, host peak and weight-upload bandwidth.

One mode per process (the host peak is per process), e.g. on the H200 machine:

    for mode in alloc register off; do
      python benchmarks/pin_model.py --model qwen3-1.7b --pin-model $mode
    done

Each run builds the engine exactly as `train_throughput.py` does (the model on the meta
device, materialised layer by layer into the engine's host store), then uploads every
layer's weights to the GPU through the engine's own upload path (`upload_stage`, the
weights stream, non-blocking copies from the upload buffers), one layer at a time, each
waited for before the next; the best of `--repeats` passes over the whole model gives the bandwidth.
It prints one JSON object: `build_s` (construction, pinning included), the host peaks as
`train_throughput.py` reports them (`peak_host_gib` = peak RSS + PyTorch's pinned
allocator; `pinned_registered_gib` is page-locked in place and already in the RSS) and
`upload_gb_s`. Without a GPU it reports the host side only (nothing is pinned on the CPU).

Expected from the seed's description: `alloc` fastest uploads and the largest host peak
(pinned copies, rounded up to powers of two by the pinned allocator), `register` about one
model size (pinned in place) at the same bandwidth, `off` no page-locked memory and the
slowest uploads (pageable copies go through a staging buffer and block the host).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_throughput as tt  # noqa: E402
from bench_common import git_commit  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=[*tt.SHAPES, "tiny"], default="qwen3-1.7b")
    p.add_argument("--pin-model", choices=["alloc", "register", "off"], default="alloc")
    p.add_argument("--repeats", type=int, default=3, help="passes over all weights; the fastest counts")
    p.add_argument("--optimizer", choices=["adam", "adam_bf16"], default="adam")
    return p.parse_args(argv)


def upload_all(engine, repeats: int) -> dict:
    """Upload every layer's weights (upload buffer 0) through the engine's path; best pass."""
    from laden.engine.roundpipe.device import wait_host
    from laden.engine.roundpipe.residency import release, upload_stage

    pipe = engine.pipe
    lane = pipe.lanes[0]
    num_bytes = sum(hp.uploads[0].numel() * hp.uploads[0].element_size() for hp in pipe.store.params)
    best = float("inf")
    for _ in range(repeats):
        if lane.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for layer_id in range(pipe.num_layers):
            res = upload_stage(pipe.store, lane, [layer_id], buf=0, trainable=False)
            wait_host(res.layer_ready[layer_id])  # one layer resident at a time
            release(res)
        best = min(best, time.perf_counter() - start)
    if not lane.is_cuda:  # the path ran (a CPU "upload" is a copy); no bandwidth to report
        return {"upload_gb_s": None, "upload_bytes": num_bytes}
    return {
        "upload_gb_s": round(num_bytes / best / 1e9, 2),
        "upload_bytes": num_bytes,
        "upload_s": round(best, 3),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    tt_args = tt.parse_args(
        ["--model", args.model, "--pin-model", args.pin_model, "--optimizer", args.optimizer]
    )
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    tt.cap_gpu(tt_args, device)
    model = tt.build_model(tt_args)
    start = time.perf_counter()
    engine = tt.build_engine(tt_args, model, device)
    build_s = time.perf_counter() - start
    pinned = tt._uploads_pinned(engine)
    expected = None if pinned is None else args.pin_model != "off"
    problems = [] if pinned == expected else [f"pin_model={args.pin_model!r} but uploads_pinned={pinned}"]
    if pinned is False and expected:
        store = engine.pipe.store
        pageable = [hp.name for hp in store.params if not all(store.page_locked(u) for u in hp.uploads)]
        problems.append(
            f"{len(pageable)} of {len(store.params)} parameters upload from pageable memory: {pageable[:3]}"
        )
    result = {
        "name": "pin_model",
        "valid": not problems,
        "problems": problems,
        "model": args.model,
        "pin_model": args.pin_model,
        "optimizer": args.optimizer,
        "num_params": sum(p.numel() for p in model.parameters()),
        "build_s": round(build_s, 2),
        **upload_all(engine, args.repeats),
        "uploads_pinned": pinned,
        **tt.memory_peaks(engine),
        "git_commit": git_commit(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    print(json.dumps(result), flush=True)
    if problems:
        raise SystemExit("pin_model: INVALID RESULT: " + "; ".join(problems))
    return result


if __name__ == "__main__":
    main()
