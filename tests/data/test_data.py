"""Data sources, SFT tokenization and loss masks, the max_length policy, resumable batch order."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from repo_paths import ROOT

from laden.data import GlobalBatchIterator, build_sft_samples, load_records, tokenize_sft_record

RECORDS = [
    {"prompt": "What is 1 + 2?", "completion": "3"},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
    {"prompt": "Name a color.", "completion": "Blue", "extra": 7},
]
ASSET_JSONL = ROOT / "laden" / "assets" / "sft_tiny.jsonl"


# ---------------------------------------------------------------- sources


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    return path


def test_load_jsonl_skips_blank_lines(tmp_path):
    assert load_records(str(_write_jsonl(tmp_path / "d.jsonl", RECORDS))) == RECORDS


def test_load_jsonl_bad_line_reports_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": oops}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{path.name}:2: invalid JSON"):
        load_records(str(path))


def test_load_jsonl_rejects_non_object_line(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n[1, 2]\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r":2: expected a JSON object"):
        load_records(str(path))


def test_load_json_list(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(RECORDS), encoding="utf-8")
    assert load_records(str(path)) == RECORDS


def test_load_json_must_be_a_list(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"train": RECORDS}), encoding="utf-8")
    with pytest.raises(ValueError, match="list of objects"):
        load_records(str(path))


def test_load_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(5)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert load_records(str(path)) == rows


def test_load_saved_dataset_and_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(4)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "single"))
    assert load_records(str(tmp_path / "single")) == rows

    split_dict = datasets.DatasetDict(
        train=datasets.Dataset.from_list(rows), test=datasets.Dataset.from_list(rows[:1])
    )
    split_dict.save_to_disk(str(tmp_path / "dict"))
    assert load_records(str(tmp_path / "dict")) == rows
    assert load_records(str(tmp_path / "dict"), split="test") == rows[:1]
    with pytest.raises(ValueError, match=r"no split 'valid'.*\['test', 'train'\]"):
        load_records(str(tmp_path / "dict"), split="valid")


def test_load_hf_name_through_load_dataset(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    data_dir = tmp_path / "local_repo"
    data_dir.mkdir()
    _write_jsonl(data_dir / "train.jsonl", RECORDS)
    # `load_dataset` resolves a local directory like a hub repository, without network.
    loaded = load_records(f"hf:{data_dir}", split="train")
    assert [{k: v for k, v in r.items() if v is not None} for r in loaded] == RECORDS


def test_load_errors_name_path_and_formats(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl.*\.parquet"):
        load_records(str(tmp_path / "missing.jsonl"))
    text = tmp_path / "d.txt"
    text.write_text("a,b\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"d\.txt.*'\.txt'.*\.jsonl"):
        load_records(str(text))
    pytest.importorskip("datasets")
    with pytest.raises(ValueError, match="not a saved dataset"):
        load_records(str(tmp_path))


# ---------------------------------------------------------------- tokenization and loss mask


def _masked_runs(tokenizer, input_ids: list[int], loss_mask: list[int]) -> list[str]:
    """Decode each contiguous run of loss tokens separately."""
    runs, current = [], []
    for token, bit in zip(input_ids, loss_mask):
        if bit:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def test_prompt_completion_mask_covers_completion_and_end_token(tiny_tokenizer):
    record = {"prompt": "What is 1 + 2?", "completion": "It is 3."}
    input_ids, loss_mask = tokenize_sft_record(record, tiny_tokenizer)
    assert len(input_ids) == len(loss_mask)
    messages = [
        {"role": "user", "content": record["prompt"]},
        {"role": "assistant", "content": record["completion"]},
    ]
    assert tiny_tokenizer.decode(input_ids) == tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert _masked_runs(tiny_tokenizer, input_ids, loss_mask) == ["It is 3.<|im_end|>"]


def test_multi_turn_mask_covers_each_assistant_turn_only(tiny_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "Now double it."},
        {"role": "assistant", "content": "It is 10."},
        {"role": "user", "content": "Thanks"},
    ]
    input_ids, loss_mask = tokenize_sft_record({"messages": messages}, tiny_tokenizer)
    assert tiny_tokenizer.decode(input_ids) == tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert _masked_runs(tiny_tokenizer, input_ids, loss_mask) == ["5<|im_end|>", "It is 10.<|im_end|>"]


def test_custom_keys_and_conversational_prompt(tiny_tokenizer):
    record = {"q": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], "a": "A"}
    input_ids, loss_mask = tokenize_sft_record(record, tiny_tokenizer, prompt_key="q", completion_key="a")
    assert _masked_runs(tiny_tokenizer, input_ids, loss_mask) == ["A<|im_end|>"]
    assert "<|im_start|>system\nS" in tiny_tokenizer.decode(input_ids)


def test_no_chat_template_falls_back_to_prompt_completion_eos(tiny_tokenizer):
    plain = copy.deepcopy(tiny_tokenizer)
    plain.chat_template = None
    input_ids, loss_mask = tokenize_sft_record({"prompt": "ab", "completion": "cd"}, plain)
    assert tiny_tokenizer.decode(input_ids) == "abcd" + plain.eos_token
    assert _masked_runs(plain, input_ids, loss_mask) == ["cd" + plain.eos_token]
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        tokenize_sft_record({"messages": [{"role": "user", "content": "x"}]}, plain)


def test_template_that_is_not_prefix_stable_is_rejected(tiny_tokenizer):
    unstable = copy.deepcopy(tiny_tokenizer)
    # Marks the last message, so a prefix renders differently from the whole conversation.
    unstable.chat_template = (
        "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    with pytest.raises(ValueError, match="not prefix-stable"):
        tokenize_sft_record({"prompt": "p", "completion": "c"}, unstable)


def test_record_without_known_keys_names_index_and_keys(tiny_tokenizer):
    records = [RECORDS[0], {"question": "q", "answer": "a"}]
    with pytest.raises(ValueError, match=r"row 2: .*its keys are \['answer', 'question'\]"):
        build_sft_samples(records, tiny_tokenizer, max_length=512)


# ---------------------------------------------------------------- length policy


def _length_records() -> list[dict]:
    records = [{"prompt": "q" * n, "completion": "a" * (n % 5 + 1)} for n in range(0, 40, 3)]
    records.append({"prompt": "x" * 60, "completion": "y"})  # truncation removes all its loss tokens
    records.append({"messages": [{"role": "user", "content": "no answer"}]})  # never any loss tokens
    return records


@pytest.mark.parametrize("policy", ["filter", "truncate"])
def test_length_policy_counts_every_record(tiny_tokenizer, policy):
    records = _length_records()
    max_length = 50
    full = [tokenize_sft_record(r, tiny_tokenizer) for r in records]
    samples, stats = build_sft_samples(records, tiny_tokenizer, max_length=max_length, length_policy=policy)

    # Reference: the policy applied record by record.
    expected = []
    num_filtered = num_truncated = num_no_loss = 0
    for ids, mask in full:
        if len(ids) > max_length and policy == "filter":
            num_filtered += 1
            continue
        cut = len(ids) > max_length
        ids, mask = ids[:max_length], mask[:max_length]
        if sum(mask[1:]) == 0:
            num_no_loss += 1
            continue
        num_truncated += cut
        expected.append((ids, mask))

    assert [tuple(s) for s in samples] == expected
    assert num_filtered + num_truncated > 0 and num_no_loss >= 1  # the case exercises the policy
    assert stats.num_records == len(records)
    assert (stats.num_kept, stats.num_filtered, stats.num_truncated, stats.num_no_loss_tokens) == (
        len(expected),
        num_filtered,
        num_truncated,
        num_no_loss,
    )
    assert stats.num_kept + stats.num_filtered + stats.num_no_loss_tokens == stats.num_records
    assert stats.max_num_tokens_raw == max(len(ids) for ids, _ in full)
    assert stats.max_num_tokens == max(len(ids) for ids, _ in expected) <= max_length
    assert stats.mean_num_tokens == pytest.approx(sum(len(ids) for ids, _ in expected) / len(expected))
    assert stats.num_loss_tokens == sum(sum(mask[1:]) for _, mask in expected)
    assert stats.to_dict()["num_filtered"] == num_filtered


def test_length_policy_argument_errors(tiny_tokenizer):
    with pytest.raises(ValueError, match="length_policy='drop'"):
        build_sft_samples(RECORDS, tiny_tokenizer, max_length=64, length_policy="drop")
    with pytest.raises(ValueError, match="max_length=0"):
        build_sft_samples(RECORDS, tiny_tokenizer, max_length=0)


def test_bundled_asset_tokenizes_completely(tiny_tokenizer):
    records = load_records(str(ASSET_JSONL))
    samples, stats = build_sft_samples(records, tiny_tokenizer, max_length=4096)
    assert stats.num_kept == stats.num_records == len(records) == len(samples)
    assert stats.num_filtered == stats.num_truncated == stats.num_no_loss_tokens == 0


# ---------------------------------------------------------------- global batch order and resume


def _take(iterator, num_steps: int) -> list[list[int]]:
    return [next(iterator) for _ in range(num_steps)]


@pytest.mark.parametrize("stop_after", [0, 3, 5, 7, 11])
def test_resumed_iterator_sees_the_same_batches(stop_after):
    def make():
        return GlobalBatchIterator(23, batch_size=4, shuffle=True, seed=13)

    uninterrupted = _take(make(), 15)

    first = make()
    before = _take(first, stop_after)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    resumed = make()
    resumed.load_state_dict(state)
    assert before + _take(resumed, 15 - stop_after) == uninterrupted


def test_epochs_are_distinct_seeded_permutations():
    it = GlobalBatchIterator(10, batch_size=3, shuffle=True, seed=0)
    assert len(it) == it.steps_per_epoch == 3
    epochs = [sum(list(it), []) for _ in range(3)]
    for order in epochs:
        assert len(order) == 9 and len(set(order)) == 9  # drop_last skips one sample per epoch
    assert epochs[0] != epochs[1]
    same_seed = GlobalBatchIterator(10, batch_size=3, shuffle=True, seed=0)
    assert [sum(list(same_seed), []) for _ in range(3)] == epochs
    other_seed = GlobalBatchIterator(10, batch_size=3, shuffle=True, seed=1)
    assert sum(list(other_seed), []) != epochs[0]


def test_unshuffled_keep_last_covers_all_samples():
    it = GlobalBatchIterator(10, batch_size=4, shuffle=False, seed=0, drop_last=False)
    assert list(it) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert it.state_dict()["epoch"] == 1 and len(it) == 3


def test_next_runs_across_epochs_and_iter_finishes_the_current_one():
    it = GlobalBatchIterator(9, batch_size=3, shuffle=True, seed=5)
    first = next(it)
    rest_of_epoch = list(it)
    assert len(rest_of_epoch) == 2 and it.epoch == 1
    assert sorted(sum([first, *rest_of_epoch], [])) == list(range(9))
    crossing = [next(it) for _ in range(3)]
    assert sum(crossing, []) == it.epoch_order(1) and it.epoch == 2 and it.step_in_epoch == 0


def test_iterator_rejects_mismatched_state_and_tiny_datasets():
    it = GlobalBatchIterator(20, batch_size=4, shuffle=True, seed=1)
    state = it.state_dict()
    with pytest.raises(ValueError, match="num_samples=20"):
        GlobalBatchIterator(19, batch_size=4, shuffle=True, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"train_dataset\.batch_size=8 is larger than the 5 samples"):
        GlobalBatchIterator(5, batch_size=8, shuffle=True, seed=1)


def test_fail_fast_puts_the_longest_samples_first_in_epoch_zero_only():
    from laden.data import longest_first

    lengths = [5, 9, 1, 9, 7, 3, 8, 2, 6, 4]
    first = longest_first(lengths, 3)
    assert first == [1, 3, 6]  # 9, 9 (lower index first), 8
    plain = GlobalBatchIterator(10, batch_size=3, shuffle=True, seed=5)
    fast = GlobalBatchIterator(10, batch_size=3, shuffle=True, seed=5, first=first)
    assert next(fast) == first
    rest = [i for i in plain.epoch_order(0) if i not in first]
    assert fast.epoch_order(0) == first + rest  # the others keep their shuffled order
    assert fast.epoch_order(1) == plain.epoch_order(1)
    resumed = GlobalBatchIterator(10, batch_size=3, shuffle=True, seed=5, first=first)
    resumed.load_state_dict(fast.state_dict())
    assert [next(resumed) for _ in range(4)] == [next(fast) for _ in range(4)]  # resumed == uninterrupted
