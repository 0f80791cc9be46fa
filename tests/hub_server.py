"""A loopback Hugging Face Hub: an HTTP/1.1 server on 127.0.0.1 that answers the
endpoints huggingface_hub's ``HfFileSystem`` and distshard's ``hf://`` client call,
for dataset repositories whose commits a test pushes while it runs:

- ``GET /api/datasets/<repo>[/revision/<rev>]``: the repo's info (``sha``: the commit);
- ``GET /api/datasets/<repo>/tree/<rev>[/<path>]``: a folder's entries (``recursive``),
  each file with its ``oid`` (git blob id), ``size`` and, for LFS files, ``lfs``
  (``oid``: the sha256);
- ``POST /api/datasets/<repo>/paths-info/<rev>``: the entries of the ``paths`` asked;
- ``GET`` / ``HEAD /datasets/<repo>/resolve/<rev>/<path>``: a regular file's bytes
  (``ETag``: its blob id), or for an LFS file a 302 to ``/cdn/<sha256>`` with
  ``X-Linked-Etag`` (the sha256) and ``X-Linked-Size``; ``X-Repo-Commit`` always;
- ``GET /cdn/<sha256>``: the content, with ``Range``.

Missing repos, revisions and files are 404 with the ``X-Error-Code`` the Hub sends.
``fail(kind, status, times)`` makes the next requests of a kind (``api``, ``resolve``,
``cdn``, ``any``) answer ``status`` (429, 5xx, 404...). It counts what it serves:
``log`` (method, path, Range), ``by_kind``, ``auth`` (kind and authorization
header) and ``served`` (content bytes).
It reaches nothing beyond 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from collections import Counter
from typing import Any, Iterator
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from tests.loopback_server import LoopbackServer

__all__ = ["HubServer", "hub"]


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubServer(LoopbackServer):
    """See the module docstring. ``commit(repo, files)`` pushes a commit (``None``
    removes a file) and returns its sha; ``lfs_from``: files at least this large are
    stored as LFS files (served through the CDN redirect)."""

    def __init__(self, lfs_from: int = 1024) -> None:
        super().__init__(HubHandler)
        self.lfs_from = lfs_from
        self.lock = threading.Lock()
        self.repos: dict[str, dict[str, Any]] = {}  # repo -> {"branches": {name: sha}, "commits": {sha: files}}
        self.blobs: dict[str, bytes] = {}  # sha256 -> content
        self.faults: list[tuple[str, int]] = []
        self.on_request: Any = None  # called with (kind, path) before every request is answered
        self.reset_counters()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def reset_counters(self) -> None:
        with self.lock:
            self.log: list[tuple[str, str, str | None]] = []
            self.by_kind: Counter = Counter()
            self.auth: Counter = Counter()  # (kind, authorization header) of every request
            self.served = 0

    def commit(self, repo: str, files: dict[str, bytes | None], branch: str = "main") -> str:
        with self.lock:
            state = self.repos.setdefault(repo, {"branches": {}, "commits": {}})
            head = state["branches"].get(branch)
            tree = dict(state["commits"][head]) if head else {}
            for path, data in files.items():
                if data is None:
                    tree.pop(path, None)
                else:
                    tree[path] = data
                    self.blobs[hashlib.sha256(data).hexdigest()] = data
            sha = hashlib.sha1(f"{repo}{head}{sorted((p, blob_id(d)) for p, d in tree.items())}".encode()).hexdigest()
            state["commits"][sha] = tree
            state["branches"][branch] = sha
            return sha

    def fail(self, kind: str, status: int, times: int = 1) -> None:
        with self.lock:
            self.faults.extend([(kind, status)] * times)

    def take_fault(self, kind: str) -> int | None:
        with self.lock:
            for i, (wanted, status) in enumerate(self.faults):
                if wanted in (kind, "any"):
                    del self.faults[i]
                    return status
        return None

    def tree_at(self, repo: str, rev: str) -> tuple[str, dict[str, bytes]] | None:
        state = self.repos.get(repo)
        if state is None:
            return None
        sha = state["branches"].get(rev, rev)
        tree = state["commits"].get(sha)
        return None if tree is None else (sha, tree)

    def entry(self, path: str, data: bytes) -> dict[str, Any]:
        item: dict[str, Any] = {"type": "file", "oid": blob_id(data), "size": len(data), "path": path}
        if len(data) >= self.lfs_from:
            item["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return item


class HubHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: HubServer

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.route(True)

    def do_HEAD(self) -> None:
        self.route(False)

    def do_POST(self) -> None:
        self.route(True)

    def answer(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, send: bool = True) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send and body:
            self.wfile.write(body)

    def json(self, value: Any) -> None:
        self.answer(200, json.dumps(value).encode(), {"Content-Type": "application/json"})

    def missing(self, code: str) -> None:
        self.answer(404, json.dumps({"error": code}).encode(), {"X-Error-Code": code, "X-Error-Message": code})

    def route(self, body: bool) -> None:
        server = self.server
        parts = urlsplit(self.path)
        path = parts.path
        kind = "api" if path.startswith("/api/") else "cdn" if path.startswith("/cdn/") else "resolve"
        with server.lock:
            server.log.append((self.command, self.path, self.headers.get("Range")))
            server.by_kind[kind] += 1
            server.auth[(kind, self.headers.get("authorization"))] += 1
        length = int(self.headers.get("Content-Length") or 0)
        form = parse_qs(self.rfile.read(length).decode()) if length else {}
        if server.on_request is not None:
            server.on_request(kind, path)
        status = server.take_fault(kind)
        if status is not None:
            if status == 404:
                self.missing("EntryNotFound")
            else:
                self.answer(status, b'{"error": "injected"}', {"Retry-After": "0"})
            return
        if kind == "cdn":
            self.content(server.blobs.get(path[len("/cdn/") :]), body, {})
        elif kind == "api":
            self.api(unquote(path[len("/api/") :]), parse_qs(parts.query), form)
        else:
            self.resolve(unquote(path), body)

    def api(self, path: str, query: dict[str, list[str]], form: dict[str, list[str]]) -> None:
        words = path.split("/")
        if len(words) < 3 or words[0] != "datasets":
            self.missing("RepoNotFound")
            return
        repo, rest = "/".join(words[1:3]), words[3:]
        if repo not in self.server.repos:
            self.missing("RepoNotFound")
            return
        rev = rest[1] if len(rest) >= 2 else "main"
        found = self.server.tree_at(repo, rev)
        if found is None:
            self.missing("RevisionNotFound")
            return
        sha, tree = found
        if not rest or rest[0] == "revision":
            self.json({"id": repo, "sha": sha, "private": False, "siblings": [{"rfilename": p} for p in sorted(tree)]})
        elif rest[0] == "tree":
            self.json(self.listing(tree, "/".join(rest[2:]), query.get("recursive", ["false"])[0].lower() == "true"))
        elif rest[0] == "paths-info":
            asked = form.get("paths", [])
            self.json([self.server.entry(p, tree[p]) for p in asked if p in tree])
        else:
            self.missing("EntryNotFound")

    def listing(self, tree: dict[str, bytes], folder: str, recursive: bool) -> list[dict[str, Any]]:
        prefix = folder.strip("/") + "/" if folder.strip("/") else ""
        out, folders = [], set()
        for path in sorted(tree):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix) :]
            if "/" in rest and not recursive:
                folders.add(prefix + rest.split("/", 1)[0])
                continue
            for i, _ in enumerate(rest.split("/")[:-1]):
                folders.add(prefix + "/".join(rest.split("/")[: i + 1]))
            out.append(self.server.entry(path, tree[path]))
        out += [{"type": "directory", "oid": blob_id(f.encode()), "size": 0, "path": f} for f in sorted(folders)]
        return out

    def resolve(self, path: str, body: bool) -> None:
        words = path.strip("/").split("/")
        if len(words) < 6 or words[0] != "datasets" or words[3] != "resolve":
            self.missing("RepoNotFound")
            return
        repo, rev, name = "/".join(words[1:3]), words[4], "/".join(words[5:])
        found = self.server.tree_at(repo, rev) if repo in self.server.repos else None
        if found is None:
            self.missing("RevisionNotFound" if repo in self.server.repos else "RepoNotFound")
            return
        sha, tree = found
        if name not in tree:
            self.missing("EntryNotFound")
            return
        data = tree[name]
        entry = self.server.entry(name, data)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{entry["oid"]}"'}
        if "lfs" in entry:
            sha256 = entry["lfs"]["oid"]
            headers.update(
                {"X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": str(len(data)), "Location": f"/cdn/{sha256}"}
            )
            self.answer(302, b"", headers)
            return
        self.content(data, body, headers)

    def content(self, data: bytes | None, body: bool, headers: dict[str, str]) -> None:
        if data is None:
            self.missing("EntryNotFound")
            return
        start, end, status = 0, len(data), 200
        asked = self.headers.get("Range")
        if asked and asked.startswith("bytes="):
            first, _, last = asked[len("bytes=") :].partition("-")
            start = int(first) if first else max(0, len(data) - int(last))
            end = min(len(data), int(last) + 1) if first and last else len(data)
            status = 206
            headers = {**headers, "Content-Range": f"bytes {start}-{end - 1}/{len(data)}"}
        headers.setdefault("ETag", f'"{hashlib.sha256(data).hexdigest()[:16]}-cdn"')
        piece = data[start:end]
        if body:
            with self.server.lock:
                self.server.served += len(piece)
        self.answer(status, piece, {**headers, "Accept-Ranges": "bytes"}, send=body)


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    """A :class:`HubServer` for the test, pointed at by ``HF_ENDPOINT`` (and
    huggingface_hub's constant read from it at import), this process's clients
    forgotten before and after (they were made for another endpoint)."""
    from huggingface_hub import constants

    from distshard.sources.transport.clients import forget_clients

    server = HubServer().start()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    forget_clients()
    try:
        yield server
    finally:
        forget_clients()
        server.stop()
