"""bench_remote's rows: every variant of both suites (its label and its venv), the
figures of a row over its rounds, the tables and the S3 suite's targets."""

from __future__ import annotations

from collections import Counter
from typing import Any

import harness
from harness import Col
from remote_data import MiB, Setting
from remote_jobs import BATCH

VARIANTS = {
    "webdataset": ("webdataset 1.0.2 (one GET per shard)", "peers"),
    "distshard": ('`distshard.webdataset(urls).dist_shard(even="drop")`, index cached', "dev"),
    "distshard_shuffle": ("same, `shuffle=True`, index cached", "dev"),
    "distshard_cold": ("same, cold index (built in the job)", "dev"),
    "distshard_cold_shuffle": ("same, cold index, `shuffle=True`", "dev"),
}


S3_VARIANTS = {
    "distshard_cold": ('`distshard.webdataset(urls).dist_shard(even="drop")`, cold cache', "dev"),
    "distshard_cached": ("same, per-machine index cached (`$DISTSHARD_CACHE` warm)", "dev"),
    "distshard_stored": ("same, stored index (`python -m distshard index`), fresh `$DISTSHARD_CACHE`", "dev"),
    "distshard_local_cache": ("same, 2 epochs with `ReadOptions(cache_dir=)` (stored index if any; wall: both)", "dev"),
    "litdata": ("litdata 0.2.76 (`optimize()` chunks)", "peers"),
    "mosaic": ("Mosaic streaming 0.13.0 (MDS shards)", "peers"),
    "webdataset": ("webdataset 1.0.2 (s3fs)", "peers"),
}
FEATURES = {"distshard_stored": "index", "distshard_local_cache": "cache_dir"}  # rows that need a feature


# -- the parent: serve, run every variant in rounds, tabulate ------------------------------------------
def summarize(key: str, runs: list[dict[str, Any]], manifest: dict[str, Any], slots: int,
              budget: int) -> dict[str, Any]:
    if runs and "skipped" in runs[0]:
        return {"key": key, "skipped": runs[0]["skipped"]}
    good = [r for r in runs if not r.get("errors")]
    row: dict[str, Any] = {"key": key, "errors": [e for r in runs for e in r.get("errors", [])],
                           "left_out": harness.left_out(runs, good)}
    if not good:
        return row
    expected = Counter(manifest["keys"])
    even = "drop" if key.startswith("distshard") else None
    onces = [harness.exactly_once(r["keys"], expected, even=even, slots=slots) for r in good]
    workers = [w for r in good for w in r["workers"]]
    row.update(
        wall_s=harness.median(r["wall_s"] for r in good),
        requests=harness.median(r["requests"] for r in good),
        gets=harness.median(r["gets"] for r in good),
        heads=harness.median(r["heads"] for r in good),
        bytes=harness.median(r["served"] for r in good),
        once=next((o for o in onces if not o.ok), onces[0]).cell(),
        peak_held=max((w.get("peak_held", 0) for w in workers), default=0),
        maxrss_mib=max((w.get("maxrss_kib", 0) for w in workers), default=0) / 1024,
        budget=budget,
    )
    return row


COLUMNS = [Col("pipeline"), Col("wall s", 2), Col("vs webdataset", right=True),
           Col("requests (GET + HEAD)", right=True), Col("target", right=True), Col("bytes / dataset", 3),
           Col("target", right=True), Col("exactly-once"), Col("read-ahead peak / budget per worker", right=True),
           Col("worker RSS MiB", 0)]


def mark(ok: bool) -> str:
    return "✓" if ok else "✗"


def table(rows: list[dict[str, Any]], manifest: dict[str, Any], shards: int) -> str:
    """Against webdataset in the same run; the targets (bench_remote's docstring) for distshard."""
    total = manifest["bytes"]
    base = next((r for r in rows if r["key"] == "webdataset" and "wall_s" in r), None)
    cells: list[list[Any]] = []
    for row in rows:
        label = VARIANTS[row["key"]][0]
        if (instead := harness.unmeasured(row, "wall_s", width=100)) is not None:
            cells.append([label, instead])
            continue
        peer, cold = row["key"] == "webdataset", "cold" in row["key"]
        vs = "—" if not base else f"{row['wall_s'] / base['wall_s']:.2f}×" + (
            "" if peer else f" {mark(row['wall_s'] <= (2.0 if cold else 1.25) * base['wall_s'])}")
        requests = f"{row['requests']:.0f} ({row['gets']:.0f} + {row['heads']:.0f})"
        if peer:
            req_target = byte_target = peak = "—"
        else:
            allowed = (8 if cold else 4) * shards + (2 if cold else 1) * row["bytes"] / MiB / 4
            req_target = f"≤ {allowed:.0f} {mark(row['requests'] <= allowed)}"
            limit = 2.0 if cold else 1.10
            byte_target = f"≤ {limit:.2f} {mark(row['bytes'] <= limit * total)}"
            peak = (f"{row['peak_held'] / MiB:.1f} / {row['budget'] / MiB:.0f} MiB "
                    f"{mark(row['peak_held'] <= row['budget'])}")
        cells.append([label, row["wall_s"], vs, requests, req_target, row["bytes"] / total, byte_target, row["once"],
                      peak, row["maxrss_mib"]])
    return harness.table(COLUMNS, cells)


def s3_row(key: str, result: dict[str, Any], manifest: dict[str, Any], slots: int) -> dict[str, Any]:
    """The figures of one run: wall, first batch per rank, requests by kind, before each
    rank's first batch, bytes, exactly-once (and the second epoch's for the cache row)."""
    if "skipped" in result:
        return {"key": key, "skipped": result["skipped"]}
    row: dict[str, Any] = {"key": key, "errors": result.get("errors", [])}
    seen = result.get("seen", [])
    requests: Counter = Counter()
    for port in seen:
        requests.update(port["requests"])
    row.update(requests=dict(requests), bytes=sum(sum(p["bytes"].values()) for p in seen))
    if row["errors"] or not result.get("marks") or any(not m for m in result["marks"]):
        return row
    marks = result["marks"]
    before = [sum(1 for t, _kind, _n in port["arrivals"] if t < m[0]["first"]) for port, m in zip(seen, marks, strict=True)]
    samples = result.get("first_sample") or [None] * len(seen)
    before_sample = [None if f is None else sum(1 for t, _kind, _n in port["arrivals"] if t < f)
                     for port, f in zip(seen, samples, strict=True)]
    row.update(wall_s=result["wall_s"], first_s=[m[0]["first_s"] for m in marks], before_first=before,
               before_sample=before_sample, built_s=result.get("built"))
    keys = result["keys"]
    if len(marks[0]) > 1:  # the cache row: epoch 2 from the first rank's end of epoch 1 on
        second = [sum(n for t, _kind, n in port["arrivals"] if t > m[0]["last"]) for port, m in zip(seen, marks, strict=True)]
        row["second_epoch_bytes"] = sum(second)
        row["second_epoch_s"] = max(m[1]["last"] - m[0]["last"] for m in marks)
        row["second_epoch_requests"] = sum(sum(1 for t, _k, _n in port["arrivals"] if t > m[0]["last"])
                                           for port, m in zip(seen, marks, strict=True))
        got, wanted = Counter(keys), Counter({k: 2 for k in manifest["keys"]})
        row["once"] = harness.Once(sum((got - wanted).values()), sum((wanted - got).values()),
                                   allowed_missing=2 * (len(manifest["keys"]) % slots)).cell()
    else:
        # litdata drops a distributed epoch's tail (its drop_last), Mosaic pads it (its padding)
        even = {"litdata": "drop", "mosaic": "pad", "webdataset": None}.get(key, "drop")
        row["once"] = harness.exactly_once(keys, manifest["keys"], even=even, slots=slots).cell()
    return row


def fmt_s(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


S3_COLUMNS = [Col("pipeline"), Col("wall s", 2), Col("vs litdata", right=True),
              Col("first batch s, per rank", right=True), Col("vs litdata", right=True),
              Col("of which building the pipeline", right=True),
              Col("HEAD + GET (+ LIST)", right=True),
              Col("requests before each rank's 1st sample (1st batch)", right=True),
              Col("bytes / dataset", 3), Col("exactly-once")]


def s3_table(setting: Setting, rows: list[dict[str, Any]], manifest: dict[str, Any]) -> str:
    """One setting's rows, with ratios to litdata's (the slowest rank's first batch)."""
    base = next((r for r in rows if r["key"] == "litdata" and "wall_s" in r), None)
    cells: list[list[Any]] = []
    for row in rows:
        label = S3_VARIANTS[row["key"]][0]
        if (instead := harness.unmeasured(row, "wall_s")) is not None:
            cells.append([label, instead])
            continue
        req = row["requests"]
        listed = f" (+ {req['LIST']:,})" if req.get("LIST") else ""
        other = sum(v for k, v in req.items() if k not in ("HEAD", "GET", "LIST"))
        counts = f"{req.get('HEAD', 0):,} + {req.get('GET', 0):,}{listed}" + (f" (+ {other} other)" if other else "")
        vs = harness.ratio(row["wall_s"] / base["wall_s"]) if base and "second_epoch_bytes" not in row else None
        vs_first = harness.ratio(max(row["first_s"]) / max(base["first_s"])) if base else None
        label_cell = label
        if "second_epoch_bytes" in row:
            label_cell += (f"; 2nd epoch: {row['second_epoch_s']:.2f} s, {row['second_epoch_requests']:,} requests, "
                           f"{row['second_epoch_bytes'] / manifest['bytes']:.3f}× the dataset from the store")
        built = row.get("built_s") or []
        cells.append([label_cell, row["wall_s"], vs, fmt_s(row["first_s"]), vs_first,
                      fmt_s(built) if built and None not in built else None, counts,
                      before_cell(row), row["bytes"] / manifest["bytes"], row["once"]])
    return harness.table(S3_COLUMNS, cells)


def before_cell(row: dict[str, Any]) -> str:
    """Requests each rank's processes made before its first sample, then before its first batch."""
    samples = row.get("before_sample") or [None] * len(row["before_first"])
    first = " / ".join("—" if s is None else f"{s:,}" for s in samples)
    return f"{first} ({' / '.join(f'{b:,}' for b in row['before_first'])})"


def s3_targets(tables: list[tuple[Setting, list[dict[str, Any]], dict[str, Any]]],
               indexed: dict[str, dict[str, Any]], feats: dict[str, Any]) -> list[str]:
    """The issue's targets, each ``met`` / ``MISSED`` with its figures (or why it was not measured)."""
    lines: list[str] = []

    def say(ok: bool | None, text: str) -> None:
        lines.append(f"- {'not measured' if ok is None else 'met' if ok else 'MISSED'}: {text}")

    for setting, rows, manifest in tables:
        by = {r["key"]: r for r in rows if "wall_s" in r}
        lit = by.get("litdata")
        if setting.bandwidth:
            floor = manifest["bytes"] / setting.bandwidth
            for key in ("distshard_stored", "distshard_cached", "distshard_cold"):
                if key in by:
                    ratio = by[key]["wall_s"] / floor
                    say(ratio <= 1.10, f"{setting.title}, {key}: wall {by[key]['wall_s']:.2f} s = {ratio:.2f}× "
                        f"(dataset bytes / bandwidth = {floor:.2f} s; target ≤ 1.10×)")
            continue
        stored = by.get("distshard_stored")
        if not feats.get("index"):
            say(None, f"{setting.title}: stored index (no `python -m distshard index` in this library)")
        elif stored is None or lit is None:
            say(False if stored is None else None, f"{setting.title}: stored-index row or litdata row did not run")
        else:
            wall, first = stored["wall_s"] / lit["wall_s"], max(stored["first_s"]) / max(lit["first_s"])
            heads = stored["requests"].get("HEAD", 0)
            before = [b for b in stored.get("before_sample") or [] if b is not None]
            say(wall <= 1.0, f"{setting.title}: stored index wall {stored['wall_s']:.2f} s = {wall:.2f}× litdata's")
            say(first <= 1.0, f"{setting.title}: stored index first batch {max(stored['first_s']):.2f} s = "
                f"{first:.2f}× litdata's {max(lit['first_s']):.2f} s")
            say(heads == 0, f"{setting.title}: stored index HEAD requests {heads} (target 0)")
            say(bool(before) and max(before) <= 4 if before else None,
                f"{setting.title}: stored index requests before a rank's first sample "
                f"{' / '.join(map(str, before)) or 'not noted'} (target ≤ 4; before its first batch of "
                f"{BATCH}: {' / '.join(map(str, stored['before_first']))}, one range per file a batch spans)")
        cache = by.get("distshard_local_cache")
        if cache is not None:
            share = cache["second_epoch_bytes"] / manifest["bytes"]
            say(share <= 0.05, f"{setting.title}: 2nd epoch from the local cache read {share:.3f}× the dataset "
                "from the store (target ≤ 0.05×)")
        for row in rows:
            if row["key"].startswith("distshard") and "once" in row and not row["once"].startswith("✓"):
                say(False, f"{setting.title}, {row['key']}: exactly-once {row['once']}")
    if not feats.get("cache_dir"):
        say(None, "2nd epoch from a local cache (no `ReadOptions(cache_dir=)` in this library)")
    for data, built in indexed.items():
        if built.get("error"):
            say(False, f"`python -m distshard index` over {data}: {built['error'][:200]}")
            continue
        net = max(0.0, built["seconds"] - built.get("startup_s", 0.0))
        ratio = net / built["stream_s"]
        say(ratio <= 1.2 if data.startswith("d1024") else None,
            f"`python -m distshard index` over {data} (at the first latency measured): {built['seconds']:.2f} s, "
            f"{sum(built['requests'].values()):,} requests; less its start ({built.get('startup_s', 0.0):.2f} s: "
            f"`index --help`) {net:.2f} s = {ratio:.2f}× streaming every shard once with "
            f"{built['stream_threads']} threads ({built['stream_s']:.2f} s; target ≤ 1.2× at 1,024 shards)")
    return lines


def median_row(key: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Over rounds: the median wall, the per-rank median first batch, the first
    complete round's counts (requests do not vary with timing much)."""
    good = [r for r in runs if "wall_s" in r]
    if not good:
        return runs[0]
    row = dict(good[0])
    row["wall_s"] = harness.median(r["wall_s"] for r in good)
    row["first_s"] = [harness.median(r["first_s"][i] for r in good) for i in range(len(good[0]["first_s"]))]
    row["left_out"] = harness.left_out(runs, good)
    bad = next((r for r in good if not r["once"].startswith("✓")), None)
    if bad is not None:
        row["once"] = bad["once"]
    return row
