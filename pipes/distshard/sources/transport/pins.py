"""What names an ``hf://`` file whatever commit its URL was pinned to (see :mod:`.hub`).

A leaf: :mod:`.urls` pins a repository's URLs through :mod:`.hub`, and both the hub client and
the file identities (:mod:`.files`) take the pin off again for caches and stored indexes.
"""

from __future__ import annotations

import re

__all__ = ["unpinned"]

_PINNED = re.compile(r"^(hf://(?:datasets/|spaces/|kernels/|models/)?[^/@]+/[^/@]+)@[0-9a-f]{40}(?=/|$)", re.I)


def unpinned(url: str) -> str:
    """``url`` without the commit an ``hf://`` URL was pinned to when its source was
    built (see :mod:`.hub`): what names the file in caches and stored indexes."""
    return _PINNED.sub(r"\1", url) if url[:5].lower() == "hf://" else url
