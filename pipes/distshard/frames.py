"""The one walker of the call stack: how distshard finds what drives a pipe (a
DataLoader creating its iterator, a graph walk of torch's, a framework's wrapper, a
``.batch()`` asking ``len()``) without importing any framework. Every module that
reads the stack goes through :func:`above`; none calls ``sys._getframe`` itself.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Iterator

__all__ = ["above"]


def above(levels: int, depth: int | None = None) -> Iterator[FrameType]:
    """The frames of the stack from ``levels`` above the function that iterates this
    (1: its caller, 2: its caller's caller), at most ``depth`` of them (``None``: to
    the bottom of the stack). Iterate it in that function itself, in a ``for`` loop
    (a generator expression or another generator in between is a frame more)."""
    # this generator's own frame is 0 and the function that iterates it is 1 (the
    # frame that resumed it); a generator's frame keeps no f_back between resumptions,
    # so the first frame is taken when iteration starts and the walk follows f_back
    frame: FrameType | None = sys._getframe(levels + 1)
    while frame is not None and (depth is None or depth > 0):
        yield frame
        frame = frame.f_back
        depth = None if depth is None else depth - 1
