"""WebDataset tar shards: samples are groups of consecutive members sharing a key.

The rules are WebDataset's (``tariterators.tar_file_iterator`` and
``group_by_keys``): only regular members count; top-level ``__*__`` names and
names matching ``__[^/]*__($|/)`` are metadata and skipped; a member's key is
its path up to the first dot of its basename and its extension the rest,
lower-cased (``"dir/a.b.JPG"`` -> key ``"dir/a"``, extension ``"b.jpg"``); a
name without such a split is skipped; a new key starts a new sample; the same
extension twice in one sample is an error. A sample is the dict
``{"__key__": key, "__url__": url, ext: bytes, ...}`` in member order.

A sample with a member whose extension is ``__bad__`` and whose content is
not empty is dropped, as WebDataset's ``valid_sample`` drops it (an empty
``__bad__`` member is kept, as a key of the sample).

Headers are parsed by :class:`tarfile.TarInfo` (ustar, GNU long names, pax),
so names come out exactly as :mod:`tarfile` (and so WebDataset) reads them. The
index walks the 512-byte headers and seeks over the contents (locally a
``pread`` per header; remotely through large ranges, see ``files.open_scan``).
A sample is one byte span (from its first member's contents to the end of its
last member's), so the read-ahead reads it with at most one range and never one
per member; parsing cuts the members out of that span.
"""

from __future__ import annotations

import re
import tarfile
from array import array
from typing import Any, Iterator, Sequence

from ...errors import SourceDataError
from ..transport.files import (
    DEFAULT_FILE_ACCESS,
    FileAccess,
    FileRef,
    any_compressed,
    compression_of,
    key_of,
    open_scan,
    open_stream,
    sniff_compression,
)
from ..transport.responses import RemoteReadError
from .file_index import FileIndex, byte_windows

__all__ = ["TarFormat", "split_name"]

_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_SKIP_META = re.compile(r"__[^/]*__($|/)")
_BLOCK = tarfile.BLOCKSIZE


def split_name(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` as WebDataset splits a member name, or ``None``."""
    if "/" not in name:  # what _KEY matches there: a non-empty key up to the first dot (no regex: the index's hot loop)
        dot = name.find(".")
        return None if dot <= 0 else (name[:dot], name[dot + 1 :].lower())
    match = _KEY.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


def kept(info: Any) -> bool:
    """Whether WebDataset yields this member (a regular file that is not metadata)."""
    name = info.name
    if not info.isreg() or name is None:
        return False
    if not name.startswith("__"):  # neither rule below can hold (_SKIP_META matches at the start)
        return True
    if "/" not in name and name.endswith("__"):
        return False
    return _SKIP_META.match(name) is None


class _Walk:
    """What :meth:`tarfile.TarInfo.fromtarfile` needs from a ``TarFile``."""

    encoding = tarfile.ENCODING
    errors = "surrogateescape"

    def __init__(self, fileobj: Any) -> None:
        self.fileobj = fileobj
        self.pax_headers: dict[str, str] = {}
        self.offset = 0


def _goto(f: Any, position: int, seekable: bool) -> None:
    current = f.tell()
    if current == position:
        return
    if seekable:
        f.seek(position)
        return
    while current < position:  # a stream: read over the gap
        chunk = f.read(min(position - current, 1 << 20))
        if not chunk:
            return  # the next header read reports the truncation
        current += len(chunk)


class _Member:
    """A plain member header, read by :func:`_plain` (what ``walk`` needs of a ``TarInfo``)."""

    __slots__ = ("name", "type", "size", "offset", "offset_data")
    sparse = None

    def __init__(self, name: str, kind: bytes, size: int, offset: int) -> None:
        self.name, self.type, self.size, self.offset, self.offset_data = name, kind, size, offset, offset + _BLOCK

    def isreg(self) -> bool:
        return self.type in _REGULAR


_PLAIN_TYPES = {b"0", b"\x00", b"7", b"1", b"2", b"3", b"4", b"5", b"6"}  # no extension headers, not sparse
_REGULAR = {b"0", b"\x00", b"7"}
# a numeric field as tarfile's nti reads it: up to the first NUL, ASCII whitespace around octal digits
_OCTAL = re.compile(rb"[ \t\n\r\x0b\x0c]*([0-7]*)[ \t\n\r\x0b\x0c]*(?:\x00.*)?", re.DOTALL)
_NUMBERS = ((100, 108), (108, 116), (116, 124), (136, 148), (329, 337), (337, 345))  # mode ... devminor
_VALID: set[bytes] = set()  # numeric fields already seen to read as tarfile reads them


def _octal(field: bytes) -> int | None:
    match = _OCTAL.fullmatch(field)
    if match is None:
        return None
    digits = match.group(1)
    return int(digits, 8) if digits else 0


def _plain(buf: bytes, position: int) -> _Member | None:
    """The header in ``buf`` read exactly as :meth:`tarfile.TarInfo.frombuf` reads
    it, for a plain ustar / GNU / v7 header (no extension header, octal numbers,
    the unsigned checksum); ``None`` for anything else, which ``tarfile`` itself
    then reads (or rejects). Several times faster than ``tarfile``."""
    if len(buf) != _BLOCK or buf[156:157] not in _PLAIN_TYPES:
        return None
    size, checksum = _octal(buf[124:136]), _octal(buf[148:156])
    # the unsigned byte sum with the checksum field as spaces (NULs add nothing: dropped first, 3x faster)
    if size is None or checksum is None or checksum != 256 + sum(buf.translate(None, b"\0")) - sum(buf[148:156]):
        return None
    numbers = buf[100:124] + buf[136:148] + buf[329:345]  # mode, uid, gid, mtime, devmajor, devminor
    if numbers not in _VALID:  # the same in most headers of a shard: checked once
        if any(_octal(buf[a:b]) is None for a, b in _NUMBERS):
            return None
        if len(_VALID) > 4096:
            _VALID.clear()
        _VALID.add(numbers)
    kind = buf[156:157]
    end = buf.find(b"\0", 0, 100)
    name = buf[: 100 if end < 0 else end].decode(tarfile.ENCODING, "surrogateescape")
    end = buf.find(b"\0", 345, 500)
    prefix = "" if end == 345 else buf[345 : 500 if end < 0 else end].decode(tarfile.ENCODING, "surrogateescape")
    if kind == b"\x00" and name.endswith("/"):
        kind = b"5"
    if kind == b"5":
        name = name.rstrip("/")
    if prefix:
        name = prefix + "/" + name
    return _Member(name, kind, size, position)


def walk(f: Any, url: str, file_size: int | None, seekable: bool, where: str = "") -> Iterator[Any]:
    """Every member's header, in order (``offset``: its header, ``offset_data``:
    its contents). The caller may read the contents before asking for the next
    one. Raises ``ValueError`` naming ``url`` and the byte for a truncated or
    malformed archive; ``where`` qualifies byte positions (compressed streams).

    Plain headers are parsed here (:func:`_plain`), everything else (GNU long
    names, pax headers, odd fields) by :class:`tarfile.TarInfo`, with the same
    result."""
    state = _Walk(f)
    block = getattr(f, "read_block", None) if seekable else None  # ScanFile: one read at a position
    while True:
        position = state.offset
        if block is None:
            _goto(f, position, seekable)
        try:
            buf = f.read(_BLOCK) if block is None else block(position)
            info: Any = None if state.pax_headers else _plain(buf, position)
            if info is None:
                info = tarfile.TarInfo.frombuf(buf, state.encoding, state.errors)
                info.offset = position
                info = info._proc_member(state)
            else:
                state.offset = info.offset_data + (-(-info.size // _BLOCK) * _BLOCK if info.isreg() else 0)
        except tarfile.EOFHeaderError:  # type: ignore[attr-defined]  # tarfile's own, not in typeshed
            return  # a zero block: the end-of-archive marker
        except tarfile.EmptyHeaderError:  # type: ignore[attr-defined]
            if position == 0:
                raise SourceDataError(f"{url}: empty file, not a tar archive") from None
            raise SourceDataError(
                f"{url}: truncated tar: the data ends at byte {position}{where} without the end-of-archive marker"
            ) from None
        except tarfile.TruncatedHeaderError:  # type: ignore[attr-defined]
            raise SourceDataError(
                f"{url}: truncated tar: incomplete member header at byte {position}{where}"
                f"{_compressed_hint(f, url, position)}"
            ) from None
        except tarfile.HeaderError as exc:
            raise SourceDataError(
                f"{url}: not a valid tar header at byte {position}{where} ({exc}){_compressed_hint(f, url, position)}"
            ) from None
        except RemoteReadError:
            raise
        except (OSError, EOFError) as exc:  # a corrupt compressed stream
            raise SourceDataError(f"{url}: cannot read the member header at byte {position}{where}: {exc}") from None
        if info.sparse is not None:
            raise SourceDataError(
                f"{url}: member {info.name!r} at byte {info.offset}{where} is a sparse file, "
                "which tar shards of samples do not use; not supported"
            )
        if file_size is not None and info.isreg() and info.offset_data + info.size > file_size:
            raise SourceDataError(
                f"{url}: truncated tar: member {info.name!r} (header at byte {info.offset}) needs bytes "
                f"[{info.offset_data}, {info.offset_data + info.size}) but the file ends at byte {file_size}"
            )
        yield info


def _compressed_hint(f: Any, url: str, position: int) -> str:
    if position != 0 or compression_of(url) is not None:
        return ""
    try:
        f.seek(0)
        found = sniff_compression(f.read(8))
    except (OSError, ValueError, AttributeError):
        return ""
    if found is None:
        return ""
    return f"; the file is {found}-compressed: give it a compressed name (e.g. .tar.gz) to stream it"


def group(url: str, members: Iterator[tuple[str, Any, int, int]]) -> Iterator[tuple[str, list[tuple[str, Any]]]]:
    """WebDataset's ``group_by_keys`` over ``(name, payload, content size, header
    offset)``: ``(key, [(ext, payload), ...])`` per sample, without the samples
    WebDataset drops (a non-empty ``__bad__`` member)."""
    key: str | None = None
    parts: list[tuple[str, Any]] = []
    seen: set[str] = set()
    bad = False
    for name, payload, size, position in members:
        split = split_name(name)
        if split is None:
            continue
        new_key, ext = split
        if key is None or new_key != key:
            if key is not None and not bad:
                yield key, parts
            key, parts, seen, bad = new_key, [], {"__key__", "__url__"}, False
        if ext in seen:
            raise SourceDataError(
                f"{url}: member {name!r} (header at byte {position}) repeats the extension {ext!r} "
                f"in sample {key!r}; WebDataset rejects duplicate file names in a sample"
            )
        seen.add(ext)
        parts.append((ext, payload))
        bad = bad or (ext == "__bad__" and size > 0)
    if key is not None and not bad:
        yield key, parts


def _sample(key: str, url: str, parts: list[tuple[str, bytes]]) -> dict[str, Any]:
    sample: dict[str, Any] = {"__key__": key, "__url__": url}
    for ext, data in parts:
        sample[ext] = data
    return sample


class TarFormat:
    """The ``webdataset`` format (see the module docstring)."""

    name = "webdataset"
    file_kind = "tar file"
    access = "random access by sample (one byte span per sample, from the index)"

    def compression(self, url: str) -> str | None:
        return compression_of(url)

    def any_compressed(self, urls: Sequence[str]) -> bool:
        """Whether any of ``urls`` is compressed (a search of their names at once)."""
        return any_compressed(urls)

    # -- plain iteration --------------------------------------------------------
    def stream(self, url: str, access: FileAccess = DEFAULT_FILE_ACCESS) -> Iterator[dict[str, Any]]:
        """Every sample of the shard, reading it once from start to end."""
        compression = self.compression(url)
        where = " of the decompressed stream" if compression else ""
        with open_stream(url, compression, access) as f:

            def members() -> Iterator[tuple[str, bytes, int, int]]:
                for info in walk(f, url, None, seekable=False, where=where):
                    if not kept(info):
                        continue
                    try:
                        data = f.read(info.size)
                    except RemoteReadError:
                        raise
                    except (OSError, EOFError) as exc:
                        raise SourceDataError(
                            f"{url}: cannot read member {info.name!r} at byte {info.offset_data}{where}: {exc}"
                        ) from None
                    if len(data) != info.size:
                        raise SourceDataError(
                            f"{url}: truncated tar: member {info.name!r} (header at byte {info.offset}{where}) "
                            f"has {len(data)} of its {info.size} bytes"
                        )
                    yield info.name, data, info.size, info.offset

            for key, parts in group(url, members()):
                yield _sample(key, url, parts)

    # -- the index ----------------------------------------------------------------
    def build_index(self, ref: FileRef, access: FileAccess = DEFAULT_FILE_ACCESS) -> FileIndex:
        """Walk the headers (seeking over contents); a compressed shard is
        streamed once to count its samples."""
        assert ref.size is not None and ref.stamp is not None
        if self.compression(ref.url):
            count = sum(1 for _ in self.stream(ref.url, access))
            return FileIndex(self.name, key_of(ref.url), ref.size, ref.stamp, count, meta={"streaming": True})
        f = open_scan(ref, access)
        try:
            return self._index(f, ref, seekable=True)
        finally:
            f.close()

    def index_stream(self, f: Any, ref: FileRef) -> FileIndex:
        """The index from the shard's bytes as they flow (``f``: a sequential
        reader from the first byte; the contents are read over, never kept)."""
        return self._index(f, ref, seekable=False)

    def _index(self, f: Any, ref: FileRef, seekable: bool) -> FileIndex:
        assert ref.size is not None and ref.stamp is not None
        first, offsets, lengths, ext_ids = array("q", [0]), array("q"), array("q"), array("I")
        keys: list[str] = []
        vocabulary: dict[str, int] = {}
        members = (
            (info.name, (info.offset_data, info.size), info.size, info.offset)
            for info in walk(f, ref.url, ref.size, seekable=seekable)
            if kept(info)
        )
        for key, parts in group(ref.url, members):
            keys.append(key)
            for ext, (offset, size) in parts:
                offsets.append(offset)
                lengths.append(size)
                ext_ids.append(vocabulary.setdefault(ext, len(vocabulary)))
            first.append(len(offsets))
        return FileIndex(
            self.name,
            key_of(ref.url),
            ref.size,
            ref.stamp,
            len(keys),
            arrays={"first": first, "offset": offsets, "length": lengths, "ext": ext_ids},
            strings={"keys": keys, "exts": list(vocabulary)},
        )

    # -- random access ------------------------------------------------------------
    def spans(self, index: FileIndex, i: int) -> list[tuple[int, int]]:
        """Sample ``i``'s bytes: one span from its first member's contents to
        the end of its last member's (the headers between them included)."""
        arrays = index.arrays
        lo, hi = arrays["first"][i], arrays["first"][i + 1]
        if hi == lo:
            return []
        return [(arrays["offset"][lo], arrays["offset"][hi - 1] + arrays["length"][hi - 1])]

    def parse(self, handle: Any, index: FileIndex, i: int, ref: FileRef, views: list[memoryview]) -> dict[str, Any]:
        """Sample ``i`` from its span's bytes."""
        arrays, strings = index.arrays, index.strings
        first, offsets, lengths, ext_ids = arrays["first"], arrays["offset"], arrays["length"], arrays["ext"]
        exts = strings["exts"]
        members = range(first[i], first[i + 1])
        if not members:
            return _sample(strings["keys"][i], ref.url, [])
        view, base = views[0], offsets[first[i]]
        return _sample(
            strings["keys"][i],
            ref.url,
            [(exts[ext_ids[j]], bytes(view[offsets[j] - base : offsets[j] - base + lengths[j]])) for j in members],
        )

    def windows(self, index: FileIndex, window: int) -> Sequence[int]:
        """Shuffle windows: runs of consecutive samples spanning about ``window`` bytes."""
        arrays = index.arrays
        first, offsets, lengths = arrays["first"], arrays["offset"], arrays["length"]

        def extent(i: int) -> tuple[int, int]:
            lo, hi = first[i], first[i + 1]
            if hi == lo:
                return -1, -1
            return offsets[lo], offsets[hi - 1] + lengths[hi - 1]

        return byte_windows(index.count, extent, window)

    def sample_sizes(self, index: FileIndex) -> list[int]:
        """Stored bytes per sample: the sum of its members' lengths."""
        first, lengths = index.arrays["first"], index.arrays["length"]
        return [sum(lengths[first[i] : first[i + 1]]) for i in range(index.count)]
