"""Building a stored index (``python -m distshard index URLS``), in parallel and resumable.

A remote file on HTTP(S) or S3 is indexed from one request: a streamed GET whose
response gives its identity and whose body is parsed as it flows (see
:mod:`.streamed`); no HEAD, and the file is never held whole. A Parquet file's
index is its footer: one suffix GET of its end gives the identity and the footer
(a second range only for a footer longer than :data:`.parquet.TAIL`). Remote files are
indexed by threads (``--workers``, default :data:`REMOTE_WORKERS`: their time is
spent waiting on the store), local files by processes (their header walk is CPU).

Entries are written a pack at a time (:mod:`.entry_packs`: one object for many
files), each pack followed by the manifest listing every file done so far
(format version 3, :mod:`.manifest3`: its columns and pages, then its head; a
version 2 index refreshed is upgraded in place), so an
interrupted build goes on where its last pack ended: a file an earlier build
listed is not read again while it is the same version (one metadata request;
on S3, the listing of its folder answers 1,000 files a request, so a refresh of an
unchanged dataset costs about files / 1,000 requests). The manifest lists the files of this build and those an earlier build of the
same folder listed.

A file that cannot be indexed is reported and the others go on
(:class:`IndexBuildError` names them all at the end), unless its failure is not
the file's but the store's or the credentials' (a missing bucket, a store no
attempt could connect to, access denied): then the files not started are not
read, and the error says so (``could_not_run``). A destination that cannot be
written (http(s), a local path without a folder one may write) is refused before
any file is read.
"""

from __future__ import annotations

import logging
import os
import posixpath
import secrets
import time
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, Mapping

from ...errors import DistshardError, OptionError, SourceMissingError, UnsupportedError
from ..formats.index_cache import dumps, load_cached
from ..formats.jsonl import JsonlFormat
from ..formats.parquet import ParquetFormat, require_pyarrow
from ..formats.tar import TarFormat
from ..reading.confirm import confirm, listable
from ..transport.files import FileAccess, FileRef, file_identity, identify, local_path
from ..transport.responses import READ_ONLY, MissingBucketError, StoreUnreachable, read_only
from ..transport.urls import expand_urls, is_remote
from . import manifest
from .entry_packs import entry_range, pack_entry
from .manifest import StoredFile
from .pruning import Pruned, check_grace, prune_packs

__all__ = ["Built", "IndexBuildError", "build_stored_index", "format_named", "format_of", "named_packs"]

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
    """What a build did: where, the files listed, how many were indexed now, and
    (``prune_after``) the packs it deleted or kept."""

    location: str
    files: list[StoredFile]
    built: int
    seconds: float
    total_bytes: int
    pruned: Pruned | None = field(default=None)
    objects: set[str] = field(default_factory=set)  # the columns and pages its manifest names (version 3)


class IndexBuildError(DistshardError, OSError):
    """Files that could not be indexed (``failures``: ``"url: error"`` each, of
    ``total`` files). ``could_not_run``: the build stopped at a failure that is
    not a file's but the store's or the credentials' (a missing bucket, no
    connection to the store, access denied), told first. ``listed``: how many
    files the manifest written at ``location`` lists (0: nothing was written)."""

    def __init__(self, failures: list[str], total: int, location: str, listed: int, stop: str | None) -> None:
        self.failures, self.total, self.location, self.listed = failures, total, location, listed
        self.could_not_run = stop is not None
        kept = f"the manifest at {location} lists {listed} files" if listed else f"nothing was written to {location}"
        if stop is not None:
            message = f"{stop} ({kept}; run the command again once that is fixed)"
        else:
            shown = "\n  ".join(failures[:20]) + (
                f"\n  ... and {len(failures) - 20} more" if len(failures) > 20 else ""
            )
            again = ": run the command again to retry them" if listed else ""
            message = f"{len(failures)} of {total} files could not be indexed ({kept}{again}):\n  {shown}"
        super().__init__(message)


def _stops(url: str, exc: BaseException) -> bool:
    """Whether the failure of the file ``url`` is the store's or the credentials',
    not the file's: the build stops (the other files would fail the same way)."""
    return isinstance(exc, (MissingBucketError, StoreUnreachable)) or (
        isinstance(exc, PermissionError) and is_remote(url)
    )


def _check_writable(location: str) -> None:
    """Refuse, before any file is read, a destination the build cannot write:
    http(s) or hf:// (read-only), or a local path whose nearest existing folder this process
    may not write into (an object store answers the first write)."""
    if location.split("://", 1)[0].lower() in READ_ONLY:
        raise read_only(location)
    if is_remote(location):
        return
    path = os.path.abspath(local_path(location))
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {location} ({path} is not a folder you can write): give --out one")


#: a pack (and the manifest naming it) is written when it holds this many bytes of
#: entries or its first entry is this many seconds old: what an interruption can lose
FLUSH_BYTES = 64 << 20
FLUSH_SECONDS = 30.0
# of the time since the last manifest, at most this share goes to writing the next: a manifest names
# every file so far (its columns and pages grow with them), so a long build does not write 10^6 files'
# pages at every pack
MANIFEST_SHARE = 0.1
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
        from ..transport.streamed import index_streamed, streams

        if streams(access.client(url)):
            ref, index = index_streamed(fmt, url, access)
    if index is None:  # (a remote Parquet file: its identity and footer in one suffix GET)
        ref = FileRef(url, *identify(fmt, url, access))
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


def _listed_unchanged(items: list[StoredFile], storage_options: Mapping[str, Any] | None) -> list[tuple[str, bool]]:
    """Whether each of ``items`` (files an earlier build listed, all in one S3
    folder) is still the version it indexed, from the folder's listing
    (ListObjectsV2: 1,000 objects with their sizes and ETags a request, see
    :func:`.confirm.confirm`) instead of a metadata request each."""
    access = FileAccess(storage_options=dict(storage_options) if storage_options else None)
    refs = [FileRef(item.url, item.size, item.stamp, item.entry or item.url) for item in items]
    verdicts = confirm(None, refs, range(len(refs)), access)
    return [(ref.url, k in verdicts and verdicts[k] is None) for k, ref in enumerate(refs)]


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
    order of the files), then the manifest naming it (see :mod:`.entry_packs`)."""

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
    prune_after: float | None = None,
) -> Built:
    """Index the files ``patterns`` name (paths, URLs, globs, brace patterns; or
    one stored index's folder, whose files are indexed again) into ``out``
    (default: ``.distshard/`` beside the first file) and write its manifest.

    A remote file costs one request (a streamed GET; a file an earlier build
    listed, one metadata request while it is unchanged, or a thousandth of its
    S3 folder's listing); the entries are written
    a pack at a time, followed by the manifest (unless the last manifest took more
    than :data:`MANIFEST_SHARE` of the time since), so an interrupted build goes on
    where the last manifest ended (at most :data:`FLUSH_SECONDS` of work, or ten
    times the manifest's write).

    ``prune_after`` (seconds): once the manifest is written and every file indexed,
    delete the packs in ``out`` it does not name that are older than that
    (:func:`.pruning.prune_packs`); ``None`` keeps them all."""
    if prune_after is not None:
        check_grace(prune_after)
    urls, formats, previous, out = _what_to_index(patterns, fmt, storage_options, out)
    remote = any(is_remote(url) for url in urls)
    storage_options = _pooled(storage_options, urls, workers or REMOTE_WORKERS)
    access = FileAccess(storage_options=dict(storage_options) if storage_options else None)
    location = out.rstrip("/") if out else manifest.default_location(urls)
    _check_writable(location)
    if previous is None:
        try:
            previous = manifest.load(location, access)
        except ValueError as exc:  # not one this distshard reads: rebuilt whole
            log.info("%s: %s; indexing every file again", location, exc)
    build = _Build(location, access, urls, formats, previous, storage_options, progress)
    with _executor(remote, len(urls), workers) as pool:
        try:
            build.run(pool)
        except BaseException:  # (a pack that cannot be written, Ctrl-C): the files not started are not read
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    built = build.finish()
    if prune_after is not None and built.files:
        named = named_packs(built.files) | built.objects
        built.pruned = prune_packs(location, named, prune_after, storage_options)
    return built


def named_packs(files: list[StoredFile]) -> set[str]:
    """The names of the packs the entries of ``files`` are in (what their manifest names)."""
    return {posixpath.basename(found[0]) for found in map(entry_range, (f.entry for f in files)) if found is not None}


def _what_to_index(
    patterns: list[str], fmt: str | None, storage_options: Mapping[str, Any] | None, out: str | None
) -> tuple[list[str], dict[str, str], manifest.Stored | None, str | None]:
    """``(urls, format of each, the stored index refreshed or None, out)``: the files
    the patterns name, or those of the one stored index's folder they name."""
    formats: dict[str, str] = {}
    previous: manifest.Stored | None = None
    if len(patterns) == 1 and out is None and _names_stored(patterns[0]):
        access = FileAccess(storage_options=dict(storage_options) if storage_options else None)
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
    for url in urls:
        formats.setdefault(url, fmt or format_of(url))
    return urls, formats, previous, out


class _Build:
    """One run of the index command: what an earlier build listed, the files done,
    the pack being filled, the bytes and errors so far."""

    def __init__(
        self,
        location: str,
        access: FileAccess,
        urls: list[str],
        formats: dict[str, str],
        previous: manifest.Stored | None,
        storage_options: Mapping[str, Any] | None,
        progress: Progress | None,
    ) -> None:
        self.location, self.access, self.urls, self.formats = location, access, urls, formats
        self.storage_options, self.progress = storage_options, progress
        self.listed: dict[str, StoredFile] = {f.url: f for f in previous.files.values()} if previous else {}
        # an index copied here from elsewhere: its entries name the files there, so a file whose stamp does
        # not identify its bytes is indexed again (an S3 ETag does: its entry is kept, one HEAD)
        self.moved = previous is not None and previous.moved_from is not None
        self.order = {url: k for k, url in enumerate(urls)}
        self.packs = _Packs(location, access, self.order)
        self.done: dict[str, StoredFile] = {}
        self.built = self.total_bytes = 0
        self.errors: list[str] = []
        self.stop: str | None = None  # the failure that stopped the build (see _stops)
        self.started = time.monotonic()
        self.manifests = 0  # manifests written (each names its own columns and pages: version 3)
        self.manifest_at, self.manifest_seconds = self.started, 0.0  # when the last was written, and how long it took
        self.objects: set[str] = set()  # the columns and pages the last manifest names

    def write_manifest(self) -> list[StoredFile]:
        """The files an earlier build listed and this one does not, then this
        build's in order (indexed now, kept, or as listed before while unchecked)."""
        files = [f for url, f in self.listed.items() if url not in self.order]
        files += [self.done.get(url) or self.listed[url] for url in self.urls if url in self.done or url in self.listed]
        started = time.monotonic()
        encoded = manifest.encode3(self.location, files, f"{self.packs.build}-{self.manifests:04d}")
        self.manifests += 1
        for name, data in encoded.objects.items():  # (before the head naming them)
            manifest.write(manifest.join(self.location, name), data, self.access)
        manifest.write(manifest.join(self.location, manifest.MANIFEST), encoded.head, self.access)
        self.objects = set(encoded.objects)
        self.manifest_at = time.monotonic()
        self.manifest_seconds = self.manifest_at - started
        return files

    def manifest_due(self) -> bool:
        """Whether a pack written now is followed by the manifest: when the last one
        took at most :data:`MANIFEST_SHARE` of the time since (so a long build spends
        at most about a tenth of its time on manifests, however many files it has)."""
        return self.manifest_seconds <= MANIFEST_SHARE * (time.monotonic() - self.manifest_at)

    def finished(self, item: StoredFile) -> None:
        self.total_bytes += item.size
        if self.progress is not None:
            done = len(self.done) + len(self.packs.items)
            self.progress(done, len(self.urls), self.total_bytes, time.monotonic() - self.started)

    def checkable(self, url: str) -> StoredFile | None:
        """What an earlier build listed of ``url`` if it is only checked, not read
        again, while unchanged: of the same format, and not moved (or its stamp
        identifies its bytes)."""
        old = self.listed.get(url)
        if (
            old is not None
            and old.format == self.formats[url]
            and (not self.moved or manifest.identifies_content(old.url, old.stamp))
        ):
            return old
        return None

    def submit(self, pool: Executor, url: str) -> tuple[Future[Any], tuple[Any, str]]:
        """A listed file of the same format is checked (one metadata request); any
        other is indexed."""
        old = self.checkable(url)
        if old is not None:
            return pool.submit(_unchanged, old, self.storage_options), (url, "check")
        return self.index(pool, url)

    def index(self, pool: Executor, url: str) -> tuple[Future[Any], tuple[Any, str]]:
        return pool.submit(_index_one, url, self.formats[url], self.storage_options), (url, "index")

    def submit_all(self, pool: Executor) -> Iterator[tuple[Future[Any], tuple[Any, str]]]:
        """Every file's task: the listed S3 files of a folder checked by its listing
        (one task a folder of two or more), the other listed files one by one, the rest indexed."""
        folders: dict[str, list[StoredFile]] = {}
        for url in self.urls:
            old = self.checkable(url)
            if old is not None and listable(FileRef(old.url, old.size, old.stamp)):
                folders.setdefault(posixpath.dirname(url), []).append(old)
        by_listing: set[str] = set()
        for items in folders.values():
            if len(items) > 1:
                by_listing.update(item.url for item in items)
                yield pool.submit(_listed_unchanged, items, self.storage_options), (items, "list")
        for url in self.urls:
            if url not in by_listing:
                yield self.submit(pool, url)

    def run(self, pool: Executor) -> None:
        futures: dict[Future[Any], tuple[Any, str]] = dict(self.submit_all(pool))
        while futures:
            for future in as_completed(list(futures)):
                what, kind = futures.pop(future)
                if future.cancelled():
                    continue
                try:
                    result = future.result()
                except Exception as exc:  # noqa: BLE001 - every failure is reported, the rest kept
                    if kind != "list":
                        self.failed(what, exc, futures)
                        continue
                    folder = posixpath.dirname(what[0].url)
                    log.info(
                        "cannot list %s (%s: %s): a metadata request a file instead", folder, type(exc).__name__, exc
                    )
                    futures.update(self.submit(pool, item.url) for item in what)
                    break
                if kind == "index":
                    self.add(*result)
                    continue
                again = self.checked(result if kind == "list" else [(what, result)])
                if again:
                    futures.update(self.index(pool, url) for url in again)
                    break  # wait for them with the others

    def checked(self, verdicts: Iterable[tuple[str, bool]]) -> list[str]:
        """The files an earlier build listed, checked: those still the version it
        indexed are listed as they are; the others, to index again (none once the build stopped)."""
        again = []
        for url, same in verdicts:
            if same:
                self.done[url] = self.listed[url]
                self.finished(self.listed[url])
            elif self.stop is None:
                again.append(url)
        return again

    def failed(self, url: str, exc: BaseException, pending: Mapping[Future[Any], Any]) -> None:
        """A file's failure, reported; one of the store's stops the build: the
        files not started yet are not read."""
        self.errors.append(f"{url}: {type(exc).__name__}: {exc}")
        if self.stop is None and _stops(url, exc):
            self.stop = str(exc)
            for future in pending:
                future.cancel()

    def add(self, item: StoredFile, data: bytes) -> None:
        self.packs.add(item, data)
        self.built += 1
        self.finished(item)
        if self.packs.due():
            self.done.update((f.url, f) for f in self.packs.write())
            if self.manifest_due():
                self.write_manifest()

    def finish(self) -> Built:
        """The last pack and the manifest; the errors raised, naming the files."""
        self.done.update((f.url, f) for f in self.packs.write())
        files = self.write_manifest() if self.done or self.listed else []  # nothing at all: no folder made
        seconds = time.monotonic() - self.started
        log.info(
            "stored index at %s: %d files (%d indexed now, %d already there), %d bytes in %.1f s",
            self.location,
            len(self.done),
            self.built,
            len(self.done) - self.built,
            self.total_bytes,
            seconds,
        )
        if self.errors:
            raise IndexBuildError(self.errors, len(self.urls), self.location, len(files), self.stop)
        return Built(self.location, files, self.built, seconds, self.total_bytes, objects=self.objects)


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
