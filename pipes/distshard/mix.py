"""``distshard.mix``: interleave sources by weight, exactly, as one global stream
that is the same at any world size and worker count.

Which source each position comes from is decided by :mod:`distshard.schedule`
(from the weights, phases and costs alone, never the data): in every prefix each
source's count (or cost) is within 1 (or the largest element cost) of its exact
share. ``.dist_shard()`` after ``mix`` shards that stream like any other. When
every source has random access (a positional container, a ``distshard`` file
source, with only 1:1 ``.map()`` above), the mix has random access too: a slot
reads exactly its own positions, so each element of each source is read once over
the cluster, and ``shuffle=True``, resume and elastic resume work as for any
random-access source. Otherwise the mix is a stream that every slot walks (exact,
but every slot reads every source).

Seeding, explicitly. A mix has no randomness of its own; its sources may (an
upstream ``shuffle()``, a ``weighted_sample``). Pass ``q`` of source ``i`` (its
``q``-th time through, ``stop="all_exhausted"`` or ``samples=``) seeds the
source's random pipes from ``mix_seed(seed, received, epoch, i, q, index)``
(:meth:`MixIterDataPipe.pass_seed`), where ``received`` is the last value given to
:meth:`MixIterDataPipe.set_seed` (``dist_shard`` hands over one per epoch, the
same on every slot) and ``epoch`` the mix's own ``set_epoch``. Streams seed a
pass when they open it; the random-access view seeds a source before reading an
element of a pass other than the one it last seeded, so both give the same
elements. The element at position ``p`` is therefore a pure function of ``(seed,
received, epoch, p)``: :meth:`MixSequence.element` reads it for any ``received``
(e.g. another epoch's) and leaves the mix as it was.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Mapping
from itertools import islice
from typing import Any, Callable, Iterable, Iterator, Sequence

from torch.utils.data.datapipes.datapipe import IterDataPipe
from torch.utils.data.datapipes.iter.callable import MapperIterDataPipe

from .digests import mix_seed
from .errors import OptionError, OptionTypeError, SourceDataError, UnsupportedError
from .graph import is_random_pipe, plan_pushdown, random_pipes
from .mix_arguments import (
    Phases,
    Weights,
    check_costs,
    check_int,
    check_keys,
    check_phases,
    cost_arithmetic,
    digest,
    source_length,
    source_names,
    stored_bytes,
)
from .protocol import has_sequence, reads_many, sequence_length_varies
from .readers import SequenceReader
from .readers.sequence import ElementCopier
from .schedule import CostSchedule, integer_weights, make_schedule

__all__ = ["MixIterDataPipe", "MixSequence", "mix"]

STOPS = ("first_exhausted", "all_exhausted")
_END = object()


class MixIterDataPipe(IterDataPipe):
    r"""Sources interleaved by weight (see :func:`distshard.mix`)."""

    def __init__(
        self,
        sources: Mapping[Any, IterDataPipe],
        weights: Weights | Phases,
        *,
        seed: int | None = None,
        stop: str = "all_exhausted",
        samples: int | None = None,
        cost: str | Mapping[Any, Sequence[float]] | None = None,
    ) -> None:
        if not isinstance(sources, Mapping):
            raise OptionTypeError(
                f"sources must be a mapping name -> IterDataPipe, e.g. {{'web': web, 'code': code}}, "
                f"got {type(sources).__name__}"
            )
        if not sources:
            raise OptionError(
                "sources must be a non-empty mapping name -> IterDataPipe, e.g. {'web': web, 'code': code}"
            )
        self.keys = list(sources)
        self.names = source_names(sources)
        for key, source in sources.items():
            if not isinstance(source, IterDataPipe):
                raise OptionTypeError(
                    f"source {key!r} is a {type(source).__name__}, not an IterDataPipe; wrap it with IterableWrapper"
                )
        self.sources = list(sources.values())
        self.phases = check_phases(self.keys, weights)
        self.weights = self.phases[0][1]  # the first phase's, in source order
        if not isinstance(stop, str) or stop not in STOPS:
            raise OptionError(f"stop={stop!r} is not one of {STOPS}")
        self.samples = check_int("samples", samples, optional=True)
        self.seed = check_int("seed", seed, optional=True)
        self.stop = stop
        self.cost_kind, self.costs = self._costs(cost)
        self.schedule = make_schedule(self.phases, self.costs)
        self.declared: list[int] | None = None  # elements per source, when costs declare them
        self.known_length: int | None = None
        if self.costs is not None:
            self.declared = [len(c) for c in self.costs]
            for key, source, n in zip(self.keys, self.sources, self.declared, strict=True):
                length = source_length(source)
                if length is not None and length != n:
                    raise OptionError(
                        f"the costs of source {key!r} have {n} entries but the source has {length} "
                        "elements; give one cost per element, aligned with its positions"
                    )
            self.known_length = self.length_for(self.declared)
            assert isinstance(self.schedule, CostSchedule)  # costs make a cost schedule
            self.schedule.extend(self.known_length)  # the whole schedule, once, here: workers inherit it
        self._identity = self._make_identity()
        self._epoch = 0
        self._received: int | None = None  # the seed torch or dist_shard hands to random pipes
        self._randoms: dict[int, list] = {}  # per process: each source's random pipes
        self._seeded: dict[int, tuple] = {}  # per process: (received, epoch, pass) each source was seeded for

    def _costs(self, cost: object) -> tuple[str | None, list[list] | None]:
        if cost is None:
            return None, None
        if isinstance(cost, str):
            if cost != "bytes":
                raise OptionError(
                    f"cost={cost!r}: give 'bytes' (distshard file sources) or a mapping source -> per-element costs"
                )
            return "bytes", [
                check_costs(key, stored_bytes(key, source)) for key, source in zip(self.keys, self.sources, strict=True)
            ]
        if not isinstance(cost, Mapping):
            raise OptionTypeError(
                f"cost must be None, 'bytes' or a mapping source -> per-element costs, got {type(cost).__name__}"
            )
        check_keys(self.keys, cost, "cost", "source {key!r} has no costs; give every source its per-element costs")
        return "given", [check_costs(key, cost[key]) for key in self.keys]

    def _make_identity(self) -> str:
        """What a checkpoint records of this mix (see ``readers.base``): names, seed,
        stop, samples, every phase's start and exact weights, every cost."""
        weights = [(start, integer_weights(w)) for start, w in self.phases]
        costs = "none" if self.costs is None else f"{self.cost_kind}{cost_arithmetic(self.costs)}:{digest(self.costs)}"
        return (
            f"mix names={','.join(self.names)} seed={self.seed or 0} stop={self.stop} samples={self.samples} "
            f"phases={len(self.phases)}:{digest([start for start, _ in self.phases])} "
            f"weights={digest(weights)} cost={costs}"
        )

    def distshard_identity(self) -> str:
        return self._identity

    # -- randomness: the sources' own random pipes are re-seeded every pass --------
    def set_seed(self, seed: int) -> "MixIterDataPipe":
        """Called by ``dist_shard`` (or torch's DataLoader) with a seed that is the
        same on every slot; each pass of each source is seeded from it."""
        self._received = int(seed)
        self._seeded = {}
        return self

    def set_epoch(self, epoch: int) -> "MixIterDataPipe":
        self._epoch = int(epoch)
        self._seeded = {}
        return self

    def pass_seed(self, source: int, pass_: int, index: int) -> int:
        """The seed of a source's ``index``-th random pipe in its pass ``pass_``."""
        return mix_seed(self.seed or 0, self._received or 0, self._epoch, source, pass_, index)

    def _seed_pass(self, source: int, pass_: int) -> None:
        pipes = self._randoms.get(source)
        if pipes is None:
            pipes = self._randoms[source] = random_pipes(self.sources[source])
        for index, pipe in enumerate(pipes):
            pipe.set_seed(self.pass_seed(source, pass_, index))
        self._seeded[source] = (self._received, self._epoch, pass_)

    def seed_pass(self, source: int, pass_: int) -> None:
        """Seed ``source``'s random pipes for pass ``pass_`` unless they are already."""
        if self._seeded.get(source) != (self._received, self._epoch, pass_):
            self._seed_pass(source, pass_)

    # -- lengths -----------------------------------------------------------------
    def length_for(self, counts: list[int]) -> int:
        """The mixed stream's length when source ``i`` holds ``counts[i]`` elements."""
        schedule = self.schedule
        if self.samples is not None:
            for i, n in enumerate(counts):
                first = schedule.position_of(i, 0) if n == 0 else None
                if first is not None and first < self.samples:
                    raise SourceDataError(f"source {self.names[i]!r} is empty but the mix needs its elements")
            return self.samples
        if self.stop == "first_exhausted":
            end = schedule.first_reaching(counts)
            assert end is not None  # some source has weight in the last phase
            return end
        empty = [self.names[i] for i, n in enumerate(counts) if n == 0]
        if empty:
            raise OptionError(
                f"source {empty[0]!r} is empty: stop='all_exhausted' would never see it whole; "
                "drop it or use stop='first_exhausted'"
            )
        ends = []
        for i, n in enumerate(counts):
            last = schedule.position_of(i, n - 1)
            if last is None:
                raise OptionError(
                    f"source {self.names[i]!r} has weight 0 in the last phase and is not seen whole before it: "
                    "stop='all_exhausted' would never end; give it a weight in the last phase, or use samples= "
                    "or stop='first_exhausted'"
                )
            ends.append(last)
        return max(ends) + 1

    def __len__(self) -> int:
        if self.samples is not None:
            return self.samples
        if self.known_length is not None:
            return self.known_length
        return self.length_for([len(source) for source in self.sources])

    # -- random access -------------------------------------------------------------
    def __distshard_sequence__(self) -> "MixSequence | None":
        """A positional view of the mixed stream when every source has random
        access, else ``None`` (then the mix is a stream)."""
        plans = []
        for key, source in zip(self.keys, self.sources, strict=True):
            plan = plan_pushdown(source, True)
            if plan.sequence is None:
                return None
            if sequence_length_varies(plan.sequence):  # each pass of it would hold another number of elements
                raise UnsupportedError(
                    f"source {key!r} changes its length from epoch to epoch ({type(plan.sequence).__name__}), and "
                    "the mix reads a source's passes at positions made from its length: give it a source of fixed "
                    "length (pack(fit='best') with shuffle_documents=False)"
                )
            plans.append(plan)
        counts = [len(plan.sequence) for plan in plans]
        if self.declared is not None and counts != self.declared:  # pragma: no cover - checked at construction
            raise SourceDataError(f"the sources hold {counts} elements, their costs {self.declared}")
        length = self.known_length if self.known_length is not None else self.length_for(counts)
        return MixSequence(self, plans, length)

    def describe(self) -> str:
        def shares(weights: list[float]) -> str:
            total = sum(weights)
            return ", ".join(f"{name} {100 * w / total:.3g}%" for name, w in zip(self.names, weights, strict=True))

        if len(self.phases) == 1:
            mixture = f"({shares(self.weights)})"
        else:
            mixture = "in phases: " + "; ".join(f"from {start}: {shares(w)}" for start, w in self.phases)
        if self.costs is not None:
            what = "stored bytes" if self.cost_kind == "bytes" else "the given costs"
            mixture += f", weights as shares of {what} (every prefix within the largest element cost)"
        how = (
            "random access"
            if self.__distshard_sequence__() is not None
            else "a stream (a source without random access: every slot reads every source)"
        )
        end = f"samples={self.samples}" if self.samples is not None else f"stop={self.stop!r}"
        return f"mix of {len(self.names)} sources {mixture}, {end}, {how}"

    # -- iteration -----------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        sequence = self.__distshard_sequence__()
        if sequence is not None:
            for position in range(len(sequence)):
                yield sequence[position]
            return
        if self.declared is not None:
            yield from self._declared_stream()
        else:
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
        last_start, last_weights = self.phases[-1]
        paused = [i for i, w in enumerate(last_weights) if not w]  # never picked again in the last phase

        def open_pass(i: int) -> None:
            self._seed_pass(i, passes[i])
            iterators[i] = it = iter(self.sources[i])
            ahead[i] = next(it, _END)

        for position, (i, _) in enumerate(self.schedule.iterate()):
            if self.samples is not None and position >= self.samples:
                return
            if position == last_start and self.samples is None and self.stop == "all_exhausted":
                for j in paused:
                    if not whole[j]:  # as length_for says for random access
                        raise OptionError(
                            f"source {self.names[j]!r} has weight 0 in the last phase and is not seen whole before "
                            "it: stop='all_exhausted' would never end; give it a weight in the last phase, or use "
                            "samples= or stop='first_exhausted'"
                        )
            if iterators[i] is None:
                open_pass(i)
            if ahead[i] is _END:  # this pass of source i is over
                if not endless:
                    return  # first_exhausted
                if not whole[i]:
                    raise SourceDataError(f"source {self.names[i]!r} is empty: the mix cannot take its elements")
                passes[i] += 1
                open_pass(i)
                if ahead[i] is _END:
                    raise SourceDataError(f"source {self.names[i]!r} yielded nothing in pass {passes[i]}")
            element, ahead[i] = ahead[i], next(iterators[i], _END)  # type: ignore[arg-type]
            yield element
            if ahead[i] is _END and not whole[i]:
                whole[i] = True
                if self.samples is None and self.stop == "all_exhausted" and all(whole):
                    return

    def _declared_stream(self) -> Iterator[Any]:
        """The mixed stream when costs declare every source's count (and so the
        length): pick ``k`` of source ``i`` is element ``k % n_i`` of pass ``k // n_i``;
        a source that yields more or fewer elements than it has costs raises."""
        declared, length = self.declared, self.known_length
        assert declared is not None and length is not None
        iterators: list[Iterator[Any] | None] = [None] * len(self.sources)
        for i, k in islice(self.schedule.iterate(), length):
            pass_, index = divmod(k, declared[i])
            if index == 0:
                self._seed_pass(i, pass_)
                iterators[i] = iter(self.sources[i])
            element = next(iterators[i], _END)  # type: ignore[arg-type]
            if element is _END:
                raise SourceDataError(
                    f"source {self.names[i]!r} yielded {index} elements in pass {pass_}, but its "
                    f"costs declare {declared[i]}; give one cost per element"
                )
            if index == declared[i] - 1 and next(iterators[i], _END) is not _END:  # type: ignore[arg-type]
                raise SourceDataError(
                    f"source {self.names[i]!r} yielded more than the {declared[i]} elements its "
                    "costs declare; give one cost per element"
                )
            yield element

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_randoms"], state["_seeded"] = {}, {}  # per process
        if IterDataPipe.getstate_hook is not None:
            return IterDataPipe.getstate_hook(state)
        return state

    def __repr__(self) -> str:
        return f"MixIterDataPipe({', '.join(self.names)})"


def _composed(plan: Any) -> Callable | None:
    """The 1:1 maps above a source as one function (``None``: no map): a map's
    own function when it takes and returns whole elements (what its ``_apply_fn``
    then calls), so an element costs no call of torch's per-column logic."""
    if not plan.maps:
        return None
    if len(plan.maps) == 1:
        mapper = plan.maps[0]
        if (
            type(mapper)._apply_fn is MapperIterDataPipe._apply_fn
            and mapper.input_col is None
            and mapper.output_col is None
        ):
            return mapper.fn
    return plan.apply


def _has_random_pipes(source: IterDataPipe, plan: Any) -> bool:
    """Whether a random-access source has random pipes of its own (to seed per
    pass). Only a base with a ``__distshard_sequence__`` of its own (a mix, a
    ``weighted_sample``) or a random map can: an ``IterableWrapper`` over a list has
    none, and walking its graph would pickle the list."""
    if not any(is_random_pipe(pipe) for pipe in plan.maps) and not has_sequence(type(plan.base)):
        return False
    return bool(random_pipes(source))


class MixSequence:
    """The mixed stream with random access: position ``p`` is element ``k % n_i``
    of source ``i``, in its pass ``k // n_i``, where ``(i, k)`` is the schedule's
    pick at ``p``. A source with random pipes of its own (a ``weighted_sample``) is
    seeded for that pass first (see the module doc), as the stream would be."""

    distshard_blocks = False  # the mixed stream splits by position, like any stream

    def __init__(self, mix: MixIterDataPipe, plans: list, length: int) -> None:
        self.mix = mix
        self.names = mix.names
        self.schedule = mix.schedule
        self.sequences = [plan.sequence for plan in plans]
        self.counts = [len(sequence) for sequence in self.sequences]
        self.copiers = [ElementCopier() if plan.copy_elements else None for plan in plans]
        self.maps: list[Callable | None] = [_composed(plan) for plan in plans]
        self.random = [_has_random_pipes(source, plan) for source, plan in zip(mix.sources, plans, strict=True)]
        # sources that read many positions at once (distshard's file sources: read ahead
        # in large ranges, a round trip per range instead of per element on object storage)
        self.many = [
            not random and reads_many(sequence) for sequence, random in zip(self.sequences, self.random, strict=True)
        ]
        self.length = length
        self._identity = f"{mix.distshard_identity()} length={length} sources=" + ",".join(
            SequenceReader(s).identity() for s in self.sequences
        )

    def __len__(self) -> int:
        return self.length

    def locate(self, position: int) -> tuple[int, int]:
        """``(source, index in that source)`` of a position."""
        source, k = self.schedule.source_at(position)
        return source, k % self.counts[source]

    def __getitem__(self, position: int) -> Any:
        return next(self._read_each((position,)))

    def distshard_read(self, positions: Iterable[int], shuffled: bool = False) -> Iterator[Any]:
        """The elements at ``positions``, in order (``SequenceReader`` reads through it:
        one generator for a slot's whole share, not a call per element). A source that
        reads many positions at once (a file source) is handed, through one reader of
        its own, the indices of its picks among ``positions``, in order: its read-ahead
        fetches them in large ranges. ``shuffled`` goes to those readers."""
        if any(self.many):
            return self._read_by_source(iter(positions), shuffled)
        return self._read_each(positions)

    def _position(self, position: int) -> tuple[int, int, int]:
        """``(source, pass, index in the source)`` of a position."""
        if not 0 <= position < self.length:
            raise IndexError(f"position {position} is outside the mix of {self.length}")
        source, k = self.schedule.source_at(position)
        pass_, index = divmod(k, self.counts[source])
        return source, pass_, index

    def _finish(self, source: int, element: Any) -> Any:
        copier = self.copiers[source]
        if copier is not None:
            element = copier(element)
        apply = self.maps[source]
        return apply(element) if apply is not None else element

    def _read_by_source(self, positions: Iterator[int], shuffled: bool) -> Iterator[Any]:
        """Positions are taken from ``positions`` as the readers need them: the picks
        not yet yielded wait in ``pending`` (in position order), and each reading
        source's indices in its own queue, which its reader drains (reading ahead
        takes positions early; the others' picks then wait as three integers)."""
        many, sequences, mix = self.many, self.sequences, self.mix
        pending: deque[tuple[int, int, int]] = deque()
        queues: list[deque[int]] = [deque() for _ in sequences]

        def take() -> bool:
            position = next(positions, None)
            if position is None:
                return False
            pick = self._position(position)
            pending.append(pick)
            if many[pick[0]]:
                queues[pick[0]].append(pick[2])
            return True

        def indices(source: int) -> Iterator[int]:
            queue = queues[source]
            while queue or take():
                if queue:
                    yield queue.popleft()

        readers: list[Iterator[Any] | None] = [None] * len(sequences)
        try:
            while pending or take():
                source, pass_, index = pending.popleft()
                if many[source]:
                    reader = readers[source]
                    if reader is None:
                        reader = readers[source] = iter(sequences[source].distshard_read(indices(source), shuffled))
                    element = next(reader)
                else:
                    if self.random[source]:
                        mix.seed_pass(source, pass_)
                    element = sequences[source][index]
                yield self._finish(source, element)
        finally:
            for reader in readers:
                close = getattr(reader, "close", None)
                if close is not None:
                    close()

    def _read_each(self, positions: Iterable[int]) -> Iterator[Any]:
        # _position and _finish inlined: this loop is the mixing CPU (bench_mix), a call an element counts
        length, source_at, mix = self.length, self.schedule.source_at, self.mix
        counts, sequences, copiers, maps, random = self.counts, self.sequences, self.copiers, self.maps, self.random
        for position in positions:
            if not 0 <= position < length:
                raise IndexError(f"position {position} is outside the mix of {length}")
            source, k = source_at(position)
            pass_, index = divmod(k, counts[source])
            if random[source]:
                mix.seed_pass(source, pass_)
            element = sequences[source][index]
            copier = copiers[source]
            if copier is not None:
                element = copier(element)
            apply = maps[source]
            yield apply(element) if apply is not None else element

    def element(self, position: int, received: int | None) -> Any:
        """The element at ``position`` when the mix was handed ``received`` by
        ``set_seed`` (``dist_shard`` hands one per epoch), whatever it holds now; the
        mix is left as it was."""
        mix = self.mix
        saved = mix._received
        mix._received = received
        try:
            return self[position]
        finally:
            mix._received = saved

    def distshard_identity(self) -> str:
        return self._identity

    def describe(self) -> str:
        return f"a mix of {', '.join(self.names)} ({self.length} positions)"

    def __deepcopy__(self, memo: dict) -> "MixSequence":
        return copy.copy(self)


def mix(
    sources: Mapping[Any, IterDataPipe],
    weights: Weights | Phases,
    *,
    seed: int | None = None,
    stop: str = "all_exhausted",
    samples: int | None = None,
    cost: str | Mapping[Any, Sequence[float]] | None = None,
) -> MixIterDataPipe:
    r"""Interleave ``sources`` by ``weights`` into one stream.

    The source of every position comes from a low-discrepancy schedule computed from
    the weights alone: in every prefix of the stream each source's count is within 1
    of its exact share (``p * w / sum(weights)``), so any window of consecutive
    positions (a global batch) is within 2 of its share, not the ~sqrt(n) of
    independent draws. The stream is the same at any world size and worker count;
    ``.dist_shard()`` after it shards it exactly, and reads each element of each
    source once when every source has random access.

    Args:
        sources: a mapping name -> IterDataPipe, in a fixed order (names may be any
            hashable keys that print differently; weights and costs use the same keys).
        weights: a mapping name -> positive number (proportions; need not sum to 1),
            or phases ``[(0, w0), (start1, w1), ...]``: positions from ``start_k`` on
            follow ``w_k`` (a curriculum, an annealing mix), every prefix of a phase
            counted from its start within 1 of the phase's shares, every source going
            on where it stopped. In phases a weight may be 0 (the source pauses).
        seed: base of the seeds of each source's own random pipes (``shuffle()``),
            re-drawn for every pass from ``(seed, epoch, pass)``.
        stop: ``"first_exhausted"`` ends when a source runs out;
            ``"all_exhausted"`` (default) cycles exhausted sources (a new pass, with
            a new order when the source shuffles) until every source was seen whole.
        samples: a fixed epoch length instead (sources cycle as needed).
        cost: make the weights shares of *cost* instead of counts: a mapping
            name -> per-element costs aligned with the source's positions (token
            counts), or ``"bytes"`` for distshard file sources (each sample's stored
            bytes, from their index). In every prefix each source's cost is within
            the largest element cost of its share of the prefix's cost. The schedule
            is computed here, once, from the costs alone.

    Example:
        >>> web, code = IterableWrapper(range(70)), IterableWrapper(range(100, 130))
        >>> dp = distshard.mix({"web": web, "code": code}, {"web": 0.7, "code": 0.3})
        >>> sharded = dp.dist_shard(even="drop")  # doctest: +SKIP
        >>> annealed = distshard.mix({"web": web, "code": code},
        ...                          [(0, {"web": 0.9, "code": 0.1}), (50, {"web": 0.5, "code": 0.5})])
    """
    return MixIterDataPipe(sources, weights, seed=seed, stop=stop, samples=samples, cost=cost)
