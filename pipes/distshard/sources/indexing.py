"""Building a stored index (``python -m distshard index URLS``), in parallel and resumable.

A remote file on HTTP(S) or S3 is indexed from one request: a streamed GET whose
response gives its identity and whose body is parsed as it flows (see
:mod:`.streamed`); no HEAD, and the file is never held whole. Remote files are
indexed by threads (``--workers``, default :data:`REMOTE_WORKERS`: their time is
spent waiting on the store), local files by processes (their header walk is CPU).

Entries are written a pack at a time (:mod:`.packs`: one object for many
files), each pack followed by the manifest listing every file done so far, so an
interrupted build goes on where its last pack ended: a file an earlier build
listed is not read again while it is the same version (one metadata request).
The manifest lists the files of this build and those an earlier build of the
same folder listed.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from ..errors import OptionError, SourceMissingError, UnsupportedError
from . import manifest
from .files import FileAccess, FileRef, file_identity
from .index import dumps, load_cached
from .jsonl import JsonlFormat
from .manifest import StoredFile
from .packs import pack_entry
from .parquet import ParquetFormat, require_pyarrow
from .tar import TarFormat
from .urls import expand_urls, is_remote

__all__ = ["Built", "build_stored_index", "format_named", "format_of"]

log = logging.getLogger("distshard")

_SUFFIXES = {
    ".tar": "webdataset",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
}
FORMATS = ("webdataset", "jsonl", "parquet")

#: called as files finish: (files done, files, bytes done, seconds so far)
Progress = Callable[[int, int, int, float], None]


def format_named(name: str) -> Any:
    """The format object of ``name`` (``webdataset``, ``jsonl``, ``parquet``)."""
    if name == "webdataset":
        return TarFormat()
    if name == "jsonl":
        return JsonlFormat()
    if name == "parquet":
        require_pyarrow()
        return ParquetFormat(None)
    raise OptionError(f"unknown format {name!r}: one of {', '.join(FORMATS)}")


def format_of(url: str) -> str:
    """The format a file's name announces; ``ValueError`` naming it otherwise."""
    base = url.split("?", 1)[0].lower()
    for suffix, name in _SUFFIXES.items():
        if base.endswith(suffix):
            return name
    raise OptionError(
        f"{url}: cannot tell its format from its name (.tar, .jsonl, .parquet are indexed; "
        "compressed files are streamed whole and need no index): pass --format"
    )


@dataclass
class Built:
    """What a build did: where, the files listed, how many were indexed now."""

    location: str
    files: list[StoredFile]
    built: int
    seconds: float
    total_bytes: int


#: a pack (and the manifest naming it) is written when it holds this many bytes of
#: entries or its first entry is this many seconds old: what an interruption can lose
FLUSH_BYTES = 64 << 20
FLUSH_SECONDS = 30.0
REMOTE_WORKERS = 32  # files indexed at once by default (threads: each waits on one streamed GET)


def _index_one(url: str, fmt_name: str, storage_options: Mapping[str, Any] | None) -> tuple[StoredFile, bytes]:
    """One file indexed: ``(StoredFile without its entry's place, the entry's
    bytes)``. Remote files on HTTP(S) and S3 with one streamed GET (its response
    gives the identity); other files with their identity (a ``stat``, a metadata
    request) and then reads. Runs in a thread or a worker process."""
    access = FileAccess(storage_options=dict(storage_options) if storage_options else None)
    fmt = format_named(fmt_name)
    if fmt.compression(url):
        raise UnsupportedError(f"{url} is compressed: it is streamed whole and has no index to store")
    index = None
    if is_remote(url) and hasattr(fmt, "index_stream"):
        from .streamed import index_streamed, streams

        if streams(access.client(url)):
            ref, index = index_streamed(fmt, url, access)
    if index is None:
        ref = FileRef(url, *file_identity(url, access))
        index = (None if is_remote(url) else load_cached(fmt_name, ref)) or fmt.build_index(ref, access)
    assert ref.size is not None and ref.stamp is not None
    return StoredFile(url, fmt_name, index.count, ref.size, ref.stamp, ""), dumps(index)


def _unchanged(item: StoredFile, storage_options: Mapping[str, Any] | None) -> bool:
    """Whether a file an earlier build listed is still the version it indexed
    (a ``stat``, or one metadata request): then it is not read again."""
    access = FileAccess(storage_options=dict(storage_options) if storage_options else None)
    try:
        return file_identity(item.url, access) == (item.size, item.stamp)
    except FileNotFoundError:
        return False


def _executor(remote: bool, count: int, workers: int | None) -> Executor:
    if remote:
        return ThreadPoolExecutor(
            max_workers=max(1, min(count, workers or REMOTE_WORKERS)), thread_name_prefix="distshard-index"
        )
    if (workers or os.cpu_count() or 1) <= 1 or count <= 1:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="distshard-index")
    import multiprocessing

    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    return ProcessPoolExecutor(max_workers=min(count, workers or os.cpu_count() or 1), mp_context=context)


class _Packs:
    """The entries indexed since the last write, written as one pack (in the
    order of the files), then the manifest naming it (see :mod:`.packs`)."""

    def __init__(self, location: str, access: FileAccess, order: Mapping[str, int]) -> None:
        self.location, self.access, self.order = location, access, order
        self.build = f"{time.time_ns():x}{secrets.token_hex(3)}"
        self.written = 0
        self.items: list[tuple[StoredFile, bytes]] = []
        self.bytes = 0
        self.since = 0.0

    def add(self, item: StoredFile, data: bytes) -> None:
        if not self.items:
            self.since = time.monotonic()
        self.items.append((item, data))
        self.bytes += len(data)

    def due(self) -> bool:
        return bool(self.items) and (self.bytes >= FLUSH_BYTES or time.monotonic() - self.since >= FLUSH_SECONDS)

    def write(self) -> list[StoredFile]:
        """Write the pack (one request); the files with their entries' places."""
        if not self.items:
            return []
        items = sorted(self.items, key=lambda pair: self.order.get(pair[0].url, -1))
        self.items, self.bytes = [], 0
        pack = manifest.join(self.location, f"entries-{self.build}-{self.written:04d}.pack")
        self.written += 1
        out, at = [], 0
        for item, data in items:
            out.append(replace(item, entry=pack_entry(pack, at, at + len(data))))
            at += len(data)
        manifest.write(pack, b"".join(data for _, data in items), self.access)
        return out


def build_stored_index(
    patterns: list[str],
    *,
    fmt: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    out: str | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
) -> Built:
    """Index the files ``patterns`` name (paths, URLs, globs, brace patterns; or
    one stored index's folder, whose files are indexed again) into ``out``
    (default: ``.distshard/`` beside the first file) and write its manifest.

    A remote file costs one request (a streamed GET; a file an earlier build
    listed, one metadata request while it is unchanged); the entries are written
    a pack at a time, each followed by the manifest, so an interrupted build
    goes on where its last pack ended (at most :data:`FLUSH_SECONDS` of work)."""
    access = FileAccess(storage_options=dict(storage_options) if storage_options else None)
    formats: dict[str, str] = {}
    previous: manifest.Stored | None = None
    if len(patterns) == 1 and out is None and _names_stored(patterns[0]):
        out = manifest.location_of(patterns[0])
        previous = manifest.load(out, access)
        if previous is None:
            raise SourceMissingError(f"no stored index at {out} to refresh")
        urls = [f.url for f in previous.files.values()]
        formats = {f.url: f.format for f in previous.files.values()}
    else:
        urls = [url for pattern in patterns for url in expand_urls(pattern, storage_options)]
    if not urls:
        raise OptionError("no files to index")
    urls = list(dict.fromkeys(urls))
    remote = any(is_remote(url) for url in urls)
    storage_options = _pooled(storage_options, urls, workers or REMOTE_WORKERS)
    access = FileAccess(storage_options=dict(storage_options) if storage_options else None)
    location = out.rstrip("/") if out else manifest.default_location(urls)
    for url in urls:
        formats.setdefault(url, fmt or format_of(url))
    started = time.monotonic()
    if previous is None:
        try:
            previous = manifest.load(location, access)
        except ValueError as exc:  # not one this distshard reads: rebuilt whole
            log.info("%s: %s; indexing every file again", location, exc)
    listed: dict[str, StoredFile] = {f.url: f for f in previous.files.values()} if previous is not None else {}
    order = {url: k for k, url in enumerate(urls)}
    packs = _Packs(location, access, order)
    done: dict[str, StoredFile] = {}
    built = total_bytes = 0
    errors: list[str] = []

    def write_manifest() -> list[StoredFile]:
        """The files an earlier build listed and this one does not, then this
        build's in order (indexed now, kept, or as listed before while unchecked)."""
        files = [f for url, f in listed.items() if url not in order]
        files += [done.get(url) or listed[url] for url in urls if url in done or url in listed]
        manifest.write(manifest.join(location, manifest.MANIFEST), manifest.dumps(location, files), access)
        return files

    def finished(item: StoredFile) -> None:
        nonlocal total_bytes
        total_bytes += item.size
        if progress is not None:
            progress(len(done) + len(packs.items), len(urls), total_bytes, time.monotonic() - started)

    with _executor(remote, len(urls), workers) as pool:
        futures: dict[Future[Any], tuple[str, bool]] = {}
        for url in urls:
            old = listed.get(url)
            if old is not None and old.format == formats[url]:
                futures[pool.submit(_unchanged, old, storage_options)] = (url, True)
            else:
                futures[pool.submit(_index_one, url, formats[url], storage_options)] = (url, False)
        while futures:
            for future in as_completed(list(futures)):
                url, checking = futures.pop(future)
                try:
                    result = future.result()
                except Exception as exc:  # noqa: BLE001 - every failure is reported, the rest kept
                    errors.append(f"{url}: {type(exc).__name__}: {exc}")
                    continue
                if checking:
                    if result:  # still the indexed version: listed as it is
                        done[url] = listed[url]
                        finished(listed[url])
                    else:
                        futures[pool.submit(_index_one, url, formats[url], storage_options)] = (url, False)
                        break  # wait for it with the others
                    continue
                item, data = result
                packs.add(item, data)
                built += 1
                finished(item)
                if packs.due():
                    done.update((f.url, f) for f in packs.write())
                    write_manifest()
    done.update((f.url, f) for f in packs.write())
    files = write_manifest() if done or listed else []  # (nothing indexed, nothing listed: no folder made)
    seconds = time.monotonic() - started
    log.info(
        "stored index at %s: %d files (%d indexed now, %d already there), %d bytes in %.1f s",
        location,
        len(done),
        built,
        len(done) - built,
        total_bytes,
        seconds,
    )
    if errors:
        raise OSError(
            f"{len(errors)} of {len(urls)} files could not be indexed (the others are in {location}; "
            "run the command again to retry them):\n  " + "\n  ".join(errors[:20])
        )
    return Built(location, files, built, seconds, total_bytes)


def _pooled(storage_options: Mapping[str, Any] | None, urls: list[str], workers: int) -> Mapping[str, Any] | None:
    """S3's client keeps 10 connections unless told (botocore's
    ``max_pool_connections``): as many as files are indexed at once, unless the
    storage options say otherwise."""
    if not any(url.split("://", 1)[0].lower() in ("s3", "s3a") for url in urls):
        return storage_options
    options = dict(storage_options or {})
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("max_pool_connections", max(10, workers))
    options["config_kwargs"] = config
    return options


def _names_stored(text: str) -> bool:
    name = text.rstrip("/").rsplit("/", 1)[-1]
    return name in (manifest.FOLDER, manifest.MANIFEST)
