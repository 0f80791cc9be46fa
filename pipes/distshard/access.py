"""How a source is read, decided once for both front-ends.

Each front-end says what its source is, as an :class:`Access`: the DataPipe from its
graph (a random-access view below 1:1 maps, a stream, units), ``DistShardNode`` from
what it was given (a sequence, a node). :func:`reader_of` turns that into the one
reader the engine runs (``readers/``), and :func:`check_access` refuses, with one
message for both front-ends, the options a source cannot honour (``shuffle=True`` and
``even="carry"`` need random access). What needs no front-end lives here too: the
counts a ``sizes`` callable gives, asked once per unit per job (:class:`UnitCounts`),
and the reader of an earlier epoch that ``even="carry"`` reads its tail through
(:class:`EpochReader`). A file source that cannot be read at random (compressed
files) is read as whole files (:class:`WholeFiles`): each file goes to one slot.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from torch.utils.data import get_worker_info
from torch.utils.data.datapipes.iter.callable import MapperIterDataPipe
from torch.utils.data.datapipes.iter.utils import IterableWrapperIterDataPipe

from . import context as _context
from .errors import UnsupportedError
from .graph import is_positional, random_access
from .groups import DataGroup
from .options import carry_refused, random_access_needed
from .plan import CARRY, Even
from .protocol import has_sequence, sequence_length_varies, sequence_of, units_of
from .readers import (
    RandomAccessReader,
    Reader,
    SequenceReader,
    SizedUnitsReader,
    StreamReader,
    WholeFilesReader,
    WholeUnitsReader,
    stable_digest,
    unit_sizes,
)
from .readers.sequence import DEEPCOPY_WARNING
from .state import WHOLE_FILES_SOURCE

__all__ = [
    "Access",
    "EpochReader",
    "UnitCounts",
    "WholeFiles",
    "access_of",
    "check_access",
    "mode_of",
    "reader_of",
    "unwrapped",
    "whole_files",
]


@dataclass(frozen=True)
class WholeFiles:
    """A file source read as whole files: ``expand(file)`` streams one file's
    samples in order; ``description`` is the source's line for ``explain()``."""

    files: list[str]
    expand: Callable[[Any], Iterable[Any]]
    description: str


def whole_files(source: Any, below_maps: bool = False) -> WholeFiles | None:
    """The whole files of ``source`` (``below_maps``: of the source below its 1:1
    ``.map()`` pipes) if it is a file source (it has ``__distshard_units__``) that has
    no random access (compressed files), else ``None``. Finding out indexes a file
    source once (its identities then travel to DataLoader workers with the pipe)."""
    while below_maps and isinstance(source, MapperIterDataPipe):
        source = source.datapipe
    found = units_of(source)
    return None if found is None else WholeFiles(*found)


@dataclass
class Access:
    """What a front-end found its source to be; exactly one way of reading it:

    * ``sequence``: random access, ``sequence[i]`` being the ``i``-th element
      (``copy_elements``: deep-copy each element read, as ``IterableWrapper`` does);
    * ``stream``: a fresh iterable of the elements, or of the units in unit mode
      (``name`` and ``identity`` say what it is, the same in every process);
    * ``whole``: whole files, file ``k`` to slot ``k mod num_slots`` (``identity``
      says what pipes surround them).
    """

    sequence: Any = None
    copy_elements: bool = False
    stream: Callable[[], Iterable[Any]] | None = field(default=None, repr=False)
    name: str = ""
    identity: str = ""
    whole: WholeFiles | None = None

    @property
    def random(self) -> bool:
        return self.sequence is not None


def access_of(source: Any, *, bare: bool = False, whole: bool = True) -> Access | None:
    """How ``source`` is read when it is not a stream: the one adapter from a source
    (see :mod:`distshard.protocol`) to its :class:`Access`. Its own positional
    sequence (``__distshard_sequence__``), an ``IterableWrapper``'s positional
    iterable (copied as the wrapper copies) or, with ``bare``, ``source`` itself if
    it is positional (``DistShardNode`` takes sequences as they are); else (unless not
    ``whole``: units are never read as whole files) the whole files of a compressed
    file source; else ``None``: ``source`` is a stream."""
    if bare:
        sequence = sequence_of(source) if has_sequence(type(source)) else (source if is_positional(source) else None)
        copy_elements = False
    else:
        sequence, copy_elements = random_access(source)
    if sequence is not None:
        return Access(sequence=sequence, copy_elements=copy_elements)
    files = whole_files(source) if whole else None
    return None if files is None else Access(whole=files)


def mode_of(expand: Callable[[Any], Any] | None, sizes: Any, whole: bool = False) -> str:
    """What a state records as its ``mode``: ``element``, ``units`` (expand without
    sizes, or whole files) or ``sized_units``."""
    if whole:
        return "units"
    if expand is None:
        return "element"
    return "units" if sizes is None else "sized_units"


def check_access(
    access: Access,
    *,
    even: Even,
    shuffle: bool,
    expand: Callable[[Any], Any] | None,
    source: str,
    fix: str,
    shuffle_fix: str,
) -> None:
    """Refuse what ``source`` (the name of what a front-end was given) cannot be read
    for: ``shuffle=True`` and ``even="carry"`` need random access to the elements
    (units need sizes, which ``options.check_options`` asks for). ``fix`` says which
    random-access sources this front-end takes, ``shuffle_fix`` what else serves
    ``shuffle=True``."""
    if even == CARRY and access.random and sequence_length_varies(access.sequence):
        raise UnsupportedError(
            f"even='carry' needs the same length every epoch (an epoch starts with the tail of the one before), "
            f"but {source} ({type(access.sequence).__name__}) changes its length from epoch to epoch: "
            "pack(fit='best', shuffle_documents=True) packs a new number of blocks every epoch. Use even='drop' "
            "or 'pad', or shuffle_documents=False"
        )
    if expand is not None or access.random:
        return
    if access.whole is not None and (even is not None or shuffle):
        raise UnsupportedError(
            f"{'shuffle=True' if shuffle else f'even={even!r}'} needs random access, but "
            f"{access.whole.description}. Decompress the files to read them at random, or use even=None and "
            "shuffle=False (end DDP loops with distshard.stop_together(); a .shuffle(buffer) after dist_shard "
            "mixes what a slot reads)"
        )
    if even == CARRY:
        raise carry_refused(f"a stream ({source}, no random access)", f"Use {fix}, or even='drop' / 'pad'")
    if shuffle:
        raise random_access_needed(source, f"use {fix}{shuffle_fix}")


def reader_of(
    access: Access, expand: Callable[[Any], Any] | None, sizes: Any, counts: Callable[[list], list[int]] | None = None
) -> Reader:
    """The reader of one epoch of ``access`` (in unit mode ``expand`` gives a unit's
    elements, ``sizes`` their counts, through ``counts`` when given): the one place
    that decides how a source is read."""
    if access.whole is not None:
        whole = access.whole
        return WholeFilesReader(
            lambda: whole.files,
            whole.expand,
            f"{WHOLE_FILES_SOURCE}{stable_digest(whole.files)}:{access.identity}",
            whole.description,
        )
    if expand is not None:
        assert access.stream is not None, "unit mode streams its units"
        if sizes is None:
            return WholeUnitsReader(access.stream, expand, f"units:{access.identity}")
        units = list(access.stream())
        return SizedUnitsReader(units, counts(units) if counts is not None else unit_sizes(units, sizes), expand)
    if access.sequence is not None:
        return SequenceReader(access.sequence, access.copy_elements)
    assert access.stream is not None, "an Access has a sequence or a stream"
    return StreamReader(access.stream, access.name, f"stream:{access.identity}")


class UnitCounts:
    """The counts of units: ``sizes`` as given (a sequence or a mapping), or the
    answers of a ``sizes`` callable, asked once per unit per job and remembered (they
    travel with the pipe to DataLoader workers, so no slot asks again)."""

    def __init__(self, sizes: Any) -> None:
        self.sizes = sizes
        self.answers: dict[Any, int] = {}

    @property
    def computed(self) -> bool:
        """Whether the counts come from a callable (asking it may read the units)."""
        return callable(self.sizes) and not isinstance(self.sizes, Mapping)

    def __call__(self, units: list) -> list[int]:
        if not self.computed:
            return unit_sizes(units, self.sizes)
        try:
            missing = [unit for unit in units if unit not in self.answers]
        except TypeError:  # unhashable units: nothing to remember them by
            return unit_sizes(units, self.sizes)
        self.answers.update(zip(missing, unit_sizes(missing, self.sizes), strict=True))
        return [self.answers[unit] for unit in units]

    def ask_all(self, units: list, group: DataGroup | None = None) -> None:
        """Ask the callable for every unit, once per job: with torch.distributed up
        each rank asks for its share of the units and the answers are exchanged (a
        collective, made when the pipe is built: build the pipeline on every rank of
        ``group``, the data group, default: every rank); else this process asks for all."""
        found = _context.dist_rank_world()
        if group is not None and found is not None:
            found = group.rank, group.world_size
        if found is None or found[1] == 1 or get_worker_info() is not None:
            self(units)
            return
        rank, world = found
        share = units[rank::world]
        try:
            mine: Any = dict(zip(share, self(share), strict=True))
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            mine = exc
        for answer in _context.gather_objects(mine, "the sizes of the units (each rank asks for its share)", group):
            if isinstance(answer, Exception):
                raise answer
            self.answers.update(answer)


class EpochReader(RandomAccessReader):
    """A random-access reader of another epoch (``even="carry"``'s tail): reads with
    the upstream seeded for that epoch (``seed``) and seeds it back (``back``) after,
    whether the source's view took its seeds when it was made or takes them at every
    access (a mix seeds its sources' passes lazily)."""

    def __init__(self, inner: Reader, seed: Callable[[], None], back: Callable[[], None]) -> None:
        assert isinstance(inner, RandomAccessReader), "even='carry' reads random-access sources only"
        self.inner, self._seed, self._back = inner, seed, back
        self.mode, self.prefers_blocks, self.shuffle_kind = inner.mode, inner.prefers_blocks, inner.shuffle_kind

    def length(self) -> int:
        return self.inner.length()

    def identity(self) -> str:
        return self.inner.identity()

    def describe(self) -> str:
        return self.inner.describe()

    def order(self, seed: int) -> Callable[[int], int]:
        return self.inner.order(seed)

    def read(self, positions: Iterable[int], shuffled: bool = False) -> Iterator[Any]:
        self._seed()
        try:
            yield from self.inner.read(positions, shuffled)
        finally:
            self._back()


def unwrapped(base: Any) -> Any:
    """What to stream from: an ``IterableWrapper``'s own iterable (same elements,
    same deep copy), which skips torch's per-element hook, about 0.8 µs an
    element: most of the cost of walking a stream to find a slot's share."""
    if type(base) is not IterableWrapperIterDataPipe:
        return base
    data = base.iterable
    if base.deepcopy:
        try:
            data = copy.deepcopy(data)
        except TypeError:
            warnings.warn(DEEPCOPY_WARNING, stacklevel=3)
    return data
