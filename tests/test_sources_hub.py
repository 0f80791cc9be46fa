"""``hf://`` datasets against a loopback Hub (tests/hub_server.py, by ``HF_ENDPOINT``):
pinned to the commit the build resolved, identities from the Hub, exact ranges,
the local cache, errors by status, the index command, and no listing in workers."""

from __future__ import annotations

import json
import time

import pytest

from distshard.errors import SourceChangedError, SourceMissingError
from distshard.sources import ReadOptions, RemoteReadError, jsonl, parquet
from distshard.sources.transport.clients import forget_clients
from tests.hub_server import hub  # noqa: F401  (a fixture)
from tests.source_factories import isolated_cache as cache  # noqa: F401  (autouse)

pytest.importorskip("huggingface_hub")
pytest.importorskip("aiohttp")

REPO = "org/corpus"
URLS = f"hf://datasets/{REPO}/data/*.jsonl"


def lines(tag: str, n: int) -> bytes:
    """``n`` JSON lines of ``tag``, each the same length whatever the tag (of one length)."""
    return "".join(json.dumps({"tag": tag, "i": i, "pad": "x" * 300}) + "\n" for i in range(n)).encode()


def push(hub, tag: str, sizes=(400, 7)) -> dict[str, bytes]:  # noqa: F811
    files = {f"data/part-{f}.jsonl": lines(f"{tag}{f}", n) for f, n in enumerate(sizes)}
    hub.commit(REPO, {**files, "README.md": b"# corpus\n"})
    return files


def tags(rows) -> set[str]:
    return {row["tag"][:2] for row in rows}


def test_every_row_once_in_about_one_pass_of_the_bytes(hub):  # noqa: F811
    files = push(hub, "a")
    source = jsonl(URLS)
    assert len(source) == 407
    hub.reset_counters()
    got = [(row["tag"], row["i"]) for rank in range(2) for row in source.dist_shard(rank=rank, world_size=2)]
    assert sorted(got) == sorted((f"a{f}", i) for f, n in enumerate((400, 7)) for i in range(n))
    total = sum(len(data) for data in files.values())
    assert hub.served <= 1.10 * total, (hub.served, total)
    assert hub.by_kind["api"] == 0  # no listing, no identity asked while reading
    assert "--out DIR` into a folder DIR (hf:// is read-only), then index=DIR" in str(source.dist_shard().explain())


def test_a_same_size_rewrite_pushed_during_or_between_jobs_yields_no_row_of_another_commit(hub):  # noqa: F811
    push(hub, "a")
    source = jsonl(URLS)  # pinned to the commit of main now
    len(source)
    push(hub, "b")  # every file rewritten at the same size: a new commit on main
    assert tags(source.dist_shard()) == {"a0", "a1"}
    assert tags(jsonl(URLS).dist_shard(shuffle=True)) == {"b0", "b1"}  # a job built after it reads it


def test_the_stamp_is_the_hubs_identity_and_a_second_epoch_from_the_cache_asks_nothing(hub, tmp_path):  # noqa: F811
    files = push(hub, "a")
    source = jsonl(URLS, read_options=ReadOptions(cache_dir=str(tmp_path / "ranges")))
    sequence = source.__distshard_sequence__()
    assert all(ref.stamp.startswith(("sha256:", "blob:")) for ref in sequence.refs), sequence.refs
    shard = source.dist_shard(shuffle=True)
    first = sorted(row["i"] for row in shard)
    hub.reset_counters()
    shard.set_epoch(1)
    assert sorted(row["i"] for row in shard) == first and len(first) == 407
    assert hub.log == [], hub.log
    assert sum(len(data) for data in files.values()) > 0


def test_a_file_unchanged_by_a_new_commit_is_read_from_the_cache(hub, tmp_path):  # noqa: F811
    push(hub, "a")
    options = ReadOptions(cache_dir=str(tmp_path / "ranges"))
    assert len(list(jsonl(URLS, read_options=options).dist_shard())) == 407
    hub.commit(REPO, {"data/part-1.jsonl": lines("c1", 7)})  # a new commit rewrites part-1 only
    hub.reset_counters()
    rows = list(jsonl(URLS, read_options=options).dist_shard())
    assert tags(rows) == {"a0", "c1"} and len(rows) == 407
    reads = [path for _, path, _ in hub.log if "/resolve/" in path and not path.endswith("manifest.json")]
    assert reads and all(path.endswith("part-1.jsonl") for path in reads), hub.log


def test_the_token_goes_with_every_read_as_a_header(hub):  # noqa: F811
    push(hub, "a")
    source = jsonl(URLS, storage_options={"token": "hf_loopback"})
    assert len(list(source.dist_shard())) == 407
    asked = {auth for (kind, auth) in hub.auth if kind in ("api", "resolve") and auth is not None}
    assert asked == {"Bearer hf_loopback"} and hub.auth[("resolve", None)] == 0, hub.auth


def test_a_missing_file_is_refused_in_one_request(hub):  # noqa: F811
    push(hub, "a")
    jsonl(URLS).counts()
    hub.reset_counters()
    started = time.monotonic()
    with pytest.raises(SourceMissingError, match="nothing.jsonl"):
        jsonl([f"hf://datasets/{REPO}/data/nothing.jsonl"]).counts()
    assert time.monotonic() - started < 5
    # the revision's resolution, the look for a stored index beside it; the folder's listing (kept
    # from the first source's glob) says there is no such file: nothing retried
    assert [path.split("/")[-1] for _, path, _ in hub.log] == ["corpus", "manifest.json"], hub.log
    forget_clients()  # a process that never listed the folder: one listing, no retry
    hub.reset_counters()
    with pytest.raises(SourceMissingError, match="nothing.jsonl"):
        jsonl([f"hf://datasets/{REPO}/data/nothing.jsonl"]).counts()
    assert [path.split("?")[0].split("/")[-1] for _, path, _ in hub.log][1:] == ["manifest.json", "data"], hub.log
    with pytest.raises(SourceMissingError):
        jsonl([f"hf://datasets/{REPO.replace('corpus', 'nowhere')}/data/x.jsonl"]).counts()
    assert sum(1 for _, path, _ in hub.log if "nowhere" in path) == 1  # the revision's resolution: 404 at once


def test_a_file_gone_at_read_time_is_missing_at_once(hub):  # noqa: F811
    push(hub, "a")
    source = jsonl(URLS)
    len(source)
    hub.reset_counters()
    hub.fail("resolve", 404, times=10)
    with pytest.raises(SourceMissingError):
        list(source.dist_shard())
    assert hub.by_kind["resolve"] == 1


def test_429_and_5xx_are_retried_within_distshards_bounds(hub):  # noqa: F811
    push(hub, "a")
    hub.fail("api", 503)
    source = jsonl(URLS, read_options=ReadOptions(retries=3, retry_seconds=10))
    assert len(source) == 407  # the revision's resolution retried
    hub.reset_counters()
    hub.fail("resolve", 429)
    hub.fail("cdn", 502)
    assert len(list(source.dist_shard())) == 407
    strict = jsonl(URLS, read_options=ReadOptions(retries=1, retry_seconds=10))
    len(strict)
    hub.reset_counters()
    hub.fail("resolve", 503, times=100)
    started = time.monotonic()
    with pytest.raises(RemoteReadError, match="2 attempts failed"):
        list(strict.dist_shard())
    assert hub.by_kind["resolve"] == 2 and time.monotonic() - started < 5  # no retries nested inside


def test_the_index_command_refuses_to_write_to_the_hub_and_a_stored_index_starts_in_few_requests(
    hub,  # noqa: F811
    tmp_path,
    capsys,
):
    from distshard.__main__ import main

    push(hub, "a")
    assert main(["index", URLS]) == 2
    err = capsys.readouterr().err
    assert "read-only: give --out" in err, err
    out = tmp_path / "index"
    assert main(["index", URLS, "--out", str(out)]) == 0
    hub.reset_counters()
    source = jsonl(URLS, index=str(out))
    assert len(source) == 407
    next(iter(source.dist_shard()))
    # beyond the revision's resolution (and huggingface_hub's own look for its agent registry): the
    # glob's one listing, then no identity per file, and the first range (the Hub's redirect, the CDN)
    beyond = [path for _, path, _ in hub.log if not path.endswith(("/agent-harnesses", f"/datasets/{REPO}"))]
    assert len(beyond) == 3 and "/tree/" in beyond[0], hub.log
    hub.commit(REPO, {"README.md": b"# corpus, v2\n"})  # a new commit, the data unchanged: the index serves it
    hub.reset_counters()
    assert len(list(jsonl(URLS, index=str(out)).dist_shard())) == 407
    assert not any(path.endswith("/paths-info") or "/revision/" in path for _, path, _ in hub.log), hub.log
    push(hub, "b")  # a same-size rewrite after the index was written: the stale index is refused
    with pytest.raises(SourceChangedError):
        list(jsonl(URLS, index=str(out)).dist_shard())


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_list_nothing_and_a_push_mid_epoch_changes_nothing(hub, context):  # noqa: F811
    from torch.utils.data import DataLoader

    push(hub, "a")
    shard = jsonl(URLS, read_options=ReadOptions(max_range=16 << 10, first_range=16 << 10)).dist_shard()
    len(shard)
    hub.reset_counters()
    loader = DataLoader(shard, batch_size=None, num_workers=2, multiprocessing_context=context, timeout=120)
    for epoch in range(2):
        shard.set_epoch(epoch)
        got = []
        for row in loader:
            got.append((row["tag"], row["i"]))
            if epoch == 0 and len(got) == 5:
                push(hub, "b")  # a same-size rewrite of every file while the workers read
        assert sorted(got) == sorted((f"a{f}", i) for f, n in enumerate((400, 7)) for i in range(n))
    assert hub.by_kind["api"] == 0, [path for _, path, _ in hub.log if "/api/" in path]


def test_parquet_on_the_hub_reads_each_row_once(hub):  # noqa: F811
    pa = pytest.importorskip("pyarrow")
    import io

    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.table({"text": [f"row-{i}" for i in range(500)]}), buffer, row_group_size=50)
    hub.commit(REPO, {"data/train.parquet": buffer.getvalue()})
    source = parquet(f"hf://datasets/{REPO}/data/*.parquet")
    assert len(source) == 500  # the identity and the footer
    hub.reset_counters()
    assert sorted(row["text"] for r in range(3) for row in source.dist_shard(rank=r, world_size=3)) == sorted(
        f"row-{i}" for i in range(500)
    )
    assert hub.served <= 1.10 * len(buffer.getvalue()), (hub.served, len(buffer.getvalue()))


def rank_urls(rank: int, world_size: int) -> list[str]:
    """A rank's source over :data:`URLS`: the URLs it pinned (run by the gloo test below)."""
    return list(jsonl(URLS).urls)


def test_the_ranks_of_a_job_pin_one_commit_whatever_is_pushed_while_they_build(hub):  # noqa: F811
    from distshard.verify import run_on_group

    push(hub, "a")
    resolutions = []

    def second_resolution_after_a_push(kind, path):  # without agreement, the second rank's resolution
        if kind == "api" and path.rstrip("/").endswith(f"/datasets/{REPO}"):  # would see the push
            resolutions.append(path)
            if len(resolutions) == 2:
                push(hub, "b")

    hub.on_request = second_resolution_after_a_push
    outcomes = run_on_group(rank_urls, world_size=2, timeout=120)
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    assert outcomes[0].value == outcomes[1].value and "@" in outcomes[0].value[0], [o.value for o in outcomes]
    assert len(resolutions) == 1  # rank 0 resolved the revision, rank 1 took its commit
