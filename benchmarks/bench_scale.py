"""Scale, by simulation: what a job pays for its plan and its index as shards grow.

``plan``: 100,000 shards and 65,536 slots (1,024 nodes x 8 ranks x 8 workers), no
cluster needed. For one slot, the time and memory to build its plan over the
shards' counts and reach its first element; the size and merge time of an elastic
state when every slot stopped at a random point of its block, then one slot of a
new run (32,768 slots) planning from that merged state.

``stored`` (issue 33): a stored index as ``python -m distshard index s3://bench/data/``
writes it (packs of entries; manifest format version 3, its head, columns and pages,
or with ``--manifest-version 2`` the ``manifest.json`` listing every file, S3 URLs and ETags) for 10^5 and 10^6 tar shards (10^7 with ``--huge``) on a virtual S3
bucket on 127.0.0.1 (``synthetic_s3.py``: the shards are made on demand, so a rank
can read any of them). A fresh process is one rank: rank 0 of 1,024 (no workers),
and rank 0 of 32,768 x 2 DataLoader workers (65,536 slots), fork and spawn (not at
10^7: rank 0 of 1,024 alone unless ``--huge-workers``). Per
rank: the bytes it fetched before its first sample (manifest, entries, data), its
CPU to that sample, its peak RSS (and above the interpreter's, after the imports),
a worker's peak RSS and private memory at its first sample, and what a spawned
worker is sent (the pickled process object: the pipe and the loader's queues).

``refresh`` (issue 33): the requests of ``python -m distshard index
s3://bench/data/.distshard`` on an unchanged dataset of 10^5 and 10^6 shards.

``local`` (issue 33): 2*10^4 and 10^5 one-line JSON-lines files indexed by the
command; a fresh process builds ``distshard.jsonl(glob)`` and takes rank 0 of
1,024's first element: bytes read (``rchar``), CPU and RSS from before the glob.

    .venv/bin/python benchmarks/bench_scale.py                  # everything, at the sizes above
    .venv/bin/python benchmarks/bench_scale.py --only stored    # one part (plan, stored, refresh, local)
    .venv/bin/python benchmarks/bench_scale.py --huge           # and 10^7 shards (one big run at a time)
    .venv/bin/python benchmarks/bench_scale.py --quick          # every part, small (2,000 files)
    .venv/bin/python benchmarks/bench_scale.py --only stored --sizes 1000000 --manifest-version 2   # one size, before

Not measured in ``plan``: reading the per-file index entries; it starts from the counts.
"""

# Issue 33, items 1-2, as built (``--manifest-version 3``, the default; ``2`` measures the before
# column): manifest.json is a small head (counts, the dataset's identity, the column descriptions, the
# page size); the columns object (count, size, the page table: a few bytes a file, fixed-width
# little-endian) is fetched whole by every rank; pages of 512 files (names, ETags, where the entries
# lie) are fetched as a slot reaches them (stored/manifest3.py, stored/paged.py). A source given the
# brace pattern the head records keeps it lazy (sources/transport/brace_list.py: no URL list) and maps
# file k to file k with no page (other URLs: by the digest in the head); a spawned worker is pickled
# the pattern, the head and where the index is, and fetches its own columns and pages.

from __future__ import annotations

import argparse
import bisect
import json
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipes"))

import harness  # noqa: E402
from distshard.context import ShardContext  # noqa: E402
from distshard.engine import SlotRun  # noqa: E402
from distshard.merging import merge_states  # noqa: E402
from distshard.readers import SequenceReader  # noqa: E402


class Shards:
    """A positional view over shards with known counts, as a file source's sequence
    is (one int per shard; element i is (shard, index in shard))."""

    distshard_blocks = True

    def __init__(self, counts: list[int]) -> None:
        self.starts = [0]
        for count in counts:
            self.starts.append(self.starts[-1] + count)

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i: int) -> tuple[int, int]:
        shard = bisect.bisect_right(self.starts, i) - 1
        return shard, i - self.starts[shard]

    def distshard_identity(self) -> str:
        return f"shards:{len(self.starts) - 1}:{self.starts[-1]}"


def _slot_plan(counts: list[int], world: int, workers: int, rank: int, worker: int, resume=None) -> dict:
    """Build one slot's run and take its first element: seconds and peak bytes."""
    tracemalloc.start()
    started = time.perf_counter()
    reader = SequenceReader(Shards(counts))
    ctx = ShardContext(rank, world, worker, workers, "explicit")
    run = SlotRun(reader, ctx=ctx, even="drop", shuffle=False, epoch=0, seed=0, resume=resume)
    first = next(iter(run))
    seconds = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"seconds": seconds, "peak_mb": peak / 2**20, "first": first}


def _merged_state(counts: list[int], world: int, workers: int, rng: random.Random) -> tuple[dict, dict]:
    """Every slot's state after it took a random part of its block, and their merge."""
    reader = SequenceReader(Shards(counts))
    states = []
    started = time.perf_counter()
    for rank in range(world):
        for worker in range(workers):
            ctx = ShardContext(rank, world, worker, workers, "explicit")
            run = SlotRun(reader, ctx=ctx, even="drop", shuffle=False, epoch=0, seed=0)
            share = run.count // ctx.num_slots  # type: ignore[operator]
            run.taken = rng.randint(0, share)  # stopped at a random point of its block
            states.append(run.state())
    build = time.perf_counter() - started
    started = time.perf_counter()
    merged = merge_states(states)
    merge = time.perf_counter() - started
    text = json.dumps(merged)
    return merged, {"states_s": build, "merge_s": merge, "json_mb": len(text) / 2**20,
                    "intervals": len(merged["remaining"])}


def measure(shards: int, world: int, workers: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    counts = [rng.randint(100, 500) for _ in range(shards)]
    slots = world * workers
    plan = _slot_plan(counts, world, workers, world - 1, workers - 1)  # the last slot: the farthest block
    merged, merge = _merged_state(counts, world, workers, rng)
    after = _slot_plan(counts, world // 2, workers, world // 2 - 1, workers - 1, resume=merged)
    return {"shards": shards, "samples": sum(counts), "slots": slots, "plan": plan, "merge": merge,
            "resumed_plan": after}


# -- issue 33: the stored index at 10^5..10^7 files -------------------------------------------------
MIB = 2**20
STORED = (100_000, 1_000_000)
HUGE = 10_000_000
REFRESH = (100_000, 1_000_000)
LOCAL = (20_000, 100_000)
QUICK = 2_000
LAYOUTS = {"rank 0 of 1,024": (1_024, 0, None), "65,536 slots, fork": (32_768, 2, "fork"),
           "65,536 slots, spawn": (32_768, 2, "spawn")}


def _status() -> dict[str, int]:
    """This process's ``VmRSS``, ``VmHWM`` and private bytes (``smaps_rollup``), in bytes."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                out[name] = int(value.split()[0]) * 1024
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("Private_Clean", "Private_Dirty"):
                out["private"] = out.get("private", 0) + int(value.split()[0]) * 1024
    return out


def first_in_worker(sample: dict) -> dict:
    """What a DataLoader worker reports with its first sample (its memory, its CPU so far)."""
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    return {"key": sample["__key__"], "worker": None if info is None else info.id, **_status(),
            "cpu_s": time.process_time()}


def _options(endpoint: str) -> dict:
    return {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"}}


def _pickled_sizes() -> list[int]:
    """Patch multiprocessing's spawn pickling: the sizes of what each spawned process is sent."""
    from multiprocessing import reduction

    sizes: list[int] = []
    dump = reduction.dump

    def counted(obj, file, protocol=None):  # type: ignore[no-untyped-def]
        before = file.tell()
        dump(obj, file, protocol)
        sizes.append(file.tell() - before)

    reduction.dump = counted  # type: ignore[assignment]
    return sizes


def rank_run(endpoint: str, files: int, world: int, workers: int, start: str | None) -> dict:
    """One rank in a fresh process (``harness.launch``): rank 0 of ``world`` with
    ``workers`` DataLoader workers started by ``start``, over the virtual bucket's
    stored index; what it cost up to its first sample."""
    import urllib.request

    import torch.utils.data

    import distshard

    distshard.webdataset(["s3://bench/data/shard-0000000.tar"], storage_options=_options(endpoint))  # imports
    urls = f"s3://bench/data/shard-{{0000000..{files - 1:07d}}}.tar"
    sizes = _pickled_sizes() if start == "spawn" else []
    urllib.request.urlopen(urllib.request.Request(endpoint + "/__reset", data=b""), timeout=30).read()
    base, cpu0 = _status(), time.process_time()
    source = distshard.webdataset(urls, storage_options=_options(endpoint))  # (the pattern's URLs)
    cpu_urls = time.process_time() - cpu0
    pipe = source.dist_shard(rank=0, world_size=world)
    pickled = None
    if workers:
        pickled = len(__import__("pickle").dumps(pipe))
        loader = torch.utils.data.DataLoader(pipe.map(first_in_worker), batch_size=None, num_workers=workers,
                                             multiprocessing_context=start, prefetch_factor=1)
        iterator = iter(loader)
        firsts = [next(iterator) for _ in range(workers)]  # (in turn: one from each worker)
    else:
        firsts = [first_in_worker(next(iter(pipe)))]
    cpu = time.process_time() - cpu0
    end = _status()
    with urllib.request.urlopen(endpoint + "/__stats", timeout=30) as answer:
        fetched = json.loads(answer.read())
    if workers:
        del iterator  # (the workers stop)
    return {"files": files, "world": world, "workers": workers, "start": start, "cpu_s": cpu, "cpu_urls_s": cpu_urls,
            "rss_peak": end["VmHWM"], "rss_base": base["VmRSS"], "rss_above": end["VmHWM"] - base["VmRSS"],
            "pipe_pickle": pickled, "spawn_sent": sizes, "firsts": firsts, "fetched": fetched}


def _fetched(row: dict, what: str) -> int:
    return sum(v for k, v in row["fetched"]["bytes"].items() if k.endswith(" " + what))


def _index_fetched(row: dict) -> int:
    """Bytes of the stored index a rank fetched: the manifest, (version 3) its columns and pages, entries."""
    return sum(_fetched(row, what) for what in ("manifest", "columns", "pages", "pack"))


def measure_stored(
    files: int, root: Path, timeout: float, version: int = 3, with_workers: bool = False
) -> tuple[dict, list[dict]]:
    """Write the stored index of ``files`` shards (manifest format ``version``), serve it,
    run each layout's rank."""
    import synthetic_s3

    folder = root / f"index-{files}"
    started = time.perf_counter()
    written = synthetic_s3.write_stored_index(folder, files, version=version)
    written["write_s"] = time.perf_counter() - started
    rows = []
    with synthetic_s3.Running(files, folder) as store:
        for label, (world, workers, start) in LAYOUTS.items():
            if files > STORED[-1] and workers and not with_workers:
                continue  # (10^7 with workers: --huge-workers)
            done = harness.launch(__file__, "rank_run", {"endpoint": store.endpoint, "files": files,
                                                         "world": world, "workers": workers, "start": start},
                                  timeout=timeout)
            rows.append({"label": label, **done})
    return written, rows


def _manifest_bytes(written: dict) -> int:
    """What every rank fetches of the manifest: ``manifest.json`` (version 3: and its columns)."""
    return written["manifest_bytes"] + written.get("columns_bytes", 0)


def _stored_table(measured: list[tuple[int, dict, list[dict]]]) -> str:
    columns = [harness.Col("files", 0), harness.Col("manifest (+ columns)", 2, " MB"), harness.Col("rank"),
               harness.Col("fetched before the first sample: index", 2, " MB"), harness.Col("data", 2, " MB"),
               harness.Col("requests", 0), harness.Col("CPU to the first sample", 2, " s"),
               harness.Col("of which the URLs", 2, " s"),
               harness.Col("rank's peak RSS", 0, " MiB"), harness.Col("above the interpreter", 0, " MiB"),
               harness.Col("a worker's peak RSS / private", right=True), harness.Col("spawned worker sent", right=True)]
    rows: list[list] = []
    for files, written, runs in measured:
        for row in runs:
            if "errors" in row:
                rows.append([files, _manifest_bytes(written) / 1e6, f"{row['label']}: failed: "
                             + harness.error_line(row["errors"][0])])
                continue
            workers = [f for f in row["firsts"] if f.get("worker") is not None]
            memory = (f"{max(w['VmHWM'] for w in workers) / MIB:.0f} / {max(w['private'] for w in workers) / MIB:.0f}"
                      " MiB" if workers else "—")
            sent = f"{max(row['spawn_sent']) / 1e6:.2f} MB" if row["spawn_sent"] else "—"
            rows.append([files, _manifest_bytes(written) / 1e6, row["label"],
                         _index_fetched(row) / 1e6, _fetched(row, "data") / 1e6,
                         sum(row["fetched"]["requests"].values()), row["cpu_s"], row.get("cpu_urls_s", 0.0),
                         row["rss_peak"] / MIB,
                         row["rss_above"] / MIB, memory, sent])
    return harness.table(columns, rows)


def refresh_run(endpoint: str) -> dict:
    """``python -m distshard index s3://bench/data/.distshard`` in this process."""
    import urllib.request

    from distshard.sources.stored.indexing import build_stored_index

    urllib.request.urlopen(urllib.request.Request(endpoint + "/__reset", data=b""), timeout=30).read()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    built = build_stored_index(["s3://bench/data/.distshard"], storage_options=_options(endpoint))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    with urllib.request.urlopen(endpoint + "/__stats", timeout=30) as answer:
        fetched = json.loads(answer.read())
    return {"files": len(built.files), "indexed": built.built, "cpu_s": cpu, "wall_s": wall, "fetched": fetched}


def measure_refresh(files: int, root: Path, timeout: float, version: int = 3) -> dict:
    import synthetic_s3

    folder = root / f"refresh-{files}"
    synthetic_s3.write_stored_index(folder, files, version=version)
    with synthetic_s3.Running(files, folder) as store:
        return harness.launch(__file__, "refresh_run", {"endpoint": store.endpoint}, timeout=timeout)


def local_run(pattern: str) -> dict:
    """A fresh process: ``distshard.jsonl(pattern)`` and rank 0 of 1,024's first element."""
    import distshard

    base, cpu0, read0 = _status(), time.process_time(), harness.rchar()
    first = next(iter(distshard.jsonl(pattern).dist_shard(rank=0, world_size=1_024)))
    cpu, read, end = time.process_time() - cpu0, harness.rchar() - read0, _status()
    return {"first": first, "cpu_s": cpu, "read": read, "rss_peak": end["VmHWM"], "rss_base": base["VmRSS"],
            "rss_above": end["VmHWM"] - base["VmRSS"]}


def measure_local(files: int, root: Path, timeout: float) -> dict:
    """``files`` one-line JSON-lines files, the index command, then :func:`local_run`."""
    import subprocess

    folder = root / f"jsonl-{files}"
    folder.mkdir(parents=True)
    for i in range(files):
        (folder / f"part-{i:07d}.jsonl").write_text(json.dumps({"id": i, "text": f"line {i}"}) + "\n")
    pattern = str(folder / "part-*.jsonl")
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "distshard", "index", pattern], check=True, timeout=timeout,
                   env=harness.child_env(str(root / "index-cache")), stdout=subprocess.DEVNULL)
    indexed_s = time.perf_counter() - started
    done = harness.launch(__file__, "local_run", {"pattern": pattern}, timeout=timeout)
    index = folder / ".distshard"
    read_whole = [index / "manifest.json", *index.glob("columns-*.bin")]  # (what every rank reads whole)
    return {"files": files, "index_s": indexed_s, "manifest_bytes": sum(p.stat().st_size for p in read_whole), **done}


def _local_table(rows: list[dict]) -> str:
    columns = [harness.Col("files", 0), harness.Col("manifest (+ columns)", 2, " MB"), harness.Col("read", 2, " MB"),
               harness.Col("read per file", 0, " B"), harness.Col("CPU", 2, " s"), harness.Col("CPU per file", 1, " µs"),
               harness.Col("peak RSS", 0, " MiB"), harness.Col("above the interpreter", 0, " MiB")]
    return harness.table(columns, [
        [r["files"], r["manifest_bytes"] / 1e6, r["read"] / 1e6, r["read"] / r["files"], r["cpu_s"],
         r["cpu_s"] / r["files"] * 1e6, r["rss_peak"] / MIB, r["rss_above"] / MIB] if "errors" not in r
        else [r["files"], "failed: " + harness.error_line(r["errors"][0])] for r in rows])


def _refresh_line(row: dict) -> str:
    if "errors" in row:
        return "refresh: failed: " + harness.error_line(row["errors"][0])
    requests = row["fetched"]["requests"]
    return (f"refresh of an unchanged dataset of {row['files']:,} shards: {sum(requests.values()):,} requests "
            f"({', '.join(f'{k}: {v:,}' for k, v in sorted(requests.items()))}), {row['indexed']} indexed again, "
            f"{row['cpu_s']:.1f} s of CPU, {row['wall_s']:.1f} s")


def run_plan(quick: bool) -> str:
    configs = [(10_000, 512, 8)] if quick else [(10_000, 512, 8), (100_000, 8_192, 8)]
    rows = [measure(*config) for config in configs]
    columns = [harness.Col("shards", 0), harness.Col("samples", 0), harness.Col("slots", 0),
               harness.Col("one slot: plan + first element", 1, " ms"), harness.Col("peak memory", 1, " MB"),
               harness.Col("merged state (JSON)", 2, " MB"), harness.Col("intervals", 0),
               harness.Col("merge time", 2, " s"), harness.Col("new run's slot from the merged state", right=True)]
    return harness.table(columns, [
        [row["shards"], row["samples"], row["slots"], row["plan"]["seconds"] * 1e3, row["plan"]["peak_mb"],
         row["merge"]["json_mb"], row["merge"]["intervals"], row["merge"]["merge_s"],
         f"{row['resumed_plan']['seconds'] * 1e3:.1f} ms, {row['resumed_plan']['peak_mb']:.1f} MB"]
        for row in rows])


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"every part small ({QUICK:,} files)")
    parser.add_argument("--huge", action="store_true", help=f"stored: also {HUGE:,} shards, rank 0 of 1,024 alone (~10 min to write the index, ~7 GB of disk)")
    parser.add_argument("--huge-workers", action="store_true", help="stored: at 10^7 the layouts with workers too")
    parser.add_argument("--only", default="plan,stored,refresh,local", help="parts, comma-separated")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a measuring process may take")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--manifest-version", type=int, choices=(2, 3), default=3,
                        help="stored, refresh: the manifest format written (2: the before column)")
    parser.add_argument("--sizes", help="stored, refresh, local: the file counts, comma-separated (default: the parts' own)")
    harness.add_child_args(parser)
    args = parser.parse_args(argv)
    if args.run is not None:
        return harness.child(args.run, args.out, globals())
    parts = set(args.only.split(","))
    session = harness.Session()
    print(session.header())
    payload: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        root = Path(tmp)
        if "plan" in parts:
            print("\nplan:\n\n" + run_plan(args.quick))
        if "stored" in parts:
            sizes = (QUICK,) if args.quick else STORED + ((HUGE,) if args.huge else ())
            sizes = tuple(int(n) for n in args.sizes.split(",")) if args.sizes else sizes
            measured = [(files, *measure_stored(files, root, args.timeout, args.manifest_version, args.huge_workers))
                        for files in sizes]
            payload["stored"] = measured
            print("\nstored index, rank before its first sample:\n\n" + _stored_table(measured))
        if "refresh" in parts:
            refresh = tuple(int(n) for n in args.sizes.split(",")) if args.sizes else (QUICK,) if args.quick else REFRESH
            payload["refresh"] = [measure_refresh(files, root, args.timeout, args.manifest_version) for files in refresh]
            print("".join("\n" + _refresh_line(row) for row in payload["refresh"]))
        if "local" in parts:
            local = tuple(int(n) for n in args.sizes.split(",")) if args.sizes else (QUICK,) if args.quick else LOCAL
            payload["local"] = [measure_local(files, root, args.timeout) for files in local]
            print("\nlocal JSON-lines files, rank 0 of 1,024's first element:\n\n" + _local_table(payload["local"]))
    session.dump(args.json, **payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
