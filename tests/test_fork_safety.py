"""Every ``os.register_at_fork`` hook of the package against the state it guards
against, put there on purpose at the fork: a lock another thread of the parent
holds, a client a thread is still starting (its module half imported), a request
of the parent's in flight, the parent's counters and caches. A child made by
``os.fork`` (as a DataLoader worker is) must not wait for anything of its
parent's: each test fails without its hook, by a bounded wait (the child is
killed), never a hang.

Tested elsewhere: ``remote``'s keeping of the connections a child inherits
(``test_sources_remote.py::test_no_hang_in_the_parent_after_fork_workers``),
``parquet``'s decode counter lock (``test_waits.py``), the epoch mailbox
(``test_persistent.py::test_a_forked_rank_and_its_workers_hear_only_themselves``).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import traceback
from contextlib import contextmanager
from typing import Callable, Iterator

import pytest

from distshard.sources.reading import cache, fetch
from distshard.sources.transport import clients
from distshard.sources.transport.lru import LRU
from tests.fork_events import FORKING, IMPORTING
from tests.helpers import wait_child

CHILD_SECONDS = 30.0  # what a child may take; one that waits for its parent's thread never ends

_ARMED: list[bool] = []


def _fork_starting() -> None:
    if _ARMED:
        FORKING.set()


# registered after distshard's hooks, so it runs before them (before-hooks run last registered first)
os.register_at_fork(before=_fork_starting)


def in_child(check: Callable[[], object], seconds: float = CHILD_SECONDS) -> None:
    """Run ``check()`` in a child made by ``os.fork``: fail if it raises, or if it has
    not ended within ``seconds`` (it waits for something nobody in it will release)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        code = 1
        try:
            check()
            code = 0
        except BaseException:  # noqa: BLE001 - reported to the parent
            os.write(write, traceback.format_exc()[-4000:].encode())
        finally:
            os._exit(code)
    os.close(write)
    try:
        code = wait_child(pid, seconds, "it waits for its parent's thread")
    except BaseException:
        os.close(read)
        raise
    with os.fdopen(read, "rb") as pipe:
        report = pipe.read().decode()
    assert code == 0, report


@contextmanager
def held_by_another_thread(lock: object) -> Iterator[None]:
    """``lock`` held by another thread of this process for the block (a fork in the
    block: the child inherits it held, by a thread it does not have)."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:  # type: ignore[attr-defined]
            taken.set()
            release.wait(120)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert taken.wait(30)
    try:
        yield
    finally:
        release.set()
        thread.join(30)


def test_a_fork_waits_for_a_client_a_thread_is_starting():
    """``clients._before_fork``: a source starts its client in a thread (``warm_up``:
    the filesystem's imports, its session); a fork made while that thread is still
    importing the filesystem's module would leave the child a module lock held by a
    thread it does not have, and the child's first client would wait for it forever."""
    import fsspec

    url = "slowimport://bucket/file"
    fsspec.register_implementation("slowimport", "tests.fork_slow_fs.SlowImportFileSystem", clobber=True)
    sys.modules.pop("tests.fork_slow_fs", None)
    IMPORTING.clear()
    FORKING.clear()
    _ARMED.append(True)
    try:
        clients.warm_up(url)
        assert IMPORTING.wait(30)  # the thread is inside the module's import now
        in_child(lambda: clients.client_for(url).fs)
    finally:
        _ARMED.clear()
        FORKING.set()  # (the import goes on, if the fork did not wait for it)
        for thread in list(clients._WARMING.values()):
            thread.join(30)
        with clients._LOCK:
            clients._CLIENTS.pop(("slowimport", ()), None)
        registry = importlib.import_module("fsspec.registry")  # (fsspec.registry is its mapping)
        registry.known_implementations.pop("slowimport", None)
        registry._registry.pop("slowimport", None)


def test_the_clients_lock_held_at_a_fork_is_free_in_the_child():
    """``clients._after_fork_in_child``: another thread of the parent making a client
    at the fork (the index's threads, a read-ahead) holds the clients' lock."""
    pytest.importorskip("fsspec")
    with held_by_another_thread(clients._LOCK):
        in_child(lambda: clients.client_for("memory://fork/file"))


def test_a_child_fetches_a_stored_entry_its_parent_had_on_its_way(tmp_path):
    """``packs._after_fork_in_child``: the parent's request for a chunk of stored index
    entries in flight at the fork (the store holds its answer back), and the lock of
    the entries' table held by another of its threads: the child asks the entry
    itself, instead of waiting for a request of its parent's that will never answer
    in it."""
    pytest.importorskip("aiohttp")
    from distshard.sources.stored import entry_packs as packs
    from distshard.sources.transport.files import DEFAULT_FILE_ACCESS
    from tests.range_server import serve

    pack = tmp_path / "entries.pack"
    pack.write_bytes(bytes(range(256)) * 4)
    answer, asked = threading.Event(), threading.Event()

    def hold_the_first(path: object) -> None:  # the parent's request: answered once the test says so
        if not asked.is_set():
            asked.set()
            answer.wait(60)

    with serve(tmp_path, before_get=hold_the_first) as server:
        entries = [packs.pack_entry(server.url(pack), start, start + 256) for start in (0, 256, 512, 768)]
        chunks = packs.PackedEntries(entries)

        def check() -> None:
            assert packs.fetch_packed(entries[1], chunks, DEFAULT_FILE_ACCESS) == bytes(range(256))

        try:
            packs.fetch_ahead(entries[:1], chunks, DEFAULT_FILE_ACCESS)
            assert asked.wait(30) and entries[0] in packs._PENDING
            with held_by_another_thread(packs._LOCK):
                in_child(check)
        finally:
            answer.set()
        assert packs.fetch_packed(entries[1], chunks, DEFAULT_FILE_ACCESS) == bytes(range(256))


def test_the_range_caches_lock_held_at_a_fork_is_free_in_the_child(tmp_path):
    """``cache._after_fork_in_child``: another thread of the parent opening the local
    range cache at the fork holds the lock of the process's caches."""
    with held_by_another_thread(cache._LOCK):
        in_child(lambda: cache.range_cache(str(tmp_path / "ranges"), 1 << 20))


def test_a_child_counts_its_own_reads_from_zero():
    """``fetch.reset_stats`` at a fork: the read-ahead's counters are the child's own
    (what the tests and benchmarks read per DataLoader worker), and their lock,
    held by another thread of the parent at the fork, is free."""

    def check() -> None:
        assert fetch.STATS.as_dict() == {"ranges": 0, "bytes": 0, "cached": 0, "peak_held": 0}, fetch.STATS
        with fetch.STATS.lock:  # as the read-ahead counts a range
            fetch.STATS.ranges += 1

    with fetch.STATS.lock:
        fetch.STATS.ranges += 1  # the parent read something
    try:
        with held_by_another_thread(fetch.STATS.lock):
            in_child(check)
    finally:
        with fetch.STATS.lock:
            fetch.STATS.ranges -= 1


def test_a_child_starts_with_empty_caches_whose_locks_are_free():
    """``lru._after_fork``: the per-process caches (open files, indexes, entries
    fetched along) start empty in a child, the parent's handles stay the parent's,
    and a cache's lock another thread of the parent held at the fork is free."""
    kept: LRU[str] = LRU(max_items=4)
    kept.put("handle", "the parent's")

    def check() -> None:
        assert kept.get("handle") is None and len(kept) == 0
        kept.put("handle", "the child's")
        assert kept.get("handle") == "the child's"

    with held_by_another_thread(kept._lock):
        in_child(check)
    assert kept.get("handle") == "the parent's"


# -- one registry, one walker ------------------------------------------------------------------


def test_the_fork_registry_runs_every_hook_in_the_child_also_after_one_that_raises(monkeypatch, caplog):
    from distshard import forks

    ran: list[str] = []
    monkeypatch.setattr(forks, "_after_in_child", list(forks._after_in_child))
    monkeypatch.setattr(forks, "_before", list(forks._before))

    def broken() -> None:
        raise RuntimeError("a hook that fails")

    forks.at_fork(lambda: ran.append("first"), before=broken)
    forks.at_fork(broken, before=lambda: ran.append("before"))
    forks.at_fork(lambda: ran.append("second"))

    def check() -> None:  # the child: every hook ran, in the order registered, the parent's before-hooks first
        assert ran == ["before", "first", "second"], ran

    with caplog.at_level("ERROR", logger="distshard"):
        in_child(check)
    assert ran == ["before"]  # the parent ran its before-hooks, the last registered first, past the broken one
    assert "broken" in caplog.text and "a hook that fails" in caplog.text


def test_a_forked_child_forgets_the_rank_a_pipe_brought_by_pickle(monkeypatch):
    from distshard import context

    monkeypatch.setattr(context, "_pickled", None)
    context.note_captured((1, 2))

    def check() -> None:
        assert context._pickled is None

    in_child(check)
    assert context._pickled == (1, 2)


def test_nothing_but_the_registry_and_the_walker_touches_fork_hooks_or_frames():
    from pathlib import Path

    package = Path(distshard_path())
    found = {
        str(path.relative_to(package)): word
        for path in package.rglob("*.py")
        for word in ("register_at_fork", "_getframe")
        if word in path.read_text()
    }
    assert found == {"forks.py": "register_at_fork", "frames.py": "_getframe"}


def distshard_path() -> str:
    import distshard

    return os.path.dirname(distshard.__file__)
