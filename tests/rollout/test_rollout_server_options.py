"""The `vllm` / `sglang` sections of the run config reach the command lines of the servers laden starts."""

from __future__ import annotations

import json
import subprocess

import pytest
from rl_runs import tiny_rl_config as _tiny_rl_config

from laden.config.alloc import AllocationMode
from laden.rollout.servers import (
    SGLangEngine,
    SGLangServerConfig,
    VLLMEngine,
    VLLMServerConfig,
    start_server_engine,
)
from laden.rollout.servers.sglang import sglang_command
from laden.rollout.servers.vllm import vllm_command


def tiny_rl_config(tmp_path, *overrides):
    """The tiny RL job on a node of 2 GPUs: one for the trainer, one for the server."""
    return _tiny_rl_config(tmp_path, "cluster.n_gpus_per_node=2", *overrides)


def _flags(argv: list[str]) -> dict[str, str | None]:
    """`--flag value` -> {flag: value}, a bare `--flag` -> {flag: None} (each flag once)."""
    out: dict[str, str | None] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            assert arg not in out, f"{arg} given twice in {argv}"
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[arg] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def _launched(monkeypatch, cfg, backend: str, **kwargs):
    """The server config `start_server_engine` hands the engine for `cfg` (nothing is started)."""
    seen = {}

    def fake_launch(model_dir, *, dp, tp, cfg, initial_version, **kwargs):
        seen["cfg"] = cfg
        return "engine"

    engine = VLLMEngine if backend == "vllm" else SGLangEngine
    monkeypatch.setattr(engine, "launch", staticmethod(fake_launch))
    assert (
        start_server_engine(AllocationMode.parse(f"{backend}:d1"), model_dir="m", cfg=cfg, **kwargs)
        == "engine"
    )
    return seen["cfg"]


SET = {
    "vllm": (
        ["seed=7", "vllm.gpu_memory_utilization=0.6", "vllm.max_model_len=512", "vllm.max_num_seqs=64",
         "vllm.enable_prefix_caching=false", "vllm.enable_chunked_prefill=true", "vllm.enforce_eager=true",
         "vllm.block_size=32", "vllm.cpu_offload_gb=2.5"],
        {"--gpu-memory-utilization": "0.6", "--max-model-len": "512", "--max-num-seqs": "64",
         "--no-enable-prefix-caching": None, "--enable-chunked-prefill": None, "--enforce-eager": None,
         "--block-size": "32", "--cpu-offload-gb": "2.5", "--seed": "7"},
    ),
    "sglang": (
        ["seed=7", "sglang.mem_fraction_static=0.7", "sglang.context_length=1024", "sglang.max_running_requests=32",
         "sglang.chunked_prefill_size=-1", "sglang.max_prefill_tokens=4096", "sglang.disable_radix_cache=true",
         "sglang.attention_backend=triton", "sglang.enable_metrics=true"],
        {"--mem-fraction-static": "0.7", "--context-length": "1024", "--max-running-requests": "32",
         "--chunked-prefill-size": "-1", "--max-prefill-tokens": "4096", "--disable-radix-cache": None,
         "--attention-backend": "triton", "--enable-metrics": None, "--random-seed": "7"},
    ),
}  # fmt: skip
"""Per backend: config overrides, and the flags (with their values) they must become."""

UNSET = {
    "vllm": ("--gpu-memory-utilization", "0.9", ("max-model-len", "max-num-seqs", "enable-prefix-caching",
             "enable-chunked-prefill", "enforce-eager", "block-size", "cpu-offload-gb")),
    "sglang": ("--mem-fraction-static", "0.9", ("context-length", "max-running-requests", "chunked-prefill-size",
               "max-prefill-tokens", "disable-radix-cache", "attention-backend", "enable-metrics")),
}  # fmt: skip
"""Per backend: the memory flag always passed, its default, and the flags a default config leaves out."""


def _server_flags(monkeypatch, tmp_path, backend: str, *overrides: str) -> dict[str, str | None]:
    cfg = tiny_rl_config(tmp_path, f"rollout.backend={backend}:d1", *overrides)
    server = _launched(monkeypatch, cfg, backend)
    assert isinstance(server, VLLMServerConfig if backend == "vllm" else SGLangServerConfig)
    command = vllm_command if backend == "vllm" else sglang_command
    return _flags(command("py", "/m", port=1, tp=1, cfg=server)[0])


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_the_config_section_becomes_the_servers_flags(monkeypatch, tmp_path, backend):
    overrides, expected = SET[backend]
    flags = _server_flags(monkeypatch, tmp_path, backend, *overrides)
    assert {k: flags.get(k, "absent") for k in expected} == expected
    assert "--enable-prefix-caching" not in flags  # false is the --no- form alone


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_defaults_leave_the_options_to_the_server(monkeypatch, tmp_path, backend):
    memory_flag, default, names = UNSET[backend]
    flags = _server_flags(monkeypatch, tmp_path, backend)
    assert flags[memory_flag] == default
    for name in names:
        assert f"--{name}" not in flags and f"--no-{name}" not in flags, name


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_an_explicit_server_config_wins_over_the_run_config(monkeypatch, tmp_path, backend):
    cfg = tiny_rl_config(tmp_path, f"rollout.backend={backend}:d1", "vllm.max_num_seqs=8",
                         "sglang.max_running_requests=8")  # fmt: skip
    server_cls = VLLMServerConfig if backend == "vllm" else SGLangServerConfig
    server = _launched(monkeypatch, cfg, backend, server=server_cls())
    assert getattr(server, "max_num_seqs" if backend == "vllm" else "max_running_requests") is None


_PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))
print(json.dumps({k: getattr(args, k) for k in json.loads(sys.argv[2])}))
"""


@pytest.mark.server
def test_vllm_parses_the_flags_to_the_configured_values(monkeypatch, tmp_path, vllm_python):
    """vLLM 0.32's own argument parser (no server started) reads every flag as the value set."""
    overrides, _ = SET["vllm"]
    server = _launched(monkeypatch, tiny_rl_config(tmp_path, "rollout.backend=vllm:d1", *overrides), "vllm")
    argv = vllm_command(str(vllm_python), "/m", port=1, tp=1, cfg=server)[0]
    names = ["gpu_memory_utilization", "max_model_len", "max_num_seqs", "enable_prefix_caching",
             "enable_chunked_prefill", "enforce_eager", "block_size", "cpu_offload_gb", "seed"]  # fmt: skip
    out = subprocess.run(
        [str(vllm_python), "-c", _PARSE, json.dumps(argv[3:]), json.dumps(names)],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    assert parsed == {name: getattr(server, name) for name in names}
    assert parsed["enable_prefix_caching"] is False and parsed["max_num_seqs"] == 64
