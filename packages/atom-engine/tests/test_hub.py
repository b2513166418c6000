"""Hugging Face Hub IDs (`atom_engine.hub`): the real `huggingface_hub` against a Hub API served on
the loopback by this module (`HubServer`), and against a cache laid out as the library writes it.

The library reads HF_HOME, HF_HUB_OFFLINE, HF_ENDPOINT and HF_TOKEN once, at import, so each case
runs in a fresh interpreter with its own environment: `hub.py` alone (it imports nothing of
ATOM's, so a start takes a fraction of a second), or the whole engine where it must load.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from transformers import LlamaConfig

import atom_engine.hub
from atom_engine.cli.main import build_parser

HUB_PY = atom_engine.hub.__file__
SHA_MAIN = "a" * 40
SHA_V1 = "b" * 40
TOKEN = "hf_test_token"
# 12 MiB: the library writes what it received in 10 MiB chunks, so a cut 1 MiB short of the end
# leaves 10 MiB on disk to resume from.
BIG = bytes(range(256)) * (48 << 10)


class HubServer:
    """The Hub endpoints `snapshot_download` / `hf_hub_download` call, for in-memory repos:
    `GET /api/models/{repo}/revision/{rev}` (the commit), `GET /api/models/{repo}/tree/{commit}`
    (the file list), `HEAD` / `GET /{repo}/resolve/{rev}/{file}` (X-Repo-Commit, ETag,
    Content-Length; the bytes). `repos[repo_id] = {"refs": {rev: commit}, "commits": {commit:
    {path: bytes}}, "gated": bool}`; `requests` logs (method, path) of every request."""

    def __init__(self, repos: dict) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        self.ranges: list[str] = []  # the Range headers of file GETs
        self.cut_once: set[str] = set()  # files whose first GET stops 1 MiB short, then closes
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                server.answer(self, body=False)

            def do_GET(self) -> None:
                server.answer(self, body=True)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def file_requests(self) -> list[tuple[str, str]]:
        return [(m, p) for m, p in self.requests if "/resolve/" in p]

    def answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        self.requests.append((handler.command, path))
        parts = path.strip("/").split("/")
        if len(parts) < 5:  # not one of the endpoints above (the library asks for others)
            return self.send(handler, 404, b"", {}, body)
        if parts[:2] == ["api", "models"]:  # api/models/org/name/{revision|tree}/rev
            repo_id, kind, rev = "/".join(parts[2:4]), parts[4], parts[5]
        else:  # org/name/resolve/rev/file
            repo_id, kind, rev = "/".join(parts[:2]), parts[2], parts[3]
        repo = self.repos.get(repo_id)
        if repo is None:
            return self.send(handler, 404, b"", {"X-Error-Code": "RepoNotFound"}, body)
        commit = repo["refs"].get(rev, rev if rev in repo["commits"] else None)
        if commit is None:
            return self.send(handler, 404, b"", {"X-Error-Code": "RevisionNotFound"}, body)
        files = repo["commits"][commit]
        if kind == "revision":
            info = {"id": repo_id, "sha": commit, "siblings": [{"rfilename": f} for f in files]}
            return self.send(handler, 200, json.dumps(info).encode(), {}, body)
        if kind == "tree":
            tree = [
                {"type": "file", "path": f, "size": len(data), "oid": _sha(data)}
                for f, data in files.items()
            ]
            return self.send(handler, 200, json.dumps(tree).encode(), {}, body)
        name = "/".join(parts[4:])
        headers = {"X-Repo-Commit": commit}
        authorized = handler.headers.get("authorization") == f"Bearer {TOKEN}"
        if repo.get("gated") and not authorized:
            headers["X-Error-Code"] = "GatedRepo"
            return self.send(handler, 401, b"", headers, body)
        if name not in files:
            headers["X-Error-Code"] = "EntryNotFound"
            return self.send(handler, 404, b"", headers, body)
        data = files[name]
        headers["ETag"] = f'"{_sha(data)}"'
        ranged = handler.headers.get("range") if body else None
        if ranged:
            self.ranges.append(ranged)
            start = int(ranged.removeprefix("bytes=").split("-")[0])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return self.send(handler, 206, data[start:], headers, body)
        if body and name in self.cut_once:  # an interrupted download
            self.cut_once.discard(name)
            headers["Content-Length"] = str(len(data))
            handler.send_response(200)
            for key, value in headers.items():
                handler.send_header(key, value)
            handler.end_headers()
            handler.wfile.write(data[: len(data) - (1 << 20)])
            handler.close_connection = True
            return None
        return self.send(handler, 200, data, headers, body)

    @staticmethod
    def send(handler, status: int, data: bytes, headers: dict, body: bool) -> None:
        handler.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            handler.send_header(key, value)
        handler.end_headers()
        if body:
            handler.wfile.write(data)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _resolve(env: dict, name: str = "resolve_model", **kwargs) -> dict:
    """`hub.<name>(**kwargs)` in a fresh interpreter with `env`: {"path": ...} or {"error": ...}."""
    script = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('hub', {HUB_PY!r})\n"
        "hub = importlib.util.module_from_spec(spec); spec.loader.exec_module(hub)\n"
        "try:\n"
        f"    print(json.dumps({{'path': hub.{name}(**json.loads(sys.argv[1]))}}))\n"
        "except ValueError as e:\n"
        "    print(json.dumps({'error': str(e)}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, json.dumps(kwargs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def _env(hf_home: Path, endpoint: str, offline: bool = False, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(hf_home), HF_ENDPOINT=endpoint, NO_PROXY="127.0.0.1", **extra)
    env.pop("TRANSFORMERS_OFFLINE", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


# What a repo holds besides what ATOM loads: none of these may be fetched.
NOT_LOADED = {
    "README.md": b"# tiny",
    ".gitattributes": b"*.safetensors filter=lfs",
    "pytorch_model.bin": b"torch pickle",
    "consolidated.safetensors": b"a copy the index does not name",
    "original/model.safetensors": b"a subfolder copy",
}
LOADED = {
    "config.json": b'{"model_type": "llama", "rev": "main"}',
    "generation_config.json": b'{"eos_token_id": 2}',
    "tokenizer.json": b'{"model": {}}',
    "tokenizer_config.json": b'{"model_max_length": 64}',
    "chat_template.jinja": b"{{ messages }}",
    "model.safetensors.index.json": json.dumps(
        {
            "weight_map": {
                "a": "model-00001-of-00002.safetensors",
                "b": "model-00002-of-00002.safetensors",
            }
        }  # fmt: skip
    ).encode(),
    "model-00001-of-00002.safetensors": b"shard one",
    "model-00002-of-00002.safetensors": b"shard two",
}


@pytest.fixture
def hub():
    v1 = {**LOADED, "config.json": b'{"model_type": "llama", "rev": "v1"}'}
    gguf = {
        "config.json": b"{}",
        "tiny-Q4.gguf": b"GGUF one",
        "tiny-Q8.gguf": b"GGUF two",
        "tiny-F32.gguf": BIG,
    }
    server = HubServer(
        {
            "org/tiny": {
                "refs": {"main": SHA_MAIN, "v1": SHA_V1},
                "commits": {SHA_MAIN: {**LOADED, **NOT_LOADED}, SHA_V1: v1},
            },
            "org/tiny-gguf": {"refs": {"main": SHA_MAIN}, "commits": {SHA_MAIN: gguf}},
            "org/gated": {"refs": {"main": SHA_MAIN}, "commits": {SHA_MAIN: LOADED}, "gated": True},
        }
    )
    yield server
    server.stop()


def _hand_built_cache(hf_home: Path, repo_id: str, commit: str, checkpoint: Path) -> Path:
    """`repo_id` at `commit` in an HF cache as the library lays it out: content-addressed
    `blobs/`, `refs/main` naming the commit, `snapshots/<commit>/` of relative symlinks."""
    storage = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir()
    for file in checkpoint.iterdir():
        data = file.read_bytes()
        blob = storage / "blobs" / _sha(data)
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    return snapshot


LOAD_OFFLINE = """
import json, sys
from atom_engine import LLM, SamplingParams

engine = dict(dtype="float32", device="cpu", enforce_eager=True, num_kv_blocks=32)
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
result = {}
for key, model in (("hub", "org/tiny-llama"), ("local", sys.argv[1])):
    with LLM(model=model, **engine) as llm:
        (out,) = llm.generate(["The capital of France is"], params, use_tqdm=False)
        result[key] = out.outputs[0].token_ids
        result[key + "_path"] = llm.engine.model_path
try:
    LLM(model="org/not-cached", **engine)
except ValueError as e:
    result["error"] = str(e)
print(json.dumps(result))
"""


def test_offline_cache_loads_with_no_network(tiny_checkpoint, tmp_path):
    config = LlamaConfig(
        vocab_size=49152,  # the bundled tokenizer's, saved beside the weights
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    checkpoint, _ = tiny_checkpoint(config)
    snapshot = _hand_built_cache(tmp_path, "org/tiny-llama", SHA_MAIN, checkpoint)
    server = HubServer({})  # HF_ENDPOINT: any request the library made would show here
    try:
        result = subprocess.run(
            [sys.executable, "-c", LOAD_OFFLINE, str(checkpoint)],
            env=_env(tmp_path, server.url, offline=True),
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["hub_path"] == str(snapshot) and out["local_path"] == str(checkpoint)
    assert len(out["hub"]) == 6 and out["hub"] == out["local"]
    assert "'org/not-cached'" in out["error"] and "HF_HUB_OFFLINE" in out["error"]
    assert server.requests == []


def test_download_fetches_only_what_atom_loads_then_hits_the_cache(hub, tmp_path):
    env = _env(tmp_path, hub.url)
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / SHA_MAIN
    assert _resolve(env, model="org/tiny") == {"path": str(snapshot)}
    fetched = {p.split(f"/resolve/{SHA_MAIN}/")[1] for m, p in hub.file_requests() if m == "GET"}
    assert fetched == set(LOADED)  # no README, .bin, consolidated copy or subfolder
    for name, data in LOADED.items():
        assert (snapshot / name).read_bytes() == data
    assert not (snapshot / "README.md").exists() and not (snapshot / "original").exists()

    # The second start: the commit is looked up, no file is requested again.
    before = len(hub.file_requests())
    assert _resolve(env, model="org/tiny") == {"path": str(snapshot)}
    assert len(hub.file_requests()) == before
    # Offline: the same snapshot, and no request at all.
    before = len(hub.requests)
    assert _resolve(_env(tmp_path, hub.url, offline=True), model="org/tiny") == {
        "path": str(snapshot)
    }
    assert len(hub.requests) == before

    # --revision: another commit, its own snapshot.
    other = _resolve(env, model="org/tiny", revision="v1")["path"]
    assert other == str(snapshot.parent / SHA_V1)
    assert b'"v1"' in (Path(other) / "config.json").read_bytes()
    # load_format dummy: no weights; a tokenizer ID: its files, no weights either.
    dummy = tmp_path / "dummy"
    path = _resolve(env, model="org/tiny", download_dir=str(dummy), weights=False)["path"]
    assert sorted(p.name for p in Path(path).glob("*.safetensors")) == []
    assert (Path(path) / "tokenizer.json").is_file()
    assert _resolve(env, "resolve_tokenizer", tokenizer="org/tiny", download_dir=str(dummy)) == {
        "path": path
    }


def test_gguf_file_downloads_that_file_only(hub, tmp_path):
    env = _env(tmp_path, hub.url)
    path = _resolve(env, model="org/tiny-gguf/tiny-Q8.gguf")["path"]
    assert path.endswith(f"{SHA_MAIN}/tiny-Q8.gguf") and Path(path).read_bytes() == b"GGUF two"
    assert [p for m, p in hub.file_requests() if m == "GET"] == [
        "/org/tiny-gguf/resolve/main/tiny-Q8.gguf"
    ]
    path = _resolve(env, model="org/tiny-gguf", gguf_file="tiny-Q4.gguf")["path"]
    assert Path(path).read_bytes() == b"GGUF one"
    assert "has no file 'nope.gguf'" in _resolve(env, model="org/tiny-gguf/nope.gguf")["error"]


def test_wrong_id_gated_and_missing_revision_are_one_clear_error(hub, tmp_path):
    env = _env(tmp_path, hub.url)
    error = _resolve(env, model="org/no-such-model")["error"]
    assert "'org/no-such-model' not found" in error and "check the name" in error
    error = _resolve(env, model="org/gated")["error"]
    assert "gated" in error and "HF_TOKEN" in error
    path = _resolve(_env(tmp_path, hub.url, HF_TOKEN=TOKEN), model="org/gated")["path"]
    assert (Path(path) / "model-00002-of-00002.safetensors").read_bytes() == b"shard two"
    error = _resolve(env, model="org/tiny", revision="v9")["error"]
    assert "revision 'v9'" in error and "--revision" in error
    (tmp_path / "a-file").write_text("")  # no cache directory can be made under it
    error = _resolve(env, model="org/tiny", download_dir=str(tmp_path / "a-file"))["error"]
    assert "could not store model 'org/tiny'" in error and "--download-dir" in error
    error = _resolve(env, model="./no/such/dir")["error"]
    assert "no such local path" in error


def test_offline_without_the_model_names_hf_hub_offline(tmp_path):
    error = _resolve(_env(tmp_path, "http://127.0.0.1:9", offline=True), model="org/tiny")["error"]
    assert "HF_HUB_OFFLINE" in error and "org/tiny" in error


def test_cli_prints_the_error_without_a_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "atom_engine.cli.main", "serve", "--model", "org/missing"],
        env=_env(tmp_path, "http://127.0.0.1:9", offline=True),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "org/missing" in result.stderr and "HF_HUB_OFFLINE" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_takes_the_model_positionally():
    from atom_engine.cli.main import _serve

    args = build_parser().parse_args(["serve", "Qwen/Qwen3-0.6B", "--port", "9000"])
    assert args.model_tag == "Qwen/Qwen3-0.6B" and args.model is None
    args = build_parser().parse_args(["serve", "org/a", "--model", "org/b"])
    with pytest.raises(ValueError, match="named twice"):
        _serve(args)


def test_an_interrupted_download_resumes(hub, tmp_path):
    hub.cut_once.add("tiny-F32.gguf")
    path = _resolve(_env(tmp_path, hub.url), model="org/tiny-gguf", gguf_file="tiny-F32.gguf")
    assert Path(path["path"]).read_bytes() == BIG
    gets = [p for m, p in hub.file_requests() if m == "GET"]
    assert gets == ["/org/tiny-gguf/resolve/main/tiny-F32.gguf"] * 2
    (ranged,) = hub.ranges  # the second GET asked for the rest only
    assert ranged.startswith("bytes=") and int(ranged[6:].split("-")[0]) > 0
