"""Host memory of the roundpipe engine: exact bytes per parameter per mode, prediction == allocation,
shared masters (adam_bf16: the bf16 master is the upload copy), models materialised from the meta
device, the construction peak, and the benchmark's host-memory check for the Qwen3-8B shape."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from repo_paths import ROOT, SUPPORT
from roundpipe_cases import reference_loss
from tiny import tiny_qwen3_config
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3Config

from laden.data.batch import pack_samples
from laden.engine.roundpipe import RoundPipeEngine
from laden.engine.roundpipe.host.memory import (
    bytes_per_param,
    measured_host_bytes,
    meta_params,
    predict_engine_host_bytes,
)
from laden.optim import AdamWBF16, OptimSettings, param_groups_with_decay

GIB = 1 << 30
SCRIPT = ROOT / "benchmarks" / "train_throughput.py"
# The modes of the host-memory table in laden.engine.roundpipe.host.memory: (optimizer, model and master
# dtype, compute dtype) -> bytes per parameter with the synchronous and the asynchronous step.
BYTES_PER_PARAM = {
    ("adam", torch.float32, torch.bfloat16): {"sync": 18, "async": 24},  # 2 bf16 + 4 master + 8 + 4 grad
    ("adam_bf16", torch.bfloat16, torch.bfloat16): {"sync": 10, "async": 14},  # 2 shared + 6 + 2 grad
    ("adam", torch.float32, torch.float32): {"sync": 16, "async": 24},  # 4 shared + 8 + 4 grad
    # actor.optimizer_dtype=bfloat16: torch's AdamW on the bf16 masters (warned), as in every engine
    ("adam", torch.bfloat16, torch.bfloat16): {"sync": 8, "async": 12},  # 2 shared + 4 + 2 grad
}

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(*, tied: bool = False) -> Qwen3Config:
    cfg = tiny_qwen3_config(vocab_size=64, num_hidden_layers=3)
    cfg.tie_word_embeddings = tied
    return cfg


def tiny_model(dtype: torch.dtype, *, tied: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(tied=tied), dtype=dtype)


def make_steps(num_steps: int, seed: int = 0) -> list[list]:
    """One document per row: bf16 engine and per-document reference then round identically."""
    gen = torch.Generator().manual_seed(seed)
    return [
        [pack_samples([(torch.randint(0, 64, (n,), generator=gen).tolist(), [1] * n)]) for n in (6, 4, 7)]
        for _ in range(num_steps)
    ]


def train(engine: RoundPipeEngine, steps: list[list]) -> list[torch.Tensor]:
    return [
        engine.train_batch(mbs, global_num_loss_tokens=sum(mb.num_loss_tokens for mb in mbs))["loss"]
        for mbs in steps
    ]


def settings(optimizer: str, **overrides) -> OptimSettings:
    base = {"type": optimizer, "lr": 1e-3, "eps": 1e-4, "gradient_clipping": 0.0, "total_steps": 10}
    return OptimSettings(**{**base, **overrides})


# ---- exact bytes per parameter -----------------------------------------------------------------
@pytest.mark.parametrize("pin_model", ["alloc", "register", "off"])
@pytest.mark.parametrize("optim_step", ["sync", "async"])
@pytest.mark.parametrize(("optimizer", "dtype", "compute"), list(BYTES_PER_PARAM))
def test_measured_bytes_per_param_match_the_table_and_the_prediction(
    optimizer, dtype, compute, optim_step, pin_model
):
    """After two steps (optimizer states and inboxes exist) the engine holds exactly the documented
    bytes per parameter, and `predict_engine_host_bytes` (from the model alone) predicted every kind."""
    model = tiny_model(dtype)
    o = settings(optimizer)
    kwargs = dict(compute_dtype=compute, optimizer_dtype=dtype, optim_step=optim_step, pin_model=pin_model)
    predicted = predict_engine_host_bytes(model, optim=o, pinned=False, **kwargs)
    if optimizer == "adam" and dtype == torch.bfloat16:
        with pytest.warns(UserWarning, match="bfloat16 master weights keeps bf16 Adam states"):
            engine = RoundPipeEngine(model, optim=o, model_memory_limit=0.0004, **kwargs)
        assert type(engine.optimizer) is torch.optim.AdamW
    else:
        engine = RoundPipeEngine(model, optim=o, model_memory_limit=0.0004, **kwargs)
    assert len(engine.plan.bwd_plan) > 2
    train(engine, make_steps(2))
    measured = engine.host_bytes_by_kind()
    num_params = engine.num_params
    assert measured == predicted
    assert bytes_per_param(measured, num_params) == BYTES_PER_PARAM[(optimizer, dtype, compute)][optim_step]
    store = engine.pipe.store
    shared = dtype == compute
    assert measured["master"] == (0 if shared else num_params * 4)
    for hp in store.params:
        assert hp.master is not None and hp.master.dtype == dtype
        buf = store.groups[hp.group.index].master_buf if shared else None  # type: ignore[union-attr]
        if shared:  # the master IS an upload copy: the update writes what devices upload next
            assert hp.master.data_ptr() == hp.uploads[buf].data_ptr(), hp.name
        else:
            assert all(hp.master.data_ptr() != u.data_ptr() for u in hp.uploads), hp.name
        assert hp.param.data_ptr() == hp.uploads[0].data_ptr(), hp.name  # the model views buffer 0


@pytest.mark.parametrize("pin_model", ["register", "off"])
def test_memory_mapped_weights_are_used_in_place(tmp_path, pin_model):
    """`off` (and `register`, which pins in place) keeps weights that are already in the compute
    dtype where they are: a model loaded memory-mapped is not copied into the host store, which
    is what lets `off` train a frozen or bf16 model larger than host memory. It trains like the
    same model held in plain memory."""
    reference = tiny_model(torch.bfloat16)
    torch.save(reference.state_dict(), tmp_path / "weights.pt")
    mapped = torch.load(tmp_path / "weights.pt", mmap=True, weights_only=True)
    with meta_params():
        skeleton = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.bfloat16)
    skeleton.load_state_dict(mapped, assign=True)
    file_ptrs = {name: p.data_ptr() for name, p in skeleton.named_parameters()}
    kwargs = dict(optim=settings("adam_bf16"), compute_dtype=torch.bfloat16, pin_model=pin_model)
    engine = RoundPipeEngine(skeleton, **kwargs)
    for hp in engine.pipe.store.params:
        assert hp.uploads[0].data_ptr() == file_ptrs[hp.name], hp.name  # no copy of the mapped weights
    in_memory = RoundPipeEngine(copy.deepcopy(reference), **kwargs)
    steps = make_steps(2)
    for a, b in zip(train(engine, steps), train(in_memory, steps)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("devices", [1, 2])
def test_tied_embedding_staging_is_predicted(devices):
    """A tied embedding used by the first and the last stage: on one device the head's gradient
    waits on the device for the embedding's stage, one landing; on two, each stage lands its own
    and the second goes through one staging buffer more. The prediction knows which."""
    model = tiny_model(torch.bfloat16, tied=True)
    o = settings("adam_bf16")
    predicted = predict_engine_host_bytes(
        model, optim=o, pinned=False, optim_step="async", pin_model="register", num_devices=devices
    )
    engine = RoundPipeEngine(
        model, optim=o, optim_step="async", pin_model="register", model_memory_limit=0.0004,
        devices=[torch.device("cpu")] * devices,
    )  # fmt: skip
    assert len(engine.plan.bwd_plan) > 2
    train(engine, make_steps(2))
    measured = engine.host_bytes_by_kind()
    assert measured == predicted and (measured["grad_staging"] > 0) == (devices == 2)


def test_measured_host_bytes_counts_a_storage_once():
    """Kinds never double count: shared masters are reported as weights, not as master."""
    engine = RoundPipeEngine(
        tiny_model(torch.bfloat16), optim=settings("adam_bf16"), compute_dtype=torch.bfloat16
    )
    store = engine.pipe.store
    unique = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for hp in store.params
        for t in [*hp.uploads, hp.master]
        if t is not None
    }
    weights = sum(unique.values())
    by_kind = measured_host_bytes(store)
    assert by_kind["weights"] == weights and by_kind["master"] == 0


# ---- shared masters stay exact -----------------------------------------------------------------
def test_async_adam_bf16_equals_one_step_stale_kahan_reference():
    """The asynchronous step with shared bf16 masters (ping-pong between the two upload buffers):
    step k computes on the weights of update k-1 and its update applies to those of update k."""
    o = settings("adam_bf16")
    current = tiny_model(torch.bfloat16, tied=True)
    opt = AdamWBF16(param_groups_with_decay(current.named_parameters(), o.weight_decay), lr=o.lr, eps=o.eps)
    stale = copy.deepcopy(current)
    engine = RoundPipeEngine(tiny_model(torch.bfloat16, tied=True), optim=o, compute_dtype=torch.bfloat16,
                             optim_step="async", model_memory_limit=0.01)  # fmt: skip
    for mbs in make_steps(4):
        num_tokens = sum(mb.num_loss_tokens for mb in mbs)
        ref_loss = reference_loss(stale, mbs, num_tokens)
        previous = copy.deepcopy(current)
        for p, q in zip(current.parameters(), stale.parameters()):
            p.grad = q.grad
        opt.step()
        opt.zero_grad()
        stale = previous
        out = engine.train_batch(mbs, global_num_loss_tokens=num_tokens)
        torch.testing.assert_close(out["loss"], ref_loss)
    masters = engine.state_dict()["model"]
    for name, p in current.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), msg=name)


# ---- models built on the meta device -----------------------------------------------------------
def copy_init(reference: nn.Module, skeleton: nn.Module):
    """An `init_meta` that fills a skeleton module's parameters from the same module of `reference`."""
    names = {id(m): name for name, m in skeleton.named_modules()}
    ref_modules = dict(reference.named_modules())

    def init(module: nn.Module) -> None:
        source = ref_modules[names[id(module)]]
        for attr, p in module._parameters.items():
            if p is not None:
                p.copy_(source._parameters[attr])

    return init


@pytest.mark.parametrize(("optimizer", "dtype"), [("adam", torch.float32), ("adam_bf16", torch.bfloat16)])
def test_engine_from_meta_equals_engine_from_real_model(optimizer, dtype):
    """Materialised from a meta skeleton layer by layer (fp32 masters filled in full precision, then
    cast), the engine trains exactly like one built from the real model."""
    reference = tiny_model(dtype)
    with meta_params():
        skeleton = AutoModelForCausalLM.from_config(tiny_config(), dtype=dtype)
    assert all(p.is_meta for p in skeleton.parameters()) and not any(b.is_meta for b in skeleton.buffers())
    kwargs = dict(optim=settings(optimizer), compute_dtype=torch.bfloat16, model_memory_limit=0.0004)
    from_meta = RoundPipeEngine(skeleton, init_meta=copy_init(reference, skeleton), **kwargs)
    from_real = RoundPipeEngine(copy.deepcopy(reference), **kwargs)
    masters = from_meta.state_dict()["model"]
    for name, p in reference.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), rtol=0, atol=0, msg=name)
    steps = make_steps(2)
    for a, b in zip(train(from_meta, steps), train(from_real, steps)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for name, t in from_real.state_dict()["model"].items():
        torch.testing.assert_close(from_meta.state_dict()["model"][name], t, rtol=0, atol=0, msg=name)


def test_meta_model_gets_the_hugging_face_init_by_default():
    with meta_params():
        skeleton = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.bfloat16)
    engine = RoundPipeEngine(skeleton, optim=settings("adam_bf16"), compute_dtype=torch.bfloat16)
    real = tiny_model(torch.bfloat16)
    for (name, p), (_, q) in zip(engine.model.named_parameters(), real.named_parameters()):
        assert p.device.type == "cpu" and p.dtype == q.dtype and torch.isfinite(p).all(), name
        if p.ndim == 1:  # norm gains
            assert (p == 1).all(), name
        else:
            assert abs(p.float().std() / q.float().std() - 1) < 0.2, name
    for (name, b), (_, c) in zip(engine.model.named_buffers(), real.named_buffers()):
        torch.testing.assert_close(b, c, msg=name)  # rotary tables were computed, not left on meta
    losses = train(engine, make_steps(2))
    assert all(torch.isfinite(x) for x in losses)


def _materialise(twin: bool) -> nn.Module:
    """A meta-built tiny model filled module by module with its `_init_weights`, directly or through
    device twins (`_init_on_device` with the CPU as the device), from the same seed."""
    from laden.engine.roundpipe.engine import _init_on_device

    with meta_params():
        model = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32)
    init = (
        functools.partial(_init_on_device, model._init_weights, torch.device("cpu"))
        if twin
        else model._init_weights
    )
    torch.manual_seed(3)
    for module in model.modules():
        if any(p is not None and p.is_meta for p in module._parameters.values()):
            module.to_empty(device="cpu", recurse=False)
            init(module)
    return model


def test_device_twin_init_equals_direct_init():
    """The GPU-assisted default init runs the model's own `_init_weights` on device twins of each
    module's parameters and copies them back: with the CPU as the device it equals the direct
    init draw for draw (the parameters stay the host ones)."""
    from laden.engine.roundpipe.engine import _default_init

    direct, twin = _materialise(twin=False), _materialise(twin=True)
    for (name, p), (_, q) in zip(direct.named_parameters(), twin.named_parameters()):
        assert q.device.type == "cpu" and isinstance(q, nn.Parameter), name
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert any(p.ndim == 1 and (p == 1).all() for p in twin.parameters())  # norm gains were set
    with meta_params():
        skeleton = AutoModelForCausalLM.from_config(tiny_config())
    assert _default_init(skeleton, [torch.device("cpu")]) == skeleton._init_weights  # no GPU: direct


_PEAK_SCRIPT = r"""
import gc, json, sys, warnings
import torch
from transformers import AutoModelForCausalLM, Qwen3Config
from laden.optim import OptimSettings
from laden.engine.roundpipe import RoundPipeEngine
from laden.engine.roundpipe.host.memory import meta_params
from tiny import tiny_qwen3_config

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

def engine(model, optimizer):
    o = OptimSettings(type=optimizer, lr=1e-3, total_steps=2)
    return RoundPipeEngine(model, optim=o, compute_dtype=torch.bfloat16, pin_model="alloc")

engine(AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=64)), "adam")  # imports, kernels
config = Qwen3Config(hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8,
                     num_key_value_heads=4, head_dim=64, vocab_size=2048, tie_word_embeddings=False)
out = {}
for build, optimizer, dtype in (("meta", "adam_bf16", torch.bfloat16), ("meta", "adam", torch.float32),
                                ("real", "adam_bf16", torch.bfloat16), ("real", "adam", torch.float32)):
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")  # restart the peak-RSS counter here
    base = status("VmRSS:")
    if build == "meta":
        with meta_params():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    e = engine(model, optimizer)
    peak = status("VmHWM:") - base
    store = sum(e.host_bytes_by_kind().values())
    out[f"{build}-{optimizer}"] = peak / store
    del e, model
print(json.dumps(out))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_construction_peak_stays_near_the_final_store():
    """Building the engine (model included) peaks at about the final host store, not at two copies.

    Measured as peak RSS in a fresh process, with glibc's mmap threshold fixed so freed tensors go
    back to the OS at once (RSS then follows live tensor bytes). From meta: the store and nothing
    else. From a real model: each parameter's original storage is freed once copied, so the peak
    is the store plus one parameter (before, fp32 masters were all copied first: 1.4x).
    """
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), env.get("PYTHONPATH", "")])  # tiny.py
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ratios = json.loads(done.stdout.strip().splitlines()[-1])
    for name, ratio in ratios.items():
        assert ratio < (1.05 if name.startswith("meta") else 1.15), ratios


# ---- the benchmark's host-memory check ---------------------------------------------------------
def load_script():
    spec = importlib.util.spec_from_file_location("train_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture(scope="module")
def qwen3_8b():
    bench = load_script()
    args = bench.parse_args(["--model", "qwen3-8b"])
    model = bench.build_model(args)  # on the meta device: nothing allocated
    assert all(p.is_meta for p in model.parameters())
    return bench, model


@pytest.mark.filterwarnings("ignore:the largest layer needs")
def test_qwen3_8b_prediction_fits_128_gib_only_with_adam_bf16(qwen3_8b):
    """As on the H200 (bf16 compute, page-locked buffers, 24 GiB GPU cap): 8.2B parameters, 4 x 4096
    tokens per step. adam_bf16 with the exact step stays under 100 GiB; fp32 Adam exceeds 128 GiB."""
    bench, model = qwen3_8b
    num_params = sum(p.numel() for p in model.parameters())
    assert 8.1e9 < num_params < 8.3e9
    cuda = torch.device("cuda")  # only the device type is read: predict for the GPU machine

    def predict(*flags: str) -> dict:
        args = bench.parse_args(["--model", "qwen3-8b", "--num-seqs", "4", *flags])
        return bench.predict_host(args, model, cuda)

    bf16 = predict("--optimizer", "adam_bf16", "--optim-step", "sync")
    assert bf16["predicted_host_gib"] < 100, bf16
    assert predict("--optimizer", "adam_bf16", "--optim-step", "sync", "--pin-model", "register")[
        "bytes_per_param"
    ] == pytest.approx(10.0, abs=1e-3)
    for step in ("sync", "async"):
        fp32 = predict("--optimizer", "adam", "--optim-step", step)
        assert fp32["predicted_host_gib"] > 128, fp32
    assert predict("--optimizer", "adam", "--optim-step", "sync", "--pin-model", "register")[
        "bytes_per_param"
    ] == pytest.approx(18.0, abs=1e-3)


@pytest.mark.filterwarnings("ignore:the largest layer needs")
def test_benchmark_refuses_a_run_that_cannot_fit_before_allocating(capsys):
    """The first stdout line is the prediction; the refusal names the knobs and what they would need."""
    bench = load_script()
    with pytest.raises(SystemExit) as exit_info:
        bench.main(
            ["--system", "laden", "--model", "qwen3-8b", "--optimizer", "adam", "--host-mem-gib", "128"]
        )
    message = str(exit_info.value)
    assert "--host-mem-gib 128" in message and "--optimizer adam_bf16" in message and "--pin-model" in message
    first = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    assert first["predicted_host_gib"] > 128 and first["host_mem_gib"] == 128


def test_benchmark_builds_on_meta_and_reports_host_bytes(capsys):
    bench = load_script()
    result = bench.main(["--system", "laden", "--model", "tiny", "--build", "meta", "--steps", "1", "--warmup", "1",
                         "--seq-len", "32", "--num-seqs", "4", "--num-microbatch", "2"])  # fmt: skip
    lines = capsys.readouterr().out.strip().splitlines()
    prediction = json.loads(lines[0])
    assert result["valid"] and result["predicted_host_gib"] == prediction["predicted_host_gib"]
    state = {k: v for k, v in prediction["by_kind_bytes"].items() if k != "activations"}
    assert result["host_bytes_by_kind"] == state and prediction["by_kind_bytes"]["activations"] > 0
