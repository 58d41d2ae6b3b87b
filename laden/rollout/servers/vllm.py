"""vLLM as a rollout backend (`rollout.backend: vllm:dNtM`): N servers of M-way tensor parallelism.

Endpoints used (vLLM 0.32; the RL and dev ones exist only with `VLLM_SERVER_DEV_MODE=1`, which
laden sets for the servers it starts):

- `POST /v1/completions` with the prompt as token ids, `logprobs: 0` (the sampled token's
  log-prob only), `return_token_ids: true` (the output as ids) and `n` samples.
- `POST /pause?mode=abort`, `POST /resume`: abort and hold generation around a weight update.
- `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`: load a
  Hugging Face safetensors directory in place (0.32 has no dedicated disk endpoint), then
  `POST /update_weight_version` and `POST /reset_prefix_cache` (KV computed under old weights).
- `POST /init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
  `/finish_weight_update`: NCCL broadcast from the trainer (needs `weight_transfer_backend`). The
  workers join through vLLM's own stateless group and PyNccl communicator, which `laden rl`'s trainer
  does not join: `laden rl` refuses `actor.weight_update_mode: xccl` with vLLM and updates by disk.
- `POST /release_kv_cache_memory` (KV only) or `POST /sleep?level=2` (KV and weights), and
  `POST /wake_up`: colocated training (needs `enable_sleep_mode`, a GPU feature).

Log-probabilities: laden's number is log softmax(logits / temperature) before top-k / top-p.
vLLM returns, per `--logprobs-mode`, `raw_logprobs` (its default: log softmax(logits), i.e. at
temperature 1) or `processed_logprobs` (after penalties, temperature *and* top-k / top-p, then
renormalised). laden starts servers with `processed_logprobs`: with top_k=0 and top_p=1 it is
exactly laden's number (measured on the CPU backend: within 1e-5 of a transformers forward at
temperature 0.7 and 1.5); with top-k / top-p on, it is the truncated distribution's log-prob,
larger than laden's by log(kept probability mass), so a warning is given. Greedy requests get
log softmax(logits) (temperature 1), as laden defines. While fewer than `min_new_tokens` are out
the stop tokens are masked and the other tokens' log-probs renormalised. On CUDA this mode also
keeps vLLM off its FlashInfer sampler (the PyTorch one returns processed log-probs).

Other facts of vLLM 0.32 this relies on: it refuses temperature > 2 and greedy with n > 1 (laden
asks for one greedy completion and copies it), and a served model's `generation_config.json`
would change the default sampling settings (laden starts it with `--generation-config vllm`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laden.rollout.base import StopReason
from laden.rollout.servers.engine import Segment, SegmentRequest, ServerEngine, ServerHandle
from laden.rollout.servers.http import AsyncJSONClient, ServerRequestError, request_json
from laden.rollout.servers.launch import attach_servers, launch_and_build, option_flags
from laden.rollout.servers.process import ServerKind

VLLM = ServerKind(
    name="vllm", module="vllm", install_hint="pip install vllm", python_env_var="LADEN_VLLM_PYTHON"
)

_FINISH: dict[str, StopReason] = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "stop"}


@dataclass(kw_only=True, slots=True)
class VLLMServerConfig:
    """How laden starts each vLLM server (one per data-parallel rank)."""

    python: str | None = None
    """Python that runs vLLM; None = `$LADEN_VLLM_PYTHON`, else this interpreter."""
    host: str = "127.0.0.1"
    """Address the servers bind; loopback by default (the API has no authentication)."""
    dtype: str = "auto"
    """`--dtype`: `auto`, `bfloat16`, `float16` or `float32`."""
    max_model_len: int | None = None
    """`--max-model-len`: longest prompt + completion; None = the model's own limit."""
    gpu_memory_utilization: float = 0.9
    """`--gpu-memory-utilization`: fraction of GPU memory for weights + KV cache (on vLLM's CPU
    backend a fraction of host memory; the KV cache size there is `VLLM_CPU_KVCACHE_SPACE` GiB)."""
    max_num_seqs: int | None = None
    """`--max-num-seqs`: sequences run at once; None = vLLM's default."""
    enable_prefix_caching: bool | None = None
    """`--enable-prefix-caching` (True) or `--no-enable-prefix-caching` (False); None = vLLM's default."""
    enable_chunked_prefill: bool | None = None
    """`--enable-chunked-prefill` (True) or `--no-enable-chunked-prefill` (False); None = vLLM's default."""
    enforce_eager: bool = False
    """`--enforce-eager`: no CUDA graphs."""
    block_size: int | None = None
    """`--block-size`: tokens per KV cache block; None = vLLM's default."""
    cpu_offload_gb: float | None = None
    """`--cpu-offload-gb`: GiB of weights per GPU kept in host memory; None = none."""
    enable_sleep_mode: bool = False
    """`--enable-sleep-mode`: needed by `sleep()`/`wake()` (colocated training); GPU only."""
    weight_transfer_backend: str | None = None
    """`--weight-transfer-config {"backend": ...}`, e.g. `nccl`, for broadcast (xccl) updates."""
    seed: int | None = None
    """`--seed` for sampling; None = vLLM's default."""
    extra_args: tuple[str, ...] = ()
    """More `api_server` arguments, appended as given."""
    env: dict[str, str] = field(default_factory=dict)
    """More environment variables for the servers."""
    startup_timeout_s: float = 900.0
    """How long to wait for `/health` (loading a large model takes minutes)."""
    log_dir: str | None = None
    """Directory of the server logs `vllm-<rank>.log`; None = a new temporary directory."""
    first_device: int = 0
    """Visible GPUs left before the servers' own (those of the trainer processes beside them)."""
    ports: tuple[int, ...] = ()
    """Port of each server, in order (`laden serve`: those of `rollout.server_urls`); empty = free ports."""


VLLM_OPTIONS = (
    "max_model_len", "max_num_seqs", "enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "block_size",
    "cpu_offload_gb", "enable_sleep_mode",
)  # fmt: skip
"""`VLLMServerConfig` fields passed as the vLLM 0.32 flag of the same name (`option_flags`)."""


def vllm_command(
    python: str, model_dir: str, *, port: int, tp: int, cfg: VLLMServerConfig
) -> tuple[list[str], dict[str, str]]:
    """The argv and extra environment of one vLLM server."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    argv += ["--host", cfg.host, "--port", str(port), "--tensor-parallel-size", str(tp), "--dtype", cfg.dtype]
    argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    argv += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
    argv += option_flags(cfg, VLLM_OPTIONS, negatable=("enable_prefix_caching", "enable_chunked_prefill"))
    if cfg.weight_transfer_backend:
        argv += ["--weight-transfer-config", json.dumps({"backend": cfg.weight_transfer_backend})]
    if cfg.seed is not None:
        argv += ["--seed", str(cfg.seed)]
    argv += list(cfg.extra_args)
    return argv, {"VLLM_SERVER_DEV_MODE": "1", **cfg.env}


class VLLMDialect:
    """vLLM 0.32's HTTP API, as `ServerEngine` uses it (see the module docstring)."""

    name = "vllm"

    def __init__(self, *, model_names: dict[str, str] | None = None) -> None:
        self.model_names = dict(model_names or {})
        """Served model name per server URL (sent as `model`; older vLLM versions require it)."""
        self._warned_truncation = False
        self._groups: dict[str, tuple[str, int]] = {}

    def completion_payload(self, url: str, request: SegmentRequest) -> dict[str, Any]:
        """The `/v1/completions` body for `request`."""
        s = request.sampling
        payload: dict[str, Any] = {
            "prompt": request.prompt_ids,
            "n": 1 if s.greedy else request.n,
            "max_tokens": request.max_new_tokens,
            "min_tokens": request.min_new_tokens,
            "temperature": 0.0 if s.greedy else s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "stop": [] if s.ignore_eos else list(s.stop),
            "stop_token_ids": [] if s.ignore_eos else list(s.stop_token_ids),
            "ignore_eos": s.ignore_eos,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "stream": False,
        }
        if request.request_id:
            payload["request_id"] = request.request_id
        if url in self.model_names:
            payload["model"] = self.model_names[url]
        return payload

    async def complete(self, http: AsyncJSONClient, url: str, request: SegmentRequest) -> list[Segment]:
        """Generate `request.n` samples with one `/v1/completions` call."""
        s = request.sampling
        if not s.greedy and (s.top_k > 0 or s.top_p < 1) and not self._warned_truncation:
            self._warned_truncation = True
            warnings.warn(
                f"vllm: top_k={s.top_k}, top_p={s.top_p}: vLLM's log-probs are of the truncated distribution, "
                "larger than laden's log softmax(logits / temperature) by log(kept mass); the trainer's "
                "recomputed log-probs will differ by that; use top_k=0 and top_p=1 for exact ones",
                stacklevel=2,
            )
        response = await http.post(url + "/v1/completions", self.completion_payload(url, request))
        segments = [parse_choice(c, url) for c in sorted(response["choices"], key=lambda c: c["index"])]
        if s.greedy and request.n > 1:
            segments = segments * request.n  # greedy completions are identical; vLLM refuses n > 1
        return segments

    async def pause(self, http: AsyncJSONClient, url: str) -> None:
        """`POST /pause?mode=abort`."""
        await _dev_call(http, url, "/pause", params={"mode": "abort"})

    async def resume(self, http: AsyncJSONClient, url: str) -> None:
        """`POST /resume`."""
        await _dev_call(http, url, "/resume")

    async def abort(self, http: AsyncJSONClient, url: str, request_ids: list[str]) -> None:
        """`POST /abort_requests {"request_ids": [...]}`; vLLM 0.32 knows a completion sent with
        `request_id` R as `cmpl-R-0` (measured), so both spellings are sent."""
        ids = [f"cmpl-{r}-0" for r in request_ids] + list(request_ids)
        await _dev_call(http, url, "/abort_requests", {"request_ids": ids})

    async def load_from_disk(self, http: AsyncJSONClient, url: str, path: str, version: int) -> None:
        """`reload_weights` from `path` over `/collective_rpc`, then tag the version, reset the prefix cache."""
        if not Path(path).is_dir():
            raise ValueError(f"vllm update_weights: weight directory {path!r} does not exist")
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        await _dev_call(http, url, "/collective_rpc", body)
        await _dev_call(http, url, "/update_weight_version", {"new_version": str(version)})
        await _dev_call(http, url, "/reset_prefix_cache")

    async def load_from_broadcast(self, http: AsyncJSONClient, url: str, source: Any, version: int) -> None:
        """NCCL transfer: init the group once per source, then start / update / finish.

        `source` carries `master_address`, `master_port`, `world_size`, `rank_offset` and the
        parameters as `names`, `dtypes` (e.g. `bfloat16`) and `shapes`. The trainer broadcasts
        while this call waits in `/update_weights`.
        """
        group = (getattr(source, "master_address", None) or source.master_addr, source.master_port)
        if self._groups.get(url) != group:
            init_info = {
                "master_address": getattr(source, "master_address", None) or source.master_addr,
                "master_port": source.master_port,
                "rank_offset": getattr(source, "rank_offset", 1),
                "world_size": source.world_size,
            }
            await _dev_call(http, url, "/init_weight_transfer_engine", {"init_info": init_info})
            self._groups[url] = group
        update_info = {
            "names": list(source.names),
            "dtype_names": list(source.dtypes),
            "shapes": list(source.shapes),
        }
        await _dev_call(http, url, "/start_weight_update")
        await _dev_call(http, url, "/update_weights", {"update_info": update_info})
        await _dev_call(http, url, "/finish_weight_update", {"weight_version": str(version)})

    async def release_memory(self, http: AsyncJSONClient, url: str, *, weights: bool) -> None:
        """`POST /sleep?level=2` (KV cache and weights) or `POST /release_kv_cache_memory` (KV only)."""
        try:
            if weights:
                await _dev_call(http, url, "/sleep", params={"level": 2, "mode": "abort"})
            else:
                await _dev_call(http, url, "/release_kv_cache_memory")
        except ServerRequestError as err:
            raise ServerRequestError(
                f"{err}; releasing memory needs a vLLM server on a GPU started with --enable-sleep-mode "
                "(VLLMServerConfig.enable_sleep_mode=True)",
                status=err.status,
                body=err.body,
            ) from None

    async def restore_memory(self, http: AsyncJSONClient, url: str) -> None:
        """`POST /wake_up` (every tag)."""
        await _dev_call(http, url, "/wake_up")


def parse_choice(choice: dict[str, Any], url: str) -> Segment:
    """One `/v1/completions` choice -> `Segment` (ids, the sampled tokens' log-probs, stop reason)."""
    reason = choice.get("finish_reason")
    if reason not in _FINISH:
        raise RuntimeError(f"vllm at {url}: unexpected finish_reason {reason!r} in {str(choice)[:300]}")
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    token_ids = choice.get("token_ids")
    if token_ids is None and logprobs is not None:
        tokens = (choice.get("logprobs") or {}).get("tokens", [])
        token_ids = [int(t.removeprefix("token_id:")) for t in tokens]  # return_tokens_as_token_ids
    token_ids = token_ids or []
    logprobs = logprobs or []
    if len(token_ids) != len(logprobs) or any(lp is None for lp in logprobs):
        raise RuntimeError(
            f"vllm at {url}: {len(token_ids)} output tokens but log-probs {str(logprobs)[:200]}; "
            "every output token needs its log-prob (was the request sent with logprobs=0?)"
        )
    return Segment(token_ids=list(token_ids), logprobs=[float(x) for x in logprobs], finish=_FINISH[reason])


async def _dev_call(
    http: AsyncJSONClient, url: str, path: str, payload: Any = None, *, params: dict[str, Any] | None = None
) -> Any:
    try:
        return await http.post(url + path, payload, params=params)
    except ServerRequestError as err:
        if err.status == 404:
            raise ServerRequestError(
                f"{err}; vLLM registers {path} only in dev mode: start the server with VLLM_SERVER_DEV_MODE=1",
                status=err.status,
                body=err.body,
            ) from None
        raise


class VLLMEngine(ServerEngine):
    """`ServerEngine` speaking vLLM; build it with `VLLMEngine.launch(...)` or `VLLMEngine.attach(...)`.

    Only the constructors differ from `ServerEngine`: the behaviour is the `VLLMDialect`.
    """

    @classmethod
    def launch(
        cls,
        model_dir: str | Path,
        *,
        dp: int = 1,
        tp: int = 1,
        cfg: VLLMServerConfig | None = None,
        initial_version: int = 0,
        **engine_kwargs: Any,
    ) -> VLLMEngine:
        """Start `dp` vLLM servers of `tp` GPUs each on `model_dir` and wait until all are healthy."""
        cfg = cfg or VLLMServerConfig()
        return launch_and_build(
            VLLM, cfg, health_path="/health", dp=dp, tp=tp,
            command=lambda python, port: vllm_command(python, str(model_dir), port=port, tp=tp, cfg=cfg),
            build=lambda servers: cls._build(servers, initial_version, engine_kwargs),
        )  # fmt: skip

    @classmethod
    def attach(cls, urls: Sequence[str], *, initial_version: int = 0, **engine_kwargs: Any) -> VLLMEngine:
        """Drive vLLM servers already running at `urls` (started with `VLLM_SERVER_DEV_MODE=1` and
        `--logprobs-mode processed_logprobs`); `close()` leaves them running."""
        return cls._build(attach_servers(urls, health_path="/health"), initial_version, engine_kwargs)

    @classmethod
    def _build(
        cls, servers: list[ServerHandle], initial_version: int, engine_kwargs: dict[str, Any]
    ) -> VLLMEngine:
        names = {s.url: _served_model_name(s.url) for s in servers}
        dialect = VLLMDialect(model_names={u: n for u, n in names.items() if n})
        return cls(dialect, servers, initial_version=initial_version, **engine_kwargs)


def _served_model_name(url: str) -> str | None:
    try:
        models = request_json("GET", url + "/v1/models", timeout_s=30)
        return models["data"][0]["id"]
    except (ServerRequestError, KeyError, IndexError, TypeError):
        return None
