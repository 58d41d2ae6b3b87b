"""A Hub id in `actor.path` is read from the Hugging Face cache, fetched from a reachable Hub, and refused
offline with the fix; local paths never touch the Hub.

No test reaches the network: the cache is built in `tmp_path` with huggingface_hub's layout
(`models--org--name/snapshots/<commit>/...`, `refs/<branch>`), and the one online test serves the tiny
model from a Hub API of a few routes on 127.0.0.1 (`HF_ENDPOINT`).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import shutil
import socket
import threading
from pathlib import Path

import pytest
from repo_paths import ROOT

from laden.cli import EXIT_USAGE, main
from laden.config import ConfigError, load_config
from laden.model.hf import hub

pytestmark = pytest.mark.usefixtures("one_thread")

huggingface_hub = pytest.importorskip("huggingface_hub")
constants = pytest.importorskip("huggingface_hub.constants")

TINY_MODEL = ROOT / "laden" / "assets" / "tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


def _cache_snapshot(cache: Path, repo_id: str, commit: str, ref: str | None = "main") -> Path:
    """The tiny model as the snapshot `commit` of `repo_id` in the Hub cache at `cache`, `ref` pointing at it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(TINY_MODEL, snapshot)
    if ref is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def _closed_port_url() -> str:
    """A local URL nothing listens on: a Hub client that tries the network is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _point_hub_at(monkeypatch, endpoint: str) -> None:
    """Every Hub request of huggingface_hub to `endpoint` (it reads HF_ENDPOINT once, at import)."""
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hub cache in `tmp_path`, offline, its endpoint a closed local port. huggingface_hub reads
    the environment once at import, so its constants are set as well."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    for name, value in (
        ("HF_HOME", str(tmp_path / "hf")),
        ("HF_HUB_CACHE", str(cache)),
        ("HF_HUB_OFFLINE", "1"),
    ):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    _point_hub_at(monkeypatch, _closed_port_url())
    return cache


def test_sft_trains_from_a_hub_id_in_the_offline_cache(hf_cache, tmp_path, capsys, caplog):
    caplog.set_level("INFO", logger="laden.model.hf.hub")
    snapshot = _cache_snapshot(hf_cache, "org/tiny", COMMIT)
    code = main(["sft", "--no-progress", f"cluster.fileroot={tmp_path / 'runs'}", "total_train_steps=1",
                 "actor.path=org/tiny"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "runs" / "sft-tiny" / "run0" / "metrics.jsonl").is_file()
    assert f"actor.path='org/tiny' is the local directory {snapshot}" in caplog.text


def test_absent_hub_id_offline_names_the_id_and_hf_download(hf_cache, tmp_path, capsys):
    code = main(["sft", f"cluster.fileroot={tmp_path / 'runs'}", "actor.path=org/absent"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    assert "actor.path='org/absent' is not a local path" in err
    assert "not in the Hugging Face cache and cannot be fetched now" in err and "HF_HUB_OFFLINE" in err
    assert "`hf download org/absent --local-dir DIR`) and set actor.path=DIR" in err
    assert "huggingface-cli" not in err and "Traceback" not in err
    assert not (tmp_path / "runs" / "sft-tiny").exists()  # refused before the run directory


def test_revision_picks_its_snapshot(hf_cache):
    main_snapshot = _cache_snapshot(hf_cache, "org/tiny", COMMIT)
    tagged = _cache_snapshot(hf_cache, "org/tiny", OTHER_COMMIT, ref="v1")
    assert hub.resolve_model_path("org/tiny") == str(main_snapshot)
    assert hub.resolve_model_path("org/tiny", revision="v1") == str(tagged)
    assert hub.resolve_model_path("org/tiny", revision=OTHER_COMMIT) == str(tagged)
    with pytest.raises(ValueError) as info:
        hub.resolve_model_path("org/tiny", revision="v2", field="critic.path")
    message = str(info.value)
    assert "critic.path='org/tiny' is not a local path" in message and "at revision 'v2'" in message
    assert "`hf download org/tiny --revision v2 --local-dir DIR`) and set critic.path=DIR" in message


def test_local_paths_never_reach_the_hub(hf_cache, tmp_path, monkeypatch, caplog):
    def no_hub(*args, **kwargs):
        raise AssertionError("snapshot_download must not be called for a local path")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    assert hub.resolve_model_path(str(TINY_MODEL)) == str(TINY_MODEL)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)  # a relative directory shaped like a Hub id
    assert hub.resolve_model_path("org/tiny") == "org/tiny"
    for not_an_id in ("./missing", "/abs/missing", "a/b/c", "~/model", "model", "org/name.git", "org--x/y"):
        assert hub.resolve_model_path(not_an_id) == not_an_id  # the loader says it does not exist
    assert hub.resolve_model_path(str(TINY_MODEL), revision="v1") == str(TINY_MODEL)
    assert "the revision 'v1' is ignored" in caplog.text


def test_config_accepts_a_hub_id_and_names_hf_download_for_a_missing_directory(hf_cache, tmp_path):
    cfg = load_config(None, ["actor.path=Qwen/Qwen3-0.6B", "actor.revision=main"])
    assert cfg.actor.path == "Qwen/Qwen3-0.6B" and cfg.actor.revision == "main"  # fetched when the run starts
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"actor.path={tmp_path / 'missing'}"])
    (error,) = info.value.errors
    assert "does not exist and is not a Hub id (org/name)" in error
    assert "`hf download <id> --local-dir DIR`, then actor.path=DIR" in error


def test_unreachable_hub_is_named_in_the_error(hf_cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # online, endpoint refuses
    with pytest.raises(ValueError) as info:
        hub.resolve_model_path("org/absent")
    message = str(info.value)
    assert "cannot be fetched now" in message and "ConnectError" in message
    assert "hf download org/absent --local-dir DIR" in message


# ---------------------------------------------------------------- a reachable Hub on 127.0.0.1


class _FakeHub(http.server.BaseHTTPRequestHandler):
    """The routes `snapshot_download` uses, serving `files` of one repository at commit `COMMIT`."""

    repo_id = "org/tiny"
    files: dict[str, bytes] = {}

    def log_message(self, *args):  # keep the test output clean
        pass

    def do_HEAD(self):
        self._serve(head=True)

    def do_GET(self):
        self._serve(head=False)

    def _serve(self, *, head: bool):
        path = self.path.split("?", 1)[0]
        api = f"/api/models/{self.repo_id}"
        if path.startswith(f"{api}/revision/"):
            entries = [{"rfilename": name} for name in self.files]
            return self._send(
                json.dumps({"id": self.repo_id, "sha": COMMIT, "siblings": entries}).encode(), head
            )
        if path.startswith(f"{api}/tree/"):
            tree = [{"type": "file", "path": name, "size": len(data), "oid": _oid(data)}
                    for name, data in self.files.items()]  # fmt: skip
            return self._send(json.dumps(tree).encode(), head)
        prefix = f"/{self.repo_id}/resolve/"
        if path.startswith(prefix):
            name = path[len(prefix) :].split("/", 1)[1]
            if name in self.files:
                data = self.files[name]
                headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_oid(data)}"'}
                return self._send(data, head, headers)
        self.send_response(404)
        self.send_header("X-Error-Code", "EntryNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _send(self, body: bytes, head: bool, headers: dict[str, str] | None = None):
        self.send_response(200)
        for key, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)


def _oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id


def test_reachable_hub_fetches_only_what_laden_reads(hf_cache, monkeypatch):
    files = {p.name: p.read_bytes() for p in TINY_MODEL.iterdir()}
    extra = {"pytorch_model.bin": b"unused", "original/params.json": b"{}", "README.md": b"# tiny"}
    monkeypatch.setattr(_FakeHub, "files", {**files, **extra})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        _point_hub_at(monkeypatch, f"http://127.0.0.1:{server.server_port}")
        directory = Path(hub.resolve_model_path("org/tiny", show_progress=False))
    finally:
        server.shutdown()
        server.server_close()
    assert directory == hf_cache / "models--org--tiny" / "snapshots" / COMMIT
    assert sorted(p.name for p in directory.iterdir()) == sorted(files)
    assert all((directory / name).read_bytes() == data for name, data in files.items())
    # Fetched once, the snapshot serves offline runs.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub.resolve_model_path("org/tiny") == str(directory)
