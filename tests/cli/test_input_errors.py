"""Input errors name the input: data files, model directories, the run directory, the hub, Ctrl-C.

Each case is one mistake a user makes, and the test asserts the error names the file or field,
the value and the fix, and that the CLI turns it into one line and an exit status.
"""

from __future__ import annotations

import errno
import http.server
import json
import os
import shutil
import socket
import threading
from pathlib import Path

import pytest
from repo_paths import ROOT

from laden.cli import EXIT_INTERRUPTED, EXIT_OS_ERROR, EXIT_USAGE, main
from laden.config import ConfigError, load_config
from laden.config.validate import unwritable_reason
from laden.data import build_sft_samples, load_records
from laden.data import sources as data_sources
from laden.model.hf.loading import load_tokenizer

TINY_MODEL = ROOT / "laden" / "assets" / "tiny"
NO_ASSISTANT = [
    {"messages": [{"role": "user", "content": "Hi"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]},
]


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _config_errors(overrides: list[str], *, job: str = "any") -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides, job=job)  # type: ignore[arg-type]
    return info.value.errors


# ---------------------------------------------------------------- 1. no records vs no loss tokens


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_jsonl_says_it_has_no_records(tmp_path, content):
    path = tmp_path / "train.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError) as info:
        load_records(str(path))
    message = str(info.value)
    assert str(path) in message and "has no records" in message and "empty" in message
    assert "loss tokens" not in message


def test_empty_json_list_says_it_has_no_records(tmp_path):
    path = tmp_path / "train.json"
    path.write_text("[]", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{path.name}' has no records"):
        load_records(str(path))


def test_records_without_an_assistant_turn_say_no_loss_tokens(tmp_path, tiny_tokenizer):
    path = _jsonl(tmp_path / "chat.jsonl", NO_ASSISTANT)
    with pytest.raises(ValueError) as info:
        build_sft_samples(load_records(str(path)), tiny_tokenizer, max_length=256)
    message = str(info.value)
    assert str(path) in message
    assert "of its 2 record(s), 2 have no loss tokens" in message
    assert "no assistant turn in 'messages'" in message and "'role': 'assistant'" in message
    assert "no records" not in message


def test_custom_keys_are_named(tmp_path, tiny_tokenizer):
    path = _jsonl(tmp_path / "chat.jsonl", [{"conv": NO_ASSISTANT[0]["messages"]}])
    with pytest.raises(ValueError, match="no assistant turn in 'conv'"):
        build_sft_samples(load_records(str(path)), tiny_tokenizer, max_length=256, messages_key="conv")


@pytest.mark.parametrize(("records", "expected"), [([], "has no records"), (NO_ASSISTANT, "no loss tokens")])
def test_cli_sft_says_which_before_the_trainers_length_policy_check(tmp_path, capsys, records, expected):
    path = _jsonl(tmp_path / "train.jsonl", records)
    code = main(
        ["sft", "--no-progress", f"cluster.fileroot={tmp_path / 'runs'}", f"train_dataset.path={path}"]
    )
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    assert err.startswith("laden: ") and str(path) in err and expected in err
    assert "samples remain after the length policy" not in err and "Traceback" not in err


def test_every_record_filtered_says_max_length(tiny_tokenizer):
    records = [{"prompt": "a" * 80, "completion": "b"}]
    with pytest.raises(ValueError, match=r"1 are longer than max_length=32 .* length_policy: truncate"):
        build_sft_samples(records, tiny_tokenizer, max_length=32)
    with pytest.raises(ValueError, match=r"1 lose every loss token when truncated to max_length=32"):
        build_sft_samples(records, tiny_tokenizer, max_length=32, length_policy="truncate")


def test_bad_record_error_names_the_file(tmp_path, tiny_tokenizer):
    path = _jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(ValueError, match=rf"{path.name}:1: the row has neither 'messages'"):
        build_sft_samples(load_records(str(path)), tiny_tokenizer, max_length=64)


# ---------------------------------------------------------------- 2. model directory without a tokenizer


def test_model_directory_without_tokenizer_files_is_refused(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(TINY_MODEL / "config.json", model / "config.json")
    with pytest.raises(ValueError) as info:
        load_tokenizer(str(model))
    message = str(info.value)
    assert f"actor.path={str(model)!r}: it has no tokenizer files" in message
    assert "tokenizer.json" in message and "tokenizer_config.json" in message and "vocab" in message
    assert "save_pretrained" in message


def test_tokenizer_with_only_special_tokens_is_refused(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<eos>": 1}, unk_token="<unk>"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(tmp_path / "model")
    with pytest.raises(
        ValueError, match=r"its tokenizer files hold no vocabulary \(2 token\(s\), all special\)"
    ):
        load_tokenizer(str(tmp_path / "model"))


def test_cli_sft_without_tokenizer_files_is_one_line(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(TINY_MODEL / "config.json", model / "config.json")
    code = main(["sft", "--no-progress", f"cluster.fileroot={tmp_path / 'runs'}", f"actor.path={model}"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    assert err.startswith("laden: actor.path=") and "no tokenizer files" in err and "Traceback" not in err


# ---------------------------------------------------------------- 3. a non-UTF-8 byte


def test_non_utf8_byte_in_jsonl_names_file_line_and_offset(tmp_path):
    lines = [b'{"prompt": "a", "completion": "b"}\n', b"\n", b'{"prompt": "caf\xe9", "completion": "c"}\n']
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b"".join(lines))
    offset = len(lines[0]) + len(lines[1]) + lines[2].index(b"\xe9")
    with pytest.raises(ValueError) as info:
        load_records(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}:3: byte 0xe9 at byte offset {offset} (column 16) is not valid UTF-8")
    assert "iconv" in message


def test_non_utf8_byte_in_json_names_file_line_and_offset(tmp_path):
    raw = b'[{"prompt": "a",\n  "completion": "\xff"}]'
    path = tmp_path / "latin1.json"
    path.write_bytes(raw)
    offset = raw.index(b"\xff")
    with pytest.raises(ValueError, match=rf"{path.name}:2: byte 0xff at byte offset {offset} "):
        load_records(str(path))


def test_multibyte_characters_before_a_bad_byte_count_as_one_column(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes('{"prompt": "éé'.encode() + b'\xc3(", "completion": "b"}\n')  # é: 2 bytes
    with pytest.raises(ValueError, match=r":1: byte 0xc3 at byte offset 16 \(column 15\)"):
        load_records(str(path))


# ---------------------------------------------------------------- 4. cluster.fileroot


@pytest.mark.parametrize(
    ("root", "reason"),
    [
        ("/dev/null/x", "does not exist and its nearest existing ancestor '/dev/null' is not a directory"),
        ("/proc/x", "does not exist and its nearest existing ancestor '/proc' is on a virtual file system"),
    ],
)
def test_fileroot_that_cannot_be_created_is_a_config_error(root, reason):
    if not Path(root).parent.exists():
        pytest.skip(f"{Path(root).parent} does not exist on this system")
    (error,) = _config_errors([f"cluster.fileroot={root}"])
    assert error.startswith(f"cluster.fileroot={root!r} {reason}")
    assert "set cluster.fileroot to a writable directory" in error


def test_fileroot_that_is_a_file_is_a_config_error(tmp_path):
    file = tmp_path / "file"
    file.write_text("x")
    (error,) = _config_errors([f"cluster.fileroot={file}"])
    assert f"cluster.fileroot={str(file)!r} is not a directory" in error
    (error,) = _config_errors([f"cluster.fileroot={file / 'sub'}"])
    assert f"its nearest existing ancestor {str(file)!r} is not a directory" in error


def test_missing_fileroot_under_a_writable_directory_passes_and_is_not_created(tmp_path):
    root = tmp_path / "a" / "b"
    cfg = load_config(None, [f"cluster.fileroot={root}"])
    assert cfg.cluster.fileroot == str(root)
    assert not (tmp_path / "a").exists()


def test_unwritable_ancestor_is_named(tmp_path, monkeypatch):
    # Root passes os.access on any mode, so the permission bit is simulated rather than chmod-ed.
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)
    reason = unwritable_reason(tmp_path / "runs")
    assert (
        reason
        == f"does not exist and its nearest existing ancestor {str(tmp_path)!r} is not writable by this user"
    )


# ---------------------------------------------------------------- 5. hf: datasets without the hub


def _no_load_dataset(*args, **kwargs):
    raise AssertionError("load_dataset must not be called when the hub is unreachable")


def test_unreachable_hub_fails_at_once_naming_the_path(monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(
        data_sources, "hub_unreachable_reason", lambda: "https://huggingface.co: ConnectError"
    )
    monkeypatch.setattr(datasets, "load_dataset", _no_load_dataset)
    with pytest.raises(ValueError) as info:
        load_records("hf:org/data")
    message = str(info.value)
    assert "dataset path 'hf:org/data' needs the Hugging Face hub, which is unreachable" in message
    assert "ConnectError" in message and "save_to_disk" in message and "HF_HUB_OFFLINE=1" in message


def test_offline_hub_connection_error_names_the_path(monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(data_sources, "hub_unreachable_reason", _no_load_dataset)  # offline: no probe

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'org/data' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match=r"'hf:org/data' could not be read from the hub .*save_to_disk"):
        load_records("hf:org/data")


def test_hub_probe_reports_a_refused_endpoint():
    pytest.importorskip("huggingface_hub")
    with socket.socket() as closed:  # bound but not listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        reason = data_sources.hub_unreachable_reason(url, timeout_s=5)
    assert reason is not None and reason.startswith(url)


def test_hub_probe_accepts_an_endpoint_that_answers():
    pytest.importorskip("huggingface_hub")
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.handle_request)
    thread.start()
    try:
        # Any HTTP answer (here 501) means the hub is reachable.
        assert (
            data_sources.hub_unreachable_reason(f"http://127.0.0.1:{server.server_port}", timeout_s=5) is None
        )
    finally:
        thread.join()
        server.server_close()


# ---------------------------------------------------------------- 6. head rules from config.json at load


def _model_dir(path: Path, **config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_config_show_checks_the_models_head_rules(tmp_path, capsys):
    model = _model_dir(tmp_path / "m40", num_attention_heads=40, num_key_value_heads=8)
    args = [f"actor.path={model}", "actor.backend=fsdp:c16", "cluster.n_nodes=2", "cluster.n_gpus_per_node=8"]
    code = main(["config", "show", "--job", "sft", *args, "train_dataset.path=d.jsonl"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    assert "actor.backend='fsdp:c16': context (c) size 16 must divide num_attention_heads=40" in err
    assert f"(head counts from {model / 'config.json'})" in err
    load_config(None, [*args[:1], "actor.backend=fsdp:c8", "cluster.n_gpus_per_node=8"])  # 8 divides 40


def test_head_counts_of_multimodal_configs_are_read_from_text_config(tmp_path):
    model = _model_dir(tmp_path / "vl", text_config={"num_attention_heads": 6, "num_key_value_heads": 2})
    (error,) = _config_errors([f"actor.path={model}", "actor.backend=fsdp:c4", "cluster.n_gpus_per_node=4"])
    assert "num_attention_heads=6" in error


def test_rollout_head_rule_only_for_rl(tmp_path):
    model = _model_dir(tmp_path / "m", num_attention_heads=4, num_key_value_heads=2)
    base = [f"actor.path={model}", "train_dataset.path=d.jsonl", "rollout.backend=sglang:t8"]
    load_config(None, base, job="sft")
    errors = _config_errors([*base, "train_dataset.type=rl", "cluster.n_gpus_per_node=16"], job="rl")
    assert any(e.startswith("rollout.backend='sglang:t8': tensor (t) size 8") for e in errors)


def test_model_path_without_a_readable_config_json_is_a_config_error(tmp_path):
    (error,) = _config_errors([f"actor.path={tmp_path / 'missing'}"])
    assert error.startswith(f"actor.path={str(tmp_path / 'missing')!r} does not exist")
    assert "hf download <id> --local-dir DIR" in error
    (error,) = _config_errors([f"actor.path={tmp_path}"])
    assert error.startswith(f"actor.path={str(tmp_path)!r} has no config.json")
    (tmp_path / "config.json").write_text("{not json")
    (error,) = _config_errors([f"actor.path={tmp_path}"])
    assert f"{tmp_path / 'config.json'} cannot be read" in error and "re-download" in error
    (tmp_path / "weights.bin").write_text("x")
    (error,) = _config_errors([f"actor.path={tmp_path / 'weights.bin'}"])
    assert "is a file; set it to a Hugging Face model directory" in error


def test_gguf_file_is_not_judged_before_loading(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert load_config(None, [f"actor.path={gguf}"]).actor.path == str(gguf)


# ---------------------------------------------------------------- 7. Ctrl-C and the run directory in the CLI


def _sft_raising(monkeypatch, exc: BaseException) -> None:
    import laden.sft.trainer

    def run_sft(cfg, *, progress):
        raise exc

    monkeypatch.setattr(laden.sft.trainer, "run_sft", run_sft)


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path, monkeypatch, capsys):
    _sft_raising(monkeypatch, KeyboardInterrupt())
    code = main(["sft", "--no-progress", f"cluster.fileroot={tmp_path}"])
    err = capsys.readouterr().err
    assert code == EXIT_INTERRUPTED == 130
    assert err.count("\n") == 1 and err.startswith("laden: interrupted; rerun the same command")
    assert str(tmp_path / "sft-tiny" / "run0") in err


def test_ctrl_c_is_reported_by_rank_0_only(tmp_path, monkeypatch, capsys):
    _sft_raising(monkeypatch, KeyboardInterrupt())
    monkeypatch.setenv("RANK", "1")
    assert main(["sft", "--no-progress", f"cluster.fileroot={tmp_path}"]) == EXIT_INTERRUPTED
    assert capsys.readouterr().err == ""


def test_os_error_in_the_run_directory_is_one_line_naming_the_path(tmp_path, monkeypatch, capsys):
    metrics = tmp_path / "sft-tiny" / "run0" / "metrics.jsonl"  # the embedded default's run directory
    _sft_raising(monkeypatch, OSError(errno.ENOSPC, "No space left on device", str(metrics)))
    code = main(["sft", "--no-progress", f"cluster.fileroot={tmp_path}"])
    err = capsys.readouterr().err
    assert code == EXIT_OS_ERROR
    assert err.count("\n") == 1 and "No space left on device" in err and str(metrics) in err
    assert "cluster.fileroot" in err


def test_os_error_outside_the_run_directory_keeps_its_traceback(tmp_path, monkeypatch):
    _sft_raising(monkeypatch, PermissionError(errno.EACCES, "Permission denied", "/elsewhere/file"))
    with pytest.raises(PermissionError):
        main(["sft", "--no-progress", f"cluster.fileroot={tmp_path}"])
