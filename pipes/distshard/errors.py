"""The errors distshard raises on purpose, by kind.

Every class derives from :class:`DistshardError` *and* from the built-in a caller
caught before it existed (``ValueError``, ``TypeError``, ``RuntimeError``,
``OSError``, ``TimeoutError``), so ``except ValueError`` keeps working while
``except StateMismatchError`` tells a state of another run from a bad argument.

This module imports nothing of the package: every other module may raise these.
"""

from __future__ import annotations

__all__ = [
    "DistshardError",
    "OptionError",
    "OptionTypeError",
    "UnsupportedError",
    "StateMismatchError",
    "ResumeOrderError",
    "SourceChangedError",
    "SourceMissingError",
    "SourceDataError",
    "SetupError",
]


class DistshardError(Exception):
    """Base of every error distshard raises on purpose; its message names the value
    at fault and the fix."""


class OptionError(DistshardError, ValueError):
    """An argument with a value distshard cannot take (``world_size=0``,
    ``multiple_of=-1``, a weight that is not positive, ...)."""


class OptionTypeError(DistshardError, TypeError):
    """An argument of a type distshard cannot take (a source that is not iterable,
    a state that is not a dict, ...)."""


class UnsupportedError(DistshardError, ValueError):
    """A combination that cannot keep the exactly-once promise and is therefore
    refused before a wrong element is yielded (``shuffle=True`` without random
    access, an elastic resume over whole compressed files, ...)."""


class StateMismatchError(DistshardError, ValueError):
    """A state that belongs to another run: another pipeline, seed, epoch, layout,
    data length or slot, or states that cannot be merged together."""


class ResumeOrderError(DistshardError, RuntimeError):
    """A loader that went on past a resumed state in a way the state cannot follow
    (an epoch started after the one that resumed it, in workers that never saw the
    state)."""


class SourceChangedError(DistshardError, ValueError):
    """A file whose identity (ETag, generation, size, mtime) is not the one indexed:
    it changed during the job or after its stored index was written; or documents
    that are no longer those ``pack()`` counted."""


class SourceMissingError(DistshardError, FileNotFoundError):
    """A file named by a pattern, an index or a manifest that is not there."""


class SourceDataError(DistshardError, ValueError):
    """Data that is not what was declared or counted of it, or cannot be read as its
    format: a unit with another element count than ``sizes=`` says, a shard index's
    wrong ``nsamples``, a truncated or corrupt file (tar, JSON lines, Parquet, a
    Megatron ``.idx`` / ``.bin`` pair), a malformed stored index manifest."""


class SetupError(DistshardError, RuntimeError):
    """The code around the pipe is set up so that distshard cannot keep its promise:
    the data split a second time or dispatched from one rank (a ``sharding_filter``
    or another ``dist_shard`` upstream, ``apply_sharding`` by hand in DataLoader
    workers, Accelerate's wrappers), or ``stop_together`` without an initialized
    process group."""
