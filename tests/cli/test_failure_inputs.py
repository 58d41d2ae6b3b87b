"""Inputs that used to fail late or as tracebacks fail at start-up, naming the file, the row or
field, the problem and the fix: bad data rows (found before step 1, by `path:line`), damaged
model directories, a `--config` that is a directory. And the weight group's store listens on
`master_addr` only, not on every interface.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import shutil
import socket
import sys
import threading
from pathlib import Path

import pytest
import torch
from repo_paths import ROOT

from laden.config import ConfigError, load_config
from laden.data import build_sft_samples, check_prompt_rows, check_sft_rows, load_records
from laden.data.rows import prompt_row_problem, sft_row_problem
from laden.model.hf.loading import load_causal_lm, skeleton_causal_lm
from laden.weights import WeightUpdateMeta, init_weight_group
from laden.weights.group import listening_store

pytestmark = pytest.mark.usefixtures("one_thread")

BAD_LINE = 53
NUM_ROWS = 60


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _rows_with_one_bad(bad: object) -> list:
    """`NUM_ROWS` good SFT/RL rows with `bad` on line `BAD_LINE`."""
    rows: list = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(NUM_ROWS)]
    rows[BAD_LINE - 1] = bad
    return rows


# ---------------------------------------------------------------- bad data rows, found at start-up


def test_sft_bad_row_stops_at_start_up_naming_its_line_the_count_and_the_fix(tmp_path, tiny_tokenizer):
    path = _jsonl(tmp_path / "train.jsonl", _rows_with_one_bad({"prompt": "q", "completion": 7}))
    with pytest.raises(ValueError) as info:
        build_sft_samples(load_records(str(path)), tiny_tokenizer, max_length=64)
    message = str(info.value)
    assert message.startswith(f"{path}:{BAD_LINE}: 'completion' is a int")
    assert f"1 of {NUM_ROWS} rows of {path} cannot be used" in message
    assert "train_dataset.on_bad_row: skip" in message


def test_sft_skip_leaves_the_bad_row_out_and_counts_it(tmp_path, tiny_tokenizer, caplog):
    path = _jsonl(tmp_path / "train.jsonl", _rows_with_one_bad({"prompt": "q", "completion": ""}))
    caplog.set_level(logging.WARNING, logger="laden.data")
    samples, stats = build_sft_samples(
        load_records(str(path)), tiny_tokenizer, max_length=64, on_bad_row="skip", field="valid_dataset"
    )
    assert len(samples) == stats.num_kept == NUM_ROWS - 1
    assert stats.num_records == NUM_ROWS and stats.to_dict()["num_skipped_bad_rows"] == 1
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"{path}:{BAD_LINE}: 'completion' is empty" in warning and "valid_dataset.on_bad_row" in warning


def test_rl_prompt_rows_stop_or_skip_and_kept_rows_keep_their_lines(tmp_path):
    rows = _rows_with_one_bad({"messages": [{"role": "user"}], "answer": "1"})
    records = load_records(str(_jsonl(tmp_path / "rl.jsonl", rows)))
    with pytest.raises(
        ValueError, match=rf"rl.jsonl:{BAD_LINE}: messages\[0\] has no 'content'.*1 of 60 rows"
    ):
        check_prompt_rows(records, on_bad_row="stop", field="train_dataset")
    kept, skipped = check_prompt_rows(records, on_bad_row="skip", field="train_dataset")
    assert (len(kept), skipped) == (NUM_ROWS - 1, 1)
    assert kept.where(BAD_LINE - 1).endswith(f"rl.jsonl:{BAD_LINE + 1}")  # the row after the bad one


def test_unreadable_jsonl_lines_are_bad_rows_too(tmp_path):
    path = tmp_path / "train.jsonl"
    lines = [json.dumps({"prompt": f"q{i}", "completion": "a"}) for i in range(NUM_ROWS)]
    lines[BAD_LINE - 1] = '{"prompt": "q", "completion": '
    lines[BAD_LINE] = "[1, 2]"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(
        ValueError, match=rf":{BAD_LINE}: invalid JSON .*2 of 60 rows .*also .*:{BAD_LINE + 1}"
    ):
        load_records(str(path))
    records = load_records(str(path), on_bad_row="skip")
    kept, skipped = check_sft_rows(records, on_bad_row="skip")
    assert (len(kept), skipped) == (NUM_ROWS - 2, 2)


def test_parquet_and_json_sources_name_the_row(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(9)]
    rows[6]["prompt"] = None  # a null cell: no prompt
    parquet = tmp_path / "train.parquet"
    pq.write_table(pyarrow.Table.from_pylist(rows), parquet)
    with pytest.raises(ValueError, match=rf"{parquet} row 7: the row has neither 'messages' nor both"):
        check_sft_rows(load_records(str(parquet)))
    as_json = tmp_path / "train.json"
    as_json.write_text(json.dumps([{"prompt": "q"}, "not a row", {"prompt": 3}]), encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{as_json} row 2: element 1 is a str"):
        load_records(str(as_json))
    records = load_records(str(as_json), on_bad_row="skip")
    with pytest.raises(ValueError, match=rf"{as_json} row 3: 'prompt' is a int"):
        check_prompt_rows(records, on_bad_row="stop")  # numbered as in the file, after one was left out


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ([1, 2], "the row is a list, not an object"),
        ({"messages": "hi"}, "'messages' is a str, expected a list"),
        ({"messages": []}, "'messages' is an empty list"),
        ({"messages": ["hi"]}, r"messages\[0\] is a str"),
        ({"messages": [{"role": 1, "content": "x"}]}, r"messages\[0\]\['role'\] is a int"),
        ({"messages": [{"role": "user", "content": 5}]}, r"messages\[0\]\['content'\] is a int"),
        ({"prompt": "q"}, "no 'completion'"),
        ({"prompt": "q", "completion": []}, "'completion' is an empty list"),
        ({"prompt": {"text": "q"}, "completion": "a"}, "'prompt' is a dict"),
    ],
)
def test_sft_row_problems(row, problem):
    found = sft_row_problem(row)
    assert found is not None and re.search(problem, found), found


def test_prompt_row_problems():
    assert prompt_row_problem({"prompt": "q", "answer": 1}) is None
    assert prompt_row_problem({"messages": [{"role": "user", "content": "q"}]}) is None
    assert "no 'messages' or 'prompt' field" in (prompt_row_problem({"question": "q"}) or "")
    assert "'prompt' is an empty string" in (prompt_row_problem({"prompt": " "}) or "")
    assert "no 'query' field" in (prompt_row_problem({"prompt": "q"}, prompt_key="query") or "")


# ---------------------------------------------------------------- damaged model directories


@pytest.fixture(scope="module")
def saved_model_dir(tmp_path_factory):
    """The tiny Qwen3 with weights (`model.safetensors`), saved once."""
    from transformers import AutoConfig, AutoModelForCausalLM

    src = ROOT / "laden" / "assets" / "tiny"
    out = tmp_path_factory.mktemp("saved") / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).save_pretrained(out)
    return out


def _copy(directory: Path, tmp_path: Path, **config_changes) -> Path:
    out = tmp_path / "model"
    shutil.copytree(directory, out)
    config = json.loads((out / "config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"num_hidden_layers": -2}, "num_hidden_layers=-2 must be a positive integer"),
        ({"vocab_size": 0, "intermediate_size": "128"}, "vocab_size=0 .*; intermediate_size='128'"),
        ({"num_key_value_heads": 3}, "num_attention_heads=4 is not divisible by num_key_value_heads=3"),
        ({"head_dim": None, "hidden_size": 66}, "hidden_size=66 is not divisible by num_attention_heads=4"),
        ({"hidden_act": "no_such_act"}, r"transformers cannot build a model from it \(KeyError"),
        ({"num_hidden_layers": 3}, "transformers cannot read it .*layer_types"),
    ],
)
def test_a_config_that_cannot_build_a_model_names_the_field_and_the_fix(tmp_path, changes, problem):
    directory = _copy(ROOT / "laden" / "assets" / "tiny", tmp_path, **changes)
    for load in (
        lambda: load_causal_lm(str(directory), dtype=torch.float32, init_from_config=True),
        lambda: skeleton_causal_lm(str(directory), dtype=torch.float32),
    ):
        with pytest.raises(ValueError, match=problem) as info:
            load()
        assert str(directory / "config.json") in str(info.value)
        assert "restore the model's original config.json" in str(info.value)


def test_a_bad_config_beside_weights_is_reported_before_loading(saved_model_dir, tmp_path):
    directory = _copy(saved_model_dir, tmp_path, num_hidden_layers=-2)
    with pytest.raises(ValueError, match=r"config.json: num_hidden_layers=-2 must be a positive integer"):
        load_causal_lm(str(directory), dtype=torch.float32)


@pytest.mark.parametrize("damage", ["truncated", "not_safetensors", "missing_shard"])
def test_an_unreadable_weight_file_names_the_file_and_the_fix(saved_model_dir, tmp_path, damage):
    directory = _copy(saved_model_dir, tmp_path)
    weights = directory / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        expected = "model.safetensors: SafetensorError: .*file not fully covered"
    elif damage == "not_safetensors":
        weights.write_bytes(b"<html>rate limited</html>")
        expected = "model.safetensors: SafetensorError"
    else:
        index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
        expected = "model.safetensors.index.json names model-00002-of-00002.safetensors, which is missing"
    with pytest.raises(ValueError, match=expected) as info:
        load_causal_lm(str(directory), dtype=torch.float32)
    assert str(directory) in str(info.value) and "download it again" in str(info.value)


# ---------------------------------------------------------------- --config naming a directory


def test_a_config_path_that_is_a_directory_says_so(tmp_path):
    (tmp_path / "run.yaml").write_text("seed: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    (error,) = info.value.errors
    assert f"{str(tmp_path)!r} is a directory" in error and "does not exist" not in error
    assert f"pass the YAML file inside it (e.g. {tmp_path / 'run.yaml'})" in error
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        ConfigError, match=r"is a directory; pass the YAML file inside it \(e\.g\. .*/empty/config\.yaml\)"
    ):
        load_config(empty)


# ---------------------------------------------------------------- the weight group's store


def _listening_addresses(port: int) -> set[str]:
    """The local addresses of the sockets listening on TCP `port` (`/proc/net/tcp*`)."""
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            if family == socket.AF_INET:
                pytest.skip(f"{table} cannot be read here: no way to see what a socket is bound to")
            continue
        for line in lines:
            fields = line.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if int(port_hex, 16) != port or fields[3] != "0A":  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            if sys.byteorder == "little":  # the kernel prints each 32-bit word in host order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add(socket.inet_ntop(family, raw))
    return found


def test_the_weight_groups_store_listens_on_master_addr_only():
    meta = WeightUpdateMeta.from_fsdp_xccl(backend="gloo", timeout_s=30)
    peer: dict = {}
    thread = threading.Thread(target=lambda: peer.update(group=init_weight_group(meta, rank=1)))
    thread.start()
    group = init_weight_group(meta, rank=0)
    thread.join(timeout=30)
    try:
        assert _listening_addresses(meta.master_port) == {"127.0.0.1"}
    finally:
        group.close()
        peer["group"].close()


def test_a_store_port_that_is_taken_names_the_fix():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port} .*master_port None"):
            listening_store("127.0.0.1", port, 2, is_master=True, timeout=datetime.timedelta(seconds=5))
