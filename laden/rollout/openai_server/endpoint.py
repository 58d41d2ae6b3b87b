"""An OpenAI-compatible endpoint in front of any `RolloutEngine`, recording every call per episode.

`OpenAIEndpoint(engine, tokenizer, sampling=...)` serves, on 127.0.0.1 and a free port, the subset of the
OpenAI API that agent code uses, non-streaming:

- `POST /v1/chat/completions`: `messages` rendered with the tokenizer's chat template (with `tools`), one
  completion, tool calls parsed in the model family's format (`laden.rollout.openai_server.tool_calls`);
- `POST /v1/completions`: a `prompt` string (encoded as the tokenizer encodes text, its BOS included) or
  a list of token ids;
- `GET /v1/models`: the one model.

Every request carries a session key as its API key (`Authorization: Bearer <key>`, what the `openai`
client sends for `api_key=`): `open_session()` makes one per episode, so concurrent episodes are told
apart, and a key that is not open is refused (401). Each answered call is recorded in its session
(`laden.rollout.openai_server.session`): prompt and completion token ids, per-token log-probs and
weight versions, exactly as the engine produced them; the agent's text never goes back through the
tokenizer. Sampling arguments the request leaves out come from `sampling` (the run's `gconfig`); a
completion's new tokens are capped so that prompt plus completion fit `max_total_tokens` (the engine's
context, or AReaL's `max_tokens_per_trajectory`, the smaller).

`chat_template_type` is `hf` or `concat` (`laden.rollout.openai_server.chat`): with `concat` a request
that continues an earlier call of its episode is prompted with that call's own tokens.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from typing import Any, Literal

from laden.rollout.base import GenerationRequest, GenerationResult, RolloutEngine, SamplingParams
from laden.rollout.openai_server.chat import check_messages, concat_prompt, render_chat, sampling_for
from laden.rollout.openai_server.http import HTTPError, JSONServer, Request, Response
from laden.rollout.openai_server.session import Interaction, Session
from laden.rollout.openai_server.tool_calls import parse_tool_calls, tool_call_format

log = logging.getLogger(__name__)

ChatTemplateType = Literal["hf", "concat"]
_SAMPLING = ("n", "stream", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stop")
"""The request arguments applied by `laden.rollout.openai_server.chat.sampling_for`, on both routes."""
_APPLIED = {
    "chat": {*_SAMPLING, "messages", "tools", "tool_choice", "chat_template_kwargs"},
    "completion": {*_SAMPLING, "prompt", "echo", "suffix"},
}
_NO_EFFECT = {"model", "user", "metadata", "store", "stream_options", "service_tier"}
"""Arguments that change nothing in a completion (one model is served; nothing is stored or streamed)."""


class OpenAIEndpoint:
    """The endpoint (module docstring); `await start()` it on the event loop the engine generates on."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        *,
        sampling: SamplingParams,
        chat_template_type: ChatTemplateType = "hf",
        max_total_tokens: int | None = None,
        tool_call_parser: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        model_name: str = "laden",
        host: str = "127.0.0.1",
    ) -> None:
        if chat_template_type not in ("hf", "concat"):
            raise ValueError(f"chat_template_type={chat_template_type!r} must be 'hf' or 'concat'")
        self.engine = engine
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.chat_template_type = chat_template_type
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.model_name = model_name
        self.tool_format = tool_call_format(tokenizer, tool_call_parser)
        limits = [n for n in (getattr(engine, "max_model_len", None), max_total_tokens) if n]
        self.max_total_tokens: int | None = min(limits) if limits else None
        self.eos_id: int | None = getattr(tokenizer, "eos_token_id", None)
        self.sessions: dict[str, Session] = {}
        self.refused_keys: dict[str, str] = {}
        """Keys refused with a reason of their own (a process-wide key that cannot tell episodes apart)."""
        self._server = JSONServer(self._handle, host=host)
        self._rids = itertools.count()
        self._said: set[str] = set()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> OpenAIEndpoint:
        await self._server.start()
        return self

    async def close(self) -> None:
        await self._server.close()

    @property
    def base_url(self) -> str:
        """`http://127.0.0.1:<port>/v1`: what an OpenAI client takes as `base_url`."""
        return f"http://{self._server.host}:{self._server.port}/v1"

    def open_session(self) -> Session:
        """A new episode's session; its `key` is the API key the episode's calls carry."""
        session = Session(f"laden-{uuid.uuid4().hex}")
        self.sessions[session.key] = session
        return session

    def close_session(self, key: str) -> Session:
        """End an episode: its key is refused from now on; its recorded calls are returned."""
        return self.sessions.pop(key)

    # ------------------------------------------------------------------ routes

    async def _handle(self, request: Request) -> Response:
        path = request.path.rstrip("/")
        routes = {"/v1/chat/completions": self._chat, "/v1/completions": self._completion}
        if path == "/v1/models" and request.method == "GET":
            return Response(200, {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                               "owned_by": "laden", "created": 0}]})  # fmt: skip
        if path not in routes:
            raise HTTPError(404, f"{request.method} {request.path} is not served; this endpoint serves "
                            "POST /v1/chat/completions, POST /v1/completions and GET /v1/models")  # fmt: skip
        if request.method != "POST":
            raise HTTPError(405, f"{request.path} takes POST")
        session = self._session(request)
        body = request.json()
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        self._say_ignored(body, "chat" if path == "/v1/chat/completions" else "completion")
        return await routes[path](session, body)

    def _session(self, request: Request) -> Session:
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("api-key", "")
        session = self.sessions.get(key)
        if key in self.refused_keys:
            raise HTTPError(401, self.refused_keys[key], kind="authentication_error")
        if session is None:
            raise HTTPError(401, (
                f"API key {key[:24]!r} is not an open episode's session key; pass the api_key (and base_url) "
                "that the agent's run() receives to the OpenAI client, e.g. AsyncOpenAI(base_url=base_url, "
                "api_key=api_key)"
            ), kind="authentication_error")  # fmt: skip
        return session

    async def _chat(self, session: Session, body: dict[str, Any]) -> Response:
        messages = check_messages(body.get("messages"))
        tools = body.get("tools") or None
        choice = body.get("tool_choice")
        parse = tools is not None and choice != "none"
        if tools is not None and choice not in (None, "auto", "none"):
            self._say_once("tool_choice", "tool_choice=%r is not enforced by laden's endpoint: the model may answer "
                           "without a tool call (its calls are parsed as with tool_choice=auto)", choice)  # fmt: skip
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise HTTPError(
                400, f"chat_template_kwargs={kwargs!r:.100} must be an object of template arguments"
            )
        if parse and self.tool_format is None:
            self._say_once("tools", "tools were given, but the chat template of %s has no tool-call format laden "
                           "knows (<tool_call>{json}</tool_call>): tool calls are not parsed, the model's text comes "
                           "back as content; set rollout.agent.tool_call_parser to name the format",
                           getattr(self.tokenizer, "name_or_path", "the model"))  # fmt: skip
        parent = session.find_parent(messages)
        full = render_chat(
            self.tokenizer,
            messages,
            tools,
            {**self.chat_template_kwargs, **kwargs},
        )
        prompt, concat = full, False
        if self.chat_template_type == "concat" and parent is not None:
            glued = concat_prompt(_parent_tokens(parent, self._stop_ids(), self.eos_id), full, self.eos_id)
            if glued is None:
                self._say_once(
                    "concat",
                    "the chat template does not end turns with the end-of-sequence token, so a "
                    "continued conversation cannot be extended as tokens; such calls are rendered whole",
                )
            else:
                prompt, concat = glued, True
        if self.chat_template_type == "concat" and body.get("stop") is not None:
            self._say_once("stop", "stop strings are ignored with chat_template_type concat (as AReaL does)")
            body = {k: v for k, v in body.items() if k != "stop"}
        call = Interaction(id=f"chatcmpl-{uuid.uuid4().hex[:29]}", api="chat", prompt_ids=prompt,
                           messages=messages, parent=parent, concat=concat)  # fmt: skip
        result = await self._generate(session, call, body)
        text = self.tokenizer.decode(_without_stop(result, self._stop_ids()), skip_special_tokens=False)
        content, calls = parse_tool_calls(text, self.tool_format) if parse else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        call.output_message = message
        finish = "tool_calls" if calls and result.stop_reason == "stop" else result.stop_reason
        return Response(200, {
            "id": call.id, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": _usage(call),
        })  # fmt: skip

    async def _completion(self, session: Session, body: dict[str, Any]) -> Response:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            ids = list(prompt)
        else:
            raise HTTPError(400, "'prompt' must be a non-empty string or a non-empty list of token ids (one prompt "
                            "per request)")  # fmt: skip
        if body.get("echo") or body.get("suffix"):
            raise HTTPError(400, "echo and suffix are not supported; leave them out")
        call = Interaction(id=f"cmpl-{uuid.uuid4().hex[:29]}", api="completion", prompt_ids=ids)
        result = await self._generate(session, call, body)
        text = self.tokenizer.decode(list(result.output_ids), skip_special_tokens=False)
        return Response(200, {
            "id": call.id, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
            "choices": [{"index": 0, "text": text, "finish_reason": result.stop_reason, "logprobs": None}],
            "usage": _usage(call),
        })  # fmt: skip

    # ------------------------------------------------------------------ generation

    async def _generate(self, session: Session, call: Interaction, body: dict[str, Any]) -> GenerationResult:
        """Generate `call`'s completion and record it in `session` (recorded on arrival: arrival order)."""
        sampling = sampling_for(body, self.sampling, prompt_len=len(call.prompt_ids),
                                max_total_tokens=self.max_total_tokens, eos_id=self.eos_id)  # fmt: skip
        request = GenerationRequest(rid=f"{session.key}-{next(self._rids)}", input_ids=tuple(call.prompt_ids),
                                    sampling=sampling)  # fmt: skip
        session.add(call)
        results = [r async for r in self.engine.generate([request])]
        if len(results) != 1:
            raise RuntimeError(f"the rollout engine returned {len(results)} completions for one request")
        (result,) = results
        if result.stop_reason == "abort":
            raise HTTPError(
                500, "the rollout engine aborted the generation (it is shutting down)", kind="server_error"
            )
        call.completion_ids = list(result.output_ids)
        call.logprobs = list(result.output_logprobs)
        call.versions = list(result.output_versions)
        call.stop_reason = result.stop_reason
        return result

    def _stop_ids(self) -> set[int]:
        ids = set(self.sampling.stop_token_ids)
        if self.eos_id is not None:
            ids.add(self.eos_id)
        return ids

    def _say_ignored(self, body: dict[str, Any], api: str) -> None:
        """Say once which arguments of a request are not applied (`frequency_penalty`, `seed`, `logprobs`, ...;
        a value that asks for nothing, None, 0 or false, is not counted)."""
        ignored = sorted(k for k, v in body.items() if k not in _APPLIED[api] | _NO_EFFECT
                         and v not in (None, 0, 0.0, False))  # fmt: skip
        if ignored:
            self._say_once(f"ignored:{','.join(ignored)}", "request arguments %s are not applied by laden's endpoint "
                           "(the completion is sampled without them)", ignored)  # fmt: skip

    def _say_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning(message, *args)


def _without_stop(result: GenerationResult, stop_ids: set[int]) -> list[int]:
    """The output without its stop token (kept in the tokens, left out of the text)."""
    ids = list(result.output_ids)
    if result.stop_reason == "stop" and ids and ids[-1] in stop_ids:
        ids.pop()
    return ids


def _parent_tokens(parent: Interaction, stop_ids: set[int], eos_id: int | None) -> list[int]:
    """The parent's prompt and completion without its stop token, then the end-of-sequence token (AReaL's
    concat rule: a completion cut by length gets one too, as part of the next prompt)."""
    out = [*parent.prompt_ids, *parent.completion_ids]
    if parent.stop_reason == "stop" and parent.completion_ids and out[-1] in stop_ids:
        out.pop()
    return [*out, eos_id] if eos_id is not None else out


def _usage(call: Interaction) -> dict[str, int]:
    p, c = len(call.prompt_ids), len(call.completion_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
