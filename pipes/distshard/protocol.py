"""The source contract: every hook by which a source tells ``dist_shard`` how to read it.

A source (a pipe below ``dist_shard``, or what ``DistShardNode`` is given) may declare:

* ``__distshard_positional__ = True`` (class attribute): ``obj[i]`` is the ``i``-th
  element iteration yields (:func:`distshard.positional` sets it);
* ``__distshard_sequence__()``: a positional sequence of its stream (``len`` and
  ``[]``), or ``None`` when it has none (a mix of streams, compressed files);
* ``__distshard_units__()``: ``(files, expand)``, its whole files and how one file
  streams its samples, for a file source that cannot be read at random; its
  ``describe()`` is its line in ``explain()``;
* ``distshard_identity()``: what it is, the same in every process (seeds, weights,
  files), part of every state's source identity.

The sequence it returns may declare, for the reader (``readers/sequence.py``):

* ``distshard_read(positions, shuffled)``: read many positions at once (read-ahead);
* ``distshard_order(seed)``: the permutation ``shuffle=True`` visits;
* ``distshard_shuffle_kind``: what that permutation is, for ``explain()``;
* ``distshard_blocks``: neighbours share a file, so slots take contiguous blocks;
* ``distshard_length_varies``: its length may change from epoch to epoch (a packing of
  whole documents in a new order every epoch), so ``even="carry"`` is refused;
* ``distshard_prefetch(slots)``: called in a rank before its DataLoader workers start,
  with the positions each of its slots will read (lazy iterators): fetch once what they
  all need first and keep it in the sequence, which the workers get (pickled or forked);
* ``distshard_identity()``: as above;
* ``describe()``: its line in ``explain()``.

The protocols below name them (``isinstance`` works with the runtime-checkable ones);
the functions are the one place that asks a source for them. How a source becomes an
``Access`` (what a front-end reads) is :func:`distshard.access.access_of`, built on them.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence, runtime_checkable

from .errors import OptionTypeError

__all__ = [
    "IdentifiedSource",
    "PositionalSource",
    "ReadableSequence",
    "UnitSource",
    "declares_positional",
    "has_sequence",
    "own_identity",
    "reads_many",
    "sequence_blocks",
    "sequence_description",
    "sequence_identity",
    "sequence_length_varies",
    "sequence_order",
    "sequence_prefetch",
    "sequence_reader",
    "sequence_shuffle_kind",
    "sequence_of",
    "units_of",
]


@runtime_checkable
class PositionalSource(Protocol):
    """A source with random access to its own stream (a file source, a mix, ``pack``)."""

    def __distshard_sequence__(self) -> Sequence[Any] | None: ...


@runtime_checkable
class UnitSource(Protocol):
    """A file source that can also be read as whole files (compressed files)."""

    def __distshard_units__(self) -> tuple[Sequence[str], Callable[[Any], Iterable[Any]]]: ...

    def describe(self) -> str: ...


@runtime_checkable
class IdentifiedSource(Protocol):
    """A source (or its sequence) that says what it is, the same in every process."""

    def distshard_identity(self) -> str: ...


class ReadableSequence(Protocol):
    """What ``__distshard_sequence__()`` returns, with the optional hooks the reader asks for."""

    distshard_blocks: bool
    distshard_length_varies: bool
    distshard_shuffle_kind: str

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...

    def distshard_read(self, positions: Iterable[int], shuffled: bool = False) -> Iterator[Any]: ...

    def distshard_order(self, seed: int) -> Callable[[int], int]: ...

    def distshard_identity(self) -> str: ...

    def distshard_prefetch(self, slots: Sequence[Iterator[int]]) -> None: ...


def declares_positional(cls: type) -> bool:
    """Whether the class says ``obj[i]`` is its ``i``-th element."""
    return getattr(cls, "__distshard_positional__", False) is True


def has_sequence(cls: type) -> bool:
    """Whether the class has a ``__distshard_sequence__`` hook (asking it may build an index)."""
    return getattr(cls, "__distshard_sequence__", None) is not None


def sequence_of(source: Any) -> Any:
    """The positional sequence ``source``'s hook returns, or ``None`` (no hook, or no
    random access). ``TypeError`` for a hook that returns something without ``len``
    and ``[]``."""
    hook = getattr(type(source), "__distshard_sequence__", None)
    if hook is None:
        return None
    sequence = hook(source)
    if sequence is not None and not (hasattr(sequence, "__len__") and hasattr(sequence, "__getitem__")):
        raise OptionTypeError(
            f"{type(source).__name__}.__distshard_sequence__() returned {type(sequence).__name__}, "
            "which lacks __len__ or __getitem__; return a positional sequence or None"
        )
    return sequence


def units_of(source: Any) -> tuple[list[str], Callable[[Any], Iterable[Any]], str] | None:
    """``(files, expand, description)`` of a file source that has no random access
    (compressed files), else ``None``."""
    units = getattr(type(source), "__distshard_units__", None)
    if units is None or sequence_of(source) is not None:
        return None
    files, expand = units(source)
    return list(files), expand, source.describe()


def own_identity(obj: Any) -> str | None:
    """What ``obj``'s class says it is (``distshard_identity()``), or ``None``."""
    own = getattr(type(obj), "distshard_identity", None)
    return str(own(obj)) if callable(own) else None


def reads_many(sequence: Any) -> bool:
    """Whether ``sequence`` reads many positions at once (``distshard_read``)."""
    return sequence_reader(sequence) is not None


# -- what the reader asks a source's sequence (readers/sequence.py) --------------------


def sequence_reader(sequence: Any) -> Callable[[Iterable[int], bool], Iterator[Any]] | None:
    """``sequence.distshard_read`` (read many positions at once), or ``None``."""
    many = getattr(sequence, "distshard_read", None)
    return many if callable(many) else None


def sequence_order(sequence: Any, seed: int) -> Callable[[int], int] | None:
    """The permutation ``sequence.distshard_order(seed)`` gives, or ``None`` (no hook)."""
    own = getattr(sequence, "distshard_order", None)
    return own(seed) if callable(own) else None


def sequence_prefetch(sequence: Any) -> Callable[[Sequence[Iterator[int]]], None] | None:
    """``sequence.distshard_prefetch`` (fetch before the workers start what the
    rank's slots need first), or ``None``."""
    own = getattr(sequence, "distshard_prefetch", None)
    return own if callable(own) else None


def sequence_shuffle_kind(sequence: Any) -> str | None:
    """What ``sequence``'s permutation is (``distshard_shuffle_kind``), or ``None``."""
    kind = getattr(sequence, "distshard_shuffle_kind", None)
    return kind if isinstance(kind, str) else None


def sequence_blocks(sequence: Any) -> bool:
    """Whether ``sequence`` asks for contiguous blocks per slot (``distshard_blocks``)."""
    return bool(getattr(sequence, "distshard_blocks", False))


def sequence_length_varies(sequence: Any) -> bool:
    """Whether ``sequence``'s length may change from epoch to epoch (``distshard_length_varies``)."""
    return bool(getattr(sequence, "distshard_length_varies", False))


def sequence_identity(sequence: Any) -> str | None:
    """What ``sequence`` says it is (``distshard_identity()``), or ``None``."""
    own = getattr(sequence, "distshard_identity", None)
    return str(own()) if callable(own) else None


def sequence_description(sequence: Any) -> str | None:
    """``sequence.describe()``, its line in ``explain()``, or ``None``."""
    described = getattr(sequence, "describe", None)
    return str(described()) if callable(described) else None
