"""Every wait of the library is bounded and, past its bound, raises a TimeoutError
(``distshard.waits.WaitTimeout``) naming what it waited for: an index lock held by a
stuck builder, a remote read whose event loop never answers, a collective that one
rank never joins."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

import distshard
from distshard.sources import ReadOptions, webdataset
from distshard.sources.formats import index_cache as index
from distshard.sources.transport import clients, remote
from distshard.sources.transport import responses as answers
from distshard.sources.transport.files import FileRef
from distshard.verify import run_on_group
from distshard.waits import CollectiveTimeout, WaitTimeout

from .helpers import child_env, wait_child
from .range_server import serve
from .source_factories import write_shards

ROOT = Path(__file__).resolve().parent.parent

HOLDER = """
import sys, time
from pathlib import Path
from distshard.sources.formats.index_cache import _locked

with _locked(Path(sys.argv[1])):
    print("held", flush=True)
    while True:
        time.sleep(1000)
"""


def test_an_index_lock_held_by_a_stuck_builder_raises_naming_the_file_the_lock_and_its_holder(tmp_path, monkeypatch):
    shard = tmp_path / "a.tar"
    shard.write_bytes(b"\0" * 1024)
    ref = FileRef(str(shard), 1024, "1")
    monkeypatch.setenv("DISTSHARD_CACHE", str(tmp_path / "cache"))
    entry = index.cache_path("tar", ref)
    env = child_env(PYTHONPATH=str(ROOT / "pipes"))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(entry)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        monkeypatch.setattr(index, "LOCK_WAIT", 0.5)
        with pytest.raises(index.IndexLockTimeout) as raised:  # old code: flock waited forever
            index.obtain("tar", ref, lambda r: pytest.fail("built under another's lock"))
        message = str(raised.value)
        assert isinstance(raised.value, TimeoutError) and isinstance(raised.value, WaitTimeout)
        assert f"{entry}.lock of {shard}," in message and f"held by pid {holder.pid} on " in message
        holder.kill()  # a lock ends with its process: the next builder goes ahead at once
        holder.wait(timeout=30)
        built = index.FileIndex("tar", "a", 1024, "1", 0)
        assert index.obtain("tar", ref, lambda r: built)[0] is built
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_a_read_whose_event_loop_never_answers_raises_naming_the_url_and_range(tmp_path, monkeypatch):
    paths, expected = write_shards(tmp_path / "data", shards=2, per_shard=5)
    with serve(tmp_path) as server:
        urls = [server.url(p) for p in paths]
        expected = [{**sample, "__url__": urls[paths.index(sample["__url__"])]} for sample in expected]
        options = ReadOptions(timeout=1, retry_seconds=0, retries=0)
        sequence = webdataset(urls, read_options=options).__distshard_sequence__()  # indexed: the loop works
        monkeypatch.setattr(answers, "QUEUE_SLACK", 0.5)  # the bound every client waits by
        client = clients.client_for(urls[0])
        release = threading.Event()
        client.loop.call_soon_threadsafe(release.wait, 120)  # the client's event loop is stuck
        try:
            with pytest.raises(remote.RemoteReadTimeout) as raised:  # old code: waited for the loop
                list(sequence.distshard_read(range(len(sequence))))
        finally:
            release.set()
        message = str(raised.value)
        assert isinstance(raised.value, TimeoutError) and isinstance(raised.value, distshard.RemoteReadError)
        assert message.startswith(urls[0]) and "bytes [" in message and "no answer within" in message
        assert list(sequence.distshard_read(range(len(sequence)))) == expected  # the loop answers again


def _one_rank_never_joins(rank, world_size):
    import torch.distributed as dist

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))
    if rank == 1:
        time.sleep(8)  # never calls gather_states
        return "slept"
    try:
        distshard.gather_states({"rank": rank}, group=group)
    except Exception as exc:  # noqa: BLE001 - what rank 0 got is the answer
        return type(exc).__name__, isinstance(exc, TimeoutError), str(exc)
    return "no error"


@pytest.mark.timeout(180)
def test_a_collective_one_rank_never_joins_raises_naming_it():
    outcomes = run_on_group(_one_rank_never_joins, world_size=2, timeout=90)
    assert [o.error for o in outcomes] == [None, None], [o.error for o in outcomes]
    kind, is_timeout, message = outcomes[0].value
    assert (kind, is_timeout) == (CollectiveTimeout.__name__, True), message
    assert message.startswith("gather_states: all_gather_object of every rank's state"), message


def test_a_lock_another_thread_held_at_a_fork_is_free_in_the_child():
    """A DataLoader worker forked while another thread of its rank counted a Parquet
    decode would otherwise wait forever for a lock nobody in it holds."""
    parquet = importlib.import_module(
        "distshard.sources.formats.parquet"
    )  # the module (the package exports a function)

    with parquet._DECODES_LOCK:  # held at the fork, as by another thread of the parent
        pid = os.fork()
        if pid == 0:  # the child: count a decode as parse does
            with parquet._DECODES_LOCK:
                os._exit(0)
    assert wait_child(pid, 60, "the child waited for a lock held by a thread of its parent") == 0
