"""A local stand-in for huggingface.co that the real huggingface_hub client talks to over HTTP.

It serves the few endpoints `snapshot_download` uses (repo info, tree listing, HEAD/GET `resolve` with Range
for resume) from directories on disk, and answers gated / missing repos and revisions with the Hub's own error
headers, so huggingface_hub raises its real exceptions. Use the `fake_hub` fixture (conftest.py):

    fake_hub.add_repo("org/name", model_dir)               # public
    fake_hub.add_repo("meta/gated", model_dir, gated=True, access_token="hf_ok")  # 403 GatedRepo for other tokens
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    sha: str
    files: dict[str, bytes]
    gated: bool = False
    access_token: str | None = None  # the one token a gated repo accepts
    requests: list[str] = field(default_factory=list)
    # failure injection: files whose next GET stops halfway (a dropped connection) / whose GET fails with HTTP 500
    cut_once: set[str] = field(default_factory=set)
    failing: set[str] = field(default_factory=set)


def _etag(name: str, data: bytes) -> str:
    if name.endswith(".safetensors"):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.ranges: list[str] = []  # the Range headers of file downloads: resumed transfers
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # keep pytest output clean
                pass

            def do_GET(self) -> None:
                hub._handle(self, body=True)

            def do_HEAD(self) -> None:
                hub._handle(self, body=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def add_repo(
        self,
        repo_id: str,
        src_dir: str | Path,
        *,
        sha: str = "f" * 40,
        gated: bool = False,
        access_token: str | None = None,
    ) -> FakeRepo:
        src = Path(src_dir)
        files = {p.relative_to(src).as_posix(): p.read_bytes() for p in sorted(src.rglob("*")) if p.is_file()}
        self.repos[repo_id] = FakeRepo(sha, files, gated, access_token)
        return self.repos[repo_id]

    def start(self) -> FakeHub:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handle(self, req: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(urlsplit(req.path).path)
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        match = api or resolve
        if match is None:
            return self._error(req, 404, "EntryNotFound")
        repo = self.repos.get(match.group(1))
        if repo is None:
            return self._error(req, 401, "RepoNotFound")
        revision = match.group(3) if api else match.group(2)
        if revision not in ("main", repo.sha):
            return self._error(req, 404, "RevisionNotFound")
        repo.requests.append(f"{req.command} {path}")
        if api and api.group(2) == "revision":
            siblings = [{"rfilename": name} for name in repo.files]
            return self._send(req, 200, json.dumps({"id": match.group(1), "sha": repo.sha, "siblings": siblings}))
        if api:
            tree = [
                {"type": "file", "path": name, "size": len(data), "oid": _etag(name, data)}
                | (
                    {"lfs": {"oid": _etag(name, data), "size": len(data), "pointerSize": 134}}
                    if name.endswith(".safetensors")
                    else {}
                )
                for name, data in repo.files.items()
            ]
            return self._send(req, 200, json.dumps(tree))
        if repo.gated and req.headers.get("Authorization") != f"Bearer {repo.access_token}":
            return self._error(req, 403, "GatedRepo")
        name = resolve.group(3)
        data = repo.files.get(name)
        if data is None:
            return self._error(req, 404, "EntryNotFound")
        if body and name in repo.failing:
            return self._send(req, 500, "internal error")
        start = 0
        if range_header := req.headers.get("Range"):
            self.ranges.append(range_header)
            start = int(re.fullmatch(r"bytes=(\d+)-\d*", range_header).group(1))
        headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{_etag(name, data)}"'}
        payload = data[start:] if body else b""
        if body and name in repo.cut_once:
            repo.cut_once.discard(name)
            payload = payload[: len(payload) // 2]
            req.close_connection = True
        self._send(req, 206 if start else 200, payload, headers, length=len(data) - start)

    def _error(self, req: BaseHTTPRequestHandler, status: int, code: str) -> None:
        self._send(req, status, json.dumps({"error": code}), {"X-Error-Code": code})

    def _send(
        self,
        req: BaseHTTPRequestHandler,
        status: int,
        payload: str | bytes,
        headers: dict[str, str] | None = None,
        length: int | None = None,
    ) -> None:
        data = payload.encode() if isinstance(payload, str) else payload
        req.send_response(status)
        for key, value in (headers or {}).items():
            req.send_header(key, value)
        req.send_header("Content-Length", str(len(data) if length is None else length))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(data)
