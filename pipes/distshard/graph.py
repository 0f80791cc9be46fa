"""Walking the DataPipe graph upstream of ``dist_shard``: sharding pipes that
would shard twice, random pipes to seed, and the pushdown of selection below
1:1 maps down to a random-access source.

torch discovers a pipeline's graph by pickling it with hooks
(``torch.utils.data.graph.traverse_dps``); we use the same walk so that we see
exactly what torch's DataLoader sees when it applies sharding and seeds. A pipe
that cannot be pickled (a class defined inside a function) makes that walk
fail; we then walk the pipes' attributes instead.
"""

from __future__ import annotations

import array
import inspect
import pickle
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import FunctionType
from typing import Any, Generic, Iterator, TypeVar

import torch
from torch.utils.data.datapipes.datapipe import IterDataPipe, MapDataPipe
from torch.utils.data.datapipes.iter.callable import MapperIterDataPipe
from torch.utils.data.datapipes.iter.utils import IterableWrapperIterDataPipe
from torch.utils.data.datapipes.map.callable import MapperMapDataPipe
from torch.utils.data.datapipes.map.utils import SequenceWrapperMapDataPipe
from torch.utils.data.graph import DataPipe, DataPipeGraph, traverse_dps
from torch.utils.data.graph_settings import get_all_graph_pipes

from .errors import OptionTypeError, SetupError
from .protocol import declares_positional, has_sequence, sequence_of

__all__ = [
    "Positional",
    "Pushdown",
    "is_positional",
    "is_random_pipe",
    "is_sharding_pipe",
    "pipe_graph",
    "plan_pushdown",
    "positional",
    "random_access",
    "upstream_pipes",
]

T = TypeVar("T")

# what torch's traversal raises (and catches itself when dill is installed) for
# something pickle cannot serialize: a local class, a lock in a list attribute, ...
_PICKLING_ERRORS = (pickle.PickleError, AttributeError, TypeError)


def is_random_pipe(pipe: object) -> bool:
    """Whether torch's DataLoader seeds ``pipe``: it has a ``set_seed`` method (the
    test of torch's ``graph_settings``, written here: torch keeps it private)."""
    return inspect.ismethod(getattr(pipe, "set_seed", None))


def is_sharding_pipe(pipe: object) -> bool:
    """Whether ``pipe`` shards (``sharding_filter``, a ``dist_shard``): it has an
    ``apply_sharding`` method, as torch's ``graph_settings`` decides."""
    return inspect.ismethod(getattr(pipe, "apply_sharding", None))


def pipe_graph(pipe: DataPipe) -> DataPipeGraph:
    """The graph of ``pipe`` and the pipes it reads from, in torch's format
    ``{id(pipe): (pipe, {id(parent): (parent, {...}), ...})}``.

    torch's own traversal when it works; when it cannot pickle a pipe (e.g. a
    DataPipe class defined inside a function), a walk of the pipes' attributes:
    the values of ``vars(pipe)`` that are DataPipes or lists, tuples and dicts
    holding DataPipes, in attribute order.
    """
    try:
        return traverse_dps(pipe)
    except _PICKLING_ERRORS:
        return _attribute_graph(pipe, {}, set())


def _attribute_graph(pipe: DataPipe, done: dict[int, DataPipeGraph], path: set[int]) -> DataPipeGraph:
    """``pipe_graph`` from attributes; ``done`` shares the subgraph of a pipe met
    twice, ``path`` stops cycles."""
    key = id(pipe)
    if key in done:
        return done[key]
    parents: DataPipeGraph = {}
    path.add(key)
    for parent in _attribute_pipes(pipe):
        if id(parent) not in path and id(parent) not in parents:
            parents.update(_attribute_graph(parent, done, path))
    path.discard(key)
    done[key] = {key: (pipe, parents)}
    return done[key]


def _attribute_pipes(pipe: DataPipe) -> Iterator[DataPipe]:
    """The DataPipes among ``pipe``'s attribute values and inside its lists,
    tuples and dicts, depth first in attribute order."""
    try:
        stack = [iter(vars(pipe).values())]
    except TypeError:  # no __dict__
        return
    seen: set[int] = set()
    while stack:
        for value in stack[-1]:
            if isinstance(value, (IterDataPipe, MapDataPipe)):
                yield value
            elif isinstance(value, (list, tuple, dict)) and id(value) not in seen:
                seen.add(id(value))
                stack.append(iter(value.values() if isinstance(value, dict) else value))
                break
        else:
            stack.pop()


def upstream_pipes(source: DataPipe) -> list[DataPipe]:
    """Every pipe ``source`` reads from, ``source`` included, each once, in a
    deterministic order (the order of torch's own traversal, see :func:`pipe_graph`)."""
    return get_all_graph_pipes(pipe_graph(source))


def check_no_sharding(source: IterDataPipe, pipes: list[DataPipe] | None = None) -> None:
    """Raise ``RuntimeError`` if a sharding pipe sits upstream of a new ``dist_shard``.

    Sharding twice keeps ``1 / S²`` of the data: a ``sharding_filter`` or another
    ``dist_shard`` upstream is always a mistake.
    """
    for pipe in upstream_pipes(source) if pipes is None else pipes:
        if is_sharding_pipe(pipe):
            raise SetupError(
                f"dist_shard() was applied downstream of {type(pipe).__name__}, which "
                "already shards the stream; sharding twice loses data. Remove the "
                f"{type(pipe).__name__} (dist_shard splits over ranks and DataLoader "
                "workers by itself) or this dist_shard."
            )


def random_pipes(source: IterDataPipe, pipes: list[DataPipe] | None = None) -> list[DataPipe]:
    """The upstream pipes with a ``set_seed`` method (e.g. ``shuffle()``), in
    traversal order; every copy of the pipeline finds them in the same order.
    ``pipes``: ``upstream_pipes(source)`` if already walked (a walk pickles every pipe)."""
    return [pipe for pipe in (upstream_pipes(source) if pipes is None else pipes) if is_random_pipe(pipe)]


class Positional(Generic[T]):
    """A sequence declared positional; see :func:`positional`."""

    __distshard_positional__ = True
    __slots__ = ("sequence",)

    def __init__(self, sequence: Any) -> None:
        if not (hasattr(sequence, "__len__") and hasattr(sequence, "__getitem__")):
            raise OptionTypeError(
                f"positional() needs an object with __len__ and __getitem__, got "
                f"{type(sequence).__name__}; pass anything else to IterableWrapper as is "
                "(dist_shard then streams it)"
            )
        self.sequence = sequence

    def __len__(self) -> int:
        return len(self.sequence)

    def __getitem__(self, index: int) -> T:
        return self.sequence[index]

    def __iter__(self) -> Iterator[T]:
        sequence = self.sequence
        for index in range(len(sequence)):
            yield sequence[index]

    def __repr__(self) -> str:
        return f"positional({type(self.sequence).__name__} of {len(self)})"


def positional(sequence: Any) -> Positional:
    """Declare that ``sequence[i]`` is the ``i``-th element, so that ``dist_shard``
    may read it by index (each element once cluster-wide) instead of streaming it.

    The result has ``len()``, positional ``[]`` and iterates ``sequence[0]``,
    ``sequence[1]``, ... (by index, whatever ``iter(sequence)`` does), so plain
    iteration and the sharded reads see the same elements in the same order.
    Needed only for a container with its own ``__iter__`` that ``dist_shard``
    does not know (see :func:`distshard.graph.is_positional`: lists, tuples,
    ranges, tensors, NumPy arrays, ``array.array``, map-style datasets, Hugging
    Face ``datasets.Dataset`` are known); a class can also declare itself with
    ``__distshard_positional__ = True``. Do not use it where ``[]`` looks up
    labels or keys (a pandas Series with a non-default index: pass
    ``series.to_list()`` or ``series.reset_index(drop=True)``).

    Example:
        >>> import distshard
        >>> from torch.utils.data.datapipes.iter import IterableWrapper
        >>> rows = distshard.positional(["a", "b", "c"])
        >>> list(IterableWrapper(rows).dist_shard(rank=0, world_size=2))
        ['a', 'c']
    """
    return sequence if isinstance(sequence, Positional) else Positional(sequence)


_PROTOCOL = ("__len__", "__getitem__", "__iter__")


def _keeps(cls: type, base: type) -> bool:
    """``cls`` uses ``base``'s indexing, length and iteration (overrides none)."""
    return all(getattr(cls, name, None) is getattr(base, name, None) for name in _PROTOCOL)


def is_positional(obj: object) -> bool:
    """Whether ``obj[i]`` for ``i`` in ``range(len(obj))`` is exactly what iterating
    ``obj`` yields, in order. Conservative: ``False`` for anything not known to be.

    Known: a class declaring ``__distshard_positional__ = True``; list, tuple,
    range, ``array.array``, NumPy arrays (and memmaps) and tensors of at least one
    dimension, Hugging Face ``datasets.Dataset``; and any class whose iteration is
    its indexing: a Python ``__getitem__`` and no ``__iter__`` (Python then
    iterates ``obj[0]``, ``obj[1]``, ... as for torch's map-style datasets and
    ``MapDataPipe``) or ``collections.abc.Sequence``'s inherited ``__iter__``. Subclasses that override
    ``__len__``, ``__getitem__`` or ``__iter__`` of a known type are not known.
    """
    cls = type(obj)
    if declares_positional(cls):
        return True
    for base in (list, tuple, range, array.array):
        if isinstance(obj, base):
            return _keeps(cls, base)
    numpy = sys.modules.get("numpy")  # an ndarray exists only once numpy is imported
    if numpy is not None and isinstance(obj, numpy.ndarray):
        return (cls is numpy.ndarray or isinstance(obj, numpy.memmap)) and obj.ndim >= 1
    if isinstance(obj, torch.Tensor):
        return obj.dim() >= 1 and _keeps(cls, torch.Tensor)
    for ancestor in cls.__mro__:  # Hugging Face datasets.Dataset, without importing datasets
        if ancestor.__module__ == "datasets.arrow_dataset" and ancestor.__name__ == "Dataset":
            return _keeps(cls, ancestor)
    if isinstance(obj, SequenceWrapperMapDataPipe) and isinstance(obj.sequence, Mapping):
        return False  # keyed, not positional
    if isinstance(obj, MapperMapDataPipe) and not is_positional(obj.datapipe):
        return False
    if isinstance(obj, (str, bytes, bytearray, memoryview, Mapping)):
        return False
    # Iteration is obj[0], obj[1], ... through the same Python __getitem__ (a C type
    # such as mmap may iterate its sequence slot and index another: not trusted).
    iterate = getattr(cls, "__iter__", None)
    return (
        (iterate is None or iterate is Sequence.__iter__)
        and hasattr(cls, "__len__")
        and isinstance(getattr(cls, "__getitem__", None), FunctionType)
    )


@dataclass
class Pushdown:
    """How a slot reads the stream that reaches ``dist_shard``.

    ``base`` is the pipe whose positions are counted: the source itself, or,
    with pushdown, the first pipe upstream that is not a 1:1 ``map``. ``maps``
    are the 1:1 maps between ``base`` and ``dist_shard`` (upstream first); a slot
    applies them to its own elements only, which gives the same elements in the
    same order as running them on every element. ``sequence`` is set when
    ``base`` has positional random access (see :func:`random_access`), so a slot
    can index its positions instead of walking the stream.
    """

    base: IterDataPipe
    maps: list[MapperIterDataPipe] = field(default_factory=list)
    sequence: Any = None
    copy_elements: bool = False

    def apply(self, element: Any) -> Any:
        for mapper in self.maps:
            element = mapper._apply_fn(element)
        return element


def random_access(pipe: IterDataPipe) -> tuple[Any, bool]:
    """``(sequence, deepcopy)`` when ``pipe``'s stream can be read by position:
    ``sequence[i]`` is the ``i``-th element ``pipe`` yields. Else ``(None, False)``.

    Two cases: a source whose class has ``__distshard_sequence__()`` returning such
    a sequence (or ``None``), and an ``IterableWrapper`` over an object
    :func:`is_positional` accepts; ``deepcopy`` is then the wrapper's. Anything
    else, such as a container whose ``[]`` is not what its iteration yields (a
    pandas-like Series with its own index, ``mmap``, a mapping), is streamed.
    """
    if has_sequence(type(pipe)):
        return sequence_of(pipe), False
    if type(pipe) is IterableWrapperIterDataPipe and is_positional(pipe.iterable):
        return pipe.iterable, bool(pipe.deepcopy)
    return None, False


def plan_pushdown(source: IterDataPipe, enabled: bool) -> Pushdown:
    """Find the base, the 1:1 maps above it and random access, for ``source``.

    Only ``map`` (``MapperIterDataPipe`` and its subclasses such as ``collate``)
    is crossed: ``filter``, ``batch``, ``shuffle``, flat-maps and anything else
    may change how many elements there are or their order, so selection never
    moves past them. ``enabled=False`` crosses nothing (maps with side effects).
    """
    maps: list[MapperIterDataPipe] = []
    base = source
    if enabled:
        while isinstance(base, MapperIterDataPipe):
            maps.append(base)
            base = base.datapipe
    sequence, copy_elements = random_access(base)
    return Pushdown(base, maps[::-1], sequence, copy_elements)


def pipeline_of(obj: Any) -> IterDataPipe | None:
    """The ``IterDataPipe`` inside ``obj``: itself, or what it holds as ``.pipeline``
    (``StatefulPipeline``), ``.dataset`` (a DataLoader) or ``._datapipe`` (torch's
    wrapper of a DataPipe dataset), unwrapped repeatedly; ``None`` if there is none."""
    for _ in range(8):
        if isinstance(obj, IterDataPipe):
            return obj
        obj = next(
            (
                getattr(obj, name)
                for name in ("pipeline", "dataset", "_datapipe")
                if getattr(obj, name, None) is not None
            ),
            None,
        )
        if obj is None:
            return None
    return None
