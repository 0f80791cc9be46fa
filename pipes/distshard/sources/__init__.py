"""File sources: WebDataset tar shards, JSON lines, Parquet and Megatron token files as ``IterDataPipe``\\ s.

Iterated alone, a source yields every sample of every file in order;
``.dist_shard()`` reads it at random by position (see :mod:`.pipe` for the
protocol), so each slot reads only its own samples' bytes::

    import distshard

    dp = distshard.webdataset("shards/train-{000000..000063}.tar").dist_shard(even="drop", shuffle=True)

Remote URLs (``s3://``, ``gs://``, ``https://``) go through fsspec with
``storage_options=``; reads are checked, retried and read ahead (see
:mod:`.remote`, :mod:`.fetch` and :class:`ReadOptions`).
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Mapping
from typing import Any, Optional, Sequence, Union
from urllib.parse import urljoin

from ..errors import OptionTypeError, SourceDataError, SourceMissingError
from ..groups import data_group
from .formats.jsonl import JsonlFormat
from .formats.megatron import TokensFormat, pair_prefixes, require_numpy
from .formats.parquet import ParquetFormat
from .formats.tar import TarFormat
from .pipe import FileSourceIterDataPipe, SourceSequence
from .read_options import ReadOptions
from .stored.manifest import FOLDER, FORMAT, MANIFEST, location_of
from .stored.manifest import load as load_manifest
from .stored.manifest import parse as parse_manifest
from .stored.manifest import read as read_small
from .transport.files import FileAccess, key_of
from .transport.responses import RemoteReadError
from .transport.urls import UrlsArg, braceexpand, expand_urls, is_remote

__all__ = [
    "FileSourceIterDataPipe",
    "JsonLinesIterDataPipe",
    "ParquetIterDataPipe",
    "ReadOptions",
    "RemoteReadError",
    "SourceSequence",
    "TokensIterDataPipe",
    "WebDatasetIterDataPipe",
    "braceexpand",
    "expand_urls",
    "jsonl",
    "parquet",
    "read_shard_index",
    "tokens",
    "webdataset",
]

ShardIndex = Union[str, "os.PathLike[str]", Mapping[str, Any]]
StorageOptions = Optional[Mapping[str, Any]]


class WebDatasetIterDataPipe(FileSourceIterDataPipe):
    """WebDataset tar shards; see :func:`distshard.webdataset`."""


class JsonLinesIterDataPipe(FileSourceIterDataPipe):
    """JSON-lines files; see :func:`distshard.jsonl`."""


class ParquetIterDataPipe(FileSourceIterDataPipe):
    """Parquet files; see :func:`distshard.parquet`."""


def _stored_location(index: ShardIndex) -> str | None:
    """The folder of a stored index (``python -m distshard index``) that ``index``
    names by its form: a folder (local, or a URL ending in ``/``), ``.distshard``."""
    if not isinstance(index, (str, os.PathLike)):
        return None
    text = os.fspath(index)
    if text.endswith("/") or text.rstrip("/").rsplit("/", 1)[-1] == FOLDER:
        return text.rstrip("/")
    if not is_remote(text) and os.path.isdir(os.path.expanduser(text)):
        return text
    return None


class TokensIterDataPipe(FileSourceIterDataPipe):
    """Megatron-LM indexed datasets (``.bin`` + ``.idx`` pairs); see :func:`distshard.tokens`."""

    def lengths(self) -> Any:
        """Tokens per sequence, in the order the source yields them: a numpy
        ``int64`` array read from the ``.idx`` files (their cached index), never
        from the ``.bin`` files. Also what ``distshard.mix(cost=...)`` takes."""
        return self._lengths(check=False)

    def distshard_token_counts(self) -> Any:
        """The hook a consumer that counts tokens (``distshard.pack``) asks a source
        for its per-element token counts without reading the elements: here
        :meth:`lengths`, once every pair is known to hold integer token ids (a
        float32 or float64 pair holds values, not ids: ``TypeError`` naming it)."""
        return self._lengths(check=True)

    def _lengths(self, check: bool) -> Any:
        np = require_numpy()
        sequence = self.__distshard_sequence__()
        assert sequence is not None, "token files are always read at random"
        counts = []
        for f in range(len(sequence.refs)):
            ref, index = sequence.file_index(f)
            if check:
                self.fmt.check_token_ids(index, ref.url)  # type: ignore[attr-defined]
            counts.append(self.fmt.token_counts(index))  # type: ignore[attr-defined]
        return np.concatenate(counts) if counts else np.zeros(0, np.int64)


def read_shard_index(index: ShardIndex, storage_options: StorageOptions = None) -> tuple[list[str], dict[str, int]]:
    """The shards and sample counts of a wids-style shard index
    (``{"shardlist": [{"url": ..., "nsamples": ...}, ...]}``): ``(urls, {url: count})``.

    ``index`` is the JSON's path or URL (relative shard URLs are resolved against
    it, as wids does) or the already loaded dict. A stored index's
    ``manifest.json`` (``python -m distshard index``) is read too: its files and counts.
    """
    base: str | None = None
    if isinstance(index, Mapping):
        data: Any = index
    elif isinstance(index, (str, os.PathLike)):
        base = os.fspath(index)
        try:
            text = read_small(base, FileAccess(storage_options=storage_options)).decode("utf-8")
            data = json.loads(text)
        except FileNotFoundError:
            raise SourceMissingError(f"shard index {base}: no such file") from None
        except ValueError as exc:
            raise SourceDataError(f"shard index {base}: not valid JSON: {exc}") from None
    else:
        raise OptionTypeError(f"index must be a path, a URL or a dict, got {type(index).__name__}")
    where = f"shard index {base}" if base else "shard index"
    if isinstance(data, Mapping) and data.get("format") == FORMAT and base is not None:
        stored = parse_manifest(location_of(base), json.dumps(data).encode("utf-8"))
        return [f.url for f in stored.files.values()], {f.url: f.count for f in stored.files.values()}
    shards = data.get("shardlist") if isinstance(data, Mapping) else None
    if not isinstance(shards, list):
        raise SourceDataError(f'{where}: expected {{"shardlist": [{{"url": ..., "nsamples": ...}}, ...]}}')
    urls: list[str] = []
    counts: dict[str, int] = {}
    for position, shard in enumerate(shards):
        url = shard.get("url") if isinstance(shard, Mapping) else None
        count = shard.get("nsamples") if isinstance(shard, Mapping) else None
        if not isinstance(url, str) or not url or isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise SourceDataError(
                f"{where}: shardlist[{position}] needs a 'url' string and a non-negative "
                f"integer 'nsamples', got {shard!r}"
            )
        if base is not None and not is_remote(url) and not os.path.isabs(url):
            url = urljoin(base, url) if is_remote(base) else os.path.join(os.path.dirname(base), url)
        urls.append(url)
        counts[url] = count
    return urls, counts


def _files(
    urls: UrlsArg | None, index: ShardIndex | None, storage_options: StorageOptions
) -> tuple[Sequence[str], dict[str, int], str | None]:
    """``(files, counts from a wids-style index, the folder of a stored index)``."""
    if index is None:
        if urls is None:
            raise OptionTypeError("urls is required (a list of files, a glob or a brace pattern)")
        return expand_urls(urls, storage_options), {}, None
    location = _stored_location(index)
    if location is None and isinstance(index, (str, os.PathLike)) and os.fspath(index).endswith(MANIFEST):
        location = location_of(os.fspath(index))
    if location is not None:  # counts and identities come from the stored index when the source is prepared
        if urls is not None:
            return expand_urls(urls, storage_options), {}, location
        stored = load_manifest(location, FileAccess(storage_options=storage_options))
        if stored is None:
            raise SourceMissingError(f"no stored index at {location} (no {MANIFEST} there)")
        return [f.url for f in stored.files.values()], {}, location
    listed, declared = read_shard_index(index, storage_options)
    if urls is None:
        return listed, declared, None
    files = expand_urls(urls, storage_options)
    by_key = {key_of(url): n for url, n in declared.items()}
    by_name = {posixpath.basename(url): n for url, n in declared.items()}
    counts = {}
    for url in files:
        n = by_key.get(key_of(url))
        if n is None and len(by_name) == len(declared):
            n = by_name.get(posixpath.basename(url))
        if n is not None:
            counts[url] = n
    return files, counts, None


def webdataset(
    urls: UrlsArg | None,
    *,
    index: ShardIndex | None = None,
    storage_options: StorageOptions = None,
    read_options: ReadOptions | None = None,
    mesh: Any = None,
    group: Any = None,
) -> WebDatasetIterDataPipe:
    """WebDataset tar shards as an ``IterDataPipe`` of samples.

    Each sample is a dict ``{"__key__": key, "__url__": shard, "<ext>": bytes, ...}``
    grouping consecutive members that share a key (the member path up to the
    first dot of its basename), exactly as ``webdataset`` groups them (and, as
    it does, without samples that hold a non-empty ``__bad__`` member).
    ``.dist_shard()`` reads each slot's samples at random from a per-shard index
    of member offsets (built once, cached under ``$DISTSHARD_CACHE``), as few
    large range requests fetched ahead of use; gzip / bz2 / xz / zstd shards go
    whole to slots instead (each decompressed once).

    Args:
        urls: a list of paths or URLs, a glob, or a brace pattern
            (``"shard-{000000..000063}.tar"``); ``None`` takes the shards of ``index``.
        index: a wids-style shard index (``{"shardlist": [{"url", "nsamples"}]}``,
            its path or the dict): counts come from it without opening the shards;
            a count that does not match its shard raises ``ValueError`` before
            any of that shard's samples is yielded. Or a stored index written by
            ``python -m distshard index`` (its folder or its ``manifest.json``);
            by default one in ``.distshard/`` beside the first shard is found.
        storage_options: for remote URLs, handed to fsspec (``{"endpoint_url": ...,
            "key": ..., "secret": ...}`` for S3, ``{"headers": ...}`` for HTTP, ...);
            the environment keeps working as it does for fsspec.
        read_options: read-ahead budget, range sizes, shuffle window, retries
            (:class:`distshard.ReadOptions`).
        mesh, group: in a model-parallel job, the data group (a ``DeviceMesh`` of
            the data-parallel dimensions, or a ``ProcessGroup``, as for
            ``.dist_shard()``): the index build, split across ranks when
            ``torch.distributed`` is up, is split over these ranks only (build the
            source on each of them); default: every rank.

    Example:
        >>> dp = distshard.webdataset("data/shard-{000000..000063}.tar").dist_shard(even="drop")
        >>> dp = dp.map(lambda s: (decode_jpeg(s["jpg"]), int(s["cls"])))
    """
    files, counts, stored = _files(urls, index, storage_options)
    return WebDatasetIterDataPipe(
        TarFormat(), files, counts, storage_options, read_options, stored, data_group(mesh, group)
    )


def jsonl(
    urls: UrlsArg | None,
    *,
    index: ShardIndex | None = None,
    storage_options: StorageOptions = None,
    read_options: ReadOptions | None = None,
    mesh: Any = None,
    group: Any = None,
) -> JsonLinesIterDataPipe:
    """JSON-lines files as an ``IterDataPipe``: one parsed JSON value per non-blank line.

    Lines are UTF-8 (``\\n`` or ``\\r\\n``); a bad line raises ``ValueError``
    naming the file, the line number and the byte offset. ``.dist_shard()`` reads
    each line at random from an index of line offsets (one scan per file, cached);
    compressed files (``.gz``, ``.bz2``, ``.xz``, ``.zst``) go whole to slots.
    ``index``, ``storage_options``, ``read_options``, ``mesh`` and ``group`` as for
    :func:`webdataset`.

    Example:
        >>> dp = distshard.jsonl("corpus/part-*.jsonl").dist_shard(even="drop").map(tokenize)
    """
    files, counts, stored = _files(urls, index, storage_options)
    return JsonLinesIterDataPipe(
        JsonlFormat(), files, counts, storage_options, read_options, stored, data_group(mesh, group)
    )


def tokens(
    urls: UrlsArg,
    *,
    storage_options: StorageOptions = None,
    read_options: ReadOptions | None = None,
    mesh: Any = None,
    group: Any = None,
) -> TokensIterDataPipe:
    """Megatron-LM indexed datasets, read in place: one token sequence per
    element, as a 1-D numpy array of the dataset's dtype.

    A dataset is a ``<prefix>.bin`` + ``<prefix>.idx`` pair (``MMIDIDX`` version 1,
    what Megatron-LM's ``tools/preprocess_data.py`` writes), named by either file or
    by the prefix; ``urls`` is a list, a glob or a brace pattern of such names, each
    pair taken once, in the order first named (``"corpus/*.bin"``, ``"corpus/*"``).
    Iterated alone the source yields every sequence of every pair in order.
    ``.dist_shard()`` reads each sequence at random: exactly its bytes of the ``.bin``
    (locally one ``pread``, remotely through the read-ahead), from the ``.idx``
    read once per job (cached like any file index). The identity of both files
    is recorded; a ``.bin`` that changes during a job raises. A pair that does not
    match (bad magic, version or dtype code, a truncated ``.idx``, a ``.bin`` whose
    size is not where the pointers end, a missing file) raises naming the file.
    ``lengths()`` gives the tokens per sequence from the ``.idx`` alone.
    Needs numpy (``pip install distshard[tokens]``). ``storage_options``,
    ``read_options``, ``mesh`` and ``group`` as for :func:`webdataset`.

    Example:
        >>> dp = distshard.tokens("corpus/train_text_document").dist_shard(even="drop", shuffle=True)
    """
    require_numpy()
    prefixes = pair_prefixes(expand_urls(urls, storage_options))
    return TokensIterDataPipe(
        TokensFormat(), prefixes, None, storage_options, read_options, data_group=data_group(mesh, group)
    )


def parquet(
    urls: UrlsArg | None,
    columns: Sequence[str] | None = None,
    *,
    index: ShardIndex | None = None,
    storage_options: StorageOptions = None,
    read_options: ReadOptions | None = None,
    mesh: Any = None,
    group: Any = None,
) -> ParquetIterDataPipe:
    """Parquet files as an ``IterDataPipe``: one dict per row.

    Needs ``pyarrow`` (``pip install distshard[parquet]``). ``columns`` selects
    the columns. ``.dist_shard()`` reads rows at random: the index is the files'
    footers (rows and column chunk ranges per row group); a slot fetches a row
    group's selected column chunks and decodes it once while its rows are read
    (``shuffle=True`` keeps a row group's rows together). ``index``,
    ``storage_options``, ``read_options``, ``mesh`` and ``group`` as for
    :func:`webdataset`.

    Example:
        >>> dp = distshard.parquet("table/*.parquet", columns=["text", "label"]).dist_shard(even="drop")
    """
    from .formats.parquet import require_pyarrow

    require_pyarrow()
    files, counts, stored = _files(urls, index, storage_options)
    return ParquetIterDataPipe(
        ParquetFormat(columns), files, counts, storage_options, read_options, stored, data_group(mesh, group)
    )
