"""This process's clients, one per protocol and set of storage options (the registry above them all).

:func:`client_for` picks and makes the client of a URL: :class:`.hub.HubClient`
for ``hf://``, :class:`.s3direct.DirectS3Client` for ``s3://`` where its outcome is
certain (``DISTSHARD_S3_CLIENT``: ``auto``, ``s3fs``, ``direct``), else
:class:`.remote.Client` (fsspec); each is a :class:`.contract.Transport`.

**Fork safety.** Clients are per process. A child made by ``fork`` (a DataLoader
worker) never uses, closes or garbage-collects what it inherited: closing an
inherited aiohttp connection in the child removes the parent's socket from the
parent's epoll set (the same kernel object), and the parent then waits forever for
its next response (over TLS it tells the server ``close_notify``, which ends the
parent's connection). So the child keeps every inherited fsspec filesystem alive
(those in fsspec's instance caches included, held from just before the fork:
fsspec's own fork hook empties its caches in the child, first when fsspec was
imported before this module), detaches their close-on-collect finalizers (which
also run at a child's normal exit), and makes its own. What the parent learnt that
holds no connection nor event loop is reused: an ``s3://`` client in the child is
made from the parent's aiobotocore session (see :mod:`.remote`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from typing import Any, Mapping

from ...errors import OptionError
from ...forks import at_fork
from ..read_options import ReadOptions
from . import remote
from .contract import Transport

log = logging.getLogger("distshard")

__all__ = ["client_for", "forget_clients", "frozen", "glob_remote", "remote_identity", "s3_client_choice", "warm_up"]

_DEFAULT = ReadOptions()

_LOCK = threading.Lock()
_CLIENTS: dict[Any, Transport] = {}
_ORPHANS: list[Any] = []  # what a forked child inherited: kept alive, never closed or collected
_INHERITED: dict[Any, Any] = {}  # a forked child: the parent's aiobotocore sessions, by client key
_FORKING: list[Any] = []  # fsspec's cached filesystems, held from just before a fork to just after it
_WARMING: dict[Any, threading.Thread] = {}  # clients being started in the background, by key (see warm_up)
WARM_UP_JOIN = 60.0  # seconds a fork waits for a client started in the background


def frozen(value: Any) -> Any:
    """A hashable stand-in for storage options (dicts, lists, objects by id)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


def client_for(url: str, storage_options: Mapping[str, Any] | None = None) -> Transport:
    """This process's client for ``url``'s protocol and ``storage_options``: for
    ``s3://`` and ``s3a://`` the direct client (:class:`.s3direct.DirectS3Client`)
    when :func:`.s3config.direct_config` finds it eligible, unless the environment
    variable ``DISTSHARD_S3_CLIENT`` is ``s3fs`` (``direct``: raise naming the
    reason when it is not eligible; ``auto``, the default: s3fs then); else
    :class:`.remote.Client` (fsspec)."""
    protocol = url.split("://", 1)[0].lower()
    key = (protocol, frozen(storage_options or {}))
    client = _CLIENTS.get(key)
    if client is None:
        with _LOCK:
            client = _CLIENTS.get(key)
            if client is None:
                client = _CLIENTS[key] = _make_client(url, protocol, dict(storage_options or {}), _INHERITED.get(key))
    return client


def s3_client_choice(url: str, storage_options: Mapping[str, Any] | None = None) -> str | None:
    """For ``explain()``: which client reads an ``s3://`` URL and, for s3fs, why
    (``None`` for other URLs); makes no client."""
    protocol = url.split("://", 1)[0].lower()
    if protocol not in ("s3", "s3a"):
        return None
    from .s3config import ENV, direct_config

    if (os.environ.get(ENV) or "auto").strip().lower() == "s3fs":
        return f"S3 through s3fs ({ENV}=s3fs)"
    config = direct_config(storage_options)
    if isinstance(config, str):
        return f"S3 through s3fs (not read directly: {config})"
    return "S3 read directly (http.client, no s3fs)"


def _make_client(url: str, protocol: str, options: dict[str, Any], inherited: Any) -> Transport:
    """The direct S3 client (:mod:`.s3direct`) where it is eligible and
    ``DISTSHARD_S3_CLIENT`` allows it, else fsspec's."""
    if protocol == "hf":
        from .hub import HubClient

        return HubClient(url, options, client_for)
    if protocol in ("s3", "s3a"):
        from .s3config import ENV, direct_config
        from .s3direct import DirectS3Client

        choice = (os.environ.get(ENV) or "auto").strip().lower()
        if choice not in ("auto", "s3fs", "direct"):
            raise OptionError(f"{ENV}={os.environ.get(ENV)!r}: use auto (the default), s3fs or direct")
        if choice != "s3fs":
            config = direct_config(options)
            if not isinstance(config, str):
                return DirectS3Client(protocol, options, config, lambda: remote.Client(url, protocol, options))
            if choice == "direct":
                raise OptionError(
                    f"{ENV}=direct, but {protocol}:// with these storage options cannot be read directly: {config}; "
                    f"unset {ENV} (or set it to s3fs) to read through s3fs"
                )
            log.debug("%s:// goes through s3fs, not the direct client: %s", protocol, config)
    return remote.Client(url, protocol, options, inherited)


def warm_up(url: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Begin this process's client for ``url`` in a background thread: the
    filesystem's imports (``import s3fs``: aiobotocore, botocore, aiohttp), its
    session and credentials, overlapped with whatever the caller does until its
    first request, which then waits for them only if they are still under way. A
    failure here is left for that first request to raise. A fork waits for the
    thread first (a child must not inherit an import or a lock half done)."""
    protocol = url.split("://", 1)[0].lower()
    key = (protocol, frozen(storage_options or {}))
    started = _WARMING.get(key)
    if key in _CLIENTS or (started is not None and started.is_alive()):
        return
    options = dict(storage_options or {})

    def start() -> None:
        try:
            client_for(url, options).warm()
        except Exception as exc:  # noqa: BLE001 - the first request raises it again
            log.debug("starting the %s:// client in the background failed: %s: %s", protocol, type(exc).__name__, exc)

    thread = threading.Thread(target=start, name=f"distshard-{protocol}-client", daemon=True)  # (no options: secrets)
    for done in [k for k, t in _WARMING.items() if not t.is_alive()]:
        del _WARMING[done]
    _WARMING[key] = thread
    thread.start()


def forget_clients() -> None:
    """Drop this process's clients without closing them (what a forked child does)."""
    with _LOCK:
        _ORPHANS.extend(_CLIENTS.values())
        _CLIENTS.clear()


def remote_identity(
    url: str, storage_options: Mapping[str, Any] | None = None, options: ReadOptions = _DEFAULT
) -> tuple[int, str]:
    """``(size, stamp)`` of a remote file: one metadata request."""
    return client_for(url, storage_options).identity(url, options)


def glob_remote(pattern: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """The URLs matching a remote glob, sorted."""
    return client_for(pattern, storage_options).glob(pattern)


# -- the fork ---------------------------------------------------------------------------------
def _before_fork() -> None:
    for thread in list(_WARMING.values()):
        if thread is not threading.current_thread():
            thread.join(WARM_UP_JOIN)
    _FORKING[:] = _cached_filesystems()


def _after_fork_in_parent() -> None:
    _FORKING.clear()


def _after_fork_in_child() -> None:
    global _LOCK
    _LOCK = threading.Lock()
    remote.reset_stats()
    _WARMING.clear()
    for key, client in _CLIENTS.items():
        session = client.shareable_session()
        if session is not None:
            _INHERITED[key] = session
    _ORPHANS.extend(_CLIENTS.values())
    _CLIENTS.clear()
    _keep_inherited_filesystems()


def _cached_filesystems() -> list[Any]:
    """The filesystems in fsspec's instance caches (none if fsspec is not imported)."""
    spec = sys.modules.get("fsspec.spec")
    if spec is None:
        return []
    found: list[Any] = []
    todo = [spec.AbstractFileSystem]
    seen: set[int] = set()
    while todo:
        cls = todo.pop()
        if id(cls) in seen:
            continue
        seen.add(id(cls))
        todo.extend(cls.__subclasses__())
        cache = cls.__dict__.get("_cache")
        if isinstance(cache, dict):
            found.extend(cache.values())
    return found


def _keep_inherited_filesystems() -> None:
    """Keep every fsspec filesystem this child inherited alive and detach the
    finalizers that would close its sessions (see the module docstring): fsspec
    empties its instance caches in a new process, which would collect them. Its own
    fork hook may have emptied them before this one runs (when fsspec was imported
    before this module), so the filesystems cached at the fork were held across it
    (``_FORKING``, filled by ``_before_fork``)."""
    inherited: list[Any] = list(_FORKING)
    _FORKING.clear()
    for client in _ORPHANS:
        fs = client.made_filesystem() if hasattr(client, "made_filesystem") else None
        if fs is not None:
            inherited.append(fs)
    _ORPHANS.extend(inherited)
    ids = {id(obj) for obj in inherited}
    registry = getattr(weakref.finalize, "_registry", {})
    for finalizer, info in list(registry.items()):
        target = info.weakref() if getattr(info, "weakref", None) is not None else None
        if target is not None and id(target) in ids:
            finalizer.detach()


at_fork(_after_fork_in_child, before=_before_fork, after_in_parent=_after_fork_in_parent)
