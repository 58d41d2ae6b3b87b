"""RoundPipe 0.1.1 (PyPI) on the reference workload: the outside baseline for laden's roundpipe engine.

Prints ONE JSON object with the keys of `train_throughput.py` (name, model, shape, tokens_per_s,
mfu = 6N, hfu with the recompute of the plans that ran, hfu_8n, GPU and host peaks, device,
versions, valid/problems) plus `roundpipe`, and on failure `error` and `error_kind` (gpu_oom,
host_oom, timeout, terminated, no_gpu, bad_env, error).

RoundPipe 0.1.1 runs only under transformers 4.x, so this script runs in an interpreter whose
`PYTHONPATH` points at the RoundPipe wheels (roundpipe, beartype, transformers 4.57.1,
huggingface-hub 0.36, tokenizers 0.22) and imports neither laden nor anything needing transformers 5:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/rpsite .rp/*.whl
    PYTHONPATH=/tmp/rpsite python3 benchmarks/roundpipe_ref.py --model qwen3-1.7b --steps 3 --warmup 1

RoundPipe is driven the way its own benchmark drives it: the Qwen3 sequential preset, bf16
weights on the host with fp32 optimizer masters (`optim_dtype`), its host Adam (decoupled weight
decay, a C++ kernel compiled at first use; set TORCH_EXTENSIONS_DIR to share the build), the
chunked loss (`return_logits=False`), the one-step-stale async step, no gradient clipping,
torch.compile on (`--no-compile` sets RPP_DISABLE_TORCH_COMPILE=1). Each step re-runs RoundPipe's
own planner, as it does itself, but with the model memory limit it would compute on a card of
`--gpu-mem-cap-gib` (0.6 x its memory: 14.4 GB under the 24 GiB cap) instead of the whole H200's;
`--model-memory-limit-gib 22` gives it laden's budget (the cap less 2 GiB), and
`--model-memory-limit 0` keeps RoundPipe's own default (0.6 x the free memory of the whole GPU when
it was imported). RoundPipe counts a layer's bytes in GB (10^9) against that limit, while laden's
limit is GiB: `--model-memory-limit-gib X` hands it X x 2^30 / 10^9, so both plan against the same
bytes (`--model-memory-limit` takes RoundPipe's own number as is). HFU counts the layers each timed
step's plan recomputed: RoundPipe's fused stage (`bwd_plan[0]`) runs forward and backward in one
residency, every other backward stage recomputes its forward.

Sequences are not packed: `--num-seqs` rows of `--seq-len` tokens, split into
`--num-microbatch` micro-batches, causal SDPA attention (an all-ones attention mask is passed, as
RoundPipe's benchmark does: without one, transformers 4.57 materialises a dense T x T mask).

Trade-off: the measurement runs in a child process. RoundPipe's worker threads end the process
with `os._exit(1)` on any exception (a GPU OOM inside a stage included), so only a parent that
never touches CUDA can still print the JSON result with the error classified; this costs one
more interpreter start (about a second) and a copy of the child's output through pipes.
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    attention_forward_flops,
    git_commit,
    layer_forward_params,
    recomputed_layers,
    shapes,
    utilisation,
)

NAME = "train_throughput/roundpipe"
GIB = 1 << 30
SHAPES = shapes(  # `tiny` is a CPU smoke shape
    "qwen3-1.7b", "qwen3-8b",
    tiny=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=128, tie_word_embeddings=True),
)  # fmt: skip
TAIL_LINES = 80  # lines of the child's output kept to classify a crash


class RunError(RuntimeError):
    """A failure whose kind is known up front (no GPU, wrong transformers)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(SHAPES), default="qwen3-1.7b")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--num-seqs", type=int, default=16, help="sequences per optimizer step")
    p.add_argument("--num-microbatch", type=int, default=4)
    p.add_argument("--recompute-grain", choices=["stage", "layer"], default="stage")
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gpu-mem-cap-gib", type=float, default=24.0)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--model-memory-limit", type=float, default=None,
                        help="RoundPipe's planner limit as it takes it (it counts layer bytes in GB); default "
                             "0.6 x the cap, 0 = RoundPipe's own default")  # fmt: skip
    budget.add_argument("--model-memory-limit-gib", type=float, default=None,
                        help="the same bytes as laden's model_memory_limit of this many GiB")  # fmt: skip
    p.add_argument("--pin-model", choices=["alloc", "register", "off"], default="alloc")
    p.add_argument("--optim-step", choices=["async", "sync"], default="async")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", action="store_true", help="RPP_DISABLE_TORCH_COMPILE=1")
    p.add_argument(
        "--timeout-s", type=float, default=0.0, help="stop the measurement after this long (0 = never)"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("seq_len", "num_seqs", "num_microbatch", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.warmup < 0:
        p.error(f"--warmup={args.warmup} must be at least 0")
    if args.num_seqs % args.num_microbatch:
        p.error(f"--num-seqs={args.num_seqs} is not a multiple of --num-microbatch={args.num_microbatch}; "
                "RoundPipe splits the rows evenly: pick a divisor")  # fmt: skip
    return args


def memory_limit_gb(args: argparse.Namespace) -> float | None:
    """The model memory limit handed to RoundPipe's planner, in its units (None: its own default)."""
    if getattr(args, "model_memory_limit_gib", None) is not None:
        return round(args.model_memory_limit_gib * (1 << 30) / 1e9, 3)
    if args.model_memory_limit is None:
        return round(0.6 * args.gpu_mem_cap_gib, 3)
    return args.model_memory_limit or None


def shape(args: argparse.Namespace) -> dict:
    return {
        "seq_len": args.seq_len, "num_seqs": args.num_seqs, "num_microbatch": args.num_microbatch,
        "recompute_grain": args.recompute_grain, "optim_step": args.optim_step, "pin_model": args.pin_model,
        "optimizer": "roundpipe.optim.Adam", "optimizer_dtype": "float32", "attn": "sdpa",
        "loss_chunk_size": 4096, "clip": 0.0, "torch_compile": not args.no_compile,
        "model_memory_limit_gb": memory_limit_gb(args), "model_memory_limit_gib": args.model_memory_limit_gib,
    }  # fmt: skip


def run_facts(args: argparse.Namespace) -> dict:
    """What every result records about how it ran (also a failed run's)."""
    step = "async (one-step-stale)" if args.optim_step == "async" else "sync"
    return {"mode": f"{step} step, no clip", "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}


def versions() -> dict:
    """Package versions from their metadata (honours PYTHONPATH; imports nothing)."""
    out = {}
    for pkg in ("torch", "transformers", "roundpipe"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def error_result(args: argparse.Namespace, progress: dict, kind: str, message: str) -> dict:
    """The JSON object of a failed run: what was known when it failed, the error and its kind."""
    result = {"name": NAME, "model": args.model, "shape": shape(args), **run_facts(args), **versions(), "device": None,
              "gpu_mem_cap_gib": args.gpu_mem_cap_gib, "git_commit": git_commit(), **progress}  # fmt: skip
    result.update(valid=False, problems=[f"{kind}: {message}"], error=message, error_kind=kind,
                  tokens_per_s=None, mfu=None, hfu=None)  # fmt: skip
    return result


def classify(text: str, returncode: int | None) -> str:
    """The kind of a crash, from the end of the child's output and its exit status."""
    low = text.lower()
    if "outofmemoryerror" in low or "cuda out of memory" in low or "cuda error: out of memory" in low:
        return "gpu_oom"
    if returncode == -signal.SIGKILL or "memoryerror" in low or "cannot allocate memory" in low:
        return "host_oom"  # the kernel's OOM killer sends SIGKILL
    if returncode == -signal.SIGTERM:
        return "terminated"
    return "error"


# ---------------------------------------------------------------- worker (the child process)


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def note(progress: dict, **facts) -> None:
    """Record facts for an error result, here and (through stdout) in the parent."""
    progress.update(facts)
    emit({"progress": facts})


def setup_cuda(args: argparse.Namespace):
    """Cap every GPU at `--gpu-mem-cap-gib`, as on a card of that size; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    for i in range(torch.cuda.device_count()):
        total = torch.cuda.get_device_properties(i).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_mem_cap_gib * GIB / total), i)
    return torch.device("cuda", torch.cuda.current_device())


def build_model(args: argparse.Namespace, device):
    """Random-init bf16 Qwen3 on the host; initialised on the GPU when there is one (much faster)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(args.seed)
    config = Qwen3Config(**SHAPES[args.model], use_cache=False, attn_implementation="sdpa")
    with torch.device(device if device is not None else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to("cpu").train()
    if device is not None:
        torch.cuda.empty_cache()
    return model


def check_packages() -> str:
    """Where roundpipe is, after checking that this interpreter has the RoundPipe environment."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        raise RunError("bad_env", f"RoundPipe 0.1.1's Qwen3 preset needs transformers 4.x, found "
                       f"{transformers.__version__}: run with PYTHONPATH=/tmp/rpsite (the .rp/ wheels)")  # fmt: skip
    spec = importlib.util.find_spec("roundpipe")
    if spec is None:
        raise RunError(
            "bad_env", "roundpipe is not importable: install .rp/*.whl with --target and set PYTHONPATH"
        )
    return str(spec.origin)


def wrap(args: argparse.Namespace, model):
    import torch
    from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe
    from roundpipe.optim import Adam

    run_config = RoundPipeRunConfig(num_microbatch=args.num_microbatch, recompute_grain=args.recompute_grain)
    rp = wrap_model_to_roundpipe(model, use_sequential_preset=True, optim_dtype=torch.float32,
                                 pin_model=args.pin_model, model_run_config=run_config, name="qwen3")  # fmt: skip
    optim = Adam(rp.optim_parameters(), lr=args.lr, weight_decay=0.01, decoupled_weight_decay=True)
    return rp, optim


def train_step(args: argparse.Namespace, rp, optim, input_ids):
    """One optimizer step over `input_ids` [num_seqs, seq_len]; returns (host loss, plan used)."""
    import torch
    from roundpipe import ModelExecutePlan, RoundPipeRunConfig

    limit = memory_limit_gb(args)
    # RoundPipe's planner on fresh timings, as it runs itself (`forward_backward` without a plan does
    # this), with the card's limit or its own default: either way the plan that runs is known here.
    rp.model_timer.update_times()
    if limit is not None:
        plan = ModelExecutePlan.auto("fused", rp, model_memory_limit=limit)
    else:
        plan = ModelExecutePlan.auto("fused", rp)
    cfg = RoundPipeRunConfig(num_microbatch=args.num_microbatch, recompute_grain=args.recompute_grain,
                             execute_plan=plan)  # fmt: skip
    # An explicit all-ones mask: with none, transformers 4.57 sees position_ids, checks for packed
    # sequences and builds a dense [rows, 1, T, T] mask, which rules out the flash SDPA kernel.
    mask = torch.ones_like(input_ids)
    kwargs = {"input_ids": input_ids, "attention_mask": mask, "labels": input_ids, "return_logits": False}
    loss = rp.forward_backward(input_kwargs=kwargs, run_config=cfg,
                               loss_fn=lambda out, _: out.loss / args.num_microbatch)  # fmt: skip
    rp.step(lambda: (optim.step(), optim.zero_grad(), None)[-1], is_async=args.optim_step == "async")
    return loss, plan


def finish() -> None:
    """Wait for the optimizer thread's queue (grads downloaded, step done) and the GPU."""
    import torch
    from roundpipe.optim_stream import synchronize_optim

    synchronize_optim()
    torch.cuda.synchronize()


def measure(args: argparse.Namespace, progress: dict) -> dict:
    import torch

    device = setup_cuda(args)
    note(progress, device=torch.cuda.get_device_name(device) if device is not None else "cpu")
    where = check_packages()
    model = build_model(args, device)
    num_params = sum(p.numel() for p in model.parameters())  # tied weights once
    layer_params = layer_forward_params(
        model
    )  # RoundPipe's sequential preset: prefix, decoder layers, postfix
    note(progress, num_params=num_params)
    if device is None:
        raise RunError("no_gpu", f"RoundPipe needs a CUDA GPU (it reads the free GPU memory when imported; "
                       f"found {where}); the {args.model} model was built under transformers 4.x")  # fmt: skip
    rp, optim = wrap(args, model)
    gen = torch.Generator().manual_seed(args.seed)
    losses, plans, start = [], [], time.perf_counter()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            finish()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
        ids = torch.randint(0, model.config.vocab_size, (args.num_seqs, args.seq_len), generator=gen)
        loss, plan = train_step(args, rp, optim, ids)
        plans.append(plan)
        losses.append(float(loss))  # host tensor, already waited for by forward_backward
        note(progress, steps_done=step + 1, losses=losses)
    finish()
    seconds = time.perf_counter() - start
    tok_s = args.steps * args.num_seqs * args.seq_len / seconds
    pinned = all(p.is_pinned() for p in model.parameters())
    timed = plans[args.warmup :]
    recomputed = [recomputed_layers(p.bwd_plan) for p in timed]
    return {
        "name": NAME, "model": args.model, "shape": shape(args), **run_facts(args), "plan": repr(plans[-1]),
        "plans_timed": sorted({repr(p) for p in timed}), "fused_layers": len(plans[-1].bwd_plan[0]),
        "tokens_per_s": round(tok_s, 1), "step_s": round(seconds / args.steps, 4), "num_params": num_params,
        **utilisation(tokens_per_s=tok_s, num_params=num_params, layer_params=layer_params, recomputed=recomputed,
                      attn_fwd_flops=attention_forward_flops(model.config, args.seq_len)),
        "last_loss": losses[-1], "losses": losses, "grad_norms": [], "uploads_pinned": pinned,
        **problems(losses, pinned, args.pin_model), **memory_peaks(), "git_commit": git_commit(),
        "device": progress["device"], "gpu_mem_cap_gib": args.gpu_mem_cap_gib, **versions(),
    }  # fmt: skip


def problems(losses: list[float], pinned: bool, pin_model: str) -> dict:
    found = []
    bad = [i for i, v in enumerate(losses) if not math.isfinite(v)]
    if bad:
        found.append(f"loss is not finite from step {bad[0]} on (warm-up included): {losses}")
    if not pinned and pin_model != "off":
        found.append(f"pin_model={pin_model!r} but the host weights are not page-locked")
    return {"valid": not found, "problems": found}


def memory_peaks() -> dict:
    """GPU peaks; host peak = peak RSS + PyTorch's pinned allocator peak (pin_model=alloc lives there)."""
    import torch

    rss_gib = 0.0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            rss_gib = int(line.split()[1]) * 1024 / GIB
    stats = torch.cuda.host_memory_stats()
    nested = stats.get("allocated_bytes")  # flattened keys in recent torch, a dict in older ones
    peak = stats.get("allocated_bytes.peak", nested.get("peak", 0) if isinstance(nested, dict) else 0)
    pinned_gib = int(peak) / GIB
    return {
        "peak_gpu_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
        "peak_gpu_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3),
        "peak_rss_gib": round(rss_gib, 3), "pinned_gib": round(pinned_gib, 3),
        "pinned_allocator_gib": round(pinned_gib, 3), "pinned_registered_gib": 0.0,
        "peak_host_gib": round(rss_gib + pinned_gib, 3),
    }  # fmt: skip


def run_worker(args: argparse.Namespace) -> None:
    progress: dict = {}
    try:
        result = measure(args, progress)
    except BaseException as exc:  # every failure on this thread becomes a JSON result
        traceback.print_exc()
        kind = exc.kind if isinstance(exc, RunError) else classify(f"{type(exc).__name__}: {exc}", None)
        result = error_result(args, progress, kind, f"{type(exc).__name__}: {exc}"[:2000])
    emit(result)
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without the interpreter's exit, which joins RoundPipe's worker threads (nothing is left to do).
    os._exit(0 if result["valid"] else 1)


# ---------------------------------------------------------------- parent (never touches CUDA)


class Terminated(Exception):
    """SIGTERM reached the parent (the caller's time limit, most likely)."""


class ChildOutput:
    """Forwards the child's output to stderr; keeps its JSON result, progress and last lines."""

    def __init__(self, proc: subprocess.Popen):
        self.result: dict | None = None
        self.progress: dict = {}
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.threads = [threading.Thread(target=self._read, args=(s, s is proc.stdout), daemon=True)
                        for s in (proc.stdout, proc.stderr)]  # fmt: skip
        for t in self.threads:
            t.start()

    def _read(self, stream, is_stdout: bool) -> None:
        for line in stream:
            if is_stdout and line.startswith("{"):
                try:
                    obj = json.loads(line)
                except ValueError:
                    obj = None
                if isinstance(obj, dict) and "progress" in obj:
                    self.progress.update(obj["progress"])
                    continue
                if isinstance(obj, dict) and "valid" in obj:
                    self.result = obj
                    continue
            self.tail.append(line)
            sys.stderr.write(line)

    def join(self, timeout_s: float = 10.0) -> None:
        for t in self.threads:
            t.join(timeout_s)


def run_parent(args: argparse.Namespace, argv: list[str]) -> dict:
    env = dict(os.environ, TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
    if args.no_compile:
        env["RPP_DISABLE_TORCH_COMPILE"] = "1"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", *argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out, kind, rc = ChildOutput(proc), None, None
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        rc = proc.wait(timeout=args.timeout_s or None)
    except (subprocess.TimeoutExpired, Terminated) as exc:
        kind = "timeout" if isinstance(exc, subprocess.TimeoutExpired) else "terminated"
        proc.kill()  # the child (same process group) may already be gone
        rc = proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
    out.join()
    if out.result is not None and (kind is None or out.result.get("valid")):
        return out.result  # a result printed before a stop at exit still stands
    tail = "".join(out.tail)
    kind = kind or classify(tail, rc)
    last = [line.strip() for line in out.tail if line.strip()][-3:]
    message = (
        f"child exited with status {rc} ({kind}) after {out.progress.get('steps_done', 0)} steps: "
        + " | ".join(last)
    )
    return error_result(args, out.progress, kind, message[:2000])


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        run_worker(args)  # does not return
    result = run_parent(args, [a for a in argv if a != "--worker"])
    print(json.dumps(result), flush=True)
    return 0 if result.get("valid") else 1


if __name__ == "__main__":
    sys.exit(main())
