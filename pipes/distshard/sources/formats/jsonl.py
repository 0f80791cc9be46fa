"""JSON lines: one parsed JSON value per non-blank line (UTF-8, ``\\n`` or
``\\r\\n`` line ends, an optional byte-order mark, blank lines skipped).

The index must scan the file for newlines (once, then cached; remotely in
large ranges); reading a line at random reads exactly its bytes (the
read-ahead coalesces neighbouring lines of a slot into large ranges).
"""

from __future__ import annotations

import io
import json
from array import array
from typing import Any, Iterator, Sequence

from ...errors import SourceDataError
from ..transport.files import DEFAULT_FILE_ACCESS, FileAccess, FileRef, compression_of, key_of, open_scan, open_stream
from ..transport.files import any_compressed as names_compressed
from ..transport.responses import RemoteReadError
from .file_index import FileIndex, byte_windows

__all__ = ["JsonlFormat", "parse_line"]

_BOM = b"\xef\xbb\xbf"


def parse_line(raw: bytes, url: str, line: int | None, offset: int, where: str = "") -> Any:
    """``json.loads`` of one line; ``ValueError`` naming the file, the line
    number and the byte offset of the line's start on failure."""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        problem = f"not UTF-8 ({exc.reason} at byte {offset + exc.start}{where})"
    except json.JSONDecodeError as exc:
        problem = f"invalid JSON: {exc.msg} (column {exc.colno})"
    at = f"line {line}, " if line is not None else ""
    raise SourceDataError(f"{url}: {at}byte {offset}{where}: {problem}: {raw[:80]!r}")


def _lines(f: Any) -> Iterator[tuple[int, int, bytes]]:
    """``(line number, byte offset of the content, content)`` for every non-blank
    line (the content without its ``\\n``; a leading byte-order mark removed)."""
    offset = 0
    for number, raw in enumerate(f, start=1):
        start, size = offset, len(raw)
        offset += size
        if raw.endswith(b"\n"):
            raw = raw[:-1]
        if start == 0 and raw.startswith(_BOM):
            raw, start = raw[3:], 3
        if raw.strip():
            yield number, start, raw


class JsonlFormat:
    """The ``jsonl`` format (see the module docstring)."""

    name = "jsonl"
    file_kind = "JSON-lines file"
    access = "random access by line (byte ranges from the index)"

    def compression(self, url: str) -> str | None:
        return compression_of(url)

    def any_compressed(self, urls: Sequence[str]) -> bool:
        """Whether any of ``urls`` is compressed (a search of their names at once)."""
        return names_compressed(urls)

    def stream(self, url: str, access: FileAccess = DEFAULT_FILE_ACCESS) -> Iterator[Any]:
        """Every value of the file, in order."""
        compression = self.compression(url)
        where = " of the decompressed stream" if compression else ""
        with open_stream(url, compression, access) as f:
            try:
                for number, start, raw in _lines(f):
                    yield parse_line(raw, url, number, start, where)
            except RemoteReadError:
                raise
            except (OSError, EOFError) as exc:  # a corrupt compressed stream
                raise SourceDataError(f"{url}: cannot read the file: {exc}") from None

    def build_index(self, ref: FileRef, access: FileAccess = DEFAULT_FILE_ACCESS) -> FileIndex:
        """Scan for newlines: the byte range of every non-blank line. A
        compressed file is streamed once to count its lines."""
        assert ref.size is not None and ref.stamp is not None
        if self.compression(ref.url):
            count = 0
            with open_stream(ref.url, self.compression(ref.url), access) as f:
                try:
                    count = sum(1 for _ in _lines(f))
                except RemoteReadError:
                    raise
                except (OSError, EOFError) as exc:
                    raise SourceDataError(f"{ref.url}: cannot read the file: {exc}") from None
            return FileIndex(self.name, key_of(ref.url), ref.size, ref.stamp, count, meta={"streaming": True})
        raw = open_scan(ref, access)
        try:
            return self.index_stream(io.BufferedReader(raw, 1 << 20), ref)
        finally:
            raw.close()

    def index_stream(self, f: Any, ref: FileRef) -> FileIndex:
        """The index from the file's bytes as they flow (``f``: a sequential
        buffered reader from the first byte)."""
        assert ref.size is not None and ref.stamp is not None
        starts, lengths = array("q"), array("q")
        for _, start, line in _lines(f):
            starts.append(start)
            lengths.append(len(line))
        return FileIndex(
            self.name, key_of(ref.url), ref.size, ref.stamp, len(starts), arrays={"start": starts, "length": lengths}
        )

    def spans(self, index: FileIndex, i: int) -> list[tuple[int, int]]:
        """Line ``i``: exactly its bytes."""
        start = index.arrays["start"][i]
        return [(start, start + index.arrays["length"][i])]

    def parse(self, handle: Any, index: FileIndex, i: int, ref: FileRef, views: list[memoryview]) -> Any:
        start = index.arrays["start"][i]
        raw = bytes(views[0])
        try:
            return parse_line(raw, ref.url, None, start)
        except ValueError:
            pass
        line = _line_number(handle, start)  # the error path: count the newlines before it
        return parse_line(raw, ref.url, line, start)

    def windows(self, index: FileIndex, window: int) -> Sequence[int]:
        """Shuffle windows: runs of consecutive lines spanning about ``window`` bytes."""
        starts, lengths = index.arrays["start"], index.arrays["length"]
        return byte_windows(index.count, lambda i: (starts[i], starts[i] + lengths[i]), window)

    def sample_sizes(self, index: FileIndex) -> Sequence[int]:
        """Stored bytes per line (without its line end)."""
        return index.arrays["length"]


def _line_number(handle: Any, offset: int) -> int:
    count, position = 1, 0
    while position < offset:
        size = min(1 << 20, offset - position)
        count += handle.read_at(position, size).count(b"\n")
        position += size
    return count
