"""A virtual S3 bucket on 127.0.0.1 for bench_scale.py: millions of tar shards that
take no storage, beside a stored index that is real files on disk.

``python benchmarks/synthetic_s3.py --files N --folder DIR --port P`` serves the
bucket ``bench`` (path style, any signature accepted):

- ``data/shard-0000000.tar`` ... ``data/shard-{N-1}.tar``: WebDataset tars made on
  demand from their number (:func:`shard_bytes`; all of one size, each its own
  bytes and its own S3-like ETag, :func:`etag`), so a rank can read any of them;
- ``data/.distshard/<name>``: the file ``DIR/<name>`` (a stored index the benchmark
  wrote: ``manifest.json`` and its packs; a PUT writes there);
- GET (with ``Range``), HEAD, PUT and ListObjectsV2 (1,000 keys a page, ``prefix``,
  ``delimiter``, ``continuation-token``), as S3 answers them for what distshard asks.

``GET /__stats`` answers the requests and body bytes so far by kind (``GET``,
``HEAD``, ``LIST``, ``PUT``) and by what was asked (``manifest``, ``pack``,
``data``); ``POST /__reset`` sets them to 0. Listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import hashlib
import http.server
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit
from xml.sax.saxutils import escape

BUCKET = "bench"
DATA = "data/"
INDEX = DATA + ".distshard/"
SAMPLES = 8  # samples a shard
PAYLOAD = 16 << 10  # bytes of a sample's .bin member (and 64 of its .json)
PAGE = 1000  # keys of a ListObjectsV2 page


def shard_key(i: int) -> str:
    return f"{DATA}shard-{i:07d}.tar"


def etag(files: int, i: int) -> str:
    """Shard ``i``'s ETag as S3 sends it (quoted 32 hex digits), its own per shard."""
    return '"' + hashlib.md5(f"{files}:{i}".encode()).hexdigest() + '"'


@functools.lru_cache(maxsize=64)
def shard_bytes(i: int) -> bytes:
    """Shard ``i``: :data:`SAMPLES` samples ``{i:07d}-{j:02d}`` of a ``.json`` and a ``.bin`` member."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for j in range(SAMPLES):
            for ext, size in (("json", 64), ("bin", PAYLOAD)):
                info = tarfile.TarInfo(f"{i:07d}-{j:02d}.{ext}")
                info.size, info.mtime = size, 0
                tar.addfile(info, io.BytesIO(bytes([j % 256]) * size))
    return buf.getvalue()


SHARD_SIZE = len(shard_bytes(0))


class _Keys:
    """The bucket's keys in order, as a sequence (``bisect`` finds a listing's start)."""

    def __init__(self, files: int, folder: Path) -> None:
        self.files = files
        self.index = sorted(INDEX + p.name for p in folder.iterdir() if p.is_file())

    def __len__(self) -> int:
        return len(self.index) + self.files

    def __getitem__(self, k: int) -> str:  # ('.distshard/' sorts before 'shard-')
        return self.index[k] if k < len(self.index) else shard_key(k - len(self.index))


class Store:
    """What the server serves and what it counted."""

    def __init__(self, files: int, folder: Path) -> None:
        self.files, self.folder = files, folder
        self.lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self._etags: dict[str, tuple[tuple[int, int], str]] = {}

    def count(self, kind: str, what: str, body: int) -> None:
        with self.lock:
            self.requests[f"{kind} {what}"] += 1
            self.bytes[f"{kind} {what}"] += body

    def stats(self) -> dict[str, dict[str, int]]:
        with self.lock:
            return {"requests": dict(self.requests), "bytes": dict(self.bytes)}

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.bytes.clear()

    def shard(self, key: str) -> int | None:
        match = re.fullmatch(r"data/shard-(\d{7})\.tar", key)
        return int(match.group(1)) if match and int(match.group(1)) < self.files else None

    def stat(self, key: str) -> tuple[int, str] | None:
        """``(size, ETag)`` of ``key``, or ``None``."""
        i = self.shard(key)
        if i is not None:
            return SHARD_SIZE, etag(self.files, i)
        path = self.path(key)
        if path is None or not path.is_file():
            return None
        st = path.stat()
        known = self._etags.get(key)
        if known is None or known[0] != (st.st_size, st.st_mtime_ns):
            known = ((st.st_size, st.st_mtime_ns), '"' + hashlib.md5(path.read_bytes()).hexdigest() + '"')
            self._etags[key] = known
        return st.st_size, known[1]

    def path(self, key: str) -> Path | None:
        if not key.startswith(INDEX) or "/" in key[len(INDEX) :]:
            return None
        return self.folder / key[len(INDEX) :]

    def read(self, key: str, start: int, stop: int) -> bytes:
        i = self.shard(key)
        if i is not None:
            return shard_bytes(i)[start:stop]
        path = self.path(key)
        assert path is not None
        with path.open("rb") as f:
            f.seek(start)
            return f.read(stop - start)

    def listing(self, prefix: str, delimiter: str, after: str) -> tuple[list[str], list[str], str | None]:
        """One ListObjectsV2 page: ``(keys, common prefixes, next token)``."""
        keys = _Keys(self.files, self.folder)
        k = bisect.bisect_right(keys, max(after, prefix)) if after else bisect.bisect_left(keys, prefix)
        found: list[str] = []
        prefixes: list[str] = []
        while k < len(keys) and len(found) + len(prefixes) < PAGE:
            key = keys[k]
            if not key.startswith(prefix):
                break
            rest = key[len(prefix) :]
            if delimiter and delimiter in rest:
                common = prefix + rest.split(delimiter, 1)[0] + delimiter
                if not prefixes or prefixes[-1] != common:
                    prefixes.append(common)
                k = bisect.bisect_left(keys, common + "\uffff")
                continue
            found.append(key)
            k += 1
        more = k < len(keys) and keys[k].startswith(prefix)
        return found, prefixes, keys[k - 1] if more else None


def what_of(key: str) -> str:
    if key.endswith("/manifest.json"):
        return "manifest"
    if key.startswith(INDEX) and key.endswith(".bin"):  # a version 3 manifest's columns and pages
        return "columns" if key.startswith(INDEX + "columns-") else "pages"
    return "pack" if key.startswith(INDEX) else "data"


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "Server"

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _key(self) -> tuple[str, dict[str, list[str]]]:
        parts = urlsplit(self.path)
        bucket, _, key = parts.path.lstrip("/").partition("/")
        query = parse_qs(parts.query, keep_blank_values=True)
        if bucket != BUCKET:
            return "", query
        from urllib.parse import unquote

        return unquote(key), query

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None, head: bool = False) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _missing(self, head: bool = False) -> None:
        body = b"<Error><Code>NoSuchKey</Code><Message>no such key</Message></Error>"
        self._send(404, b"" if head else body, {"Content-Type": "application/xml"}, head)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/__reset":
            self.server.store.reset()
        self._send(200, b"{}")

    def do_HEAD(self) -> None:
        key, _ = self._key()
        found = self.server.store.stat(key)
        self.server.store.count("HEAD", what_of(key), 0)
        if found is None:
            return self._missing(head=True)
        self.send_response(200)
        self.send_header("Content-Length", str(found[0]))
        self.send_header("ETag", found[1])
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()

    def do_PUT(self) -> None:
        key, _ = self._key()
        data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = self.server.store.path(key)
        self.server.store.count("PUT", what_of(key), len(data))
        if path is None:
            return self._send(403, b"<Error><Code>AccessDenied</Code><Message>read only</Message></Error>")
        tmp = path.with_name(path.name + ".part")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        self._send(200, b"", {"ETag": '"' + hashlib.md5(data).hexdigest() + '"'})

    def do_GET(self) -> None:
        if self.path == "/__stats":
            return self._send(200, json.dumps(self.server.store.stats()).encode())
        key, query = self._key()
        if "list-type" in query:
            return self._list(query)
        store = self.server.store
        found = store.stat(key)
        if found is None:
            store.count("GET", what_of(key), 0)
            return self._missing()
        size, tag = found
        match = self.headers.get("If-Match")
        if match is not None and match != tag:
            store.count("GET", what_of(key), 0)
            return self._send(412, b"<Error><Code>PreconditionFailed</Code><Message>etag</Message></Error>")
        start, stop, status = 0, size, 200
        asked = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range") or "")
        if asked is not None:
            if asked.group(1):
                start = int(asked.group(1))
                stop = min(size, int(asked.group(2)) + 1) if asked.group(2) else size
            else:
                start = max(0, size - int(asked.group(2)))
            status = 206
        body = store.read(key, start, stop)
        store.count("GET", what_of(key), len(body))
        headers = {"ETag": tag, "Accept-Ranges": "bytes"}
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        self._send(status, body, headers)

    def _list(self, query: dict[str, list[str]]) -> None:
        prefix = (query.get("prefix") or [""])[0]
        delimiter = (query.get("delimiter") or [""])[0]
        after = (query.get("continuation-token") or query.get("start-after") or [""])[0]
        keys, prefixes, token = self.server.store.listing(prefix, delimiter, after)
        url = (query.get("encoding-type") or [""])[0] == "url"
        name = (lambda k: quote(k, safe="/")) if url else escape
        parts = [f"<ListBucketResult><Name>{BUCKET}</Name><Prefix>{name(prefix)}</Prefix>",
                 f"<KeyCount>{len(keys) + len(prefixes)}</KeyCount><MaxKeys>{PAGE}</MaxKeys>",
                 f"<IsTruncated>{'true' if token else 'false'}</IsTruncated>"]
        if url:
            parts.append("<EncodingType>url</EncodingType>")
        if token:
            parts.append(f"<NextContinuationToken>{escape(token)}</NextContinuationToken>")
        for key in keys:
            size, tag = self.server.store.stat(key) or (0, "")
            parts.append(f"<Contents><Key>{name(key)}</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
                         f"<ETag>{escape(tag)}</ETag><Size>{size}</Size><StorageClass>STANDARD</StorageClass>"
                         "</Contents>")
        parts += [f"<CommonPrefixes><Prefix>{name(p)}</Prefix></CommonPrefixes>" for p in prefixes]
        body = ('<?xml version="1.0" encoding="UTF-8"?>' + "".join(parts) + "</ListBucketResult>").encode()
        self.server.store.count("LIST", "listing", len(body))
        self._send(200, body, {"Content-Type": "application/xml"})


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, store: Store) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.store = store


class Running:
    """The server in its own process (its RSS and CPU are not the rank's):
    ``endpoint``, ``stats()``, ``reset()``; a context manager that stops it."""

    def __init__(self, files: int, folder: Path, timeout: float = 60.0) -> None:
        from latency_proxy import free_port

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, __file__, "--files", str(files), "--folder", str(folder), "--port", str(self.port)]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.stats()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"the synthetic S3 server did not start (exit {self.proc.returncode})") from None
                time.sleep(0.05)

    def _call(self, path: str, data: bytes | None = None) -> dict:
        with urllib.request.urlopen(urllib.request.Request(self.endpoint + path, data=data), timeout=30) as answer:
            return json.loads(answer.read())

    def stats(self) -> dict[str, dict[str, int]]:
        return self._call("/__stats")

    def reset(self) -> None:
        self._call("/__reset", b"")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def __enter__(self) -> "Running":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_stored_index(folder: Path, files: int, endpoint_bucket: str = f"s3://{BUCKET}",
                       version: int = 3) -> dict[str, int]:
    """The stored index ``python -m distshard index s3://bench/data/`` would write
    for the ``files`` shards (packs of 64 MiB of entries; the manifest naming each
    file's pack and range: format ``version`` 3, its head, columns and pages, as the
    command writes it, or 2, as it wrote it before), written into ``folder``; its
    bytes by kind. Each entry is the real one of its shard (built from shard 0's
    index, with the shard's own URL, ETag and sample keys)."""
    from dataclasses import replace

    from distshard.sources.formats.index_cache import dumps
    from distshard.sources.formats.tar import TarFormat
    from distshard.sources.stored import manifest
    from distshard.sources.stored.entry_packs import pack_entry
    from distshard.sources.transport.files import FileRef

    folder.mkdir(parents=True, exist_ok=True)
    sample = folder / "shard-sample.tar"
    sample.write_bytes(shard_bytes(0))
    st = sample.stat()
    template = TarFormat().build_index(FileRef(str(sample), st.st_size, str(st.st_mtime_ns)))
    sample.unlink()
    location = f"{endpoint_bucket}/{INDEX.rstrip('/')}"
    listed, pack, chunks, at, written = [], 0, [], 0, 0
    for i in range(files):
        url = f"{endpoint_bucket}/{shard_key(i)}"
        keys = [f"{i:07d}-{j:02d}" for j in range(SAMPLES)]
        entry = dumps(replace(template, key=url, size=SHARD_SIZE, stamp=etag(files, i),
                              strings={**template.strings, "keys": keys}))
        name = f"entries-synthetic-{pack:04d}.pack"
        listed.append(manifest.StoredFile(url, template.format, SAMPLES, SHARD_SIZE, etag(files, i),
                                          pack_entry(f"{location}/{name}", at, at + len(entry))))
        chunks.append(entry)
        at += len(entry)
        if at >= 64 << 20 or i == files - 1:
            (folder / name).write_bytes(b"".join(chunks))
            written += at
            pack, chunks, at = pack + 1, [], 0
    if version == 2:
        data = manifest.dumps(location, listed)
        objects: dict[str, bytes] = {}
    else:
        encoded = manifest.encode3(location, listed, "synthetic")
        data, objects = encoded.head, encoded.objects
    for name, blob in objects.items():
        (folder / name).write_bytes(blob)
    (folder / manifest.MANIFEST).write_bytes(data)
    sizes = {name.split("-", 1)[0] + "_bytes": len(blob) for name, blob in objects.items()}
    return {"manifest_bytes": len(data), "pack_bytes": written, "packs": pack, "version": version, **sizes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, required=True)
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    Server(args.port, Store(args.files, args.folder)).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
