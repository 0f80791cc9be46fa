"""Shards over the loopback range server indexed with the stored-index command, and the
server's requests by kind: shared by the stored-index tests."""

from __future__ import annotations

from collections import Counter

from distshard.__main__ import main
from tests.range_server import RangeServer
from tests.source_factories import write_shards

SHARDS = 64


def key(sample: dict) -> str:
    return f"{sample['__url__'].rsplit('/', 1)[-1]}#{sample['__key__']}"


def indexed(tmp_path, server, shards=SHARDS, per_shard=3) -> tuple[str, list[str], list[dict]]:
    """``shards`` tars served over HTTP, indexed with the command into the
    ``.distshard/`` folder the server serves beside them (HTTP is read-only)."""
    paths, expected = write_shards(tmp_path / "data", shards=shards, per_shard=per_shard)
    urls = [server.url(p) for p in paths]
    pattern = urls[0].rsplit("/", 1)[0] + f"/shard-{{000000..{shards - 1:06d}}}.tar"
    assert main(["index", pattern, "--out", str(tmp_path / "data" / ".distshard")]) == 0
    return pattern, urls, expected


def requests_by_kind(server: RangeServer) -> dict[str, int]:
    """Requests since the last reset: HEAD, manifest, entry, data (range) GETs."""
    return kinds_of(server.settle().log)


def kinds_of(log) -> dict[str, int]:
    """The requests of a range server's ``log`` by kind: HEAD, manifest, entry, data (range)
    GETs; a version 3 index's columns and pages (when not inline) are "index"."""
    kinds: Counter = Counter()
    for method, path, _ in log:
        if method != "GET":
            kinds[method] += 1
        elif path.endswith("manifest.json"):
            kinds["manifest"] += 1
        elif path.endswith((".idx", ".pack")):
            kinds["entry"] += 1
        elif path.rsplit("/", 1)[-1].startswith(("columns-", "pages-")) and path.endswith(".bin"):
            kinds["index"] += 1  # a version 3 manifest's columns and pages, not inline
        else:
            kinds["data"] += 1
    return dict(kinds)
