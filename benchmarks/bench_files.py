"""Real sharded files: ``distshard.webdataset`` against torch's ``sharding_filter``,
distshard's unit mode with an indexed-tar ``expand`` and the real peers (webdataset,
Hugging Face ``datasets``, MosaicML Streaming, litdata), in one run, on the same
generated data, 4 gloo ranks × 2 DataLoader workers.

The data
--------
64 WebDataset-style tar shards (``--shards``) of 201–492 samples each (seeded),
each sample a JPEG-like blob (``.jpg``: a JPEG start marker, 1–4 KiB of
incompressible bytes, an end marker) and its label (``.cls``). Mosaic and litdata
read their own formats: the same samples converted once to MDS and by
``litdata.optimize`` (chunks of about the tars' mean size), in setup (conversion
times reported, outside the measured window). litdata's row reads through its
``StreamingDataset`` and ``StreamingDataLoader``, as its users do. The unit-mode row
is ``IterableWrapper(urls).dist_shard(expand=IndexedTar, sizes=counts)``: the shards'
sample counts given (as a shard index's ``nsamples``), each shard's headers walked
with ``tarfile`` by the worker that reads it, each sample's members read by ``pread``.

What runs
---------
Every variant runs in its own process tree (``harness.launch``: the dev venv for
torch and distshard, the benchmark-only venv ``benchmarks/.venv`` for the
peers), which starts a gloo group of ``WORLD_SIZE = 4`` ranks on 127.0.0.1
(``harness.run_job``); every
rank iterates ``DataLoader(dataset, batch_size=32, num_workers=2,
multiprocessing_context="fork")``, so there are ``S = 8`` slots. ``decode`` is
the same in every variant: a BLAKE2b of the JPEG bytes, then a calibrated busy
loop (~0.25 ms of CPU), counted. Each distshard run starts with an empty
``$DISTSHARD_CACHE``: the cold index build is part of the measured job. Rounds
are interleaved (every variant once per round, in a rotating order) and the
table shows medians.

Columns
-------
per-slot counts
    samples each slot yielded (the last pipe of every pipeline counts them in
    its worker), min–max over the 8 slots.
exactly-once
    the multiset of every key the 4 ranks received against the N keys of the
    data: ✓, or the duplicates / missing; ``even="drop"`` may drop ``N mod 8``,
    litdata (its ``drop_last``, on in a distributed run) ``N mod (8 × 32)``.
decodes / N
    decode calls summed over all processes, divided by N.
read / data
    bytes read (``rchar`` of ``/proc/self/io``: every ``read``/``pread``) by the
    8 workers over their life plus by the 4 ranks while they build the pipeline
    (a rank's reads while iterating are the batches its workers send it through
    pipes, not file reads, so they are not counted), divided by the tar bytes.
CPU s / wall s
    user + sys CPU of the 4 ranks and their workers over the window (from just
    before the pipeline is built to the workers' exit), summed; the slowest
    rank's wall time over the same window (``harness.Meter``).
peak RSS
    the peak resident set of the 12 processes, summed (forked workers share
    pages, so this over-counts what the job needs).
user lines
    the lines a user writes to get from shard files to decoded samples per slot
    (the DataLoader line, common to all, excluded).

How to run
----------
::

    .venv/bin/python benchmarks/bench_files.py --setup-peers   # once: benchmarks/.venv with the peers
    .venv/bin/python benchmarks/bench_files.py                 # 64 shards, 3 rounds: ~10 min on 2 cores
    .venv/bin/python benchmarks/bench_files.py --quick         # 12 shards, 1 round
    .venv/bin/python benchmarks/bench_files.py --only distshard,webdataset --json files.json

Without the peers' venv their rows say so; nothing else needs more than the dev venv.
With the ``litdata`` row, the output ends with issue 32's target: ``distshard.webdataset``'s
CPU ≤ 0.9× litdata's, from each round's ratio (the rows of a round run side by side), the
unit mode's ratio beside it::

    .venv/bin/python benchmarks/bench_files.py --only distshard,unit_tar,litdata
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch.utils.data.datapipes.datapipe import IterDataPipe

import harness
from files_data import convert, convert_litdata, fake_jpeg, generate, import_streaming, read_tar
from harness import Col

# re-exported: convert, convert_litdata are called in a child by name (harness.launch); remote_data uses fake_jpeg
__all__ = ["convert", "convert_litdata", "fake_jpeg"]

WORLD_SIZE, NUM_WORKERS, BATCH = 4, 2, 32
NUM_SLOTS = WORLD_SIZE * NUM_WORKERS
DECODE_TARGET_S = 0.25e-3


# -- decode: counted, the same everywhere ------------------------------------------------------
class Decode(harness.Decode):
    """``sample -> key`` after hashing the JPEG bytes and ``iters`` digests of CPU
    (``{"__key__": key}`` with ``as_dict``: Hugging Face's ``map`` wants a dict)."""

    def __init__(self, iters: int, as_dict: bool = False) -> None:
        super().__init__(iters)
        self.as_dict = as_dict

    def __call__(self, sample: dict[str, Any]) -> Any:
        jpg = sample["jpg"]
        if isinstance(jpg, dict):  # Hugging Face's Image(decode=False)
            jpg = jpg["bytes"]
        self.work(hashlib.blake2b(jpg, digest_size=16).digest())
        return {"__key__": sample["__key__"]} if self.as_dict else sample["__key__"]


# -- the variants ----------------------------------------------------------------------------------
class TarSamples(IterDataPipe):  # ... and the pipe around it
    def __init__(self, urls):
        self.urls = urls

    def __iter__(self):
        for url in self.urls:
            yield from read_tar(url)


_READER_LINES = 13 + 6  # read_tar + TarSamples, as a user writes them


class IndexedTar:  # the unit mode's expand: a tar's samples by position, from its headers
    def __init__(self, url):  # (in the worker that reads the shard)
        parts = {}
        with tarfile.open(url) as tf:  # seeks from header to header
            for member in tf:
                if member.isfile():
                    key, ext = member.name.split(".", 1)
                    parts.setdefault(key, []).append((ext, member.offset_data, member.size))
        self.samples = list(parts.items())
        self.fd = os.open(url, os.O_RDONLY)  # pread: no shared offset across forked workers

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        key, parts = self.samples[i]
        return {"__key__": key, **{ext: os.pread(self.fd, size, at) for ext, at, size in parts}}


_INDEXED_TAR_LINES = 18  # IndexedTar; its sizes are the shards' counts (a shard index's nsamples)


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    venv: str  # "dev" or "peers"
    code: str  # what the user writes (shown in the README)
    extra_lines: int = 0  # helper code the user writes besides ``code``
    distshard: bool = False
    epochs: int = 1  # > 1: the even='drop' / 'carry' rows, run over several epochs (a table of their own)

    @property
    def lines(self) -> int:
        return len([line for line in self.code.splitlines() if line.strip()]) + self.extra_lines


VARIANTS = [
    Variant("sf_files", "torch `sharding_filter` over files", "dev",
            "dp = TarSamples(IterableWrapper(urls).sharding_filter()).map(decode)",
            extra_lines=_READER_LINES),
    Variant("sf_samples", "torch `sharding_filter` over samples", "dev",
            "dp = TarSamples(IterableWrapper(urls)).sharding_filter().map(decode)",
            extra_lines=_READER_LINES),
    Variant("webdataset", "webdataset 1.0.2", "peers",
            "ds = wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node,\n"
            "                    workersplitter=wds.split_by_worker, empty_check=False)\n"
            "ds = ds.map(decode)"),
    Variant("hf", "HF datasets 4.8.5 (streaming)", "peers",
            'ds = load_dataset("webdataset", data_files={"train": urls}, split="train", streaming=True)\n'
            'ds = ds.cast_column("jpg", Image(decode=False))\n'
            "ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)\n"
            'ds = ds.map(decode, remove_columns=["jpg", "cls", "__url__"])'),
    Variant("mosaic", "MosaicML Streaming 0.13.0 (MDS copy)", "peers",
            "class Decoded(StreamingDataset):\n"
            "    def __getitem__(self, i):\n"
            "        return decode(super().__getitem__(i))\n"
            "ds = Decoded(local=mds_dir, shuffle=False, batch_size=32)",
            extra_lines=1),  # MDSWriter conversion, at least one more line
    Variant("litdata", "litdata 0.2.76 (`optimize()` copy)", "peers",
            "class Decoded(StreamingDataset):\n"
            "    def __getitem__(self, i):\n"
            "        return decode(super().__getitem__(i))\n"
            "ds = Decoded(litdata_dir)\n"
            "loader = StreamingDataLoader(ds, batch_size=32, num_workers=2)",
            extra_lines=1),  # the optimize() conversion, at least one more line
    Variant("unit_tar", "distshard unit mode, indexed-tar expand", "dev",
            'dp = IterableWrapper(urls).dist_shard(expand=IndexedTar, sizes=counts, even="drop").map(decode)',
            extra_lines=_INDEXED_TAR_LINES, distshard=True),
    Variant("distshard", "distshard.webdataset", "dev",
            'dp = distshard.webdataset(urls).dist_shard(even="drop").map(decode)', distshard=True),
    Variant("distshard_shuffle", "distshard.webdataset, shuffle=True", "dev",
            'dp = distshard.webdataset(urls).dist_shard(even="drop", shuffle=True).map(decode)',
            distshard=True),
    Variant("distshard_drop_epochs", "distshard.webdataset, even='drop', 4 epochs", "dev",
            'dp = distshard.webdataset(urls).dist_shard(even="drop", multiple_of=32).map(decode)',
            distshard=True, epochs=4),
    Variant("distshard_carry_epochs", "distshard.webdataset, even='carry', 4 epochs", "dev",
            'dp = distshard.webdataset(urls).dist_shard(even="carry", multiple_of=32).map(decode)',
            distshard=True, epochs=4),
]
BY_KEY = {v.key: v for v in VARIANTS}


def import_libraries(key: str, urls: list[str]) -> None:
    """Import what ``key`` needs before the measured window (imports read .py
    files: that is not reading the data)."""
    if key == "webdataset":
        import webdataset  # noqa: F401
    elif key == "hf":
        from datasets import Image, load_dataset

        # HF imports more on the first iteration (~240 KB of .py per process):
        # one sample of one shard here, before the window, so that forked workers have it
        ds = load_dataset("webdataset", data_files={"train": urls[:1]}, split="train", streaming=True)
        next(iter(ds.cast_column("jpg", Image(decode=False))))
    elif key == "mosaic":
        import_streaming()
    elif key == "litdata":
        import litdata  # noqa: F401
    elif key.startswith("distshard") or key == "unit_tar":
        import distshard.sources  # noqa: F401


def build(key: str, manifest: dict[str, Any], decode: Decode, rank: int, copy: str | None) -> Any:
    """Variant ``key``'s pipeline on ``rank``; ``copy``: the converted copy it reads (Mosaic, litdata)."""
    urls = manifest["urls"]
    if key in ("sf_files", "sf_samples"):
        from torch.utils.data.datapipes.iter import IterableWrapper

        if key == "sf_files":
            return TarSamples(IterableWrapper(urls).sharding_filter()).map(decode)
        return TarSamples(IterableWrapper(urls)).sharding_filter().map(decode)
    if key == "webdataset":
        import webdataset as wds

        ds = wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node,
                            workersplitter=wds.split_by_worker, empty_check=False)
        return ds.map(decode)
    if key == "hf":
        from datasets import Image, load_dataset
        from datasets.distributed import split_dataset_by_node

        ds = load_dataset("webdataset", data_files={"train": urls}, split="train", streaming=True)
        ds = ds.cast_column("jpg", Image(decode=False))
        ds = split_dataset_by_node(ds, rank=rank, world_size=WORLD_SIZE)
        return ds.map(Decode(decode.iters, as_dict=True), remove_columns=["jpg", "cls", "__url__"])
    if key == "mosaic":
        StreamingDataset = import_streaming().StreamingDataset

        class Decoded(StreamingDataset):
            def __getitem__(self, i: int) -> Any:
                return decode(super().__getitem__(i))

        return Decoded(local=copy, shuffle=False, batch_size=BATCH)
    if key == "litdata":
        from litdata import StreamingDataset

        class Decoded(harness.SelfReporting, StreamingDataset):  # SelfReporting: the workers' reports
            def __getitem__(self, i: Any) -> Any:
                return decode(super().__getitem__(i))

        return Decoded(copy)
    if key == "unit_tar":
        from torch.utils.data.datapipes.iter import IterableWrapper

        import distshard  # noqa: F401  (dist_shard on every IterDataPipe)

        return IterableWrapper(urls).dist_shard(expand=IndexedTar, sizes=manifest["counts"], even="drop").map(decode)
    if key in ("distshard", "distshard_shuffle"):
        import distshard
        import distshard.sources

        webdataset = getattr(distshard, "webdataset", distshard.sources.webdataset)  # until it is exported
        return webdataset(urls).dist_shard(even="drop", shuffle=key == "distshard_shuffle").map(decode)
    if key in ("distshard_drop_epochs", "distshard_carry_epochs"):
        import distshard

        even = "carry" if key == "distshard_carry_epochs" else "drop"
        return distshard.webdataset(urls).dist_shard(even=even, multiple_of=BATCH).map(decode)
    raise ValueError(f"unknown variant {key!r}")


# -- one variant on a gloo group (in a child process tree) ---------------------------------------------
@dataclass
class FilesJob(harness.Job):
    """Every rank (torchrun's variables set: Mosaic reads them) builds variant ``key``
    inside the window and iterates it through ``DataLoader(batch_size=32,
    num_workers=2)``; the workers count from their start."""

    key: str = ""
    manifest: dict[str, Any] = field(default_factory=dict)
    iters: int = 0
    copy: str | None = None  # the converted copy Mosaic or litdata reads
    batch_size: int | None = BATCH
    worker_init: bool = True
    torchrun_env: bool = True

    def prepare(self, rank: int) -> None:
        import_libraries(self.key, self.manifest["urls"])

    def build(self, rank: int) -> Any:
        return build(self.key, self.manifest, Decode(self.iters), rank, self.copy)

    def loader(self, pipe: Any) -> Any:
        if self.key != "litdata":
            return super().loader(pipe)
        from litdata import StreamingDataLoader

        return StreamingDataLoader(pipe, batch_size=self.batch_size, num_workers=self.num_workers,
                                   multiprocessing_context="fork", timeout=self.timeout,
                                   worker_init_fn=harness.worker_init)

    def close(self, iterator: Any) -> None:
        if iterator is not None and not hasattr(iterator, "_shutdown_workers") and hasattr(iterator, "close"):
            iterator.close()  # StreamingDataLoader's generator: its DataLoader iterator joins the workers
            return
        super().close(iterator)

    def describe(self, pipe: Any) -> str:
        """For distshard rows: does dist_shard read the source at random (the file
        sources' protocol wired in), or stream it?"""
        plan = harness.read_plan(pipe)
        return "" if plan is None else "random access" if plan.sequence is not None else "streams (protocol not wired)"

    def keep(self, batch: Any, values: list) -> None:
        values.extend(batch["__key__"] if isinstance(batch, dict) else batch)


def run_variant(key: str, data: str, iters: int, copy: str | None, timeout: float) -> dict[str, Any]:
    """In a child process: one gloo group, one variant; a summary."""
    manifest = json.loads((Path(data) / "manifest.json").read_text())
    variant = BY_KEY[key]
    run = harness.run_job(FilesJob(key=key, manifest=manifest, iters=iters, copy=copy, timeout=timeout,
                                   epochs=variant.epochs, world_size=WORLD_SIZE, num_workers=NUM_WORKERS))
    got, workers = Counter(run.values()), run.workers
    expected: Any = manifest["keys"]
    slots = {(w["rank"], w["worker"]): w["yielded"] for w in workers}
    epochs_part: dict[str, Any] = {}
    if variant.epochs > 1:  # multiple_of=BATCH: rounds of whole batches
        epochs_part = harness.epochs_check(got, manifest["keys"], workers, epochs=variant.epochs,
                                           even="carry" if key == "distshard_carry_epochs" else "drop",
                                           unit=NUM_SLOTS * BATCH, slots=NUM_SLOTS)
        expected = Counter({k: variant.epochs for k in manifest["keys"]})
    # litdata drops a distributed epoch's tail (its drop_last, on by default there) in whole batches
    even, unit = ("drop", NUM_SLOTS * BATCH) if key == "litdata" else ("drop" if variant.distshard else None, NUM_SLOTS)
    once = harness.exactly_once(got, expected, even=even, slots=unit)
    return {
        **epochs_part,
        "errors": run.errors,
        "complete": run.complete,
        "per_slot": [slots.get((r, w)) for r in range(WORLD_SIZE) for w in range(NUM_WORKERS)],
        "once": asdict(once),
        "decodes": run.total("decodes"),
        "read_bytes": run.read_bytes,
        "rank_read_bytes": [r["rank_rchar"] for r in run.measured],
        "worker_read_bytes": [w["rchar"] for w in workers],
        "cpu_s": run.cpu_s,
        "wall_s": run.wall_s,
        "rss_mib": run.rss_mib,
        "reads": next((r["info"] for r in run.measured if r.get("info")), ""),
    }


EPOCHS_COLUMNS = [Col("pipeline"), Col("per-slot counts by epoch"), Col("equal slots"), Col("delivered", 0),
                  Col("dropped", 0), Col("padded", 0), Col("left for the next epoch", 0), Col("exact"),
                  Col("CPU s", 1), Col("CPU / drop's", 3, "×")]


def epochs_table(rows: list[dict[str, Any]]) -> str:
    """The even='drop' / 'carry' rows over several epochs, CPU against drop's."""
    drop = next((row for row in rows if row["key"] == "distshard_drop_epochs" and "cpu_s" in row), None)
    cells = []
    for row in rows:
        code = f"`{BY_KEY[row['key']].code}`"
        if "epochs_runs" not in row:
            cells.append([code, f"not run: {harness.error_line((row.get('errors') or [row.get('skipped') or 'no complete run'])[0])}"])
            continue
        last = row["epochs_runs"][-1]
        cells.append([code, harness.slot_counts(last["per_epoch_slots"]), last["equal_slots"], last["delivered"],
                      last["dropped"], last["padded"], last["left_for_next_epoch"],
                      all(r["exact"] and r["equal_slots"] for r in row["epochs_runs"]), row["cpu_s"],
                      row["cpu_s"] / drop["cpu_s"] if drop else None])
    return harness.table(EPOCHS_COLUMNS, cells)


# -- the parent: generate, run every variant in rounds, tabulate --------------------------------------
def summarize(variant: Variant, runs: list[dict[str, Any]], manifest: dict[str, Any]) -> dict[str, Any]:
    n, total = len(manifest["keys"]), manifest["bytes"]
    if runs and "skipped" in runs[0]:
        return {"key": variant.key, "skipped": runs[0]["skipped"]}
    good = [r for r in runs if r.get("complete") and not r.get("errors")]
    row: dict[str, Any] = {"key": variant.key, "label": variant.label, "lines": variant.lines, "runs": runs,
                           "errors": [e for r in runs for e in r.get("errors", [])], "left_out": harness.left_out(runs, good)}
    if not good:
        return row
    if variant.epochs > 1:
        row.update(epochs_runs=[{k: r[k] for k in ("per_epoch_slots", "equal_slots", "delivered", "exact",
                                                   "left_for_next_epoch", "dropped", "padded")} for r in good],
                   cpu_s=harness.median(r["cpu_s"] for r in good), cpu_runs=[r["cpu_s"] for r in good])
        return row
    onces = [harness.Once(**r["once"]) for r in good]
    slots = good[0]["per_slot"]
    row.update(
        per_slot=f"{min(slots)}–{max(slots)}" if min(slots) != max(slots) else f"{slots[0]} each",
        exactly_once=next((o for o in onces if not o.ok), onces[0]).cell(),
        decodes_per_n=harness.median(r["decodes"] / n for r in good),
        read_ratio=harness.median(r["read_bytes"] / total for r in good),
        cpu_s=harness.median(r["cpu_s"] for r in good),
        wall_s=harness.median(r["wall_s"] for r in good),
        rss_mib=harness.median(r["rss_mib"] for r in good),
        reads=good[0].get("reads", ""),
    )
    return row


COLUMNS = [Col("pipeline"), Col("per-slot counts"), Col("exactly-once"), Col("decodes / N", 2),
           Col("read / data", 2, "×"), Col("CPU s", 1), Col("wall s", 1), Col("peak RSS MiB", 0), Col("user lines", 0)]


def table(rows: list[dict[str, Any]]) -> str:
    cells = []
    for row in rows:
        variant = BY_KEY[row["key"]]
        if (instead := harness.unmeasured(row, "per_slot", none="no complete run")) is not None:
            cells.append([variant.label, instead])
        else:
            label = variant.label + (f" ({row['reads']})" if variant.distshard and row["reads"] else "")
            cells.append([label, row["per_slot"], row["exactly_once"], row["decodes_per_n"], row["read_ratio"],
                          row["cpu_s"], row["wall_s"], row["rss_mib"], row["lines"]])
    return harness.table(COLUMNS, cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="12 shards of 40-90 samples, 1 round")
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated variant keys: " + ",".join(BY_KEY))
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--expected", type=float, default=90.0,
                        help="seconds a variant's job is expected to take: past them, every process's stack is "
                             "dumped with py-spy into a file the round's line names (default: 90)")
    parser.add_argument("--json", type=Path, help="also dump every measurement here")
    parser.add_argument("--data", type=Path, help="where to write the shards (default: a temp dir)")
    parser.add_argument("--setup-peers", action="store_true", help="create benchmarks/.venv with the peers")
    harness.add_child_args(parser)
    args = parser.parse_args(argv)
    if args.setup_peers:
        return harness.setup_peers()
    if args.run:  # one variant, or the MDS conversion, in a fresh process tree
        return harness.child(args.run, args.out, globals())
    return orchestrate(args, harness.choose(args.only, BY_KEY, parser))


# the converted copies a peer reads, made once before the rounds (outside the measured window)
COPIES = {"mosaic": ("convert", "MDS conversion for Mosaic"), "litdata": ("convert_litdata", "litdata.optimize()")}


def make_copies(chosen: list[Variant], data: Path, workdir: Path, timeout: float) -> dict[str, dict[str, Any]]:
    """Every chosen peer's converted copy: ``{key: {"path", "bytes", "seconds"}}``, or
    ``{key: {"error"}}`` when its conversion failed (no entry without the peers' venv)."""
    copies: dict[str, dict[str, Any]] = {}
    for key, (func, _) in COPIES.items():
        if not any(v.key == key for v in chosen) or not harness.peers_python():
            continue
        out = workdir / key
        done = harness.launch(__file__, func, {"data": str(data), "out": str(out)}, peers=True, timeout=timeout,
                              grace=0)
        copies[key] = ({"path": str(out), "bytes": done["bytes"], "seconds": done["seconds"]} if "bytes" in done
                       else {"error": f"the {COPIES[key][1]} conversion failed"})
    return copies


def run_rounds(args: argparse.Namespace, chosen: list[Variant], data: Path, iters: int, rounds: int,
               copies: dict[str, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Every variant once a round, in the rounds' rotating order; each one's runs."""
    results: dict[str, list[dict[str, Any]]] = {v.key: [] for v in chosen}
    for r, order in harness.rounds(chosen, rounds):
        for variant in order:
            copy = copies.get(variant.key, {})
            if "error" in copy:
                results[variant.key].append({"errors": [copy["error"]], "complete": False})
                continue
            started = time.perf_counter()
            done = harness.launch(
                __file__, "run_variant", {"key": variant.key, "data": str(data), "iters": iters,
                                          "copy": copy.get("path"), "timeout": args.timeout},
                peers=variant.venv == "peers", timeout=args.timeout, expected=args.expected)
            results[variant.key].append(done)
            stacks = "; stacks: " + ", ".join(done["stacks"]) if done.get("stacks") else ""
            if done.get("errors"):
                stacks += "; failed: " + harness.error_line(done["errors"][0])[:200]
            print(f"#   round {r + 1}/{rounds}: {variant.key} done in {time.perf_counter() - started:.0f}s{stacks}",
                  file=sys.stderr, flush=True)
    return results


def round_ratios(results: dict[str, list[dict[str, Any]]], key: str, base: str) -> list[float]:
    """``key``'s CPU over ``base``'s in every round both ran cleanly (side by side)."""
    return [a["cpu_s"] / b["cpu_s"] for a, b in zip(results.get(key, []), results.get(base, []), strict=False)
            if a.get("cpu_s") and b.get("cpu_s") and not a.get("errors") and not b.get("errors")]


def against_litdata(results: dict[str, list[dict[str, Any]]]) -> str | None:
    """Issue 32's target: the file source's CPU ≤ 0.9× litdata's, from the rounds'
    ratios (the rows of one round ran side by side), and the unit mode's beside it."""
    lines, verdict = [], ""
    for key in ("distshard", "unit_tar"):
        ratios = round_ratios(results, key, "litdata")
        if ratios:
            ratio = harness.median(ratios)
            verdict = verdict or (("met" if ratio <= 0.9 else "MISSED") if key == "distshard" else "")
            lines.append(f"{BY_KEY[key].label}: CPU {ratio:.3f}× litdata's (median of the rounds' ratios: "
                         f"{', '.join(f'{x:.3f}' for x in ratios)})")
    if not lines:
        return None
    return f"Target (issue 32): distshard.webdataset's CPU ≤ 0.9× litdata's: {verdict or 'not measured'}.\n" + \
        "\n".join(lines)


def orchestrate(args: argparse.Namespace, chosen: list[Variant]) -> int:
    session = harness.Session()
    shards, low, high, rounds = (12, 40, 90, 1) if args.quick else (args.shards, 201, 492, args.rounds)
    workdir = Path(tempfile.mkdtemp(prefix="bench_files-data-"))
    data = args.data or workdir / "shards"
    try:
        manifest = generate(data, shards, low, high)
        n, total = len(manifest["keys"]), manifest["bytes"]
        iters, cost = harness.calibrate(DECODE_TARGET_S)
        copies = make_copies(chosen, data, workdir, args.timeout)
        conversions = [f"{COPIES[key][1]}: {c['seconds']:.1f} s, {c['bytes'] / 2**20:.1f} MiB (outside the measured "
                       "window)" for key, c in copies.items() if "bytes" in c]
        results = run_rounds(args, chosen, data, iters, rounds, copies)
        rows = [summarize(v, results[v.key], manifest) for v in chosen]
        print(session.header(f"{shards} shards, {n:,} samples, {total / 2**20:.1f} MiB; decode {cost * 1e3:.2f} ms; "
                             f"{WORLD_SIZE} ranks x {NUM_WORKERS} workers, batch {BATCH}; {rounds} round(s), medians",
                             *conversions))
        print()
        print_tables(rows, n, total, copies)
        verdict = against_litdata(results)
        if verdict:
            print("\n" + verdict)
        harness.print_left_out(rows, lambda row: BY_KEY[row["key"]].label)
        session.dump(args.json, samples=n, bytes=total, copies=copies, decode_s=cost, rows=rows)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def print_tables(rows: list[dict[str, Any]], n: int, total: int, copies: dict[str, dict[str, Any]]) -> None:
    """The one-epoch table and the epochs table, each with its notes."""
    one_epoch = [row for row in rows if BY_KEY[row["key"]].epochs == 1]
    several = [row for row in rows if BY_KEY[row["key"]].epochs > 1]
    if one_epoch:
        print(table(one_epoch))
    if several:
        print(f"\n{BY_KEY[several[0]['key']].epochs} epochs, batch {BATCH}, multiple_of={BATCH} (rounds of "
              f"{NUM_SLOTS * BATCH} samples), {n:,} samples an epoch:\n")
        print(epochs_table(several))
        print("\ndropped: samples of the epochs' streams never delivered (under carry not counting the last "
              "epoch's tail, which opens the next epoch); padded: deliveries beyond one a sample an epoch; "
              "exact: the delivered multiset is the concatenated streams' prefix (carry) or every epoch but its "
              "last N mod 256 (drop), with equal counts on the 8 slots every epoch. Target: carry's CPU ≤ "
              "1.05× drop's, equal slots, 0 dropped, 0 padded.")
    if not one_epoch:
        return
    owns = []
    for key, what in (("mosaic", "Mosaic its MDS copy"), ("litdata", "litdata its optimize() chunks")):
        row = next((r for r in rows if r["key"] == key and "read_ratio" in r), None)
        size = copies.get(key, {}).get("bytes")
        if row and size:
            owns.append(f"{what} ({size / 2**20:.1f} MiB: {row['read_ratio'] * total / size:.2f}× of it)")
    own = f" ({'; '.join(owns)}; Mosaic repeats a few samples so that ranks have equal counts)" if owns else ""
    print(f"\nread / data: rchar over the dataset's {total / 2**20:.1f} MiB of tar files; Mosaic and litdata read "
          f"their own formats{own}. distshard builds its index cold in the measured job. Targets for "
          "distshard: read ≤ 1.10×, CPU ≤ webdataset's, shuffle=True CPU ≤ 1.2× the unshuffled run, "
          "equal per-slot counts, one user line.")

if __name__ == "__main__":
    sys.exit(main())
