"""The arguments of ``dist_shard``, checked once for both front-ends: the DataPipe's
``.dist_shard()`` and ``torchdata.nodes``' ``DistShardNode`` raise the same errors,
of the same types (``TypeError`` for a wrong type, ``ValueError`` for a wrong
value), with the same messages, because they call the same functions here.

What only one front-end has (the DataPipe's ``pushdown``, what a source must be)
is checked there, with :func:`check_flag` and :func:`random_access_needed`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from . import context as _context
from .errors import OptionError, OptionTypeError, UnsupportedError
from .groups import DataGroup, data_group
from .mailbox import EPOCH_LIMIT
from .plan import CARRY, Even, check_even, check_multiple
from .readers import check_sizes

__all__ = [
    "ShardOptions",
    "carry_refused",
    "check_epoch",
    "check_flag",
    "check_given",
    "check_options",
    "check_seed",
    "random_access_needed",
]

Sizes = Sequence[int] | Mapping[Any, int] | Callable[[Any], int]


@dataclass(frozen=True)
class ShardOptions:
    """The checked arguments: ``explicit`` is ``(rank, world_size)`` or ``None``;
    ``group`` the data group of ``mesh=`` / ``group=`` (see ``groups.py``) or ``None``."""

    explicit: tuple[int, int] | None
    even: Even
    seed: int | None
    shuffle: bool
    expand: Callable[[Any], Any] | None
    sizes: Any
    multiple_of: int
    group: DataGroup | None = None


def _int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionTypeError(f"{name}={value!r} must be an int (got {type(value).__name__})")
    if value < 0:
        raise OptionError(f"{name}={value} must be non-negative")
    return value


def check_seed(seed: object) -> int | None:
    """``seed``: ``None`` or a non-negative int."""
    return None if seed is None else _int("seed", seed)


def check_epoch(epoch: object) -> int:
    """An epoch: a non-negative int below 2**63 (what the epoch mailbox holds)."""
    epoch = _int("epoch", epoch)
    if epoch >= EPOCH_LIMIT:
        raise OptionError(f"epoch={epoch} must be below 2**63")
    return epoch


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise OptionTypeError(f"{name}={value!r} must be True or False")
    return value


def check_options(
    *,
    rank: object,
    world_size: object,
    even: object,
    seed: object,
    shuffle: object,
    expand: object,
    sizes: object,
    multiple_of: object,
    mesh: object = None,
    group: object = None,
) -> ShardOptions:
    """Check the arguments both front-ends share and return them, normalised.

    Also surfaces a malformed ``RANK`` / ``WORLD_SIZE`` environment now, rather than
    in a DataLoader worker, when no explicit rank or data group is given."""
    explicit = _context.check_explicit(rank, world_size)
    found = data_group(mesh, group)
    if found is not None and explicit is not None:
        raise _context.given_twice(explicit, found)
    checked_even = check_even(even)
    checked_seed = check_seed(seed)
    check_flag("shuffle", shuffle)
    if expand is not None and not callable(expand):
        raise OptionTypeError(f"expand={expand!r} must be a callable unit -> elements")
    multiple = check_multiple(multiple_of, checked_even)
    checked_sizes = check_sizes(sizes)
    if checked_sizes is not None and expand is None:
        raise OptionError(
            "sizes= counts the elements of each unit and needs expand=; "
            "pass expand=fn that yields a unit's elements, or drop sizes="
        )
    if checked_even == CARRY and expand is not None and checked_sizes is None:
        raise carry_refused(
            "units without sizes=", "pass sizes= (the element count of each unit), or use even='drop' / 'pad'"
        )
    if expand is not None and checked_sizes is None and (checked_even is not None or shuffle):
        what = f"even={checked_even!r}" if checked_even is not None else "shuffle=True"
        raise UnsupportedError(
            f"{what} with expand= needs sizes= (the element count of each unit): without "
            "them no slot knows how many elements the others get. Pass sizes=, or use "
            "even=None and shuffle upstream with .shuffle()"
        )
    if explicit is None and found is None:
        _context.check_environment()
    return ShardOptions(explicit, checked_even, checked_seed, bool(shuffle), expand, checked_sizes, multiple, found)


SHARD_ARGUMENTS = tuple(inspect.signature(check_options).parameters)  # the names both front-ends take


def check_given(scope: Mapping[str, object]) -> ShardOptions:
    """:func:`check_options` of the arguments a front-end's ``__init__`` was given,
    read by name from its ``locals()`` (both front-ends name them as ``check_options``
    does: the names are written once, there)."""
    return check_options(**{name: scope[name] for name in SHARD_ARGUMENTS})


def random_access_needed(source: str, fix: str) -> ValueError:
    """The error for ``shuffle=True`` over ``source``, which has no random access;
    ``fix`` says what the front-end can be given instead."""
    return UnsupportedError(f"shuffle=True needs random access to the stream, but it comes from {source}: {fix}")


def carry_refused(what: str, fix: str) -> ValueError:
    """The error for ``even="carry"`` over ``what``, which cannot be read at its
    positions; ``fix`` says what the front-end can be given instead."""
    return UnsupportedError(
        f"even='carry' cannot read {what}: the start of every epoch is the tail of the epoch before, "
        "so a slot reads the previous epoch's elements at their positions, and a stream would have to "
        f"be read through the previous epoch again. {fix}"
    )
