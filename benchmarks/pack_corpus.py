"""bench_pack's corpora: document lengths (log-uniform or web-text-like), the token
file written once per run, and the source every distshard row reads it through (the
documents by position, their lengths known without reading them)."""

from __future__ import annotations

import os
from typing import Any, Iterator

from torch.utils.data.datapipes.datapipe import IterDataPipe

SEQ_LEN = 1024


# -- the corpus ----------------------------------------------------------------------------------
def corpus_lengths(kind: str, docs: int, seed: int = 0) -> Any:
    """Document lengths: log-uniform 20–8,000 (``uniform``) or web-text-like (``web``)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return np.exp(rng.uniform(np.log(20), np.log(8000), docs)).astype(np.int64)
    body = rng.lognormal(np.log(400), 1.0, docs)
    tail = 2000 * (1 - rng.random(docs)) ** (-1 / 1.1)
    return np.clip(np.where(rng.random(docs) < 0.03, tail, body), 16, 100_000).astype(np.int64)


def make_corpus(root: str, docs: int, seed: int = 0, kind: str = "uniform") -> dict[str, Any]:
    import numpy as np

    lengths = corpus_lengths(kind, docs, seed)
    total = int(lengths.sum())
    os.makedirs(root, exist_ok=True)
    np.arange(total, dtype=np.int32).tofile(os.path.join(root, "tokens.bin"))
    np.save(os.path.join(root, "lengths.npy"), lengths)
    return {"docs": docs, "tokens": total, "kind": kind, "median": float(np.median(lengths)),
            "longest": int(lengths.max()), "longer_than_L": int((lengths > SEQ_LEN).sum())}


class _Documents:
    """Document ``i`` as a view of the memory-mapped tokens (opened once per process)."""

    __distshard_positional__ = True

    def __init__(self, root: str, offsets: Any) -> None:
        self.root, self.offsets, self._map = root, offsets, None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> Any:
        import numpy as np

        if self._map is None:
            self._map = np.memmap(os.path.join(self.root, "tokens.bin"), dtype=np.int32, mode="r")
        return self._map[self.offsets[i] : self.offsets[i + 1]]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_map": None}


class CorpusDocuments(IterDataPipe):
    """The corpus's documents read in place, by position, with their lengths known
    without reading them (as ``distshard.tokens`` does from Megatron's ``.idx``)."""

    def __init__(self, root: str) -> None:
        import numpy as np

        self.lengths = np.load(os.path.join(root, "lengths.npy"))
        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=offsets[1:])
        self.documents = _Documents(root, offsets)

    def distshard_token_counts(self) -> Any:
        return self.lengths

    def __distshard_sequence__(self) -> _Documents:
        return self.documents

    def __len__(self) -> int:
        return len(self.documents)

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self.documents)):
            yield self.documents[i]
