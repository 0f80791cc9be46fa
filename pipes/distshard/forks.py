"""The fork registry: what each module must do around an ``os.fork`` (a DataLoader
worker is one), in one place.

A module registers, when it is imported, what it must reset in a child (a lock
another thread of the parent held, the parent's clients, requests in flight,
counters, a record that belongs to the parent's process) with :func:`at_fork`, and
what it must settle in the parent before the fork (``before``) and after it
(``after_in_parent``). This module makes the one ``os.register_at_fork`` call and
runs them as the interpreter runs its own: ``before`` hooks last registered first,
the others in the order registered. A hook that raises is logged and the others
still run, as the interpreter does with its own hooks. Nothing else in the package
calls ``os.register_at_fork`` or compares process ids to find out that it forked.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

__all__ = ["at_fork"]

Hook = Callable[[], None]

_log = logging.getLogger("distshard")
_before: list[Hook] = []
_after_in_parent: list[Hook] = []
_after_in_child: list[Hook] = []


def at_fork(
    after_in_child: Hook | None = None, *, before: Hook | None = None, after_in_parent: Hook | None = None
) -> None:
    """Register what to reset in a forked child (``after_in_child``), and what to do
    in the parent before and after the fork. Registered once per module import."""
    for hooks, hook in ((_before, before), (_after_in_parent, after_in_parent), (_after_in_child, after_in_child)):
        if hook is not None:
            hooks.append(hook)


def _run(hooks: list[Hook], when: str) -> None:
    for hook in hooks:
        try:
            hook()
        except Exception:  # a hook must not stop the others, nor the fork
            _log.exception("the fork hook %s (%s) raised", getattr(hook, "__qualname__", hook), when)


def _run_before() -> None:
    _run(_before[::-1], "before")


def _run_after_in_parent() -> None:
    _run(list(_after_in_parent), "after_in_parent")


def _run_after_in_child() -> None:
    _run(list(_after_in_child), "after_in_child")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_run_before, after_in_parent=_run_after_in_parent, after_in_child=_run_after_in_child)
