"""Pipelines of the model-based exactness test (test_model.py), importable by name
in spawned processes: a :class:`Spec` says what to build, :func:`build` builds it.

Elements are distinct strings, so a multiset of them says exactly what was lost
or repeated: ``"e17"`` (element mode), ``"E17"`` (after the 1:1 ``upper`` map),
``"u3e4"`` (element 4 of unit 3).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data.datapipes.datapipe import IterDataPipe
from torch.utils.data.datapipes.iter import IterableWrapper

import distshard

# element mode: "list" (random access), "list+map" (random access, 1:1 map before the
# shard), "stream" (an object with only __iter__), "shuffled" (upstream .shuffle());
# unit mode: "units"; a distshard file source: "jsonl"; a random-access mix of two
# lists: "mix" (stop="first_exhausted", so no element repeats), the same in two
# weight phases: "mix-phases", and weighted by per-element costs: "mix-cost"; a
# random-access source whose elements change with the epoch (as weighted_sample's
# draws do): "tagged"; the JSON-lines file over HTTP from a loopback range server
# that fails every 7th request: "remote", and the same read through a local range
# cache small enough to evict during a history: "remote-cached"; a mix of that remote file and a list (the
# file read through its read-ahead from inside the mix): "mix-files"; the same elements
# in three gzip-compressed JSON-lines files, which go whole to slots: "gz"; a Megatron
# .bin/.idx pair read by distshard.tokens (its dtype varies with n), each sequence named
# after a 1:1 map that checks its tokens: "tokens"; documents of
# distinct token ids (lists, uint16 arrays or uint16 tensors) packed into blocks of seq_len tokens (distshard.pack), each block
# made a string (hashable, and as the DataLoader's default_convert leaves it) by a 1:1
# map, pushed down: "pack" (``Spec.fit``: cut from the concatenation, or whole documents
# by best fit within windows of ``Spec.window`` tokens); a JSON-lines
# file over HTTP from a server that sends weak ETags without If-Match support and
# rewrites the file at the same size in the middle of the history: "remote-weak"
# (reading must refuse, never yield the new version's elements); the "remote" file with
# its index stored beside it by `python -m distshard index` (no HEAD; entries fetched
# by the slots that read it, through the same faults): "remote-stored"; a file indexed
# the same way by the command, from a server with strong ETags, that is
# rewritten at the same size in the middle of the history, so the stored index goes
# stale under a running job (every range carries If-Match: the store answers 412;
# reading must refuse, never yield the new version's elements): "remote-stale";
# the "remote" file in a bucket of moto's S3 server behind a proxy that answers every 7th
# GET with a 503 SlowDown, a reset or a cut body, its index stored in the bucket beside it,
# read by the direct S3 client (sources/transport/s3direct.py): "remote-s3"; the elements as rows of a
# Parquet file of small row groups (3 rows) read cold (no stored index) over HTTP from a
# loopback server that fails every 7th GET (29th outside its own test), the suffix GETs that give its identity and footer
# included, each row named by a 1:1 map that checks its selected columns: "remote-parquet"
# (``Spec.parquet`` picks the path: the footer in the suffix answer, a footer longer than it
# asked by a second range checked against that identity, or a server that refuses suffix
# ranges, asked a HEAD and the footer's range); the file of "remote-stale" indexed by the
# command and read over HTTP (no faults) through a local range cache that outlives the jobs
# of a history, between which the file is rewritten at the same size or deleted (every read
# must then refuse) or a cache entry is corrupted in place or truncated (exact: the entry
# replaced; see CacheJobs): "remote-jobs"; the JSON-lines file in a repository of a loopback
# Hugging Face Hub read as hf://, a same-size rewrite pushed as a new commit in the middle of some
# jobs (tests/hub_factories.py): "remote-hub"; the elements in numbered local JSON-lines files
# (three a file) indexed by the command, the source given the brace pattern that names them
# (a lazy list, matched to the index as a pattern: no URL made but the first): "pattern-stored"
SOURCES = (
    "list",
    "list+map",
    "stream",
    "shuffled",
    "units",
    "jsonl",
    "mix",
    "mix-phases",
    "mix-cost",
    "tagged",
    "remote",
    "remote-cached",
    "mix-files",
    "gz",
    "tokens",
    "pack",
    "remote-weak",
    "remote-stored",
    "remote-s3",
    "remote-stale",
    "remote-parquet",
    "remote-jobs",
    "remote-hub",
    "pattern-stored",
)
MIXES = ("mix", "mix-phases", "mix-cost", "mix-files")


@dataclass(frozen=True)
class Spec:
    source: str
    n: int = 0  # element mode: how many elements
    unit_sizes: tuple[int, ...] = ()  # unit mode: elements per unit
    sized: bool = False  # unit mode: pass sizes=
    expand_list: bool = True  # unit mode: expand returns a list (else an iterator)
    shuffle: bool = False
    multiple: int = 1  # multiple_of, used when even == "drop"
    even: str | None = None
    seed: int | None = 0  # None: dist_shard's default (a DataLoader may hand over its seed)
    seq_len: int = 3  # "pack": tokens per block
    eos: bool = False  # "pack": an eos token (-1) after every document
    fit: str = "concat"  # "pack": "concat" or "best" (whole documents; no eos, so every block is distinct)
    window: int | None = None  # "pack", fit="best": tokens per window (None: the default, the whole corpus here)
    parquet: str = "suffix"  # "remote-parquet": one of PARQUET_PATHS
    # "remote-parquet": its server fails every n-th GET; its own history test takes 7, the
    # others less often (a fault costs a retry's backoff, and every build asks two GETs)
    fault_every: int = 29

    @property
    def units(self) -> bool:
        return self.source == "units"

    @property
    def whole_files(self) -> bool:
        """Files that go whole to slots (compressed): like units without sizes."""
        return self.source == "gz"

    @property
    def random_access(self) -> bool:
        """Where shuffle=True is documented to work."""
        return self.source in (
            "list",
            "list+map",
            "jsonl",
            "tagged",
            "remote",
            "remote-cached",
            "tokens",
            "pack",
            "remote-weak",
            "remote-stored",
            "remote-s3",
            "remote-stale",
            "remote-parquet",
            "remote-jobs",
            "remote-hub",
            "pattern-stored",
            *MIXES,
        ) or (self.units and self.sized)

    def universe(self) -> list[str]:
        """Every element of one epoch, once."""
        if self.units:
            return [f"u{u}e{i}" for u, size in enumerate(self.unit_sizes) for i in range(size)]
        if self.source in MIXES:
            return list(mixed(self.n, self.source, remote=False))
        if self.source == "pack":
            return packed_blocks(self.n, self.seq_len, self.eos, self.fit, self.window)
        return [upper(f"e{i}") if self.source == "list+map" else f"e{i}" for i in range(self.n)]


class Stream:
    """An iterable with nothing but ``__iter__``: no length, no random access."""

    def __init__(self, data: list) -> None:
        self.data = data

    def __iter__(self):
        return iter(self.data)


class Expand:
    """``expand(unit)``: the unit's elements as a list or as an iterator."""

    def __init__(self, sizes: tuple[int, ...], as_list: bool) -> None:
        self.sizes, self.as_list = sizes, as_list

    def __call__(self, unit: int) -> Any:
        elements = [f"u{unit}e{i}" for i in range(self.sizes[unit])]
        return elements if self.as_list else iter(elements)


def upper(x: str) -> str:
    return x.upper()


def documents(n: int) -> list[list[int]]:
    """``n`` documents of 1 to 5 distinct token ids: document ``i`` holds ``100 i + j``."""
    return [[100 * i + j for j in range(1 + (7 * i) % 5)] for i in range(n)]


def packed_blocks(n: int, seq_len: int, eos: bool, fit: str = "concat", window: int | None = None) -> list[str]:
    """The oracle of "pack": the blocks by definition, as strings of the tuples (ids,
    positions, mask, segments). fit="concat": the concatenation of the documents, each
    followed by the eos -1 if any, cut into ``seq_len``, the last padded with 0;
    fit="best": the brute-force best fit of tests/packing_oracle.py. Distinct: every
    block holds a token of its own (with an eos, ``seq_len`` is at least 2 and documents
    are not empty; fit="best" has no eos)."""
    from .packing_oracle import concat_layout, filled, reference_best_fit

    docs = [doc + ([-1] if eos else []) for doc in documents(n)]
    counts = [len(d) for d in docs]
    layout = (
        reference_best_fit(counts, seq_len, window or 256 * seq_len)
        if fit == "best"
        else concat_layout(counts, seq_len)
    )
    return [repr(block) for block in filled(docs, layout, seq_len)]


def block_key(block: dict) -> str:
    """A block as a string: the repr of the tuple (input_ids, position_ids, loss_mask, segment_ids)."""
    return repr(tuple(tuple(block[k].tolist()) for k in ("input_ids", "position_ids", "loss_mask", "segment_ids")))


def packed(spec: "Spec") -> Any:
    """:func:`documents` packed (``Spec.fit``, ``Spec.window``), as lists, as uint16
    numpy arrays, or as those arrays made uint16 tensors by ``tokens=torch.from_numpy``
    (by ``n % 3``)."""
    eos = -1 if spec.eos else None
    window = spec.window if spec.fit == "best" else None
    if spec.n % 3 == 0:
        return distshard.pack(IterableWrapper(documents(spec.n)), spec.seq_len, eos=eos, fit=spec.fit, window=window)
    import numpy as np
    import torch

    arrays = [np.array(d, np.uint16) for d in documents(spec.n)]
    picker = torch.from_numpy if spec.n % 3 == 2 else None
    return distshard.pack(IterableWrapper(arrays), spec.seq_len, tokens=picker, eos=eos, fit=spec.fit, window=window)


def jsonl_file(n: int) -> str:
    """A JSON-lines file of ``"e0" .. "e{n-1}"``, written once per machine (also
    found by spawned processes), its index cached in a temporary directory."""
    import json
    import os
    import tempfile

    root = os.path.join(tempfile.gettempdir(), "distshard-model")
    os.makedirs(root, exist_ok=True)
    os.environ.setdefault("DISTSHARD_CACHE", os.path.join(root, "cache"))
    path = os.path.join(root, f"e{n}.jsonl")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as handle:
            handle.writelines(json.dumps(f"e{i}") + "\n" for i in range(n))
        os.replace(tmp, path)
    return path


def gz_files(n: int) -> list[str]:
    """``"e0" .. "e{n-1}"`` in three gzip-compressed JSON-lines files (in order,
    uneven, some possibly empty), written once per machine."""
    import gzip
    import json
    import os

    root = os.path.dirname(jsonl_file(0))
    bounds = [0, n // 4, (3 * n) // 4, n]
    paths = []
    for f in range(3):
        path = os.path.join(root, f"e{n}-{f}.jsonl.gz")
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}"
            with gzip.open(tmp, "wt") as handle:
                handle.writelines(json.dumps(f"e{i}") + "\n" for i in range(bounds[f], bounds[f + 1]))
            os.replace(tmp, path)
        paths.append(path)
    return paths


TOKEN_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16")


def token_sequence(i: int) -> list[int]:
    """The tokens of sequence ``i`` of :func:`token_pair` (1 to 4 of them, the first ``i``)."""
    return [i, *((i * 7 + k) % 11 for k in range(i % 4))]


def token_name(sequence: Any) -> str:
    """``"e{i}"`` for sequence ``i`` of :func:`token_pair` when its tokens are exactly
    those written, else a name that no epoch holds."""
    values = sequence.tolist()
    return f"e{int(values[0])}" if values and values == token_sequence(int(values[0])) else f"bad{values}"


def token_pair(n: int) -> str:
    """The prefix of a Megatron .bin/.idx pair of ``n`` sequences (:func:`token_sequence`),
    of dtype ``TOKEN_DTYPES[n % 8]``, written once per machine (tests/token_files.py)."""
    import os

    from tests.token_files import write_indexed

    dtype = TOKEN_DTYPES[n % len(TOKEN_DTYPES)]
    prefix = os.path.join(os.path.dirname(jsonl_file(0)), f"t{n}-{dtype}")
    if not os.path.exists(prefix + ".idx"):
        import fcntl

        import numpy as np

        with open(prefix + ".lock", "w") as lock:  # gloo ranks start at once: one writes, once
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(prefix + ".idx"):
                tmp = f"{prefix}.{os.getpid()}"
                write_indexed(tmp, [np.array(token_sequence(i), dtype) for i in range(n)], dtype)
                os.replace(tmp + ".bin", prefix + ".bin")
                os.replace(tmp + ".idx", prefix + ".idx")  # last: its presence says the pair is whole
    return prefix


def mixed(n: int, kind: str = "mix", remote: bool = True):
    """Two lists mixed 2:1 until the first runs out: distinct elements. ``mix-phases``:
    1:3 from the middle on; ``mix-cost``: 2:1 of per-element costs; ``mix-files``: the
    first source is the remote JSON-lines file of ``"e0" .. "e{n-1}"`` (:func:`remote_jsonl`),
    or with ``remote=False`` (the oracle's universe) the same elements from a list: the
    mix's order depends on the sources' lengths and weights, never on where they are
    read, and the expectation does not go through the faulty server it checks."""
    if kind == "mix-files":
        first: Any = remote_jsonl(n) if remote else IterableWrapper([f"e{i}" for i in range(n)])
    else:
        first = IterableWrapper([f"a{i}" for i in range(n)])
    sources: dict[str, Any] = {
        "a": first,
        "b": IterableWrapper([f"b{i}" for i in range(n // 2 + 1)]),
    }
    weights: Any = {"a": 2, "b": 1}
    options: dict[str, Any] = {}
    if kind == "mix-phases":
        weights = [(0, weights), (n // 2 + 1, {"a": 1, "b": 3})]
    elif kind == "mix-cost":
        options["cost"] = {"a": [1 + i % 3 for i in range(n)], "b": [2 + i % 5 for i in range(n // 2 + 1)]}
    return distshard.mix(sources, weights, stop="first_exhausted", **options)


class Tagged(IterDataPipe):
    """A random-access source whose elements change with the epoch: element ``i`` of
    the view made after ``set_seed(s)`` is ``"e{i}@<s>"``, and ``dist_shard`` hands every
    epoch its own seed, so an element says which epoch's stream it came from."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.seed = n, 0

    def set_seed(self, seed: int) -> "Tagged":
        self.seed = int(seed)
        return self

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        view = self.__distshard_sequence__()
        return iter([view[i] for i in range(self.n)])

    def __distshard_sequence__(self) -> "TaggedView":
        return TaggedView(self.n, self.seed)


class TaggedView:
    """:class:`Tagged`'s elements as seeded when the view was made."""

    distshard_blocks = False

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.tag = n, f"{seed % 2**32:08x}"

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> str:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return f"e{i}@{self.tag}"

    def distshard_identity(self) -> str:
        return f"tagged:{self.n}"


def untag(element: Any) -> tuple[Any, str | None]:
    """``("e3", tag)`` for a :class:`Tagged` element, ``(element, None)`` otherwise."""
    if isinstance(element, str) and "@" in element:
        name, tag = element.split("@")
        return name, tag
    return element, None


def _options(spec: Spec, rank: int | None, world_size: int | None) -> dict[str, Any]:
    return dict(
        rank=rank,
        world_size=world_size,
        even=spec.even,
        seed=spec.seed,
        shuffle=spec.shuffle,
        multiple_of=spec.multiple if spec.even in ("drop", "carry") else 1,
    )


# -- a remote source with injected faults (issue 14) ------------------------------------------
_SERVER: Any = None  # (pid, RangeServer) of this process


def small_reads():
    """The remote sources' read options: small ranges, so a slot makes several
    requests and faults (or a rewrite) land inside epochs."""
    from distshard.sources import ReadOptions

    return ReadOptions(max_range=64, budget=256, max_gap=8, window=128, retry_seconds=20)


def _process_root(kind: str) -> Path:
    """A folder of this process's own for a remote source's files, removed at its exit."""
    import os
    import tempfile

    root = Path(tempfile.gettempdir()) / "distshard-model" / f"{kind}-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    _cleanup(root)
    return root


def remote_jsonl(n: int, cached: bool = False):
    """``distshard.jsonl`` of :func:`jsonl_file` over HTTP from a loopback range
    server (started once per process, in a thread) that answers every 7th GET
    with a 500, a 503, a reset connection or a short body: retried, exactly.
    ``cached``: through a local range cache (``ReadOptions.cache_dir``) shared by
    the processes of a test and smaller than the file, so it evicts as it goes."""
    import os

    from tests.range_server import RangeServer

    global _SERVER
    path = jsonl_file(n)
    if _SERVER is None or _SERVER[0] != os.getpid():
        _SERVER = (os.getpid(), RangeServer(Path(path).parent, fault_every=7).start())
    options = small_reads()
    if cached:
        options = dataclasses.replace(options, cache_dir=str(Path(path).parent / "ranges"), cache_bytes=300)
    return distshard.jsonl(_SERVER[1].url(path), read_options=options)


_WEAK: Any = None  # (pid, RangeServer, Rewriter) of this process


class Rewriter:
    """The file of ``"e0" .. "e{n-1}"`` (version 1) and its rewrite at the same size,
    ``"x0" .. "x{n-1}"`` (version 2, another mtime): the server switches to version 2
    after a few GETs of the file (``before_get``) counted from the HEAD that asks its
    identity (``on_head``); building a pipe puts version 1 back and disarms it.

    Counting from the HEAD, not from the build: a GET of an earlier example's pipe
    still reading (a worker shutting down, a read-ahead ending) must not rewrite the
    file before this pipe has seen version 1's identity, or the run would read
    version 2 throughout, rightly, and the oracle would count it foreign."""

    V1, V2 = 1_700_000_000 * 10**9, 1_700_000_100 * 10**9  # fixed mtimes: fixed weak ETags

    def __init__(self, root: Path) -> None:
        import threading

        self.root, self.lock, self.gets, self.after = root, threading.Lock(), 0, 0
        self.current: Path | None = None  # the file the pipe being built reads
        self.armed: Path | None = None  # ... once a HEAD asked its identity

    def path(self, n: int) -> Path:
        return self.root / f"e{n}.jsonl"

    def write(self, path: Path, letter: str) -> None:
        import json
        import os

        n = int(path.stem[1:])
        tmp = path.with_name(f".{path.name}.{letter}")
        tmp.write_text("".join(json.dumps(f"{letter}{i}") + "\n" for i in range(n)))
        mtime = self.V1 if letter == "e" else self.V2
        os.utime(tmp, ns=(mtime, mtime))
        os.replace(tmp, path)

    def reset(self, n: int) -> Path:
        """Version 1, and a rewrite after ``3 + n % 9`` GETs of it from its next HEAD."""
        path = self.path(n)
        with self.lock:
            if not path.exists() or path.stat().st_mtime_ns != self.V1:
                self.write(path, "e")
            self.gets, self.after, self.armed, self.current = 0, 3 + n % 9, None, path
        return path

    def head(self, path: Path) -> None:
        with self.lock:
            if self.armed is None and path == self.current:
                self.armed, self.gets = path, 0

    def __call__(self, path: Path) -> None:
        with self.lock:
            if path != self.armed:
                return
            self.gets += 1
            if self.gets == self.after and path.exists() and path.stat().st_mtime_ns == self.V1:
                self.write(path, "x")


def remote_weak_jsonl(n: int):
    """``distshard.jsonl`` over HTTP from a loopback server with weak ETags that
    rewrites the file mid-history (:class:`Rewriter`)."""
    import os

    from tests.range_server import RangeServer

    global _WEAK
    jsonl_file(0)  # the cache directory
    if _WEAK is None or _WEAK[0] != os.getpid():
        root = _process_root("weak")
        rewriter = Rewriter(root)
        _WEAK = (
            os.getpid(),
            RangeServer(root, weak=True, before_get=rewriter, on_head=rewriter.head).start(),
            rewriter,
        )
    path = _WEAK[2].reset(n)
    options = small_reads()
    return distshard.jsonl(_WEAK[1].url(path), read_options=options)


def remote_stored_jsonl(n: int):
    """:func:`remote_jsonl`'s file in a folder of this process's own, indexed once
    with the command into ``.distshard/`` beside it (served by the same faulty server):
    the source finds the stored index by itself."""
    import os
    import shutil

    from distshard.__main__ import main

    source = remote_jsonl(n)  # starts this process's server
    root = Path(jsonl_file(n)).parent / f"stored-{os.getpid()}"
    path = root / f"e{n}.jsonl"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(jsonl_file(n), path)
        _cleanup(root)
    url = _SERVER[1].url(path)
    if not (root / ".distshard" / f"done-{n}").exists():
        assert main(["index", url, "--out", str(root / ".distshard")]) == 0
        (root / ".distshard" / f"done-{n}").touch()
    return distshard.jsonl(url, read_options=source.access.options)


def pattern_stored_jsonl(n: int):
    """``"e0" .. "e{n-1}"``, three a file, in ``part-000.jsonl ..`` (at least two files, so
    the command records their pattern), written and indexed once per machine under a
    lock (spawned processes find them); the source is given the brace pattern."""
    import fcntl
    import json

    from distshard.__main__ import main

    root = Path(jsonl_file(0)).parent / f"pattern-{n}"
    files = max(2, -(-n // 3))
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "done").exists():
            for k in range(files):
                lines = [json.dumps(f"e{i}") + "\n" for i in range(3 * k, min(n, 3 * k + 3))]
                (root / f"part-{k:03d}.jsonl").write_text("".join(lines))
            assert main(["index", str(root / "part-*.jsonl")]) == 0
            head = json.loads((root / ".distshard" / "manifest.json").read_text())
            assert head["pattern"] == str(root / f"part-{{000..{files - 1:03d}}}.jsonl"), head.get("pattern")
            (root / "done").touch()
    return distshard.jsonl(str(root / f"part-{{000..{files - 1:03d}}}.jsonl"))


_S3: Any = None  # (pid, moto's server, S3Proxy, the files in its bucket) of this process
S3_BUCKET = "model"


def remote_s3_jsonl(n: int):
    """:func:`jsonl_file`'s file in a bucket of moto's S3 server on 127.0.0.1
    (started once per process, in a thread), indexed once with the command into
    ``.distshard/`` beside it, read through a proxy that answers every 7th GET with
    a 503 SlowDown, a reset connection or a cut body (``tests/s3_proxy.py``), with
    explicit credentials and endpoint: the direct S3 client's path."""
    import json
    import os

    from distshard.__main__ import main
    from tests.moto_server import start_moto
    from tests.s3_proxy import S3Proxy

    global _S3
    credentials = {"key": "testing", "secret": "testing"}
    if _S3 is None or _S3[0] != os.getpid():
        server, endpoint = start_moto()
        proxy = S3Proxy(endpoint, fault_every=7).start()
        _S3 = (os.getpid(), server, proxy, set())
        main_options = {"endpoint_url": endpoint, **credentials}
        _S3[1].options = main_options
        import boto3

        boto3.client(
            "s3",
            endpoint_url=main_options["endpoint_url"],
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).create_bucket(Bucket=S3_BUCKET)
    _, server, proxy, uploaded = _S3
    url = f"s3://{S3_BUCKET}/data-{n}/e{n}.jsonl"  # a folder each: the stored index found beside it
    if n not in uploaded:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=server.options["endpoint_url"],
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).put_object(Bucket=S3_BUCKET, Key=f"data-{n}/e{n}.jsonl", Body=Path(jsonl_file(n)).read_bytes())
        assert main(["index", url, "--storage-options", json.dumps(server.options)]) == 0
        uploaded.add(n)
    options = small_reads()
    return distshard.jsonl(url, storage_options={"endpoint_url": proxy.endpoint, **credentials}, read_options=options)


class StaleRewriter(Rewriter):
    """A :class:`Rewriter` for a file with a stored index: a job asks no HEAD, so the
    GET of the index's manifest (what every build of a pipe asks first) arms it."""

    def __call__(self, path: Path) -> None:
        if path.name == "manifest.json" and self.current is not None and path.parent == self.root / ".distshard":
            self.head(self.current)
            return
        super().__call__(path)


_STALE: Any = None  # (pid, RangeServer, StaleRewriter) of this process


def remote_stale_jsonl(n: int):
    """``distshard.jsonl`` of version 1 of :class:`Rewriter`'s file, indexed once
    by ``python -m distshard index`` into ``.distshard/`` beside it, over HTTP from a
    loopback server with strong ETags (``If-Match``) that rewrites the file at the same
    size a few GETs after a build read the manifest: the stored index goes stale under
    the running job."""
    import os

    from distshard.__main__ import main
    from tests.range_server import RangeServer

    global _STALE
    jsonl_file(0)  # the cache directory
    if _STALE is None or _STALE[0] != os.getpid():
        root = _process_root("stale")
        rewriter = StaleRewriter(root)
        # no faults: a retried GET would move the rewrite by a request, so the elements drawn
        # before it would vary between hypothesis' replays of one example ("remote-stored"
        # has the faults with a stored index)
        _STALE = (os.getpid(), RangeServer(root, before_get=rewriter).start(), rewriter)
    server, rewriter = _STALE[1], _STALE[2]
    path = rewriter.reset(n)  # version 1, armed by the next manifest GET
    url = server.url(path)
    if not (root_done := rewriter.root / ".distshard" / f"done-{n}").exists():
        assert main(["index", url, "--out", str(rewriter.root / ".distshard")]) == 0
        root_done.touch()
        rewriter.reset(n)  # the command's own manifest GET must not arm the rewrite
    options = small_reads()
    return distshard.jsonl(url, read_options=options)


class CacheJobs:
    """Jobs over :class:`Rewriter`'s version 1 of ``e{n}.jsonl``, indexed once by the
    command into ``.distshard/`` beside it, read over HTTP (strong ETags, no faults)
    through a local range cache (``cache_dir``) that outlives the jobs: between two
    jobs (:meth:`between`) the file may be rewritten at the same size (a new ETag:
    the stored index is stale) or deleted, or one of the cache's entries of it
    corrupted in place or truncated; :meth:`restore` puts version 1 back (its mtime,
    so its ETag: the index and the cache are valid again)."""

    EVENTS = ("none", "flip-entry", "truncate-entry", "rewrite", "delete")

    def __init__(self, root: Path, server: Any) -> None:
        self.root, self.server, self.rewriter = root, server, Rewriter(root)
        self.n = 0

    def source(self) -> Any:
        return distshard.jsonl(self.url, read_options=self.options)

    @property
    def url(self) -> str:
        return self.server.url(self.rewriter.path(self.n))

    @property
    def options(self) -> Any:
        return dataclasses.replace(small_reads(), cache_dir=str(self.root / "ranges"), cache_bytes=1 << 20)

    def restore(self) -> None:
        path = self.rewriter.path(self.n)
        if not path.exists() or path.stat().st_mtime_ns != Rewriter.V1:
            self.rewriter.write(path, "e")

    def between(self, event: str) -> None:
        """``event`` (one of :data:`EVENTS`), then a new job: this process's caches
        emptied as a new process starts with none (the cache directory stays)."""
        from distshard.sources.reading.cache import _CACHES
        from distshard.sources.transport.lru import clear_all

        path = self.rewriter.path(self.n)
        if event == "rewrite":
            self.rewriter.write(path, "x")
        elif event == "delete":
            path.unlink()
        elif event in ("flip-entry", "truncate-entry"):
            self.damage(event == "flip-entry")
        clear_all()
        _CACHES.clear()

    def damage(self, in_place: bool) -> None:
        """One stored range of the file: a byte of its data changed, or its end cut."""
        from distshard.sources.reading.cache import RangeCache
        from distshard.sources.transport.files import file_identity

        found = RangeCache(str(self.root / "ranges"), 1 << 20).file(self.url, *file_identity(self.url))
        entries = sorted(Path(found.directory).glob("[0-9]*-[0-9]*")) if found is not None else []
        if not entries:
            return
        entry = entries[len(entries) // 2]
        data = bytearray(entry.read_bytes())
        start, stop = map(int, entry.name.split("-"))
        if in_place:  # (the range's bytes end the entry, after its header)
            data[len(data) - (stop - start) + (stop - start) // 2] ^= 0x01
        else:
            del data[-3:]
        entry.write_bytes(bytes(data))


_JOBS: Any = None  # (pid, CacheJobs) of this process


def cache_jobs(n: int, restore: bool = True) -> CacheJobs:
    """This process's :class:`CacheJobs`, over the file of ``n`` elements, in
    version 1 (``restore=False``, what building a pipe asks: as it is, made if new)."""
    import os

    from distshard.__main__ import main
    from tests.range_server import RangeServer

    global _JOBS
    jsonl_file(0)  # the per-machine cache directory
    if _JOBS is None or _JOBS[0] != os.getpid():
        root = _process_root("jobs")
        _JOBS = (os.getpid(), CacheJobs(root, RangeServer(root).start()))
    jobs = _JOBS[1]
    jobs.n = n
    done = jobs.root / ".distshard" / f"done-{n}"
    if restore or not done.exists():
        jobs.restore()
    if not done.exists():
        assert main(["index", jobs.url, "--out", str(jobs.root / ".distshard")]) == 0
        done.touch()
    return jobs


# -- remote Parquet, cold: identity and footer from one suffix GET ------------------------------
# "suffix": the footer in the suffix answer; "wide": a footer longer than the suffix (a large
# key-value metadata), its rest asked by a second range checked against the suffix answer's
# identity; "head": a server that answers suffix ranges 400, so the file's identity is asked
# with a HEAD and its footer with a range (remembered per host)
PARQUET_PATHS = ("suffix", "wide", "head")
PARQUET_COLUMNS = ["v", "k"]  # of "k", "v", "pad": the unselected one must not show
_PARQUET: Any = None  # (pid, root, {(suffix, fault_every): RangeServer}) of this process


def parquet_row(i: int) -> dict[str, Any]:
    """Row ``i`` of :func:`remote_parquet`'s file, its selected columns."""
    return {"k": f"e{i}", "v": 7 * i + 3}


def parquet_name(row: Any) -> str:
    """``"e{i}"`` for row ``i`` of :func:`remote_parquet`'s file when it holds exactly
    the selected columns as written, else a name that no epoch holds."""
    key = row.get("k") if isinstance(row, dict) else None
    if isinstance(key, str) and key[:1] == "e" and key[1:].isdigit() and row == parquet_row(int(key[1:])):
        return key
    return f"bad{row}"


def parquet_file(root: Path, n: int, wide: bool) -> Path:
    """``root/e{n}.parquet`` (or ``e{n}-wide.parquet``): rows ``"e0" .. "e{n-1}"`` in
    row groups of 3, written once by this process."""
    path = root / f"e{n}{'-wide' if wide else ''}.parquet"
    if not path.exists():
        import os

        import pyarrow as pa
        import pyarrow.parquet as pq

        from distshard.sources.formats.parquet import TAIL

        rows = [parquet_row(i) for i in range(n)]
        table = pa.table(
            {
                "k": pa.array([r["k"] for r in rows], pa.string()),
                "v": pa.array([r["v"] for r in rows], pa.int64()),
                "pad": pa.array([f"p{i}" for i in range(n)], pa.string()),
            }
        )
        if wide:
            table = table.replace_schema_metadata({"filler": "x" * TAIL})
        tmp = path.with_name(f".{path.name}.tmp")
        pq.write_table(table, tmp, row_group_size=3)
        os.replace(tmp, path)
    return path


def remote_parquet(n: int, path: str = "suffix", fault_every: int = 7):
    """``distshard.parquet`` of :func:`parquet_file` (columns ``v`` and ``k``), cold (no
    stored index), over HTTP from a loopback range server (one per path kind and fault
    period, started once per process, in a thread) that answers every ``fault_every``-th
    GET (the suffix GETs too) with a 500, a 503, a reset connection or a short body:
    retried, exactly."""
    import os

    from tests.range_server import RangeServer

    global _PARQUET
    if path not in PARQUET_PATHS:
        raise ValueError(f"unknown Parquet path {path!r}: one of {PARQUET_PATHS}")
    jsonl_file(0)  # the cache directory
    if _PARQUET is None or _PARQUET[0] != os.getpid():
        _PARQUET = (os.getpid(), _process_root("parquet"), {})
    _, root, servers = _PARQUET
    key = (path != "head", fault_every)
    if key not in servers:
        servers[key] = RangeServer(root, fault_every=fault_every, suffix=key[0]).start()
    file = parquet_file(root, n, wide=path == "wide")
    # small reads, but a row group's two selected column chunks (adjacent) in one request
    options = dataclasses.replace(small_reads(), max_range=256)
    return distshard.parquet(servers[key].url(file), columns=PARQUET_COLUMNS, read_options=options)


def _cleanup(root: Path) -> None:
    """Remove a folder of this process's own at its exit."""
    import atexit
    import os
    import shutil

    pid = os.getpid()

    def remove() -> None:
        if os.getpid() == pid:  # not in a forked child that exits
            shutil.rmtree(root, ignore_errors=True)

    atexit.register(remove)


def build(spec: Spec, rank: int | None = None, world_size: int | None = None):
    """The ``dist_shard`` pipe of ``spec``; rank and world_size explicit unless None."""
    options = _options(spec, rank, world_size)
    if spec.units:
        units = IterableWrapper(list(range(len(spec.unit_sizes))))
        sizes = list(spec.unit_sizes) if spec.sized else None
        return units.dist_shard(expand=Expand(spec.unit_sizes, spec.expand_list), sizes=sizes, **options)
    data = [f"e{i}" for i in range(spec.n)]
    source: IterDataPipe
    if spec.source == "list":
        source = IterableWrapper(data)
    elif spec.source == "list+map":
        source = IterableWrapper(data).map(upper)
    elif spec.source == "stream":
        source = IterableWrapper(Stream(data), deepcopy=False)
    elif spec.source == "shuffled":
        source = IterableWrapper(data).shuffle()
    elif spec.source == "jsonl":
        source = distshard.jsonl(jsonl_file(spec.n))
    elif spec.source in MIXES:
        source = mixed(spec.n, spec.source)
    elif spec.source == "tagged":
        source = Tagged(spec.n)
    elif spec.source in ("remote", "remote-cached"):
        source = remote_jsonl(spec.n, cached=spec.source == "remote-cached")
    elif spec.source == "remote-weak":
        source = remote_weak_jsonl(spec.n)
    elif spec.source == "remote-stored":
        source = remote_stored_jsonl(spec.n)
    elif spec.source == "pattern-stored":
        source = pattern_stored_jsonl(spec.n)
    elif spec.source == "remote-s3":
        source = remote_s3_jsonl(spec.n)
    elif spec.source == "remote-stale":
        source = remote_stale_jsonl(spec.n)
    elif spec.source == "remote-parquet":
        source = remote_parquet(spec.n, spec.parquet, spec.fault_every).map(parquet_name)
    elif spec.source == "remote-hub":
        from tests.hub_factories import remote_hub_jsonl

        source = remote_hub_jsonl(spec.n)
    elif spec.source == "remote-jobs":
        source = cache_jobs(spec.n, restore=False).source()
    elif spec.source == "gz":
        source = distshard.jsonl(gz_files(spec.n))
    elif spec.source == "tokens":
        source = distshard.tokens(token_pair(spec.n)).map(token_name)
    elif spec.source == "pack":
        source = packed(spec).map(block_key)
    else:
        raise ValueError(f"unknown source {spec.source!r}")
    return source.dist_shard(**options)


def on_data_group(pipe, data_rank: int, data_world: int):
    """``pipe`` (a ``dist_shard`` built with ``rank=data_rank, world_size=data_world``) as
    ``dist_shard(mesh=...)`` of a data-parallel mesh dimension of ``data_world`` builds it:
    its rank comes from the data group, its states name their copy (``replica``), so
    model-parallel peers are modelled in one process without a process group."""
    from distshard.groups import DataGroup

    group = DataGroup("mesh", data_rank, data_world, tuple(range(data_world)), (data_rank,), (data_world,), ("dp",))
    pipe.core.options = dataclasses.replace(pipe.core.options, explicit=None, group=group)
    return pipe


def build_node(spec: Spec, rank: int | None = None, world_size: int | None = None):
    """The same pipeline through the torchdata.nodes front-end (``DistShardNode``)."""
    from torchdata.nodes import IterableWrapper as NodeWrapper
    from torchdata.nodes import Mapper

    from distshard import DistShardNode

    options = _options(spec, rank, world_size)
    if spec.units:
        sizes = list(spec.unit_sizes) if spec.sized else None
        return DistShardNode(
            list(range(len(spec.unit_sizes))), expand=Expand(spec.unit_sizes, spec.expand_list), sizes=sizes, **options
        )
    data = [f"e{i}" for i in range(spec.n)]
    if spec.source == "list":
        return DistShardNode(data, **options)
    if spec.source == "list+map":
        return Mapper(DistShardNode(data, **options), upper)
    if spec.source == "jsonl":
        return DistShardNode(distshard.jsonl(jsonl_file(spec.n)), **options)
    if spec.source in MIXES:
        return DistShardNode(mixed(spec.n, spec.source), **options)
    if spec.source == "tagged":  # the node seeds nothing: the same elements every epoch
        return DistShardNode(Tagged(spec.n), **options)
    if spec.source in ("remote", "remote-cached"):
        return DistShardNode(remote_jsonl(spec.n, cached=spec.source == "remote-cached"), **options)
    if spec.source == "remote-weak":
        return DistShardNode(remote_weak_jsonl(spec.n), **options)
    if spec.source == "remote-stored":
        return DistShardNode(remote_stored_jsonl(spec.n), **options)
    if spec.source == "pattern-stored":
        return DistShardNode(pattern_stored_jsonl(spec.n), **options)
    if spec.source == "remote-s3":
        return DistShardNode(remote_s3_jsonl(spec.n), **options)
    if spec.source == "remote-stale":
        return DistShardNode(remote_stale_jsonl(spec.n), **options)
    if spec.source == "remote-parquet":
        source = remote_parquet(spec.n, spec.parquet, spec.fault_every)
        return Mapper(DistShardNode(source, **options), parquet_name)
    if spec.source == "remote-hub":
        from tests.hub_factories import remote_hub_jsonl

        return DistShardNode(remote_hub_jsonl(spec.n), **options)
    if spec.source == "remote-jobs":
        return DistShardNode(cache_jobs(spec.n, restore=False).source(), **options)
    if spec.source == "gz":
        return DistShardNode(distshard.jsonl(gz_files(spec.n)), **options)
    if spec.source == "tokens":
        return Mapper(DistShardNode(distshard.tokens(token_pair(spec.n)), **options), token_name)
    if spec.source == "pack":
        return Mapper(DistShardNode(packed(spec), **options), block_key)
    # nodes have no upstream .shuffle(): "shuffled" is a plain stream here
    return DistShardNode(NodeWrapper(Stream(data)), **options)


def gloo_run(rank: int, world_size: int, spec: Spec, workers: int, take: int | None, state: dict | None = None):
    """One rank of a training-like run on a real gloo group: the rank comes from
    torch.distributed. Loads ``state`` (a merged state) if given, consumes ``take``
    elements (all if None) through a StatefulDataLoader with ``workers`` workers,
    and returns what it consumed and the merge of every rank's state
    (``gather_states``, a collective)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    pipeline = distshard.StatefulPipeline(build(spec))
    pipeline.set_epoch(0)
    if state is not None:
        pipeline.load_state_dict(state)
    kwargs = {"multiprocessing_context": "fork", "timeout": 30} if workers else {}
    loader = StatefulDataLoader(pipeline, batch_size=None, num_workers=workers, **kwargs)
    consumed: list[str] = []
    it = iter(loader)
    while take is None or len(consumed) < take:
        try:
            consumed.append(next(it))
        except StopIteration:
            break
    merged = distshard.gather_states(loader.state_dict())
    del it
    return consumed, merged
