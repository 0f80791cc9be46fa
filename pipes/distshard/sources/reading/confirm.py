"""What the local range cache may serve: bytes of a file whose identity this job
confirmed with the store.

A range fetched from the store is checked against the file's identity on its
answer (:mod:`.remote`); a range read from the local cache (:mod:`.cache`) asks
nothing, so it would serve whatever version the identity names, and with a
stored index (``python -m distshard index``) that identity comes from the
manifest, which may be older than the store. So a source confirms a file's
identity before its first cache hit (:meth:`.base.SourceSequence.confirm`):

- an identity asked from the store by this job (no stored index: the job's
  ``HEAD`` or suffix GET when it was built) is confirmed already;
- on S3 (both clients) one ListObjectsV2 page answers 1,000 objects with their
  size and ETag: :func:`confirm` lists the folder of the file (from the
  longest name prefix its files share, stopping after the last one), and every
  file of the source in that folder gets its verdict at once. A rank does so
  before its DataLoader workers start (they inherit or unpickle the verdicts);
  a process that has none lists for itself when it first hits the cache;
- elsewhere (HTTP(S), other fsspec stores, ``?versionId=`` URLs, stamps that
  are not ETags): one identity request (a HEAD) for that file, once per process.

A verdict is ``None`` (the store holds the indexed version) or ``(kind,
message)`` for a file the store no longer holds (``"missing"``) or holds in
another version (``"changed"``), raised by :func:`raise_verdict` as
``SourceMissingError`` / the stale-index ``SourceChangedError`` naming the file
and the refresh command (plain tuples, so that they pickle with the sequence).
"""

from __future__ import annotations

import os
import posixpath
from typing import Any, Iterable, Mapping, Sequence

from ...errors import SourceChangedError, SourceMissingError
from ..transport.files import FileAccess, FileRef, identify
from ..transport.responses import changed_error

__all__ = ["confirm", "listable", "raise_verdict"]


def _location(stored: str | None) -> str:
    """The stored index folder a ref's entry (``ref.stored``) is in."""
    return (stored or "").split("#", 1)[0].rsplit("/", 1)[0]


def listable(ref: FileRef) -> bool:
    """Whether ``ref``'s identity can be confirmed by an S3 listing: an object
    URL (no version named) whose stamp is an ETag (quoted), as the listing gives it."""
    url, stamp = ref.url, ref.stamp or ""
    return url.startswith(("s3://", "s3a://")) and "?" not in url and len(stamp) >= 2 and stamp[0] == stamp[-1] == '"'


def _verdict(ref: FileRef, seen: tuple[int, str] | None) -> tuple[str, str] | None:
    location = _location(ref.stored)
    if seen is None:
        return (
            "missing",
            f"{ref.url}: no such file, but the stored index at {location} lists it: the file was deleted after "
            f"the index was written; refresh it with `python -m distshard index {location}`",
        )
    size, stamp = seen
    if (size, stamp) != (ref.size, ref.stamp):
        return "changed", str(
            changed_error(ref.url, f"size {ref.size} -> {size}, stamp {ref.stamp} -> {stamp}", ref.stored)
        )
    return None


def raise_verdict(verdict: tuple[str, str] | None) -> None:
    """Raise what a verdict says (nothing for a confirmed file)."""
    if verdict is None:
        return
    kind, message = verdict
    raise (SourceMissingError if kind == "missing" else SourceChangedError)(message)


def _listed(refs: Sequence[FileRef], access: FileAccess) -> dict[int, tuple[str, str] | None]:
    """The verdicts of ``refs`` (all of one S3 folder) from one listing."""
    folder = posixpath.dirname(refs[0].url)
    names = [ref.url[len(folder) + 1 :] for ref in refs]
    prefix = os.path.commonprefix(names)
    seen = access.client(folder).list_identities(folder, prefix, max(names), access.options)
    return {k: _verdict(ref, seen.get(name)) for k, (ref, name) in enumerate(zip(refs, names, strict=True))}


def confirm(
    fmt: Any, refs: Sequence[FileRef], wanted: Iterable[int], access: FileAccess
) -> Mapping[int, tuple[str, str] | None]:
    """The verdicts of the files ``wanted`` (indices into ``refs``) and of every
    file of ``refs`` a listing answered along with them (see the module docstring):
    one listing per S3 folder (a page per 1,000 objects), else one identity
    request per file. Transient failures are retried as every request is; a store
    that refuses the listing raises its error."""
    wanted = sorted(set(wanted))
    folders: dict[str, list[int]] = {}
    out: dict[int, tuple[str, str] | None] = {}
    for f in wanted:
        ref = refs[f]
        if listable(ref):
            folders.setdefault(posixpath.dirname(ref.url), [])
            continue
        try:
            seen: tuple[int, str] | None = identify(fmt, ref.url, access)
        except FileNotFoundError:
            seen = None
        out[f] = _verdict(ref, seen)
    if folders:
        for f, ref in enumerate(refs):
            folder = posixpath.dirname(ref.url)
            if folder in folders and ref.stored is not None and listable(ref):
                folders[folder].append(f)
        for members in folders.values():
            found = _listed([refs[f] for f in members], access)
            out.update((members[k], verdict) for k, verdict in found.items())
    return out
