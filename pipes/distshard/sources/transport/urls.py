"""Turning the ``urls`` argument of a file source into an ordered list of files.

WebDataset's conventions: a string may hold several patterns separated by
``::``; each is brace-expanded exactly as the ``braceexpand`` package does
(``"shard-{000000..000063}.tar"``, ``"{a,b}"``, nested groups, backslash
escapes), in textual order; a pattern with glob characters (``*?[``) is globbed
(sorted). A list (or tuple) is taken as it is, item by item.
"""

from __future__ import annotations

import glob as _glob
import itertools
import os
import re
import string
from typing import Any, Iterable, Mapping, Sequence, Union

from ...errors import OptionError, OptionTypeError
from .brace_list import INT_RANGE, BraceList, IntRange, lazy_braceexpand

__all__ = ["braceexpand", "expand_urls", "first_remote", "is_remote"]

UrlsArg = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]]

_REMOTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_GLOB_CHARS = re.compile(r"[*?\[]")


def _pin(url: str, storage_options: Mapping[str, Any] | None, pins: dict[Any, str]) -> str:
    """An ``hf://`` URL pinned to the commit its revision is now (see :mod:`.hub`)."""
    if url[:5].lower() != "hf://":
        return url
    from .hub import pin

    return pin(url, storage_options, pins)


def is_remote(url: str) -> bool:
    """``True`` for ``scheme://...`` URLs other than ``file://`` (read through fsspec)."""
    return bool(_REMOTE.match(url)) and not url.startswith("file://")


def first_remote(urls: Sequence[str]) -> str | None:
    """The first remote URL of ``urls`` (``None``: every file is local); of a brace
    pattern whose literal start decides it (up to its first ``/`` and one more
    character: ``"s3://"``, ``"/data"``), from its first URL alone."""
    if isinstance(urls, BraceList) and len(urls):
        head = urls.head()
        slash = head.find("/")
        if 0 <= slash and slash + 2 <= len(head):  # (a scheme's "://" can only be at the first "/")
            return urls[0] if is_remote(urls[0]) else None
    return next((url for url in urls if is_remote(url)), None)


_CHAR_RANGE = re.compile(r"^([A-Za-z])\.\.([A-Za-z])(?:\.\.-?(\d+))?$")
_ALPHABET = string.ascii_uppercase + string.ascii_lowercase
_ESCAPED = re.compile(r"\\(.)")
_ONE_GROUP = re.compile(r"^([^{}\\]*)\{([^{}\\]*)\}([^{}\\]*)$")


def braceexpand(pattern: str) -> list[str]:
    """Expand brace groups exactly as the ``braceexpand`` package (0.1.7) that
    WebDataset uses does.

    ``"a{0..2}b"`` gives ``a0b a1b a2b``; ``"{00..10}"`` keeps the zero padding;
    ``"{a..g..2}"`` steps; ``"x{a,b{1,2}}"`` gives ``xa xb1 xb2``; a group that
    is neither a range nor has a comma stays, braces and all (``"{x}"``, and the
    outer braces of ``"{{a,b}}"``: ``{a} {b}``); a backslash escapes the next
    character (``"lit\\{a,b\\}.tar"`` is the one name ``lit{a,b}.tar``) and is
    removed. Unbalanced braces raise ``ValueError``.
    """
    one = _ONE_GROUP.match(pattern)
    match = INT_RANGE.match(one.group(2)) if one is not None else None
    if one is not None and match is not None:  # the common shard pattern, one range, nothing escaped: no call a name
        before, _, after = one.groups()
        return [before + number + after for number in _int_range(*match.groups())]
    try:
        return [_flatten(item) for item in _pattern(pattern)]
    except _Unbalanced:
        raise OptionError(
            f"unbalanced braces in the url pattern {pattern!r} (escape a literal brace as \\{{)"
        ) from None


class _Unbalanced(Exception):
    pass


def _flatten(item: Iterable) -> str:
    """Join, and remove escapes; as braceexpand does, at every level of nesting (so
    an escape inside a literal group is removed twice: ``"{\\\\}"`` gives ``{}``)."""
    return _ESCAPED.sub(r"\1", "".join(part if isinstance(part, str) else _flatten(part) for part in item))


def _pattern(pattern: str) -> Iterable[tuple]:
    """``pattern`` -> the product of its literal parts and groups (braceexpand's parse_pattern)."""
    start = pos = depth = 0
    items: list[Iterable] = []
    while pos < len(pattern):
        char = pattern[pos]
        if char == "\\":
            pos += 2
            continue
        if char == "{":
            if depth == 0 and pos > start:
                items.append([pattern[start:pos]])
                start = pos
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                body = pattern[start + 1 : pos]
                group = _expression(body)
                if group is None:  # neither a range nor a sequence: literal braces around it
                    items.extend([["{"], list(_pattern(body)), ["}"]])
                else:
                    items.append(group)
                start = pos + 1
        pos += 1
    if depth != 0:
        raise _Unbalanced
    if start < pos:
        items.append([pattern[start:]])
    return itertools.product(*items)


def _expression(body: str) -> list | None:
    match = INT_RANGE.match(body)
    if match is not None:
        return list(_int_range(*match.groups()))
    match = _CHAR_RANGE.match(body)
    if match is not None:
        return list(_char_range(*match.groups()))
    return _sequence(body)


def _sequence(body: str) -> list | None:
    start = pos = depth = 0
    items: list[Iterable] = []
    while pos < len(body):
        char = body[pos]
        if char == "\\":
            pos += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(list(_pattern(body[start:pos])))
            start = pos + 1
        pos += 1
    if depth != 0 or not items:
        return None
    items.append(list(_pattern(body[start:])))
    return list(itertools.chain(*items))


def _int_range(first: str, last: str, step: str | None) -> Iterable[str]:
    numbers = IntRange(first, last, step)
    return (numbers[k] for k in range(len(numbers)))


def _char_range(first: str, last: str, step: str | None) -> str:
    increment = (int(step) or 1) if step else 1
    lo, hi = _ALPHABET.index(first), _ALPHABET.index(last)
    if lo < hi:
        return _ALPHABET[lo : hi + 1 : increment]
    hi = hi or -len(_ALPHABET)
    return _ALPHABET[lo : hi - 1 : -increment]


def _glob_one(pattern: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    if is_remote(pattern):
        from .clients import glob_remote

        return glob_remote(pattern, storage_options)
    path = pattern[len("file://") :] if pattern.startswith("file://") else pattern
    return sorted(_glob.glob(os.path.expanduser(path)))


def expand_urls(urls: UrlsArg, storage_options: Mapping[str, Any] | None = None) -> Sequence[str]:
    """The ordered list of files that ``urls`` names.

    One brace pattern of ranges and word lists (``"s3://b/shard-{0000000..9999999}.tar"``;
    no ``::``, glob or ``hf://``) gives a :class:`.brace_list.BraceList`: equal to the
    list, but each URL made when asked for, so a job over 10^7 files does not build them.

    Args:
        urls: a path or URL, a brace pattern (``"shard-{000000..000063}.tar"``),
            a glob (``"data/*.jsonl"``), several of those joined by ``::``, or a
            list of paths / URLs taken literally.

    Raises:
        TypeError: ``urls`` is not a string, a path or a list of them.
        ValueError: nothing was named, or a glob matched no file.
    """
    if isinstance(urls, (str, os.PathLike)):
        text = os.fspath(urls)
        if not isinstance(text, str):
            raise OptionTypeError(f"urls must be a str or a list of str, got bytes {text!r}")
        if "{" in text and "::" not in text and "hf://" not in text.lower() and not _GLOB_CHARS.search(text):
            lazy = lazy_braceexpand(text)
            if lazy is not None:
                if lazy.holds_empty():
                    raise OptionError(f"urls names no file: {urls!r}")
                return lazy
        out: list[str] = []
        pins: dict[Any, str] = {}  # one resolution of each hf:// repository's revision
        for pattern in text.split("::"):
            if "hf://" not in pattern.lower() and not _GLOB_CHARS.search(pattern):  # (nothing to pin or glob)
                out.extend(braceexpand(pattern))
                continue
            for item in braceexpand(pattern):
                item = _pin(item, storage_options, pins)
                if _GLOB_CHARS.search(item):
                    matched = _glob_one(item, storage_options)
                    if not matched:
                        raise OptionError(f"the glob {item!r} matches no file")
                    out.extend(matched)
                else:
                    out.append(item)
    elif isinstance(urls, Iterable) and not isinstance(urls, (bytes, dict)):
        out, pins = [], {}
        for given in urls:
            if not isinstance(given, (str, os.PathLike)):
                raise OptionTypeError(f"urls must hold str or os.PathLike items, got {type(given).__name__}: {given!r}")
            out.append(_pin(os.fspath(given), storage_options, pins))
    else:
        raise OptionTypeError(f"urls must be a str, an os.PathLike or a list of them, got {type(urls).__name__}")
    if not out or "" in out:
        raise OptionError(f"urls names no file: {urls!r}")
    return out
