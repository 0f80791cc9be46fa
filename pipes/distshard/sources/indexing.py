"""Building a stored index (``python -m distshard index URLS``), in parallel and resumable.

Every file gets an entry written as soon as it is indexed (see :mod:`.manifest`),
so an interrupted build goes on where it stopped: a file whose entry is already
there for its current identity is not read again. Remote files are indexed by
threads (their time is spent waiting on ranges); local files by processes
(their header walk is CPU). The manifest is written last, listing the files of
this build and those an earlier build of the same folder listed.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..errors import OptionError, SourceMissingError, UnsupportedError
from . import manifest
from .files import FileAccess, FileRef, file_identity
from .index import dumps, load_cached, loads
from .jsonl import JsonlFormat
from .manifest import StoredFile
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


def _index_one(url: str, fmt_name: str, location: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, bool]:
    """One file's stored entry (written unless already there for its identity):
    ``(StoredFile, built now)``. Runs in a thread or a worker process."""
    access = FileAccess(storage_options=dict(storage_options) if storage_options else None)
    fmt = format_named(fmt_name)
    if fmt.compression(url):
        raise UnsupportedError(f"{url} is compressed: it is streamed whole and has no index to store")
    ref = FileRef(url, *file_identity(url, access))
    entry = manifest.join(location, manifest.entry_name(fmt_name, manifest.listed_name(location, url)))
    try:
        index = loads(manifest.read(entry, access), fmt_name, ref)
    except (FileNotFoundError, NotADirectoryError):
        index = None
    built = index is None
    if index is None:  # this machine's cache may have it (a job ran here); built otherwise, not cached here
        index = load_cached(fmt_name, ref) or fmt.build_index(ref, access)
        manifest.write(entry, dumps(index), access)
    assert ref.size is not None and ref.stamp is not None
    return StoredFile(url, fmt_name, index.count, ref.size, ref.stamp, entry), built


def _executor(remote: bool, count: int, workers: int | None) -> Executor:
    if remote:
        return ThreadPoolExecutor(max_workers=workers or min(64, count), thread_name_prefix="distshard-index")
    if (workers or os.cpu_count() or 1) <= 1 or count <= 1:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="distshard-index")
    import multiprocessing

    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    return ProcessPoolExecutor(max_workers=min(count, workers or os.cpu_count() or 1), mp_context=context)


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
    (default: ``.distshard/`` beside the first file) and write its manifest."""
    access = FileAccess(storage_options=dict(storage_options) if storage_options else None)
    formats: dict[str, str] = {}
    if len(patterns) == 1 and out is None and _names_stored(patterns[0]):
        out = manifest.location_of(patterns[0])
        stored = manifest.load(out, access)
        if stored is None:
            raise SourceMissingError(f"no stored index at {out} to refresh")
        urls = [f.url for f in stored.files.values()]
        formats = {f.url: f.format for f in stored.files.values()}
    else:
        urls = [url for pattern in patterns for url in expand_urls(pattern, storage_options)]
    if not urls:
        raise OptionError("no files to index")
    location = out.rstrip("/") if out else manifest.default_location(urls)
    for url in urls:
        formats.setdefault(url, fmt or format_of(url))
    started = time.monotonic()
    remote = any(is_remote(url) for url in urls)
    done: dict[str, StoredFile] = {}
    built = total_bytes = 0
    errors: list[str] = []
    with _executor(remote, len(urls), workers) as pool:
        futures: dict[Future[Any], str] = {
            pool.submit(_index_one, url, formats[url], location, storage_options): url for url in urls
        }
        for future in as_completed(futures):
            try:
                item, now = future.result()
            except Exception as exc:  # noqa: BLE001 - every failure is reported, the rest kept
                errors.append(f"{futures[future]}: {type(exc).__name__}: {exc}")
                continue
            done[item.url] = item
            built += now
            total_bytes += item.size
            if progress is not None:
                progress(len(done), len(urls), total_bytes, time.monotonic() - started)
    try:
        previous = manifest.load(location, access)
    except ValueError:
        previous = None
    listed = [f for f in (previous.files.values() if previous else []) if f.url not in done and f.url not in urls]
    files = listed + [done[url] for url in urls if url in done]
    manifest.write(manifest.join(location, manifest.MANIFEST), manifest.dumps(location, files), access)
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


def _names_stored(text: str) -> bool:
    name = text.rstrip("/").rsplit("/", 1)[-1]
    return name in (manifest.FOLDER, manifest.MANIFEST)
