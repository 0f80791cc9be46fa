"""Turning the ``urls`` argument of a file source into an ordered list of files.

WebDataset's conventions: a string may hold several patterns separated by
``::``; each is brace-expanded (``"shard-{000000..000063}.tar"``, ``"{a,b}"``,
nested groups), in textual order; a pattern with glob characters (``*?[``) is
globbed (sorted). A list (or tuple) is taken as it is, item by item.
"""

from __future__ import annotations

import glob as _glob
import os
import re
from typing import Iterable, Sequence, Union

__all__ = ["braceexpand", "expand_urls", "is_remote"]

UrlsArg = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]]

_REMOTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.(\d+))?$")
_GLOB_CHARS = re.compile(r"[*?\[]")


def is_remote(url: str) -> bool:
    """``True`` for ``scheme://...`` URLs other than ``file://`` (read through fsspec)."""
    return bool(_REMOTE.match(url)) and not url.startswith("file://")


def _top_level_group(pattern: str) -> tuple[int, int] | None:
    """``(start, end)`` of the first balanced ``{...}`` group, or ``None``."""
    depth = 0
    start = -1
    for pos, char in enumerate(pattern):
        if char == "{":
            if depth == 0:
                start = pos
            depth += 1
        elif char == "}" and depth:
            depth -= 1
            if depth == 0:
                return start, pos
    return None


def _split_alternatives(body: str) -> list[str]:
    parts, depth, current = [], 0, []
    for char in body:
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        depth += char == "{"
        depth -= char == "}" and depth > 0
        current.append(char)
    parts.append("".join(current))
    return parts


def _range(body: str) -> list[str] | None:
    """``{lo..hi}`` / ``{lo..hi..step}`` (integers, zero-padded like braceexpand) or
    ``{a..e}`` (single characters); ``None`` if ``body`` is not a range."""
    match = _RANGE.match(body)
    if match is None:
        chars = re.match(r"^([A-Za-z])\.\.([A-Za-z])$", body)
        if chars is None:
            return None
        lo, hi = ord(chars.group(1)), ord(chars.group(2))
        direction = 1 if hi >= lo else -1
        return [chr(c) for c in range(lo, hi + direction, direction)]
    first, last, step = match.group(1), match.group(2), int(match.group(3) or 1)
    lo, hi = int(first), int(last)
    padded = any(s.startswith(("0", "-0")) for s in (first, last) if s not in ("0", "-0"))
    width = max(len(first), len(last)) if padded else 0
    direction = 1 if hi >= lo else -1
    return [str(n).zfill(width) for n in range(lo, hi + direction, direction * max(step, 1))]


def braceexpand(pattern: str) -> list[str]:
    """Expand brace groups like the ``braceexpand`` package that WebDataset uses.

    ``"a{0..2}b"`` gives ``a0b a1b a2b``; ``"{00..10}"`` keeps the zero padding;
    ``"x{a,b{1,2}}"`` gives ``xa xb1 xb2``. A group that is neither a range nor
    has a comma is kept literally (``"{x}"``).
    """
    group = _top_level_group(pattern)
    if group is None:
        return [pattern]
    start, end = group
    head, body, tail = pattern[:start], pattern[start + 1:end], pattern[end + 1:]
    choices = _range(body)
    if choices is None:
        alternatives = _split_alternatives(body)
        if len(alternatives) == 1:  # not a group: literal braces, expand what follows
            return [head + "{" + body + "}" + rest for rest in braceexpand(tail)]
        choices = [item for alt in alternatives for item in braceexpand(alt)]
    return [head + choice + rest for choice in choices for rest in braceexpand(tail)]


def _glob_one(pattern: str) -> list[str]:
    if is_remote(pattern):
        from .remote import glob_remote

        return glob_remote(pattern)
    path = pattern[len("file://"):] if pattern.startswith("file://") else pattern
    return sorted(_glob.glob(os.path.expanduser(path)))


def expand_urls(urls: UrlsArg) -> list[str]:
    """The ordered list of files that ``urls`` names.

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
            raise TypeError(f"urls must be a str or a list of str, got bytes {text!r}")
        out: list[str] = []
        for pattern in text.split("::"):
            for item in braceexpand(pattern):
                if _GLOB_CHARS.search(item):
                    matched = _glob_one(item)
                    if not matched:
                        raise ValueError(f"the glob {item!r} matches no file")
                    out.extend(matched)
                else:
                    out.append(item)
    elif isinstance(urls, Iterable) and not isinstance(urls, (bytes, dict)):
        out = []
        for item in urls:
            if not isinstance(item, (str, os.PathLike)):
                raise TypeError(f"urls must hold str or os.PathLike items, got {type(item).__name__}: {item!r}")
            out.append(os.fspath(item))
    else:
        raise TypeError(f"urls must be a str, an os.PathLike or a list of them, got {type(urls).__name__}")
    if not out or any(not item for item in out):
        raise ValueError(f"urls names no file: {urls!r}")
    return out
