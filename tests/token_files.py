"""A tiny writer of Megatron-LM indexed datasets (``MMIDIDX`` version 1), written
here from the format's specification (Megatron-LM's ``_IndexWriter``), not taken
from the library: the tests read with ``distshard.tokens`` what this wrote.

``.idx``: ``b"MMIDIDX\\x00\\x00"``, ``<Q`` version 1, ``<B`` dtype code, ``<Q``
sequence count, ``<Q`` document index count, the ``<i4`` lengths, the ``<i8``
byte pointers (cumulative), the ``<i8`` document indices, and for multimodal
datasets one ``i1`` mode per sequence. ``.bin``: the sequences back to back.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Sequence

import numpy as np

CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}
DTYPES = list(CODES)


def sequences_for(count: int, dtype: str, seed: int = 0) -> list[np.ndarray]:
    """``count`` sequences of 0 to 9 tokens of ``dtype`` (some empty), each
    distinct: sequence ``i`` starts with ``i % 100`` then ``i // 100`` (for ``i``
    from 1; sequence 0 is empty)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        if i == 0:
            out.append(np.zeros(0, dtype))
            continue
        tail = rng.integers(0, 100, size=int(rng.integers(0, 8)))
        out.append(np.array([i % 100, i // 100, *tail], dtype=dtype))
    return out


def write_indexed(
    prefix: str | Path,
    sequences: Sequence[np.ndarray],
    dtype: str,
    documents: Sequence[int] | None = None,
    modes: Sequence[int] | None = None,
) -> tuple[str, str]:
    """Write ``prefix.bin`` and ``prefix.idx``; ``documents`` defaults to one
    document per sequence (``0 .. n``). Returns the two paths."""
    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    little = np.dtype(dtype).newbyteorder("<")
    lengths, pointers, at = [], [], 0
    with open(prefix + ".bin", "wb") as out:
        for sequence in sequences:
            data = np.asarray(sequence, dtype=little).tobytes()
            out.write(data)
            lengths.append(len(sequence))
            pointers.append(at)
            at += len(data)
    if documents is None:
        documents = list(range(len(sequences) + 1))
    with open(prefix + ".idx", "wb") as out:
        out.write(b"MMIDIDX\x00\x00")
        out.write(struct.pack("<Q", 1))
        out.write(struct.pack("<B", CODES[dtype]))
        out.write(struct.pack("<Q", len(lengths)))
        out.write(struct.pack("<Q", len(documents)))
        out.write(np.array(lengths, "<i4").tobytes())
        out.write(np.array(pointers, "<i8").tobytes())
        out.write(np.array(documents, "<i8").tobytes())
        if modes is not None:
            out.write(np.array(modes, "i1").tobytes())
    return prefix + ".bin", prefix + ".idx"


def as_tuple(sequence: np.ndarray) -> tuple:
    """A sequence as a comparable value (its dtype and tokens)."""
    return (str(np.asarray(sequence).dtype), *np.asarray(sequence).tolist())
