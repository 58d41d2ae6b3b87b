"""`rollout.agent.mode: subproc`: each agent run in a worker process with its own OpenAI environment.

Agent code that blocks (a synchronous OpenAI client, a tool that sleeps) or that reads OPENAI_BASE_URL and
OPENAI_API_KEY from the environment cannot share the trainer's event loop and environment with concurrent
episodes. Here each run goes to a `spawn`ed worker process (`max_workers` of them, AReaL's
`subproc_max_workers`), which sets both variables to the episode's endpoint and session key and runs
`asyncio.run(agent.run(data, base_url=..., api_key=...))`; the trainer's loop keeps serving the endpoint
meanwhile. What it costs: the agent (pickled once) and each row and result cross a process boundary, each
worker imports the agent's module once, and runs beyond `max_workers` wait for a free worker.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
from concurrent.futures import ProcessPoolExecutor
from typing import Any


class SubprocRunner:
    """Runs `agent.run` in worker processes (see the module docstring)."""

    def __init__(self, agent: Any, *, max_workers: int) -> None:
        try:
            self._agent = pickle.dumps(agent)
        except Exception as err:  # noqa: BLE001 - any pickling failure means the same fix
            raise ValueError(
                f"rollout.agent.mode subproc sends the agent to worker processes, but {type(agent).__name__} cannot "
                f"be pickled ({type(err).__name__}: {err}); build clients and sessions inside run(), or use "
                "rollout.agent.mode: inline"
            ) from err
        self._pool = ProcessPoolExecutor(
            max_workers=max_workers, mp_context=multiprocessing.get_context("spawn")
        )

    async def run(self, data: dict[str, Any], *, base_url: str, api_key: str) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, _run_in_worker, self._agent, data, base_url, api_key)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _run_in_worker(agent: bytes, data: dict[str, Any], base_url: str, api_key: str) -> Any:
    os.environ["OPENAI_BASE_URL"] = base_url  # this worker runs one episode at a time
    os.environ["OPENAI_API_KEY"] = api_key
    return asyncio.run(pickle.loads(agent).run(data, base_url=base_url, api_key=api_key))
