"""Tree training (AReaL's `enable_tree_training`) is refused; what laden's packing costs instead, in tokens,
on an agent's multi-turn batch exported both ways (`laden.rl.agent.export`)."""

from __future__ import annotations

import pytest
from areal_copies import AREAL, PATHS

from laden.config import ConfigError, load_config
from laden.rl.agent.export import export_calls
from laden.rl.batches import repeated_prefix_tokens
from laden.rollout.openai_server.session import Interaction


def test_the_trie_counts_shared_prefixes_once():
    assert repeated_prefix_tokens([[1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [6]]) == (11, 6)
    assert repeated_prefix_tokens([]) == (0, 0)


def _conversation(seed: int, *, prompt: list[int], calls: int, answer: int, tool: int) -> list[Interaction]:
    """`calls` calls of one agent episode, each prompted with the previous call's tokens plus a tool output."""
    out: list[Interaction] = []
    context = list(prompt)
    for k in range(calls):
        start = 10_000 * (seed + 1) + 1_000 * k  # tokens no other conversation or call has
        completion = list(range(start, start + answer))
        call = Interaction(id=f"c{seed}-{k}", api="chat", prompt_ids=list(context), parent=out[-1] if out else None,
                           concat=True, completion_ids=completion, logprobs=[0.0] * answer, versions=[0] * answer,
                           stop_reason="stop", output_message={"role": "assistant"}, reward=1.0)  # fmt: skip
        out.append(call)
        context = [*context, *completion, *range(start + 500, start + 500 + tool)]
    return out


def test_what_packing_costs_against_a_tree_on_a_multi_turn_batch():
    """A GRPO group of 8 agent conversations (AReaL's tau2 examples sample 8) on one 2000-token prompt, 5
    calls of 200 tokens with 300-token tool outputs between: the numbers the refusal quotes."""
    prompt = list(range(1, 2001))
    episodes = [_conversation(i, prompt=prompt, calls=5, answer=200, tool=300) for i in range(8)]
    costs = {}
    for style in ("individual", "concat"):
        samples = [s for calls in episodes for s in export_calls(calls, style)]
        costs[style] = repeated_prefix_tokens([[*s.prompt_ids, *s.completion_ids] for s in samples])
    assert costs == {"individual": (128_000, 19_600), "concat": (33_600, 19_600)}
    # concat trains every model turn once, as the tree would: 8 x 5 x 200 loss tokens in both
    concat = [s for calls in episodes for s in export_calls(calls, "concat")]
    assert sum(sum(s.loss_mask) for s in concat) == 8_000


@pytest.mark.parametrize("section", ["actor", "critic"])
def test_tree_training_is_refused_with_what_laden_does_instead(section):
    overrides = [*PATHS, f"+{section}.enable_tree_training=true"]
    if section == "critic":
        overrides.append("+critic={path: ''}")
    with pytest.raises(ConfigError) as err:
        load_config(AREAL / "gsm8k_grpo.yaml", overrides, job="rl")
    (line,) = [e for e in err.value.errors if e.startswith(f"{section}.enable_tree_training=true")]
    assert "tree training" in line and "not implemented" in line
    assert (
        "export_style: concat" in line and "128000 tokens individual, 33600 concat, 19600 as a tree" in line
    )
