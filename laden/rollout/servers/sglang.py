"""SGLang as a rollout backend (`rollout.backend: sglang:dNtM`): N servers of M-way tensor parallelism.

Endpoints used (SGLang's native API, the one its RL integrations drive):

- `POST /generate` with `input_ids` (a list of n copies of the prompt for n samples: SGLang's
  radix cache prefills the shared prompt once), `sampling_params` and `return_logprob: true`;
  each answer carries `output_ids` and `meta_info.output_token_logprobs` as
  `[logprob, token_id, text]` triples and `meta_info.finish_reason.type`.
- `POST /pause_generation {"mode": "abort"}`, `POST /continue_generation`.
- `POST /update_weights_from_disk {"model_path", "weight_version"}` (flushes the radix cache).
- `POST /init_weights_update_group` + `POST /update_weights_from_distributed`: a broadcast from the
  trainer (NCCL, or gloo on the CPU), one `broadcast` per named tensor (`broadcast.py`).
- `POST /release_memory_occupation {"tags": [...]}` / `POST /resume_memory_occupation`
  (needs `--enable-memory-saver`), `POST /flush_cache`, `POST /abort_request {"rid": ...}`.

Log-probabilities: by default SGLang returns log softmax(logits / temperature), taken before
top-k / top-p truncation: laden's definition, at every top-k / top-p. Setting
`SGLANG_RETURN_ORIGINAL_LOGPROB` would make it return temperature-1 numbers instead, so laden
sets it to false for the servers it starts. Greedy requests (temperature 0) get
log softmax(logits).

SGLang cannot be installed on laden's CPU test machine; this module is tested against a fake
server speaking the request and response shapes of SGLang's `io_struct.py` and `http_server.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laden.rollout.base import StopReason
from laden.rollout.servers.engine import Segment, SegmentRequest, ServerEngine
from laden.rollout.servers.http import AsyncJSONClient, ServerRequestError
from laden.rollout.servers.launch import attach_servers, launch_and_build, option_flags
from laden.rollout.servers.process import ServerKind

SGLANG = ServerKind(
    name="sglang",
    module="sglang",
    install_hint='pip install "sglang[all]"',
    python_env_var="LADEN_SGLANG_PYTHON",
)

_FINISH: dict[str, StopReason] = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass(kw_only=True, slots=True)
class SGLangServerConfig:
    """How laden starts each SGLang server (one per data-parallel rank)."""

    python: str | None = None
    """Python that runs SGLang; None = `$LADEN_SGLANG_PYTHON`, else this interpreter."""
    host: str = "127.0.0.1"
    """Address the servers bind; loopback by default (the API has no authentication)."""
    mem_fraction_static: float = 0.9
    """`--mem-fraction-static`: GPU memory fraction for weights + KV cache (`sglang.mem_fraction_static`)."""
    dtype: str = "auto"
    """`--dtype`."""
    context_length: int | None = None
    """`--context-length`: longest prompt + completion; None = the model's own limit."""
    max_running_requests: int | None = None
    """`--max-running-requests`: requests run at once; None = what the KV cache holds."""
    chunked_prefill_size: int | None = None
    """`--chunked-prefill-size`: prompt tokens per prefill chunk, -1 = no chunking; None = SGLang's default."""
    max_prefill_tokens: int | None = None
    """`--max-prefill-tokens`: prompt tokens per prefill batch; None = SGLang's default."""
    disable_radix_cache: bool = False
    """`--disable-radix-cache`: no prefix cache."""
    attention_backend: str | None = None
    """`--attention-backend`, e.g. `fa3`, `flashinfer`, `triton`; None = SGLang's choice."""
    enable_metrics: bool = False
    """`--enable-metrics`: Prometheus metrics at `/metrics`."""
    enable_memory_saver: bool = False
    """`--enable-memory-saver`: needed by `sleep()`/`wake()` (colocated training)."""
    seed: int | None = None
    """`--random-seed`; None = SGLang's default."""
    extra_args: tuple[str, ...] = ()
    """More `launch_server` arguments, appended as given."""
    env: dict[str, str] = field(default_factory=dict)
    """More environment variables for the servers."""
    startup_timeout_s: float = 900.0
    """How long to wait for `/health_generate`."""
    log_dir: str | None = None
    """Directory of the server logs `sglang-<rank>.log`; None = a new temporary directory."""
    first_device: int = 0
    """Visible GPUs left before the servers' own (those of the trainer processes beside them)."""
    ports: tuple[int, ...] = ()
    """Port of each server, in order (`laden serve`: those of `rollout.server_urls`); empty = free ports."""


SGLANG_OPTIONS = (
    "context_length", "max_running_requests", "chunked_prefill_size", "max_prefill_tokens", "disable_radix_cache",
    "attention_backend", "enable_metrics", "enable_memory_saver",
)  # fmt: skip
"""`SGLangServerConfig` fields passed as the SGLang flag of the same name (`option_flags`)."""


def sglang_command(
    python: str, model_dir: str, *, port: int, tp: int, cfg: SGLangServerConfig
) -> tuple[list[str], dict[str, str]]:
    """The argv and extra environment of one SGLang server."""
    argv = [python, "-m", "sglang.launch_server", "--model-path", str(model_dir)]
    argv += ["--host", cfg.host, "--port", str(port), "--tp", str(tp)]
    argv += ["--mem-fraction-static", str(cfg.mem_fraction_static), "--dtype", cfg.dtype]
    argv += option_flags(cfg, SGLANG_OPTIONS)
    if cfg.seed is not None:
        argv += ["--random-seed", str(cfg.seed)]
    argv += list(cfg.extra_args)
    return argv, {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false", **cfg.env}


class SGLangDialect:
    """SGLang's native HTTP API, as `ServerEngine` uses it (see the module docstring)."""

    name = "sglang"

    def __init__(self, *, group_name: str = "laden_weight_update") -> None:
        self.group_name = group_name
        """Name of the weight-broadcast process group on the servers."""
        self._groups: dict[str, tuple[str, int]] = {}
        self._rids: dict[str, list[str]] = {}

    def generate_payload(self, request: SegmentRequest) -> dict[str, Any]:
        """The `/generate` body for `request` (a batch of n identical prompts)."""
        s = request.sampling
        sampling_params = {
            "max_new_tokens": request.max_new_tokens,
            "min_new_tokens": request.min_new_tokens,
            "temperature": 0.0 if s.greedy else s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k if s.top_k > 0 else -1,
            "min_p": 0.0,
            "stop": [] if s.ignore_eos else list(s.stop),
            "stop_token_ids": [] if s.ignore_eos else list(s.stop_token_ids),
            "ignore_eos": s.ignore_eos,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        payload: dict[str, Any] = {
            "input_ids": [request.prompt_ids] * request.n,
            "sampling_params": sampling_params,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
        }
        if request.request_id:
            payload["rid"] = [f"{request.request_id}-{i}" for i in range(request.n)]
        return payload

    async def complete(self, http: AsyncJSONClient, url: str, request: SegmentRequest) -> list[Segment]:
        """Generate `request.n` samples with one `/generate` call."""
        payload = self.generate_payload(request)
        self._rids[request.request_id] = payload.get("rid", [])
        try:
            response = await http.post(url + "/generate", payload)
        finally:
            self._rids.pop(request.request_id, None)
        items = response if isinstance(response, list) else [response]
        return [parse_output(item, url) for item in items]

    async def pause(self, http: AsyncJSONClient, url: str) -> None:
        """`POST /pause_generation {"mode": "abort"}`."""
        await http.post(url + "/pause_generation", {"mode": "abort"})

    async def resume(self, http: AsyncJSONClient, url: str) -> None:
        """`POST /continue_generation`."""
        await http.post(url + "/continue_generation", {})

    async def abort(self, http: AsyncJSONClient, url: str, request_ids: list[str]) -> None:
        """`POST /abort_request {"rid": ...}` for each sample of each call."""
        for request_id in request_ids:
            for rid in self._rids.get(request_id, []):
                await http.post(url + "/abort_request", {"rid": rid})

    async def flush_cache(self, http: AsyncJSONClient, url: str) -> None:
        """`POST /flush_cache` (refused while requests run or wait)."""
        await http.post(url + "/flush_cache")

    async def load_from_disk(self, http: AsyncJSONClient, url: str, path: str, version: int) -> None:
        """`POST /update_weights_from_disk`; raise when the server answers `success: false`."""
        if not Path(path).is_dir():
            raise ValueError(f"sglang update_weights: weight directory {path!r} does not exist")
        body = {"model_path": str(path), "weight_version": str(version), "flush_cache": True}
        _check_success(
            await _post_result(http, url, "/update_weights_from_disk", body), url, "update_weights_from_disk"
        )

    async def load_from_broadcast(self, http: AsyncJSONClient, url: str, source: Any, version: int) -> None:
        """`/init_weights_update_group` once per group, then `/update_weights_from_distributed`.

        `source` (a `BroadcastBucket`) carries `master_address`, `master_port`, `world_size`, the
        group's `group_name` and `backend` (default `nccl`), this server's first
        rank (`rank_offset(url)`, or an attribute `rank_offset`, default 1) and the tensors as `names`,
        `dtypes` and `shapes`, in the order the trainer broadcasts them while this call waits.
        """
        address = getattr(source, "master_address", None) or source.master_addr
        group_name = getattr(source, "group_name", None) or self.group_name
        group = (address, source.master_port)
        if self._groups.get(url) != group:
            offset = source.rank_offset(url) if callable(getattr(source, "rank_offset", None)) else None
            init = {
                "master_address": address,
                "master_port": source.master_port,
                "rank_offset": offset if offset is not None else getattr(source, "rank_offset", 1),
                "world_size": source.world_size,
                "group_name": group_name,
                "backend": getattr(source, "backend", None) or "nccl",
            }
            _check_success(
                await _post_result(http, url, "/init_weights_update_group", init),
                url,
                "init_weights_update_group",
            )
            self._groups[url] = group
        body = {
            "names": list(source.names),
            "dtypes": list(source.dtypes),
            "shapes": [list(s) for s in source.shapes],
            "group_name": group_name,
            "flush_cache": True,
            "weight_version": str(version),
        }
        result = await _post_result(http, url, "/update_weights_from_distributed", body)
        _check_success(result, url, "update_weights_from_distributed")

    async def release_memory(self, http: AsyncJSONClient, url: str, *, weights: bool) -> None:
        """`POST /release_memory_occupation` with tags `kv_cache` (and `weights`)."""
        tags = ["kv_cache", "weights"] if weights else ["kv_cache"]
        try:
            await http.post(url + "/release_memory_occupation", {"tags": tags})
        except ServerRequestError as err:
            raise ServerRequestError(
                f"{err}; releasing memory needs an SGLang server started with --enable-memory-saver "
                "(SGLangServerConfig.enable_memory_saver=True)",
                status=err.status,
                body=err.body,
            ) from None

    async def restore_memory(self, http: AsyncJSONClient, url: str) -> None:
        """`POST /resume_memory_occupation` (every released tag)."""
        await http.post(url + "/resume_memory_occupation", {})


def parse_output(item: dict[str, Any], url: str) -> Segment:
    """One `/generate` answer -> `Segment`."""
    if "error" in item:
        raise RuntimeError(f"sglang at {url}: /generate failed: {str(item['error'])[:300]}")
    meta = item.get("meta_info") or {}
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in _FINISH:
        raise RuntimeError(
            f"sglang at {url}: unexpected finish_reason {finish!r} in meta_info {str(meta)[:300]}"
        )
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise RuntimeError(f"sglang at {url}: no meta_info.output_token_logprobs; was return_logprob sent?")
    logprobs = [float(t[0]) for t in triples]
    token_ids = item.get("output_ids")
    if token_ids is None:
        token_ids = [int(t[1]) for t in triples]
    if len(token_ids) != len(logprobs):
        raise RuntimeError(
            f"sglang at {url}: {len(token_ids)} output ids but {len(logprobs)} log-probs; they must match"
        )
    return Segment(token_ids=list(token_ids), logprobs=logprobs, finish=_FINISH[kind])


async def _post_result(http: AsyncJSONClient, url: str, path: str, body: Any) -> Any:
    try:
        return await http.post(url + path, body)
    except ServerRequestError as err:
        if err.status == 400 and err.body:
            return _json_or_text(err.body)  # SGLang answers success=false with HTTP 400
        raise


def _json_or_text(body: str) -> Any:
    import json

    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return body


def _check_success(result: Any, url: str, endpoint: str) -> None:
    if isinstance(result, dict) and result.get("success") is True:
        return
    message = result.get("message") if isinstance(result, dict) else result
    raise RuntimeError(f"sglang at {url}: /{endpoint} failed: {message}")


class SGLangEngine(ServerEngine):
    """`ServerEngine` speaking SGLang; build it with `SGLangEngine.launch(...)` or `.attach(...)`.

    Only the constructors differ from `ServerEngine`: the behaviour is the `SGLangDialect`.
    """

    @classmethod
    def launch(
        cls,
        model_dir: str | Path,
        *,
        dp: int = 1,
        tp: int = 1,
        cfg: SGLangServerConfig | None = None,
        initial_version: int = 0,
        **engine_kwargs: Any,
    ) -> SGLangEngine:
        """Start `dp` SGLang servers of `tp` GPUs each on `model_dir` and wait until all are healthy."""
        cfg = cfg or SGLangServerConfig()
        return launch_and_build(
            SGLANG, cfg, health_path="/health_generate", dp=dp, tp=tp,
            command=lambda python, port: sglang_command(python, str(model_dir), port=port, tp=tp, cfg=cfg),
            build=lambda servers: cls(SGLangDialect(), servers, initial_version=initial_version, **engine_kwargs),
        )  # fmt: skip

    @classmethod
    def attach(cls, urls: Sequence[str], *, initial_version: int = 0, **engine_kwargs: Any) -> SGLangEngine:
        """Drive SGLang servers already running at `urls`; `close()` leaves them running."""
        servers = attach_servers(urls, health_path="/health")
        return cls(SGLangDialect(), servers, initial_version=initial_version, **engine_kwargs)
