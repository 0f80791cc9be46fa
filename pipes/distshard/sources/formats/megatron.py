"""Megatron-LM's indexed datasets (``MMIDIDX``): token sequences read in place.

A dataset is a pair of files sharing a prefix: ``<prefix>.bin`` holds the
tokens of every sequence back to back, ``<prefix>.idx`` says where each one is
(Megatron-LM, ``megatron/core/datasets/indexed_dataset.py``). The ``.idx``, all
little endian:

====================  ==========================================================
``9s``                magic ``b"MMIDIDX\\x00\\x00"``
``<Q``                version, 1
``<B``                dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                      6 float64, 7 float32, 8 uint16
``<Q``                sequence count ``n``
``<Q``                document index count ``d`` (documents + 1)
``n x <i4``           sequence lengths, in tokens
``n x <i8``           sequence pointers, the byte offset of each in the ``.bin``
``d x <i8``           document indices: the sequence each document starts at,
                      then ``n``
``n x i1``            (multimodal datasets only) the mode of each sequence
====================  ==========================================================

Sequence ``i`` is the ``lengths[i]`` tokens of the ``.bin`` from byte
``pointers[i]``; the source yields it as a 1-D numpy array of the dtype. The
unit of the file source is the pair, named by its prefix: its identity covers
both files (the ``.bin``'s size and stamp, checked on every read as for any
file, and the ``.idx``'s, read once when the index is built), and its index is
the ``.idx``'s lengths and pointers (checked against the ``.bin``'s size).
Reading a sequence at random reads exactly its bytes of the ``.bin``.
"""

from __future__ import annotations

import io
import json
import struct
from array import array
from typing import Any, Iterable, Iterator, Sequence

from ...errors import OptionError, OptionTypeError, SourceChangedError, SourceDataError, SourceMissingError
from ..transport.files import (
    DEFAULT_FILE_ACCESS,
    STREAM_BUFFER,
    FileAccess,
    FileRef,
    file_identity,
    key_of,
    local_path,
    open_random,
    open_scan,
)
from ..transport.urls import is_remote
from .file_index import FileIndex, byte_windows
from .index_cache import obtain

__all__ = [
    "DTYPES",
    "MAGIC",
    "TokensFormat",
    "pair_prefixes",
    "parse_index",
    "require_numpy",
]

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document index count
#: Megatron-LM's dtype codes (``DType`` in indexed_dataset.py)
DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
_SUFFIXES = (".bin", ".idx")
_WRITE_BOTH = "write both files again in one run (Megatron-LM's tools/preprocess_data.py writes the pair)"


_NUMPY: list[Any] = []  # numpy once imported (asked for every sequence read)


def require_numpy() -> Any:
    """``numpy``, or an ``ImportError`` that says how to install it."""
    if not _NUMPY:
        try:
            import numpy
        except ImportError:
            raise ImportError(
                "distshard.tokens() yields numpy arrays: `pip install distshard[tokens]` (or `pip install numpy`)"
            ) from None
        _NUMPY.append(numpy)
    return _NUMPY[0]


def pair_prefixes(names: Iterable[str]) -> list[str]:
    """The prefix of every pair ``names`` names (by its ``.bin``, its ``.idx`` or
    the prefix itself), each once, in the order first named: a glob matching
    both files of a pair names it once."""
    out: dict[str, None] = {}
    for name in names:
        prefix = name[:-4] if name.endswith(_SUFFIXES) else name
        if not prefix or prefix.endswith("/"):
            raise OptionError(f"{name!r} names no dataset: give a <prefix>.bin, a <prefix>.idx or the <prefix>")
        out.setdefault(prefix, None)
    return list(out)


def bin_url(prefix: str) -> str:
    return prefix + ".bin"


def idx_url(prefix: str) -> str:
    return prefix + ".idx"


def _identity(url: str, prefix: str, access: FileAccess) -> tuple[int, str]:
    try:
        return file_identity(url, access)
    except FileNotFoundError:
        raise SourceMissingError(
            f"{url}: no such file. distshard.tokens reads a Megatron indexed dataset as the pair "
            f"{bin_url(prefix)} + {idx_url(prefix)}; name a prefix whose .bin and .idx both exist "
            "(or write the missing one: Megatron-LM's tools/preprocess_data.py writes both)"
        ) from None


def pair_refs(ref: FileRef) -> tuple[FileRef, FileRef]:
    """The ``.bin`` and ``.idx`` of a pair's ref (whose stamp records both)."""
    assert ref.stamp is not None, "a pair is identified before it is read"
    bin_stamp, idx_size, idx_stamp = json.loads(ref.stamp)
    return FileRef(bin_url(ref.url), ref.size, bin_stamp), FileRef(idx_url(ref.url), idx_size, idx_stamp)


def parse_index(data: bytes, where: str, bin_size: int, bin_name: str) -> tuple[int, Any, Any, int, bool]:
    """``(dtype code, lengths, pointers, documents, multimodal)`` of an ``.idx``
    (numpy arrays), checked: magic, version, dtype code, the file's length against
    its counts, and the sequences against the ``.bin``'s ``bin_size`` bytes.
    ``ValueError`` naming the file and the fix otherwise."""
    np = require_numpy()
    code, n, d, expected = _check_header(data, where)
    lengths = np.frombuffer(data, "<i4", n, HEADER.size)
    pointers = np.frombuffer(data, "<i8", n, HEADER.size + 4 * n)
    documents = np.frombuffer(data, "<i8", d, HEADER.size + 12 * n)
    _check_sequences(lengths, pointers, np.dtype(DTYPES[code]).itemsize, where, bin_size, bin_name)
    if d and (int(documents[0]) < 0 or int(documents[-1]) > n or bool((np.diff(documents) < 0).any())):
        raise SourceDataError(
            f"{where}: its document indices are not sequence numbers in increasing order within [0, {n}]: "
            f"the file is corrupt; {_WRITE_BOTH}"
        )
    return code, lengths, pointers, max(0, d - 1), len(data) == expected + n and n > 0


def _check_header(data: bytes, where: str) -> tuple[int, int, int, int]:
    """``(dtype code, sequences, document indices, bytes they take)`` of an ``.idx``'s
    header, checked against the file's length."""
    if len(data) < HEADER.size:
        raise SourceDataError(
            f"{where}: {len(data)} bytes, shorter than the {HEADER.size}-byte MMIDIDX header: "
            f"the file is truncated or not a Megatron index; {_WRITE_BOTH}"
        )
    magic, version, code, n, d = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise SourceDataError(
            f"{where}: starts with {magic!r}, not {MAGIC!r}: not a Megatron-LM indexed dataset index "
            "(MMIDIDX, what preprocess_data.py writes); name the .idx of a .bin/.idx pair"
        )
    if version != 1:
        raise SourceDataError(f"{where}: MMIDIDX version {version}; distshard.tokens reads version 1, Megatron-LM's")
    if code not in DTYPES:
        known = ", ".join(f"{c} {name}" for c, name in DTYPES.items())
        raise SourceDataError(f"{where}: dtype code {code} is none of Megatron-LM's ({known}): the file is corrupt")
    expected = HEADER.size + 12 * n + 8 * d
    if len(data) < expected:
        raise SourceDataError(
            f"{where}: {len(data)} bytes, but its header announces {n} sequences and {d} document indices "
            f"({expected} bytes): the file is truncated; {_WRITE_BOTH}"
        )
    if len(data) not in (expected, expected + n):  # n more: a multimodal dataset's sequence modes
        raise SourceDataError(
            f"{where}: {len(data)} bytes, but {n} sequences and {d} document indices take {expected} "
            f"(or {expected + n} with sequence modes): the file is corrupt; {_WRITE_BOTH}"
        )
    return code, n, d, expected


def _check_sequences(lengths: Any, pointers: Any, itemsize: int, where: str, bin_size: int, bin_name: str) -> None:
    """The sequences (numpy ``lengths`` and byte ``pointers``) lie in the ``.bin``'s
    ``bin_size`` bytes and fill them."""
    np = require_numpy()
    n = len(lengths)
    if n and int(lengths.min()) < 0:
        i = int(np.argmax(lengths < 0))
        raise SourceDataError(f"{where}: sequence {i} has length {int(lengths[i])}: the file is corrupt; {_WRITE_BOTH}")
    ends = pointers + lengths.astype(np.int64) * itemsize
    if n and int(pointers.min()) < 0:
        i = int(np.argmax(pointers < 0))
        raise SourceDataError(
            f"{where}: sequence {i} starts at byte {int(pointers[i])}: the file is corrupt; {_WRITE_BOTH}"
        )
    end = int(ends.max()) if n else 0
    if end > bin_size:
        i = int(np.argmax(ends > bin_size))
        raise SourceDataError(
            f"{bin_name}: {bin_size} bytes, but {where} puts sequence {i} at bytes [{int(pointers[i])}, "
            f"{int(ends[i])}): the .bin is truncated or belongs to another .idx; {_WRITE_BOTH}"
        )
    if end < bin_size:
        raise SourceDataError(
            f"{bin_name}: {bin_size} bytes, but the sequences of {where} end at byte {end}: "
            f"the .bin belongs to another .idx (the pair does not match); {_WRITE_BOTH}"
        )


def _array(typecode: str, values: Any) -> array:
    """``values`` (a numpy array) as an ``array`` of ``typecode`` (what an index stores)."""
    out = array(typecode)
    out.frombytes(values.astype(require_numpy().dtype(typecode)).tobytes())
    return out


class TokensFormat:
    """The ``tokens`` format of a file source: the unit is a ``.bin``/``.idx``
    pair named by its prefix (see the module docstring)."""

    name = "tokens"
    file_kind = "Megatron .bin/.idx pair"
    access = "random access by sequence (byte ranges of the .bin from the .idx)"

    def compression(self, url: str) -> str | None:
        return None

    # -- what the file source asks of a unit beyond the Format protocol ---------------------
    def identity(self, url: str, access: FileAccess = DEFAULT_FILE_ACCESS) -> tuple[int, str]:
        """``(size, stamp)`` of the pair ``url`` (a prefix): the ``.bin``'s size, and
        a stamp recording the ``.bin``'s stamp and the ``.idx``'s size and stamp,
        so that a cached index is used only while neither file changed."""
        size, stamp = _identity(bin_url(url), url, access)
        idx_size, idx_stamp = _identity(idx_url(url), url, access)
        return size, json.dumps([stamp, idx_size, idx_stamp])

    def open_random(self, ref: FileRef, access: FileAccess = DEFAULT_FILE_ACCESS) -> Any:
        """The ``.bin`` of the pair, checked against its identity on every read."""
        return open_random(pair_refs(ref)[0], access)

    # -- the Format protocol --------------------------------------------------------------
    def build_index(self, ref: FileRef, access: FileAccess = DEFAULT_FILE_ACCESS) -> FileIndex:
        """Read the ``.idx`` (whole; remotely in large ranges) and check it."""
        assert ref.size is not None and ref.stamp is not None
        bin_ref, idx_ref = pair_refs(ref)
        scan = open_scan(idx_ref, access)
        try:
            data = scan.read()
        finally:
            scan.close()
        code, lengths, pointers, documents, modes = parse_index(data, idx_ref.url, ref.size, bin_ref.url)
        return FileIndex(
            self.name,
            key_of(ref.url),
            ref.size,
            ref.stamp,
            len(lengths),
            arrays={"lengths": _array("i", lengths), "pointers": _array("q", pointers)},
            meta={"dtype": code, "documents": documents, "multimodal": modes},
        )

    def stream(self, url: str, access: FileAccess = DEFAULT_FILE_ACCESS) -> Iterator[Any]:
        """Every sequence of the pair, in order, reading the ``.bin`` once from
        start to end (its index from the cache, or built)."""
        ref = FileRef(url, *self.identity(url, access))
        index, _ = obtain(self.name, ref, lambda r: self.build_index(r, access))
        assert index is not None
        np = require_numpy()
        stored, native, _ = self._dtypes(index)
        lengths, pointers = index.arrays["lengths"], index.arrays["pointers"]
        bin_ref = pair_refs(ref)[0]
        if is_remote(url):
            f: Any = io.BufferedReader(open_scan(bin_ref, access), STREAM_BUFFER)
        else:
            f = open(local_path(bin_ref.url), "rb", buffering=STREAM_BUFFER)  # noqa: SIM115 - closed below
        with f:
            for i in range(index.count):
                if f.tell() != pointers[i]:
                    f.seek(pointers[i])
                out = np.empty(lengths[i], stored)
                got = f.readinto(out.view(np.uint8))
                if got != out.nbytes:
                    raise SourceChangedError(
                        f"{bin_ref.url}: sequence {i} wants bytes [{pointers[i]}, {pointers[i] + out.nbytes}) "
                        f"but the file ends at byte {pointers[i] + (got or 0)} (truncated after indexing?)"
                    )
                yield out if stored == native else out.astype(native)

    def spans(self, index: FileIndex, i: int) -> list[tuple[int, int]]:
        """Sequence ``i``: exactly its bytes of the ``.bin``."""
        start = index.arrays["pointers"][i]
        return [(start, start + index.arrays["lengths"][i] * self._dtypes(index)[2])]

    def parse(self, handle: Any, index: FileIndex, i: int, ref: FileRef, views: list[memoryview]) -> Any:
        """Sequence ``i`` as a 1-D numpy array of the dataset's dtype (its own
        memory, writable: it keeps no fetched range alive)."""
        stored, native, _ = self._dtypes(index)
        return _NUMPY[0].frombuffer(views[0], stored).astype(native)

    def windows(self, index: FileIndex, window: int) -> Sequence[int]:
        """Shuffle windows: runs of consecutive sequences spanning about ``window``
        bytes (:func:`.index.byte_windows`'s rule; one ``searchsorted`` a window
        when the sequences lie in order in the ``.bin``, as Megatron writes them)."""
        np = require_numpy()
        pointers = np.frombuffer(index.arrays["pointers"], np.int64)
        ends = pointers + self.token_counts(index) * self._itemsize(index)
        n = index.count
        if n > 1 and not bool((pointers[1:] >= ends[:-1]).all() and (ends[1:] >= ends[:-1]).all()):
            return byte_windows(n, lambda i: (int(pointers[i]), int(ends[i])), window)
        bounds = array("q", [0])
        i = 0
        while n:
            i = max(i + 1, int(np.searchsorted(ends, pointers[i] + window, side="right")))
            bounds.append(min(i, n))
            if i >= n:
                break
        return bounds

    def sample_sizes(self, index: FileIndex) -> list[int]:
        """Stored bytes per sequence (its tokens times the dtype's size)."""
        return (self.token_counts(index) * self._itemsize(index)).tolist()

    def sample_bytes(self, index: FileIndex) -> list[int]:
        """What ``mix(..., cost="bytes")`` weighs a sequence by: its stored bytes."""
        return self.sample_sizes(index)

    def check_token_ids(self, index: FileIndex, prefix: str) -> None:
        """``TypeError`` naming the pair when its dtype is no integer one: a float32
        or float64 pair (codes 7 and 6) holds values, not token ids."""
        code = index.meta["dtype"]
        name = DTYPES[code]
        if name.startswith("float"):
            raise OptionTypeError(
                f"{idx_url(prefix)}: dtype code {code} ({name}): the pair holds {name} values, not token ids, and "
                "pack() packs integer token ids; write the corpus with an integer dtype (Megatron-LM's "
                "tools/preprocess_data.py writes uint16 below 65,500 tokens of vocabulary, else int32), or, if the "
                "values are ids, convert them: pack(distshard.tokens(...).map(lambda a: a.astype('int64')), ...) "
                "(counted then by one pass over the .bin files)"
            )

    def token_counts(self, index: FileIndex) -> Any:
        """Tokens per sequence (a numpy ``int64`` array), from the index alone."""
        np = require_numpy()
        return np.frombuffer(index.arrays["lengths"], np.intc).astype(np.int64)

    # -- helpers ------------------------------------------------------------------------------
    def _itemsize(self, index: FileIndex) -> int:
        return int(self._dtypes(index)[2])

    def _dtypes(self, index: FileIndex) -> tuple[Any, Any, int]:
        """The dtype as stored (little endian), as yielded (native), and its size."""
        found = index.derived.get("dtypes")
        if found is None:
            native = require_numpy().dtype(DTYPES[index.meta["dtype"]])
            found = index.derived["dtypes"] = (native.newbyteorder("<"), native, native.itemsize)
        return found
