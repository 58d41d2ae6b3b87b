"""`prompt_overlap` reads each dataset's prompt by its own key."""

from __future__ import annotations

from laden.data.overlap import prompt_overlap


def test_each_dataset_is_read_by_its_own_prompt_key():
    train = [{"prompt": "What is 3 + 4?"}, {"prompt": "What is 5 + 6?"}]
    held_out = [{"question": "what is 3+4"}, {"question": "What is 7 + 8?"}, {"prompt": "What is 5 + 6?"}]
    overlap = prompt_overlap(train, held_out, prompt_key="prompt", held_out_key="question")
    assert (overlap.num_held_out, overlap.num_shared, overlap.num_exact) == (
        2,
        1,
        0,
    )  # the third row has no question
    same = prompt_overlap(
        train, held_out, prompt_key="prompt"
    )  # one key for both: the held-out rows' `prompt`
    assert (same.num_held_out, same.num_shared, same.num_exact) == (1, 1, 1)
