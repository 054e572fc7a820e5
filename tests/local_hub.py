"""A Hugging Face Hub made in the test, for the tests of models by their Hub names (both tiers): a stdlib HTTP
server that answers the few routes `huggingface_hub.snapshot_download` and `HfApi.model_info` use, pointed at
with HF_ENDPOINT, and a cache laid out by hand as huggingface_hub lays it out.

Routes (read from huggingface_hub 2.4's hf_api.py, file_download.py and utils/_http.py):
  GET  /api/models/ORG/NAME[/revision/REV]       {"id", "sha", "siblings": [{"rfilename", "size"}]} (REV: main)
  GET  /api/models/ORG/NAME/tree/REV?recursive=   [{"type": "file", "path", "size", "oid"}]
  HEAD /ORG/NAME/resolve/REV/FILE                 X-Repo-Commit, ETag, Content-Length
  GET  /ORG/NAME/resolve/REV/FILE                 the bytes (a Range header honoured)
Errors carry the Hub's X-Error-Code header, which huggingface_hub turns into its own exceptions: RepoNotFound
(404), GatedRepo (401 without a token, 403 with a token the repo does not accept), RevisionNotFound (404).
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    """A model repository: commits (sha -> {file: bytes}), branches and tags (name -> sha), and who may read it."""

    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated_token: str | None = None  # a gated repo answers only this token
    served: list[str] = field(default_factory=list)  # files sent, in order

    def push(self, files: dict[str, bytes], branch: str = "main") -> str:
        """A new commit of `files` on `branch`; its sha."""
        sha = hashlib.sha1(json.dumps(sorted((k, hashlib.sha1(v).hexdigest()) for k, v in files.items()))
                           .encode() + str(len(self.commits)).encode()).hexdigest()
        self.commits[sha] = dict(files)
        self.refs[branch] = sha
        return sha

    def commit_of(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


def directory_files(directory: Path) -> dict[str, bytes]:
    """Every file of a directory (a save_pretrained), by its path relative to it."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


class FakeHub:
    """`with FakeHub() as hub: hub.repos["org/name"] = Repo(...)`; `hub.endpoint` is HF_ENDPOINT's value."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[str] = []
        self.cut_after: int | None = None  # bytes of a file body sent before the connection drops (None: all)
        self.body_delay = 0.0  # seconds before each file body is sent: a slow download that others overlap
        self.on_request: Callable[[str], None] | None = None  # called with "METHOD /path" as each request arrives
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # the test's output stays the test's
                pass

            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def do_GET(self) -> None:
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, request: BaseHTTPRequestHandler, body: bool) -> None:
        url = urlparse(request.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        self.requests.append(f"{request.command} {url.path}")
        if self.on_request is not None:
            self.on_request(self.requests[-1])
        if parts[:2] == ["api", "models"] and (len(parts) == 4 or len(parts) >= 6 and parts[4] in ("revision", "tree")):
            repo_id = "/".join(parts[2:4])
            route, revision = (parts[4], parts[5]) if len(parts) > 4 else ("revision", "main")
            found = self.check(request, repo_id, revision)
            if found is None:
                return
            repo, sha = found
            files = repo.commits[sha]
            if route == "revision":
                data: object = {"id": repo_id, "sha": sha, "private": False,
                                "siblings": [{"rfilename": f, "size": len(b)} for f, b in files.items()]}
            else:
                data = [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                        for f, b in files.items()]
            self.send(request, 200, json.dumps(data).encode(), {"Content-Type": "application/json"}, body)
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo_id, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            found = self.check(request, repo_id, revision)
            if found is None:
                return
            repo, sha = found
            if name not in repo.commits[sha]:
                self.send(request, 404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha}, body)
                return
            self.send_file(request, repo, sha, name, body)
        else:
            self.send(request, 404, b"not a route of this hub", {}, body)

    def check(self, request: BaseHTTPRequestHandler, repo_id: str, revision: str) -> tuple[Repo, str] | None:
        """The repo and commit, or the Hub's error answered."""
        repo = self.repos.get(repo_id)
        if repo is None:
            self.send(request, 401, b"", {"X-Error-Code": "RepoNotFound",
                                          "X-Error-Message": "Repository not found"}, False)
            return None
        if repo.gated_token is not None:
            auth = request.headers.get("Authorization", "")
            if auth != f"Bearer {repo.gated_token}":
                self.send(request, 403 if auth else 401, b"", {
                    "X-Error-Code": "GatedRepo", "X-Error-Message": f"Access to model {repo_id} is restricted."}, False)
                return None
        sha = repo.commit_of(revision)
        if sha is None:
            self.send(request, 404, b"", {"X-Error-Code": "RevisionNotFound",
                                          "X-Error-Message": "Invalid rev id"}, False)
            return None
        return repo, sha

    def send_file(self, request: BaseHTTPRequestHandler, repo: Repo, sha: str, name: str, body: bool) -> None:
        data = repo.commits[sha][name]
        etag = hashlib.sha256(data).hexdigest()
        start = 0
        if (ranged := request.headers.get("Range", "")).startswith("bytes="):
            start = int(ranged[6:].split("-")[0] or 0)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"}
        if body:
            repo.served.append(name)
            time.sleep(self.body_delay)
        if not body or self.cut_after is None:
            self.send(request, 206 if start else 200, data[start:], headers, body)
            return
        request.send_response(200)  # a connection that drops part-way: Content-Length promises more than comes
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            request.send_header(key, value)
        request.end_headers()
        request.wfile.write(data[:self.cut_after])
        request.close_connection = True

    @staticmethod
    def send(request: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict, body: bool) -> None:
        request.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            request.send_header(key, value)
        request.end_headers()
        if body:
            request.wfile.write(data)


def lay_out_cache(cache: Path, repo_id: str, files: dict[str, bytes], commit: str = "a" * 40,
                  branch: str = "main") -> Path:
    """A cache as huggingface_hub lays it out (HF_HUB_CACHE/models--ORG--NAME/{blobs, snapshots/COMMIT, refs/
    BRANCH}), written by hand: the blobs by content hash, the snapshot's files links to them. Its snapshot folder."""
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    for name, data in files.items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../" * (len(Path(name).parts) + 1)) / "blobs" / blob.name)
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / branch).write_text(commit)
    return snapshot


def resolve_in_child(args: tuple[str, str, str]) -> str:
    """`resolve_model_dir(repo_id)` in a fresh process (a multiprocessing pool's worker) against ENDPOINT and CACHE:
    several at once are a node's ranks."""
    import os
    endpoint, cache, repo_id = args
    os.environ.update(HF_ENDPOINT=endpoint, HF_HUB_CACHE=cache, HF_HUB_OFFLINE="0")
    from bigtrain.models.hub import resolve_model_dir
    return resolve_model_dir(repo_id).path
