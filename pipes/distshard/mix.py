"""``distshard.mix``: interleave sources by weight, exactly, as one global stream
that is the same at any world size and worker count.

Which source each position comes from is decided by :mod:`distshard.schedule`
(from the weights alone, never the data): in every prefix each source's count is
within 1 of its exact share. ``.dist_shard()`` after ``mix`` shards that stream
like any other. When every source has random access (a positional container, a
``distshard`` file source, with only 1:1 ``.map()`` above), the mix has random
access too: a slot reads exactly its own positions, so each element of each
source is read once over the cluster, and ``shuffle=True``, resume and elastic
resume work as for any random-access source. Otherwise the mix is a stream that
every slot walks (exact, but every slot reads every source).
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Mapping
from typing import Any, Callable, Iterator

from torch.utils.data.datapipes.datapipe import IterDataPipe

from .graph import plan_pushdown, random_pipes
from .plan import mix_seed
from .readers import SequenceReader
from .schedule import Schedule

__all__ = ["MixIterDataPipe", "mix"]

STOPS = ("first_exhausted", "all_exhausted")
_END = object()


def _check_weights(names: list[str], weights: object) -> list[float]:
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a mapping name -> positive number, got {type(weights).__name__}")
    extra = [name for name in weights if name not in names]
    if extra:
        raise ValueError(f"weights name {extra[0]!r}, which is not a source; sources are {names}")
    out = []
    for name in names:
        if name not in weights:
            raise ValueError(f"source {name!r} has no weight; give every source a positive weight")
        weight = weights[name]
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise TypeError(f"the weight of source {name!r} is {weight!r}, not a number")
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"the weight of source {name!r} is {weight!r}; weights must be positive and "
                             "finite (drop a source instead of giving it weight 0)")
        out.append(weight)
    return out


class MixIterDataPipe(IterDataPipe):
    r"""Sources interleaved by weight (see :func:`distshard.mix`)."""

    def __init__(self, sources: Mapping[str, IterDataPipe], weights: Mapping[str, float], *,
                 seed: int | None = None, stop: str = "all_exhausted", samples: int | None = None) -> None:
        if not isinstance(sources, Mapping) or not sources:
            raise ValueError("sources must be a non-empty mapping name -> IterDataPipe, e.g. "
                             "{'web': web, 'code': code}")
        self.names = [str(name) for name in sources]
        for name, source in sources.items():
            if not isinstance(source, IterDataPipe):
                raise TypeError(f"source {name!r} is a {type(source).__name__}, not an IterDataPipe; wrap it "
                                "with IterableWrapper")
        self.sources = list(sources.values())
        self.weights = _check_weights(self.names, weights)
        if stop not in STOPS:
            raise ValueError(f"stop={stop!r} is not one of {STOPS}")
        if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 0):
            raise ValueError(f"samples={samples!r} must be None or a non-negative int (the epoch's length)")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed={seed!r} must be None or a non-negative int")
        self.stop, self.samples, self.seed = stop, samples, seed
        self.schedule = Schedule(self.weights)
        self._epoch = 0
        self._received: int | None = None  # the seed torch or dist_shard hands to random pipes

    # -- randomness: the sources' own random pipes are re-seeded every pass --------
    def set_seed(self, seed: int) -> "MixIterDataPipe":
        """Called by ``dist_shard`` (or torch's DataLoader) with a seed that is the
        same on every slot; each pass of each source is seeded from it."""
        self._received = int(seed)
        return self

    def set_epoch(self, epoch: int) -> "MixIterDataPipe":
        self._epoch = int(epoch)
        return self

    def pass_seed(self, source: int, pass_: int, index: int) -> int:
        """The seed of a source's ``index``-th random pipe in its pass ``pass_``."""
        return mix_seed(self.seed or 0, self._received or 0, self._epoch, source, pass_, index)

    def _seed_pass(self, source: int, pass_: int) -> None:
        for index, pipe in enumerate(random_pipes(self.sources[source])):
            pipe.set_seed(self.pass_seed(source, pass_, index))

    # -- lengths -----------------------------------------------------------------
    def length_for(self, counts: list[int]) -> int:
        """The mixed stream's length when source ``i`` holds ``counts[i]`` elements."""
        schedule = self.schedule
        empty = [self.names[i] for i, n in enumerate(counts) if n == 0]
        if self.samples is not None:
            for i, n in enumerate(counts):
                if n == 0 and self.samples > schedule.position_of(i, 0):
                    raise ValueError(f"source {self.names[i]!r} is empty but the mix needs its elements")
            return self.samples
        if self.stop == "first_exhausted":
            # a pick never comes before its window opens: skip sources that cannot end it first
            total, weights = schedule.period, schedule.weights
            opens = sorted(range(len(counts)), key=lambda i: counts[i] * total // weights[i])
            end: int | None = None
            for i in opens:
                if end is not None and counts[i] * total // weights[i] >= end:
                    break
                found = schedule.position_of(i, counts[i])
                end = found if end is None else min(end, found)
            assert end is not None
            return end
        if empty:
            raise ValueError(f"source {empty[0]!r} is empty: stop='all_exhausted' would never see it whole; "
                             "drop it or use stop='first_exhausted'")
        return max(schedule.position_of(i, n - 1) for i, n in enumerate(counts)) + 1

    def __len__(self) -> int:
        if self.samples is not None:
            return self.samples
        return self.length_for([len(source) for source in self.sources])

    # -- random access -------------------------------------------------------------
    def __distshard_sequence__(self) -> "MixSequence | None":
        """A positional view of the mixed stream when every source has random
        access, else ``None`` (then the mix is a stream)."""
        readers = []
        for source in self.sources:
            plan = plan_pushdown(source, True)
            if plan.sequence is None:
                return None
            readers.append((SequenceReader(plan.sequence, plan.copy_elements), plan.apply if plan.maps else None))
        counts = [reader.length() for reader, _ in readers]
        return MixSequence(self, readers, self.length_for(counts))

    def describe(self) -> str:
        total = sum(self.weights)
        parts = ", ".join(f"{name} {100 * w / total:.3g}%" for name, w in zip(self.names, self.weights))
        how = "random access" if self.__distshard_sequence__() is not None else \
            "a stream (a source without random access: every slot reads every source)"
        end = f"samples={self.samples}" if self.samples is not None else f"stop={self.stop!r}"
        return f"mix of {len(self.names)} sources ({parts}), {end}, {how}"

    # -- iteration -----------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        sequence = self.__distshard_sequence__()
        if sequence is not None:
            for position in range(len(sequence)):
                yield sequence[position]
            return
        yield from self._stream()

    def _stream(self) -> Iterator[Any]:
        """The mixed stream over sources that are streams: each source is read one
        element ahead, so the stream ends exactly where the random-access length
        says (a source's pass is known complete when its last element is taken)."""
        n = len(self.sources)
        iterators: list[Iterator[Any] | None] = [None] * n
        ahead: list[Any] = [_END] * n
        passes = [0] * n
        whole = [False] * n  # the source's first pass is complete
        endless = self.samples is not None or self.stop == "all_exhausted"

        def open_pass(i: int) -> None:
            self._seed_pass(i, passes[i])
            iterators[i] = iter(self.sources[i])
            ahead[i] = next(iterators[i], _END)

        for position, (i, _) in enumerate(self.schedule.iterate()):
            if self.samples is not None and position >= self.samples:
                return
            if iterators[i] is None:
                open_pass(i)
            if ahead[i] is _END:  # this pass of source i is over
                if not endless:
                    return  # first_exhausted
                if not whole[i]:
                    raise ValueError(f"source {self.names[i]!r} is empty: the mix cannot take its elements")
                passes[i] += 1
                open_pass(i)
                if ahead[i] is _END:
                    raise ValueError(f"source {self.names[i]!r} yielded nothing in pass {passes[i]}")
            element, ahead[i] = ahead[i], next(iterators[i], _END)  # type: ignore[arg-type]
            yield element
            if ahead[i] is _END and not whole[i]:
                whole[i] = True
                if self.samples is None and self.stop == "all_exhausted" and all(whole):
                    return

    def __repr__(self) -> str:
        return f"MixIterDataPipe({', '.join(self.names)})"


class MixSequence:
    """The mixed stream with random access: position ``p`` is element ``k % n_i``
    of source ``i``, where ``(i, k)`` is the schedule's pick at ``p``."""

    distshard_blocks = False  # the mixed stream splits by position, like any stream

    def __init__(self, mix: MixIterDataPipe, readers: list[tuple[SequenceReader, Callable | None]],
                 length: int) -> None:
        self.names = mix.names
        self.schedule = mix.schedule
        self.readers = readers
        self.counts = [reader.length() for reader, _ in readers]
        self.length = length
        self._identity = (f"mix:{self.names}:{self.schedule.weights}:{mix.stop}:{mix.samples}:{length}:"
                          + ",".join(reader.identity() for reader, _ in readers))

    def __len__(self) -> int:
        return self.length

    def locate(self, position: int) -> tuple[int, int]:
        """``(source, index in that source)`` of a position."""
        source, k = self.schedule.source_at(position)
        return source, k % self.counts[source]

    def __getitem__(self, position: int) -> Any:
        if not 0 <= position < self.length:
            raise IndexError(f"position {position} is outside the mix of {self.length}")
        source, index = self.locate(position)
        reader, apply = self.readers[source]
        element = next(reader.read([index]))
        return apply(element) if apply is not None else element

    def distshard_identity(self) -> str:
        return self._identity

    def describe(self) -> str:
        return f"a mix of {', '.join(self.names)} ({self.length} positions)"

    def __deepcopy__(self, memo: dict) -> "MixSequence":
        return copy.copy(self)


def mix(sources: Mapping[str, IterDataPipe], weights: Mapping[str, float], *, seed: int | None = None,
        stop: str = "all_exhausted", samples: int | None = None) -> MixIterDataPipe:
    r"""Interleave ``sources`` by ``weights`` into one stream.

    The source of every position comes from a low-discrepancy schedule computed from
    the weights alone: in every prefix of the stream each source's count is within 1
    of its exact share (``p * w / sum(weights)``), so any window of consecutive
    positions (a global batch) is within 2 of its share, not the ~sqrt(n) of
    independent draws. The stream is the same at any world size and worker count;
    ``.dist_shard()`` after it shards it exactly, and reads each element of each
    source once when every source has random access.

    Args:
        sources: a mapping name -> IterDataPipe, in a fixed order.
        weights: a mapping name -> positive number (proportions; need not sum to 1).
        seed: base of the seeds of each source's own random pipes (``shuffle()``),
            re-drawn for every pass from ``(seed, epoch, pass)``.
        stop: ``"first_exhausted"`` ends when a source runs out;
            ``"all_exhausted"`` (default) cycles exhausted sources (a new pass, with
            a new order when the source shuffles) until every source was seen whole.
        samples: a fixed epoch length instead (sources cycle as needed).

    Example:
        >>> web, code = IterableWrapper(range(70)), IterableWrapper(range(100, 130))
        >>> dp = distshard.mix({"web": web, "code": code}, {"web": 0.7, "code": 0.3})
        >>> sharded = dp.dist_shard(even="drop")  # doctest: +SKIP
    """
    return MixIterDataPipe(sources, weights, seed=seed, stop=stop, samples=samples)
