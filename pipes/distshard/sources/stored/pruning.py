"""Deleting the packs no manifest names any more (``python -m distshard index --prune``).

A build writes its entries in new packs (``entries-<build>-<n>.pack``, :mod:`.entry_packs`)
and a manifest naming the packs its files' entries are in; the packs of an earlier
build whose files were all indexed again are then named by nothing. :func:`prune_packs`
deletes, in the index's folder, the packs the new manifest does not name and that are
older than a grace period: a job that loaded the previous manifest shortly before still
fetches its entries from the packs that manifest named, and a build running at the same
time into the same folder writes its packs before the manifest naming them.

A local folder is listed and cleaned with ``os``; a URL through this process's fsspec
filesystem for it (:func:`.clients.client_for`), one listing and one ``rm`` of the packs
to delete. Only ``entries-*.pack`` objects and the columns and pages of version 3
manifests (``columns-*.bin``, ``pages-*.bin``: every manifest written names its own;
those of an earlier one are named by nothing once a later one is written) are ever
deleted.
"""

from __future__ import annotations

import logging
import math
import os
import posixpath
import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Collection, Mapping

from ...errors import OptionError, OptionTypeError
from ..transport.files import local_path
from ..transport.urls import is_remote

__all__ = ["DEFAULT_GRACE", "Pruned", "check_grace", "prune_packs"]

log = logging.getLogger("distshard")

#: seconds an unnamed pack is kept by default (``--prune-after``)
DEFAULT_GRACE = 3600.0
_PACK = re.compile(r"^(entries-.+\.pack|columns-.+\.bin|pages-.+\.bin)$")  # packs, a version 3 manifest's objects
_MODIFIED_KEYS = ("LastModified", "mtime", "last_modified", "updated", "modified", "timeCreated")


@dataclass
class Pruned:
    """What a prune did: the packs deleted and the unnamed packs kept for being younger
    than the grace period (names inside the index's folder)."""

    deleted: list[str] = field(default_factory=list)
    young: list[str] = field(default_factory=list)


def check_grace(grace: object) -> float:
    """``grace`` as seconds; ``TypeError`` / ``ValueError`` naming it unless a finite number >= 0."""
    if isinstance(grace, bool) or not isinstance(grace, (int, float)):
        raise OptionTypeError(f"prune_after={grace!r}: give the seconds an unnamed pack is kept, a number")
    if not math.isfinite(grace) or grace < 0:
        raise OptionError(f"prune_after={grace!r}: give the seconds an unnamed pack is kept, a finite number >= 0")
    return float(grace)


def _now() -> float:
    """The time the ages of the packs are measured at (seconds since the epoch)."""
    return time.time()


def prune_packs(
    location: str,
    named: Collection[str],
    grace: float = DEFAULT_GRACE,
    storage_options: Mapping[str, Any] | None = None,
) -> Pruned:
    """Delete the packs in the index folder ``location`` (a local folder or an fsspec
    URL) whose names are not in ``named`` (the packs the manifest just written names)
    and that were last modified more than ``grace`` seconds ago (see :func:`check_grace`)."""
    grace = check_grace(grace)
    found = _remote_packs(location, storage_options) if is_remote(location) else _local_packs(location)
    now = _now()
    pruned = Pruned()
    for name, modified in sorted(found.items()):
        if name in named:
            continue
        (pruned.deleted if now - modified > grace else pruned.young).append(name)
    if pruned.deleted:
        if is_remote(location):
            _remote_delete(location, pruned.deleted, storage_options)
        else:
            _local_delete(location, pruned.deleted)
    log.info(
        "%s: %d packs no manifest names deleted, %d younger than %g s kept",
        location,
        len(pruned.deleted),
        len(pruned.young),
        grace,
    )
    return pruned


def _local_packs(location: str) -> dict[str, float]:
    """``{pack name: modification time}`` of the packs in a local folder."""
    out: dict[str, float] = {}
    try:
        entries = list(os.scandir(local_path(location)))
    except FileNotFoundError:
        return out
    for entry in entries:
        if _PACK.match(entry.name) and entry.is_file(follow_symlinks=False):
            out[entry.name] = entry.stat(follow_symlinks=False).st_mtime
    return out


def _local_delete(location: str, names: list[str]) -> None:
    folder = local_path(location)
    for name in names:
        try:
            os.remove(os.path.join(folder, name))
        except FileNotFoundError:  # another prune got there first
            pass


def _fs(location: str, storage_options: Mapping[str, Any] | None) -> Any:
    from ..transport.clients import client_for

    return client_for(location, storage_options).fs


def _remote_packs(location: str, storage_options: Mapping[str, Any] | None) -> dict[str, float]:
    """``{pack name: modification time}`` of the packs under a URL (one listing)."""
    fs = _fs(location, storage_options)
    path = fs._strip_protocol(location.rstrip("/"))
    fs.invalidate_cache(path)  # what this process wrote since it last listed
    try:
        listed = fs.ls(path, detail=True)
    except FileNotFoundError:
        return {}
    out: dict[str, float] = {}
    for item in listed:
        name = posixpath.basename(str(item.get("name", "")).rstrip("/"))
        if item.get("type", "file") == "file" and _PACK.match(name):
            out[name] = _modified(fs, item)
    return out


def _modified(fs: Any, item: Mapping[str, Any]) -> float:
    """When a listed object was last written, from its listing or (else) ``fs.modified``."""
    for key in _MODIFIED_KEYS:
        value = item.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return float(fs.modified(item["name"]).timestamp())


def _remote_delete(location: str, names: list[str], storage_options: Mapping[str, Any] | None) -> None:
    fs = _fs(location, storage_options)
    path = fs._strip_protocol(location.rstrip("/"))
    fs.rm([f"{path}/{name}" for name in names])
