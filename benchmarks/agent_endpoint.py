"""What laden's OpenAI-compatible endpoint (`laden.rollout.openai_server`) adds to an agent's call.

The median wall time of a chat completion through the real `openai` client and the endpoint, against the
same prompt sent to the native engine directly (tiny model, CPU, one thread, at most 4 new tokens; the two
alternate, so a busy machine slows both alike). Run from the repository root:
`PYTHONPATH=$PWD python benchmarks/agent_endpoint.py`.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from laden.rollout import SamplingParams
from laden.rollout.base import GenerationRequest
from laden.rollout.native import NativeEngine
from laden.rollout.openai_server import OpenAIEndpoint

CALLS = 200
MESSAGES = [{"role": "user", "content": "say a"}]


def tiny_policy():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny import write_tiny_model_dir

    directory = write_tiny_model_dir(tempfile.mkdtemp())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(directory)


async def measure(model, tokenizer) -> tuple[list[float], list[float]]:
    engine = NativeEngine(model, tokenizer, max_model_len=128, max_concurrent=8)
    sampling = SamplingParams(max_new_tokens=4, greedy=True, stop_token_ids=(tokenizer.eos_token_id,))
    endpoint = await OpenAIEndpoint(engine, tokenizer, sampling=sampling).start()
    client = openai.AsyncOpenAI(
        base_url=endpoint.base_url, api_key=endpoint.open_session().key, max_retries=0
    )
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    direct, served = [], []
    try:
        for i in range(10 + CALLS):  # the first 10 of each warm up
            t0 = time.perf_counter()
            [
                r
                async for r in engine.generate(
                    [GenerationRequest(rid=f"d{i}", input_ids=prompt, sampling=sampling)]
                )
            ]
            t1 = time.perf_counter()
            await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)
            t2 = time.perf_counter()
            if i >= 10:
                direct.append(t1 - t0)
                served.append(t2 - t1)
    finally:
        await client.close()
        await endpoint.close()
        await engine.close()
    return direct, served


def main() -> None:
    torch.set_num_threads(1)
    direct, served = asyncio.run(measure(*tiny_policy()))
    a, b = statistics.median(direct) * 1e3, statistics.median(served) * 1e3
    print(f"{CALLS} calls of at most 4 new tokens: engine.generate median {a:.2f} ms, through the endpoint "
          f"(openai client, chat completions) median {b:.2f} ms: {b - a:.2f} ms per call")  # fmt: skip


if __name__ == "__main__":
    main()
