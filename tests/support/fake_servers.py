"""In-process fake vLLM and SGLang servers: their HTTP endpoints, request checks and canned answers.

The request and response JSON shapes follow vLLM 0.32's `entrypoints/openai/completion/protocol.py`,
`entrypoints/rl/online/api_router.py` and `entrypoints/serve/dev/*`, and SGLang's
`srt/entrypoints/http_server.py` and `srt/managers/io_struct.py`. Generation is a deterministic
formula of the prompt, the position and the loaded "weights" (a counter bumped by every weight
load), so a test can say which weights produced a token from its log-prob.

A fake can block a completion after `block_after` tokens until `/pause` arrives, which makes
a pause land mid-generation without any timing: the blocked request then comes back aborted with
its partial tokens (vLLM's and SGLang's `abort` mode), or, with `hold_on_pause`, is held until
`/resume` and then generated under the weights loaded meanwhile (what both servers do with a
request that arrives while paused).

Run as a program (`python fake_servers.py vllm --port N`) it serves the fake vLLM API until
SIGTERM: the stand-in server process of the launch tests.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from repo_paths import SUPPORT

WAIT_S = 20.0
"""Deadline of every wait inside a fake (a test that forgets a /pause fails instead of hanging)."""


def token_at(prompt: list[int], j: int, index: int = 0) -> int:
    """The fake's j-th output token for `prompt` (sample `index`)."""
    return 20 + (sum(prompt) + 7 * j + 5 * index) % 30


def logprob_at(weights: int, position: int) -> float:
    """The fake's log-prob of the token at absolute `position` under weights number `weights`."""
    return -0.1 * (1 + weights) - 0.001 * position


@dataclass
class Call:
    """One request a fake received."""

    method: str
    path: str
    query: dict[str, list[str]]
    body: Any


@dataclass
class Output:
    token_ids: list[int]
    logprobs: list[float]
    finish: str
    matched: int | None = None


@dataclass
class FakeCore:
    """Server state and the generation formula shared by both fakes."""

    weights: int = 0
    block_after: int | None = None
    hold_on_pause: bool = False
    abort_everything: bool = False
    calls: list[Call] = field(default_factory=list)
    blocked: int = 0
    paused: threading.Event = field(default_factory=threading.Event)
    running: threading.Event = field(default_factory=threading.Event)
    lock: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self.running.set()

    def generate(
        self, prompt: list[int], *, n: int, max_tokens: int, stop_ids: list[int], min_tokens: int = 0
    ) -> list[Output]:
        """n outputs for `prompt`, honouring blocking, pause and hold (see the module docstring)."""
        if not self.running.wait(WAIT_S):
            raise RuntimeError("fake: paused request never resumed")
        if self.abort_everything:
            return [Output([], [], "abort") for _ in range(n)]
        block_after = self.block_after
        if block_after is not None and max_tokens > block_after:
            with self.lock:
                self.blocked += 1
                self.lock.notify_all()
            if not self.paused.wait(WAIT_S):
                raise RuntimeError("fake: blocked request was never paused")
            if not self.hold_on_pause:
                return [self._run(prompt, i, block_after, stop_ids, min_tokens, "abort") for i in range(n)]
            if not self.running.wait(WAIT_S):
                raise RuntimeError("fake: held request never resumed")
        return [self._run(prompt, i, max_tokens, stop_ids, min_tokens, "length") for i in range(n)]

    def _run(
        self, prompt: list[int], index: int, count: int, stop_ids: list[int], min_tokens: int, end: str
    ) -> Output:
        out = Output([], [], end)
        for j in range(count):
            tok = token_at(prompt, j, index)
            out.token_ids.append(tok)
            out.logprobs.append(logprob_at(self.weights, len(prompt) + j))
            if tok in stop_ids and j + 1 >= min_tokens:
                out.finish, out.matched = "stop", tok
                break
        return out

    def pause(self) -> None:
        self.block_after = None
        self.running.clear()
        self.paused.set()

    def resume(self) -> None:
        self.paused.clear()
        self.running.set()

    def wait_blocked(self, count: int) -> None:
        """Wait (deadline `WAIT_S`) until `count` requests are blocked."""
        with self.lock:
            if not self.lock.wait_for(lambda: self.blocked >= count, timeout=WAIT_S):
                raise AssertionError(f"fake: {self.blocked} requests blocked, expected {count}")


class _Listener(ThreadingHTTPServer):
    # The standard library's default backlog of 5 resets connections when more requests arrive at once
    # (a held-out evaluation sends every prompt together); real servers listen with a backlog of 2048.
    request_queue_size = 256


class FakeServer:
    """A threaded HTTP server on 127.0.0.1:<free port> dispatching to `route(call) -> (status, json)`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.core = FakeCore()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._serve()

            def do_POST(self) -> None:
                self._serve()

            def _serve(self) -> None:
                parsed = urllib.parse.urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                call = Call(self.command, parsed.path, urllib.parse.parse_qs(parsed.query), body)
                fake.core.calls.append(call)
                try:
                    status, answer = fake.route(call)
                except Exception as err:  # surfaces in the test as an HTTP 500 with the reason
                    status, answer = 500, {"error": f"fake: {type(err).__name__}: {err}"}
                data = b"" if answer is None else json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = _Listener((host, port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def __enter__(self) -> FakeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.core.resume()
        self.core.paused.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def paths(self, *, skip: tuple[str, ...] = ("/health", "/health_generate", "/v1/models")) -> list[str]:
        """Paths received, in order, leaving out health and model-list probes."""
        return [c.path for c in self.core.calls if c.path not in skip]

    def bodies(self, path: str) -> list[Any]:
        """Bodies of every request to `path`."""
        return [c.body for c in self.core.calls if c.path == path]

    def route(self, call: Call) -> tuple[int, Any]:
        raise NotImplementedError


COMPLETION_KEYS = {"prompt", "n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "stop"}


class FakeVLLM(FakeServer):
    """vLLM 0.32 with `VLLM_SERVER_DEV_MODE=1` (set `dev_mode=False` for a plain server)."""

    model = "fake-model"
    dev_mode = True
    dev_paths = {
        "/pause",
        "/resume",
        "/abort_requests",
        "/collective_rpc",
        "/update_weight_version",
        "/reset_prefix_cache",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/sleep",
        "/wake_up",
        "/release_kv_cache_memory",
    }

    def route(self, call: Call) -> tuple[int, Any]:
        if call.path == "/health":
            return 200, None
        if call.path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        if call.path == "/v1/completions":
            return self._completions(call.body)
        if call.path in self.dev_paths:
            if not self.dev_mode:
                return 404, {"detail": "Not Found"}
            return self._dev(call)
        return 404, {"detail": "Not Found"}

    def _completions(self, body: dict[str, Any]) -> tuple[int, Any]:
        missing = COMPLETION_KEYS - body.keys()
        assert not missing, f"completion request lacks {missing}"
        assert body["logprobs"] == 0 and body["return_token_ids"] is True, body
        assert isinstance(body["prompt"], list) and all(isinstance(t, int) for t in body["prompt"]), body
        if body["temperature"] == 0 and body["n"] > 1:
            return 400, {"error": {"message": "n must be 1 when using greedy sampling", "code": 400}}
        outputs = self.core.generate(
            body["prompt"],
            n=body["n"],
            max_tokens=body["max_tokens"],
            stop_ids=body["stop_token_ids"],
            min_tokens=body["min_tokens"],
        )
        choices = [
            {
                "index": i,
                "text": "",
                "logprobs": {
                    "text_offset": list(range(len(o.token_ids))),
                    "token_logprobs": o.logprobs,
                    "tokens": [f"token_id:{t}" for t in o.token_ids],
                    "top_logprobs": [{f"token_id:{t}": lp} for t, lp in zip(o.token_ids, o.logprobs)],
                },
                "finish_reason": o.finish,
                "stop_reason": o.matched,
                "token_ids": o.token_ids,
                "prompt_token_ids": body["prompt"],
            }
            for i, o in enumerate(outputs)
        ]
        return 200, {"id": "cmpl-fake", "object": "text_completion", "model": self.model, "choices": choices}

    def _dev(self, call: Call) -> tuple[int, Any]:
        path, body = call.path, call.body
        if path == "/pause":
            self.core.pause()
            return 200, {"status": "paused"}
        if path in ("/resume", "/wake_up"):
            self.core.resume()  # vLLM's wake_up resumes the scheduler once fully awake
            return 200, {"status": "resumed"} if path == "/resume" else {"status": "awake", "tags": None}
        if path == "/collective_rpc":
            assert body["method"] == "reload_weights", body
            self.core.weights += 1
            return 200, {"results": [None]}
        if path == "/abort_requests":
            self.core.paused.set()  # blocked requests come back aborted; the server keeps running
            return 200, {"status": "aborted", "aborted": len(body.get("request_ids") or [])}
        if path == "/update_weight_version":
            return 200, {"success": True, "new_version": body["new_version"]}
        if path == "/reset_prefix_cache":
            return 200, {"success": True}
        if path == "/update_weights":
            assert set(body["update_info"]) == {"names", "dtype_names", "shapes"}, body
            self.core.weights += 1
            return 200, {"message": "Weights updated"}
        if path == "/sleep":
            self.core.pause()
            return 200, {"status": "sleeping", "level": int(call.query["level"][0])}
        return 200, {"message": "ok"}


class FakeSGLang(FakeServer):
    """SGLang's native API (`/generate` and the RL control endpoints).

    Broadcast updates: `/init_weights_update_group` with backend `gloo` joins the trainer's group as
    SGLang's `init_custom_process_group` does (a `tcp://` rendezvous, the store prefixed by the group
    name, `_new_process_group_helper`), and `/update_weights_from_distributed` receives the named tensors
    as SGLang's model runner does (one `broadcast` from rank 0 per tensor, in the order named), keeping
    the latest of each in `received`. Backend `nccl` (no GPU here) is only recorded.
    """

    fail_update = False
    fail_broadcast_after = None
    """Refuse `/update_weights_from_distributed` (before receiving anything) from this call on; None: never."""
    fail_version = None
    """Refuse the first bucket of this weight version (e.g. `"2"`), once; None: never."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host, port)
        self.groups: dict[str, Any] = {}
        self.received: dict[str, Any] = {}
        self.received_versions: list[str] = []
        """The weight version of each bucket received, in order (`received_from`: its group's name)."""
        self.received_from: list[str] = []

    def route(self, call: Call) -> tuple[int, Any]:
        path, body = call.path, call.body
        if path in ("/health", "/health_generate"):
            return 200, None
        if path == "/generate":
            return self._generate(body)
        if path == "/pause_generation":
            assert body == {"mode": "abort"}, body
            self.core.pause()
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if path == "/continue_generation":
            self.core.resume()
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if path == "/update_weights_from_distributed" and self._refuses_broadcast():
            return 400, {"success": False, "message": "fake: refused the broadcast", "num_paused_requests": 0}
        if path == "/update_weights_from_distributed" and body["group_name"] in self.groups:
            self._receive(body)
        if path in ("/update_weights_from_disk", "/update_weights_from_distributed"):
            if self.fail_update:
                return 400, {
                    "success": False,
                    "message": "fake: shapes do not match",
                    "num_paused_requests": 0,
                }
            self.core.weights += 1
            return 200, {
                "success": True,
                "message": "Succeeded to update model weights.",
                "num_paused_requests": 0,
            }
        if (
            path == "/fake_received"
        ):  # not SGLang's: what the broadcasts brought, for a test in another process
            return 200, {
                name: {"dtype": str(t.dtype).removeprefix("torch."), "values": t.float().tolist()}
                for name, t in self.received.items()
            }
        if path == "/init_weights_update_group":
            if body["backend"] == "gloo":
                self._join(body)
            return 200, {"success": True, "message": "Succeeded to initialize custom process group."}
        if path in (
            "/release_memory_occupation",
            "/resume_memory_occupation",
            "/abort_request",
            "/flush_cache",
        ):
            return 200, None
        return 404, {"detail": "Not Found"}

    def _refuses_broadcast(self) -> bool:
        after, bodies = self.fail_broadcast_after, self.bodies("/update_weights_from_distributed")
        if self.fail_version is not None and bodies[-1]["weight_version"] == self.fail_version:
            self.fail_version = None  # once
            return True
        return after is not None and len(bodies) > after

    def _join(self, body: dict[str, Any]) -> None:
        import datetime

        from torch.distributed.distributed_c10d import (
            PrefixStore,
            _new_process_group_helper,
            _world,
            rendezvous,
        )

        timeout = datetime.timedelta(seconds=WAIT_S)
        url = f"tcp://{body['master_address']}:{body['master_port']}"
        store, rank, world_size = next(
            rendezvous(url, body["rank_offset"], body["world_size"], timeout=timeout)
        )
        store.set_timeout(timeout)
        name = body["group_name"]
        pg, _ = _new_process_group_helper(
            world_size, rank, [], body["backend"], PrefixStore(name, store), group_name=name, timeout=timeout
        )
        _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        self.groups[name] = pg

    def _receive(self, body: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        group = self.groups[body["group_name"]]
        tensors = [
            torch.empty(shape, dtype=getattr(torch, dtype))
            for dtype, shape in zip(body["dtypes"], body["shapes"])
        ]
        handles = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
        for handle in handles:
            handle.wait()
        self.received.update(zip(body["names"], tensors))
        self.received_versions.append(body["weight_version"])
        self.received_from.append(body["group_name"])

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        super().__exit__(*exc)
        for group in self.groups.values():  # the group names of this process are free again
            dist.destroy_process_group(group)
        self.groups.clear()

    def _generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        assert body["return_logprob"] is True, body
        params = body["sampling_params"]
        batch = body["input_ids"]
        assert isinstance(batch, list) and all(isinstance(p, list) for p in batch), (
            "expected a batch of prompts"
        )
        assert params["top_k"] == -1 or params["top_k"] >= 1, params
        assert all(p == batch[0] for p in batch), "laden sends n copies of one prompt"
        prompt = batch[0]
        outputs = self.core.generate(
            prompt,
            n=len(batch),
            max_tokens=params["max_new_tokens"],
            stop_ids=params["stop_token_ids"],
            min_tokens=params["min_new_tokens"],
        )
        answers = []
        for i, o in enumerate(outputs):
            finish: dict[str, Any] = {"type": o.finish}
            if o.finish == "stop":
                finish["matched"] = o.matched
            elif o.finish == "length":
                finish["length"] = len(o.token_ids)
            else:
                finish["message"] = "Abort before prefill"
            answers.append(
                {
                    "text": "",
                    "output_ids": o.token_ids,
                    "meta_info": {
                        "id": f"fake-{i}",
                        "finish_reason": finish,
                        "prompt_tokens": len(prompt),
                        "completion_tokens": len(o.token_ids),
                        "output_token_logprobs": [[lp, t, None] for t, lp in zip(o.token_ids, o.logprobs)],
                        "weight_version": "default",
                    },
                }
            )
        return 200, answers


def stub_vllm_path(root: Path) -> str:
    """A stand-in `vllm` package under `root` whose `vllm.entrypoints.openai.api_server` is this fake vLLM:
    the `PYTHONPATH` that finds it (and this module), for the launch tests' server processes."""
    stub = root / "vllm" / "entrypoints" / "openai"
    stub.mkdir(parents=True)
    for pkg in (stub.parent.parent, stub.parent, stub):
        (pkg / "__init__.py").write_text("")
    (stub / "api_server.py").write_text("from fake_servers import main\nmain()\n")
    return os.pathsep.join([str(root), str(SUPPORT)])


def main() -> None:
    """Serve the fake vLLM API (or with `--fake-kind sglang` the fake SGLang's) on --host/--port until killed
    (stand-in for `vllm ... api_server`, or a server process of its own)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fake-kind", choices=("vllm", "sglang"), default="vllm")
    args, _ = parser.parse_known_args()
    server = (FakeSGLang if args.fake_kind == "sglang" else FakeVLLM)(args.host, args.port)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
