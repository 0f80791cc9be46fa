"""The error of a bounded wait: every wait of distshard's (a lock, a future, a
collective, a process) has a bound, and passing it raises :class:`WaitTimeout`
naming what it waited for, instead of hanging the job."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from .errors import DistshardError

__all__ = ["CollectiveTimeout", "WaitTimeout", "naming_collective_timeouts"]


class WaitTimeout(DistshardError, TimeoutError):
    """A wait passed its bound; the message says what was waited for, for how long,
    and what to look at (``except TimeoutError`` catches it)."""


class CollectiveTimeout(WaitTimeout):
    """A collective call (``torch.distributed``) that not every rank joined within
    its process group's timeout."""


@contextmanager
def naming_collective_timeouts(what: str) -> Iterator[None]:
    """Collectives are bounded by their process group's timeout (``timeout=`` of
    ``init_process_group`` / ``new_group``); torch then raises a ``RuntimeError``
    ("Timed out waiting ... for recv"). Inside the block, that error becomes a
    :class:`CollectiveTimeout` saying ``what`` was waited for."""
    try:
        yield
    except RuntimeError as exc:
        if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
            raise
        raise CollectiveTimeout(
            f"{what}: not every rank of the group took part within the process group's timeout (a rank "
            f"stopped early, crashed or is stuck; every rank must make this call): {exc}"
        ) from exc
