"""`evaluator.generate`'s disjointness check reads each dataset's prompts by its own `prompt_key`."""

from __future__ import annotations

import logging

from laden.sft.generate_eval import check_disjoint


def test_held_out_prompts_under_their_own_key_are_checked(caplog):
    train = [{"prompt": "What is 3 + 4?", "completion": "7"}]
    held_out = [{"question": "What is 3 + 4?", "answer": "7"}, {"question": "What is 1 + 1?", "answer": "2"}]
    with caplog.at_level(logging.WARNING, logger="laden"):
        check_disjoint(train, held_out, "prompt", "question")
    assert any("1 of 2 held-out prompts are also training prompts" in r.getMessage() for r in caplog.records)
