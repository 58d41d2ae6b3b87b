"""Agent workflows: an agent's `run` is the episode, the OpenAI-compatible endpoint records its calls.

AReaL's contract: an agent is any object with `async def run(self, data: dict, **extra_kwargs)`, where
`extra_kwargs` carry `base_url` and `api_key` (the endpoint's URL and this episode's session key), and it
returns its reward: a number (the reward of its last call) or `{completion id: reward}`. It talks to the
model through any OpenAI client (`openai.AsyncOpenAI(base_url=base_url, api_key=api_key)`, the OpenAI
Agents SDK, LangChain, CAMEL, ...) and never sees a token: the endpoint
(`laden.rollout.openai_server`) renders, generates and records every call as tokens with their
log-probs and weight versions.

`AgentWorkflow.arun_episode(engine, data)` runs the agent `n_samples` times on the row (concurrently; the
group its advantages are normalised in), assigns each run's reward to its calls, discounts it back over
them (`turn_discount`), and exports them as trajectories (`laden.rl.agent.export`: `individual` or
`concat`). A run that made no call yields nothing; a row none of whose runs made a call is rejected (None).
An agent run that raises (or returns something that is not a reward) rejects its row, as AReaL rejects a
failed episode: the first failure is logged with its traceback, later ones in one line, and `last_failure`
keeps the latest (the producer names it when a whole batch of rows is rejected).

`mode`: `inline` awaits `run` on the trainer's event loop (the agent must only await: blocking code
stalls generation; OPENAI_BASE_URL is set to the endpoint, and OPENAI_API_KEY to a key the endpoint
refuses with an explanation, since concurrent episodes share the process environment); `subproc` runs
each episode in a worker process whose environment holds its own OPENAI_BASE_URL and OPENAI_API_KEY
(`laden.rl.agent.subproc`).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from laden.rl.agent.export import ExportStyle, Sample, export_calls
from laden.rl.workflow import Trajectory
from laden.rollout.base import RolloutEngine, SamplingParams
from laden.rollout.openai_server import OpenAIEndpoint

log = logging.getLogger("laden.rl")

ENVIRONMENT_KEY = "laden-inline-environment"
"""OPENAI_API_KEY under `mode: inline`: refused by the endpoint with the reason (episodes share the environment)."""


@dataclass(kw_only=True, slots=True)
class AgentWorkflow:
    """Runs an agent per episode against the endpoint (see the module docstring)."""

    agent: Any
    """An object with `async def run(self, data, **extra_kwargs) -> float | dict[str, float]`."""
    tokenizer: Any
    """The policy's tokenizer: its chat template renders the messages, its tool-call format is parsed."""
    sampling: SamplingParams
    """Sampling for whatever a request leaves out (`gconfig`; `eval_gconfig` in evaluation)."""
    n_samples: int = 1
    """Agent runs per row (`n_trajs`, else `gconfig.n_samples`): one group."""
    export_style: ExportStyle = "individual"
    """`individual` or `concat` (`laden.rl.agent.export`)."""
    turn_discount: float = 1.0
    """`r[i] += turn_discount * r[i + 1]` over a run's calls, last to first."""
    chat_template_type: Literal["hf", "concat"] | None = None
    """The endpoint's prompt rendering; None: `concat` with `export_style: concat`, else `hf`."""
    max_total_tokens: int | None = None
    """The most tokens of one call, prompt plus completion (the engine's context applies too)."""
    tool_call_parser: str | None = None
    """The tool-call format (`laden.rollout.openai_server.tool_calls`); None / `auto`: from the chat template."""
    mode: Literal["inline", "subproc"] = "inline"
    """Where `run` executes (module docstring)."""
    subproc_max_workers: int = 4
    """Worker processes of `mode: subproc`."""
    dynamic_sampling: bool = False
    """Reject a row whose trajectories' rewards are all equal (no gradient in its group)."""
    evaluation: bool = False
    """One trajectory per run: its last call, with the run's final reward (held-out evaluation)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of `apply_chat_template` (a request's own `chat_template_kwargs` add to them)."""
    _endpoints: dict[int, asyncio.Task[OpenAIEndpoint]] = field(default_factory=dict, init=False, repr=False)
    _runner: Any = field(default=None, init=False, repr=False)
    failed_runs: int = field(default=0, init=False)
    """Agent runs that raised (or returned no usable reward) so far; each rejected its row."""
    last_failure: str | None = field(default=None, init=False)
    """The latest of those failures, as text (the producer names it when every row is rejected)."""

    def __post_init__(self) -> None:
        problems = []
        if not asyncio.iscoroutinefunction(getattr(self.agent, "run", None)):
            problems.append(
                f"agent {type(self.agent).__name__} has no `async def run(self, data, **extra_kwargs)`"
            )
        if not isinstance(self.n_samples, int) or self.n_samples < 1:
            problems.append(f"n_samples={self.n_samples!r} must be an integer >= 1")
        if self.export_style not in ("individual", "concat"):
            problems.append(f"export_style={self.export_style!r} must be 'individual' or 'concat'")
        if not 0 <= self.turn_discount <= 1:
            problems.append(f"turn_discount={self.turn_discount!r} must be in [0, 1]")
        if self.mode not in ("inline", "subproc"):
            problems.append(f"mode={self.mode!r} must be 'inline' or 'subproc'")
        if problems:
            raise ValueError("invalid AgentWorkflow settings: " + "; ".join(problems))

    async def arun_episode(self, engine: RolloutEngine, data: dict[str, Any]) -> list[Trajectory] | None:
        """The trajectories of `n_samples` runs of the agent on `data` (one group), or None to reject the row."""
        endpoint = await self.endpoint(engine)
        outcomes = await asyncio.gather(*(self._run(endpoint, data) for _ in range(self.n_samples)))
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if failures:
            self._reject(failures, data)
            return None
        runs = [o for o in outcomes if not isinstance(o, BaseException)]
        group_id = uuid.uuid4().hex[:12]
        numbered = [(run, sample) for run, samples in enumerate(runs) for sample in samples]
        trajs = [_trajectory(sample, group_id, i, run) for i, (run, sample) in enumerate(numbered)]
        if not trajs:
            log.warning(
                "none of the %d agent runs on a row called the endpoint; the row is rejected", self.n_samples
            )
            return None
        if self.dynamic_sampling and len({t.reward for t in trajs}) == 1:
            return None
        return trajs

    async def endpoint(self, engine: RolloutEngine) -> OpenAIEndpoint:
        """The endpoint in front of `engine`, started on first use on the running loop (once: the episodes of a
        batch start together and all wait for the same start)."""
        task = self._endpoints.get(id(engine))
        if task is None:
            task = self._endpoints[id(engine)] = asyncio.ensure_future(self._start_endpoint(engine))
        return await asyncio.shield(task)

    async def _start_endpoint(self, engine: RolloutEngine) -> OpenAIEndpoint:
        template = self.chat_template_type or ("concat" if self.export_style == "concat" else "hf")
        endpoint = OpenAIEndpoint(
            engine, self.tokenizer, sampling=self.sampling, chat_template_type=template,
            max_total_tokens=self.max_total_tokens, tool_call_parser=self.tool_call_parser,
            chat_template_kwargs=self.chat_template_kwargs,
        )  # fmt: skip
        await endpoint.start()
        if self.mode == "inline":
            os.environ["OPENAI_BASE_URL"] = endpoint.base_url
            os.environ["OPENAI_API_KEY"] = ENVIRONMENT_KEY
            endpoint.refused_keys[ENVIRONMENT_KEY] = (
                "this is the process-wide OPENAI_API_KEY: in rollout.agent.mode inline the episodes share the "
                "environment; pass the api_key that run() receives to the client, or set rollout.agent.mode: "
                "subproc for agent code that reads the environment"
            )
        return endpoint

    async def aclose(self) -> None:
        """Stop the endpoints and worker processes; idempotent."""
        for task in self._endpoints.values():
            endpoint = await task
            await endpoint.close()
        self._endpoints.clear()
        if self._runner is not None:
            self._runner.shutdown()
            self._runner = None

    async def _run(self, endpoint: OpenAIEndpoint, data: dict[str, Any]) -> list[Sample] | BaseException:
        """One agent run under its own session: its calls as samples, rewards assigned and discounted; or the
        exception the agent raised (or its unusable result's)."""
        session = endpoint.open_session()
        try:
            result = await self._call_agent(endpoint.base_url, session.key, data)
            calls = session.completed()
            if not calls:
                return []
            session.assign(result)
        except Exception as err:  # noqa: BLE001 - the agent's failure rejects its row, as in AReaL
            return err
        finally:
            endpoint.close_session(session.key)
        session.apply_reward_discount(self.turn_discount)
        if self.evaluation:
            return export_calls(calls[-1:], "individual")
        return export_calls(calls, self.export_style)

    def _reject(self, failures: list[BaseException], data: dict[str, Any]) -> None:
        """Log a row's failed runs (the first failure of the run with its traceback) and keep the last one."""
        err = failures[-1]
        self.failed_runs += len(failures)
        self.last_failure = f"agent {type(self.agent).__name__}.run raised {type(err).__name__}: {err}"
        message = (
            "%s (%d of %d runs on a row with keys %s); the row is rejected, as AReaL rejects a failed episode"
        )
        args = (self.last_failure, len(failures), self.n_samples, sorted(data))
        if self.failed_runs == len(failures):
            log.error(message, *args, exc_info=err)
        else:
            log.warning(message, *args)

    async def _call_agent(self, base_url: str, api_key: str, data: dict[str, Any]) -> Any:
        row = copy.deepcopy(data)  # each run may mutate its own copy (agents append to data["messages"])
        if self.mode == "inline":
            return await self.agent.run(row, base_url=base_url, api_key=api_key)
        if self._runner is None:
            from laden.rl.agent.subproc import SubprocRunner

            self._runner = SubprocRunner(self.agent, max_workers=self.subproc_max_workers)
        return await self._runner.run(row, base_url=base_url, api_key=api_key)


def _trajectory(sample: Sample, group_id: str, index: int, run: int) -> Trajectory:
    return Trajectory(
        prompt_ids=tuple(sample.prompt_ids), completion_ids=sample.completion_ids, logprobs=sample.logprobs,
        versions=sample.versions, reward=sample.reward, stop_reason=sample.stop_reason, group_id=group_id,
        sample_index=index, loss_mask=sample.loss_mask, info={"agent_run": run, "calls": sample.call_ids},
    )  # fmt: skip
