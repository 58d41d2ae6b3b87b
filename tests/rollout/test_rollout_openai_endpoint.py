"""The OpenAI-compatible endpoint (`laden.rollout.openai_server`) driven by the real `openai` client: chat and
completions over the native engine, tool calls parsed in the Hermes/Qwen format, one recording per session key."""

from __future__ import annotations

import asyncio
import copy
import json
import logging

import openai
import pytest
from agent_fixtures import QWEN_TOOL_TEMPLATE, ScriptedEngine
from fake_servers import FakeVLLM, logprob_at, token_at

from laden.rollout import SamplingParams
from laden.rollout.base import GenerationRequest
from laden.rollout.native import NativeEngine
from laden.rollout.openai_server import Interaction, OpenAIEndpoint, Session
from laden.rollout.openai_server.tool_calls import parse_tool_calls, tool_call_format
from laden.rollout.servers import VLLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_new_tokens=6, greedy=True)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))  # the timeout only guards against a hang


def chat_ids(tokenizer, messages, **kwargs):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def tool_tokenizer(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = QWEN_TOOL_TEMPLATE
    return tok


def test_chat_and_completions_through_the_openai_client_record_the_engine_tokens(tiny_model, tiny_tokenizer):
    messages = [{"role": "user", "content": "say a"}]
    prompt = tuple(chat_ids(tiny_tokenizer, messages))

    async def main():
        engine = NativeEngine(tiny_model, tiny_tokenizer, max_model_len=128, max_concurrent=4)
        endpoint = await OpenAIEndpoint(engine, tiny_tokenizer, sampling=GREEDY).start()
        session = endpoint.open_session()
        client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0)
        try:
            chat = await client.chat.completions.create(
                model="m", messages=messages, max_tokens=5, temperature=0
            )
            text = await client.completions.create(model="m", prompt="1+1=", max_tokens=4, temperature=0)
            by_ids = await client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=3, temperature=0)
            greedy = SamplingParams(
                max_new_tokens=5, greedy=True, stop_token_ids=(tiny_tokenizer.eos_token_id,)
            )
            (direct,) = [
                r
                async for r in engine.generate(
                    [GenerationRequest(rid="d", input_ids=prompt, sampling=greedy)]
                )
            ]
            return session, chat, text, by_ids, direct
        finally:
            await client.close()
            await endpoint.close()
            await engine.close()

    session, chat, text, by_ids, direct = run(main())
    chat_call, text_call, ids_call = session.interactions.values()
    assert [chat_call.id, text_call.id, ids_call.id] == [chat.id, text.id, by_ids.id]
    assert chat_call.prompt_ids == list(prompt)
    assert chat_call.completion_ids == direct.output_ids  # the engine's own tokens and log-probs
    assert chat_call.logprobs == pytest.approx(direct.output_logprobs)
    assert chat_call.versions == [0] * len(direct.output_ids)
    shown = direct.output_ids[:-1] if direct.stop_reason == "stop" else direct.output_ids
    assert chat.choices[0].message.content == tiny_tokenizer.decode(shown)
    assert chat.choices[0].finish_reason == direct.stop_reason
    assert chat.usage.prompt_tokens == len(prompt) and chat.usage.completion_tokens == len(direct.output_ids)
    assert (
        text_call.prompt_ids == tiny_tokenizer("1+1=")["input_ids"]
        and 1 <= len(text_call.completion_ids) <= 4
    )
    assert text.choices[0].text == tiny_tokenizer.decode(text_call.completion_ids)
    assert ids_call.prompt_ids == [5, 6, 7] and len(ids_call.logprobs) == len(ids_call.completion_ids) <= 3


def test_a_tool_call_is_parsed_and_the_tool_result_renders_into_the_next_prompt(tool_tokenizer):
    tools = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]  # fmt: skip
    answer = 'Sum:<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    eos = tool_tokenizer.eos_token_id
    engine = ScriptedEngine([[*encode(tool_tokenizer, answer), eos], [*encode(tool_tokenizer, "3"), eos]])
    question = [{"role": "user", "content": "1+2?"}]

    async def main():
        endpoint = await OpenAIEndpoint(engine, tool_tokenizer, sampling=GREEDY).start()
        session = endpoint.open_session()
        client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0)
        try:
            first = await client.chat.completions.create(model="m", messages=question, tools=tools)
            call = first.choices[0].message.tool_calls[0]
            history = [*question, first.choices[0].message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "3"}]  # fmt: skip
            second = await client.chat.completions.create(model="m", messages=history, tools=tools)
            return session, first, second, history
        finally:
            await client.close()
            await endpoint.close()

    session, first, second, history = run(main())
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content == "Sum:"
    (call,) = message.tool_calls
    assert call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 1, "b": 2}
    assert second.choices[0].message.content == "3" and second.choices[0].message.tool_calls is None
    one, two = session.interactions.values()
    assert one.prompt_ids == chat_ids(tool_tokenizer, question, tools=tools)
    expected = [*question, {"role": "assistant", "content": "Sum:", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}, history[-1]]  # fmt: skip
    assert two.prompt_ids == chat_ids(tool_tokenizer, expected, tools=tools)
    assert "<tool_response>\n3\n</tool_response>" in tool_tokenizer.decode(two.prompt_ids)
    assert two.parent is one and one.parent is None


def test_a_template_without_a_tool_format_returns_the_text_and_says_so_once(tiny_tokenizer, caplog):
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    eos = tiny_tokenizer.eos_token_id
    engine = ScriptedEngine([[*encode(tiny_tokenizer, text), eos]] * 2)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    assert tool_call_format(tiny_tokenizer) is None

    async def main():
        endpoint = await OpenAIEndpoint(engine, tiny_tokenizer, sampling=GREEDY).start()
        client = openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.open_session().key, max_retries=0
        )
        try:
            return [await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                         tools=tools) for _ in range(2)]  # fmt: skip
        finally:
            await client.close()
            await endpoint.close()

    with caplog.at_level(logging.WARNING, logger="laden.rollout.openai_server.endpoint"):
        answers = run(main())
    assert [a.choices[0].message.content for a in answers] == [text, text]
    assert all(a.choices[0].message.tool_calls is None for a in answers)
    assert sum("no tool-call format" in r.getMessage() for r in caplog.records) == 1


def test_the_hermes_parser_keeps_text_it_cannot_read_as_content():
    assert parse_tool_calls("no calls", "hermes") == ("no calls", [])
    assert parse_tool_calls("<tool_call>{not json}</tool_call>", "hermes") == (
        "<tool_call>{not json}</tool_call>",
        [],
    )
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": "é"}}</tool_call>'
                                      '<tool_call>{"name": "g"}</tool_call>', "hermes")  # fmt: skip
    assert content is None and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"x": "é"}, {}]
    with pytest.raises(ValueError, match="tool_call_parser='pythonic'"):
        tool_call_format(None, "pythonic")


def test_concurrent_sessions_are_recorded_apart(tiny_model, tiny_tokenizer):
    async def episode(endpoint, session, word):
        client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0)
        try:
            for turn in range(2):
                await client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": f"{word} {turn}"}],
                    max_tokens=4,
                    temperature=1.0,
                )
        finally:
            await client.close()

    async def main():
        engine = NativeEngine(tiny_model, tiny_tokenizer, max_model_len=128, max_concurrent=8)
        endpoint = await OpenAIEndpoint(engine, tiny_tokenizer, sampling=GREEDY).start()
        sessions = [endpoint.open_session() for _ in range(2)]
        try:
            await asyncio.gather(*(episode(endpoint, s, w) for s, w in zip(sessions, ("left", "right"))))
            for s in sessions:
                endpoint.close_session(s.key)
            with pytest.raises(openai.AuthenticationError, match="not an open episode's session key"):
                await episode(endpoint, sessions[0], "late")
        finally:
            await endpoint.close()
            await engine.close()
        return sessions

    left, right = run(main())
    for session, word in ((left, "left"), (right, "right")):
        calls = list(session.interactions.values())
        assert [c.prompt_ids for c in calls] == [
            chat_ids(tiny_tokenizer, [{"role": "user", "content": f"{word} {t}"}]) for t in range(2)
        ]
        assert all(c.completion_ids and len(c.logprobs) == len(c.completion_ids) for c in calls)


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"n": 2}, 400, "one completion per request"),
        ({"stream": True}, 400, "stream=true is not supported"),
        ({"max_tokens": 0}, 400, "max_tokens=0 must be a positive integer"),
        ({"max_tokens": 2, "max_completion_tokens": 2}, 400, "not both"),
        ({"max_completion_tokens": 0}, 400, "max_completion_tokens=0 must be a positive integer"),
        ({"top_k": 2.5}, 400, r"top_k=2.5 must be a whole number of tokens \(0 or -1 = off\)"),
        ({"messages": []}, 400, "non-empty list"),
        ({"temperature": -0.5}, 400, r"temperature=-0.5 must be >= 0; use 0 for greedy decoding"),
        ({"top_p": 0}, 400, r"top_p=0.0 must be in \(0, 1\] \(1 = off\); use temperature=0"),
        ({"top_p": 1.5}, 400, r"top_p=1.5 must be in \(0, 1\]"),
        ({"stop": 5}, 400, "stop=5 must be a string or a list of strings"),
        ({"stop": ["a", 1]}, 400, r"stop=\['a', 1\] must be a string or a list of strings"),
        ({"chat_template_kwargs": ["x"]}, 400, r"chat_template_kwargs=\['x'\] must be an object"),
    ],
)
def test_requests_the_endpoint_cannot_serve_say_why(tiny_tokenizer, body, status, message):
    engine = ScriptedEngine([[3]])

    async def main():
        endpoint = await OpenAIEndpoint(engine, tiny_tokenizer, sampling=GREEDY, max_total_tokens=64).start()
        client = openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.open_session().key, max_retries=0
        )
        try:
            args = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            extra = {k: v for k, v in body.items() if k not in args}
            args.update({k: v for k, v in body.items() if k in args})
            await client.chat.completions.create(**args, extra_body=extra)
        finally:
            await client.close()
            await endpoint.close()

    with pytest.raises(openai.APIStatusError, match=message) as err:
        run(main())
    assert err.value.status_code == status


def test_a_prompt_that_leaves_no_room_is_refused(tiny_tokenizer):
    async def main():
        endpoint = await OpenAIEndpoint(
            ScriptedEngine([]), tiny_tokenizer, sampling=GREEDY, max_total_tokens=8
        ).start()
        client = openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.open_session().key, max_retries=0
        )
        try:
            await client.completions.create(model="m", prompt="a long prompt")
        finally:
            await client.close()
            await endpoint.close()

    with pytest.raises(openai.BadRequestError, match="leaving no room for a completion within 8 tokens"):
        run(main())


def test_the_endpoint_serves_a_vllm_server_backend_too(tiny_tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    prompt = chat_ids(tiny_tokenizer, messages)

    async def main(url):
        engine = VLLMEngine.attach([url], initial_version=3)
        endpoint = await OpenAIEndpoint(engine, tiny_tokenizer, sampling=GREEDY).start()
        session = endpoint.open_session()
        client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0)
        try:
            await client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0.5)
            return session
        finally:
            await client.close()
            await endpoint.close()
            await engine.close()

    with FakeVLLM() as fake:
        session = run(main(fake.url))
    (call,) = session.interactions.values()
    assert call.prompt_ids == prompt
    assert call.completion_ids == [token_at(prompt, j) for j in range(4)]  # the server's tokens, as generated
    assert call.logprobs == pytest.approx([logprob_at(0, len(prompt) + j) for j in range(4)])
    assert call.versions == [3, 3, 3, 3] and call.stop_reason == "length"


def test_arguments_the_endpoint_does_not_apply_are_named_once(tiny_tokenizer, caplog):
    """Every argument of a request either acts or is said (once) not to: penalties, seeds, vLLM's extras, and a
    tool_choice that would force a call."""
    eos = tiny_tokenizer.eos_token_id
    engine = ScriptedEngine([[5, eos]] * 3)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

    async def main():
        endpoint = await OpenAIEndpoint(engine, tiny_tokenizer, sampling=GREEDY).start()
        client = openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.open_session().key, max_retries=0
        )
        try:
            for _ in range(2):
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice="required",
                    seed=3, frequency_penalty=0.0, user="u", extra_body={"repetition_penalty": 1.1, "top_k": 2},
                )  # fmt: skip
            await client.completions.create(model="m", prompt="x", max_tokens=2, best_of=1, temperature=0)
        finally:
            await client.close()
            await endpoint.close()

    with caplog.at_level(logging.WARNING, logger="laden.rollout.openai_server.endpoint"):
        run(main())
    said = [r.getMessage() for r in caplog.records]
    assert sum("['repetition_penalty', 'seed'] are not applied" in m for m in said) == 1, said
    assert sum("tool_choice='required' is not enforced" in m for m in said) == 1, said
    assert sum("['best_of'] are not applied" in m for m in said) == 1, said  # best_of=1 asks for something
    assert engine.requests[0].sampling.top_k == 2  # an extra the endpoint applies is not named
    assert not any("frequency_penalty" in m or "'user'" in m or "'model'" in m for m in said)


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), {"id": float("-inf")}])
def test_a_reward_that_is_not_finite_is_refused(reward):
    session = Session("k")
    call = Interaction(id="id", api="completion", prompt_ids=[1], completion_ids=[2], stop_reason="stop")
    session.add(call)
    with pytest.raises(ValueError, match=r"is (nan|inf|-inf); a reward must be a finite number"):
        session.assign(reward)
    assert call.reward is None
    session.assign(True)  # a bool is AReaL's reward of a correct episode
    assert call.reward == 1.0


@pytest.mark.parametrize(
    ("length", "message"),
    [("abc", "is not a byte count"), ("-5", "is not a byte count"), ("\u00b2", "is not a byte count"),
     ("1\r\nX-Long: " + "x" * 70_000, "over 64 KiB")],
)  # fmt: skip
def test_a_request_with_a_bad_head_gets_a_400_answer(tiny_tokenizer, length, message):
    async def main():
        endpoint = await OpenAIEndpoint(ScriptedEngine([]), tiny_tokenizer, sampling=GREEDY).start()
        try:
            host, port = endpoint.base_url.split("//")[1].split("/")[0].split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                f"POST /v1/completions HTTP/1.1\r\nContent-Length: {length}\r\n\r\n".encode("latin-1")
            )
            await writer.drain()
            answer = await reader.read()
            writer.close()
            return answer.decode("latin-1")
        finally:
            await endpoint.close()

    answer = run(main())
    assert answer.startswith("HTTP/1.1 400 Bad Request") and message in answer, answer[:200]
