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
import math
import numbers
import reprlib
from collections import deque
from collections.abc import Mapping
from itertools import islice
from typing import Any, Callable, Iterable, Iterator, Sequence

from torch.utils.data.datapipes.datapipe import IterDataPipe
from torch.utils.data.datapipes.iter.callable import MapperIterDataPipe

from .digests import blake2b_hex, mix_seed
from .errors import OptionError, OptionTypeError, SourceDataError, UnsupportedError
from .graph import is_random_pipe, plan_pushdown, random_pipes
from .protocol import has_sequence, reads_many, sequence_length_varies
from .readers import SequenceReader
from .readers.sequence import ElementCopier
from .schedule import CostSchedule, integer_weights, make_schedule

__all__ = ["MixIterDataPipe", "MixSequence", "mix"]

STOPS = ("first_exhausted", "all_exhausted")
_END = object()

Weights = Mapping[Any, float]
Phases = Sequence[tuple[int, Weights]]


def digest(*values: Any) -> str:
    """A 16-hex-digit digest of the whole ``repr`` of values (every item, unlike
    ``readers.stable_digest``'s sample): for weights and costs in identities."""
    return blake2b_hex(repr(values).encode(), 8)


def _check_int(name: str, value: object, *, optional: bool) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionTypeError(
            f"{name}={value!r} must be {'None or ' if optional else ''}an int (got {type(value).__name__})"
        )
    if value < 0:
        raise OptionError(f"{name}={value} must be non-negative")
    return value


def _names(sources: Mapping) -> list[str]:
    names = [str(key) for key in sources]
    seen: dict[str, Any] = {}
    for key, name in zip(sources, names, strict=True):
        if name in seen:
            raise OptionError(
                f"sources {seen[name]!r} and {key!r} have the same name {name!r}; give the sources "
                "keys that print differently"
            )
        seen[name] = key
    return names


def _check_keys(keys: list, given: Mapping, what: str, missing: str) -> None:
    """Every key of ``given`` is a source key and every source has one."""
    extra = [key for key in given if key not in keys]
    if extra:
        hint = ""
        if any(str(key) == str(e) for key in keys for e in extra):
            hint = " (the keys must be the sources' own keys, of the same type)"
        raise OptionError(f"{what} name {extra[0]!r}, which is not a source; sources are {keys}{hint}")
    absent = [key for key in keys if key not in given]
    if absent:
        raise OptionError(missing.format(key=absent[0]))


def _check_weights(keys: list, weights: object, where: str, zero_ok: bool) -> list[float]:
    """One phase's weights, in source order."""
    if not isinstance(weights, Mapping):
        raise OptionTypeError(f"{where}weights must be a mapping source -> weight, got {type(weights).__name__}")
    _check_keys(keys, weights, f"{where}weights", f"{where}source {{key!r}} has no weight; give every source a weight")
    out = []
    for key in keys:
        weight = weights[key]
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise OptionTypeError(f"{where}the weight of source {key!r} is {weight!r}, not a number")
        if not math.isfinite(weight) or weight < 0 or (weight == 0 and not zero_ok):
            raise OptionError(
                f"{where}the weight of source {key!r} is {weight!r}; weights must be positive and "
                "finite (drop a source instead of giving it weight 0)"
            )
        out.append(float(weight) if not isinstance(weight, int) else weight)
    if not any(out):
        raise OptionError(f"{where}every weight is 0: give some source a positive weight")
    return out


_SHORT = reprlib.Repr()
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxset = _SHORT.maxdict = 8
_SHORT.maxstring, _SHORT.maxother = 60, 60
_USAGE = (
    "mix() takes weights as a mapping {source: weight} or as phases "
    "[(0, {source: weight}), (start, {source: weight}), ...]"
)
_TAKES = "but " + _USAGE


def _mapping(pairs: Iterable[tuple[Any, Any]]) -> str:
    """``{key: value, ...}`` as Python writes it, cut after 8 items."""
    items = list(pairs)
    shown = ", ".join(f"{key!r}: {value!r}" for key, value in items[:8])
    return "{" + shown + (", ...}" if len(items) > 8 else "}")


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _wrong_weights(keys: list, weights: object) -> TypeError | None:
    """The error for ``weights`` of a shape ``mix`` does not take (a list of numbers,
    a number, a set, (source, weight) pairs, mappings without starts, ...), naming
    what it takes and, where it can be told, the mapping that was meant; ``None`` for
    the shapes of phases, checked one by one."""
    what, meant = "", ""
    equal = f"; give each source its weight, e.g. weights={_mapping((key, 1) for key in keys)} for equal shares"
    tolist = getattr(weights, "tolist", None)  # numpy arrays, tensors
    values = tolist() if callable(tolist) and not isinstance(weights, (list, tuple)) else weights
    if _is_number(values):
        what, meant = "is a single number", equal
    elif isinstance(values, (list, tuple)) and values and all(_is_number(v) for v in values):
        kind = type(weights).__name__
        if len(values) == len(keys):
            what = f"is a {kind} of numbers"
            meant = f"; with the sources in their order that is weights={_mapping(zip(keys, values, strict=True))}"
        else:
            what, meant = f"is a {kind} of {len(values)} numbers for {len(keys)} sources", equal
    elif isinstance(weights, (set, frozenset)):
        what, meant = "is a set, which has no order to tell whose weight is whose", equal
    elif (
        isinstance(weights, (list, tuple))
        and weights
        and all(
            isinstance(pair, (list, tuple)) and len(pair) == 2 and not isinstance(pair[1], Mapping) and pair[0] in keys
            for pair in weights
        )
    ):
        what, meant = "is a list of (source, weight) pairs", f"; that is weights={_mapping(weights)}"
    elif isinstance(weights, (list, tuple)) and weights and all(isinstance(m, Mapping) for m in weights):
        what = "is a list of mappings without start positions"
        if len(weights) == 1:
            meant = f"; that is weights={_mapping(weights[0].items())}"
        else:
            first, second = (_mapping(m.items()) for m in weights[:2])
            meant = f"; e.g. weights=[(0, {first}), (1000, {second})] changes to the second at position 1000"
    elif isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        what, meant = f"is of type {type(weights).__name__}", equal
    else:
        return None
    return TypeError(f"weights={_SHORT.repr(weights)} {what}, {_TAKES}{meant}")


def _arithmetic(costs: list[list]) -> str:
    """How the schedule computes with these costs, for the identity: fractional float
    costs are scheduled in exact arithmetic since state format 3's schedules computed
    them in floats (a near-tie may break the other way), so a state saved then is
    refused, not resumed onto another schedule; integer costs schedule as they did."""
    fractional = any(isinstance(x, float) and not x.is_integer() for c in costs for x in c)
    return "/exact" if fractional else ""


def _check_phases(keys: list, weights: object) -> list[tuple[int, list[float]]]:
    """``weights`` (a mapping, or phases ``[(start, mapping), ...]``) as phases of
    weights in source order."""
    if isinstance(weights, Mapping):
        return [(0, _check_weights(keys, weights, "", zero_ok=False))]
    wrong = _wrong_weights(keys, weights)
    if wrong is not None:
        raise wrong
    assert isinstance(weights, Sequence)
    if not weights:
        raise OptionError("weights has no phase; give [(0, {source: weight, ...}), ...]")
    phases: list[tuple[int, list[float]]] = []
    for j, phase in enumerate(weights):
        if isinstance(phase, (str, bytes)) or not isinstance(phase, Sequence) or len(phase) != 2:
            raise OptionTypeError(
                f"phase {j} is {_SHORT.repr(phase)}; each phase is a pair (start position, {{source: weight}}): "
                + _USAGE
            )
        start, mapping = phase
        if isinstance(start, bool) or not isinstance(start, int):
            raise OptionTypeError(f"phase {j} starts at {start!r}, not an int position")
        if j == 0 and start != 0:
            raise OptionError(f"phase 0 starts at {start}; the first phase must start at position 0")
        if j and start <= phases[-1][0]:
            raise OptionError(
                f"phase {j} starts at {start}, not after phase {j - 1}'s start {phases[-1][0]}: starts must increase"
            )
        phases.append((start, _check_weights(keys, mapping, f"phase {j} (from position {start}): ", zero_ok=True)))
    for i, key in enumerate(keys):
        if not any(weights_[i] for _, weights_ in phases):
            raise OptionError(f"source {key!r} has weight 0 in every phase; drop it instead")
    return phases


def _is_sequence(value: object) -> bool:
    return hasattr(value, "__len__") and hasattr(value, "__getitem__") and not isinstance(value, (str, bytes, Mapping))


def _check_costs(key: Any, costs: object) -> list:
    if not _is_sequence(costs):
        raise OptionTypeError(
            f"the costs of source {key!r} are a {type(costs).__name__}; give a sequence of "
            "per-element costs aligned with the source's positions (e.g. token counts)"
        )
    out = []
    for index in range(len(costs)):  # type: ignore[arg-type]
        value = costs[index]  # type: ignore[index]
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise OptionTypeError(f"cost[{key!r}][{index}]={value!r} is not a number")
        value = int(value) if isinstance(value, numbers.Integral) else float(value)
        if not math.isfinite(value) or value < 0:
            raise OptionError(f"cost[{key!r}][{index}]={value!r}; costs must be finite and non-negative")
        out.append(value)
    if out and not any(out):
        raise OptionError(
            f"the costs of source {key!r} are all 0: it would take every position of its phases; "
            "give its elements their costs, or drop it"
        )
    return out


def _source_length(source: IterDataPipe) -> int | None:
    plan = plan_pushdown(source, True)
    if plan.sequence is not None:
        return len(plan.sequence)
    try:
        return len(source)
    except TypeError:
        return None


def _stored_bytes(key: Any, source: IterDataPipe) -> list[int]:
    sequence = plan_pushdown(source, True).sequence
    sample_bytes = getattr(sequence, "sample_bytes", None)
    if not callable(sample_bytes):
        raise UnsupportedError(
            f"cost='bytes' takes each sample's stored bytes from the index of a distshard file source "
            f"(webdataset, jsonl), but source {key!r} is a {type(source).__name__}"
            f"{'' if sequence is None else ' over ' + type(sequence).__name__}; pass "
            "cost={source: [per-element costs], ...} instead"
        )
    return list(sample_bytes())


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
        self.names = _names(sources)
        for key, source in sources.items():
            if not isinstance(source, IterDataPipe):
                raise OptionTypeError(
                    f"source {key!r} is a {type(source).__name__}, not an IterDataPipe; wrap it with IterableWrapper"
                )
        self.sources = list(sources.values())
        self.phases = _check_phases(self.keys, weights)
        self.weights = self.phases[0][1]  # the first phase's, in source order
        if not isinstance(stop, str) or stop not in STOPS:
            raise OptionError(f"stop={stop!r} is not one of {STOPS}")
        self.samples = _check_int("samples", samples, optional=True)
        self.seed = _check_int("seed", seed, optional=True)
        self.stop = stop
        self.cost_kind, self.costs = self._costs(cost)
        self.schedule = make_schedule(self.phases, self.costs)
        self.declared: list[int] | None = None  # elements per source, when costs declare them
        self.known_length: int | None = None
        if self.costs is not None:
            self.declared = [len(c) for c in self.costs]
            for key, source, n in zip(self.keys, self.sources, self.declared, strict=True):
                length = _source_length(source)
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
                _check_costs(key, _stored_bytes(key, source))
                for key, source in zip(self.keys, self.sources, strict=True)
            ]
        if not isinstance(cost, Mapping):
            raise OptionTypeError(
                f"cost must be None, 'bytes' or a mapping source -> per-element costs, got {type(cost).__name__}"
            )
        _check_keys(self.keys, cost, "cost", "source {key!r} has no costs; give every source its per-element costs")
        return "given", [_check_costs(key, cost[key]) for key in self.keys]

    def _make_identity(self) -> str:
        """What a checkpoint records of this mix (see ``readers.base``): names, seed,
        stop, samples, every phase's start and exact weights, every cost."""
        weights = [(start, integer_weights(w)) for start, w in self.phases]
        costs = "none" if self.costs is None else f"{self.cost_kind}{_arithmetic(self.costs)}:{digest(self.costs)}"
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
