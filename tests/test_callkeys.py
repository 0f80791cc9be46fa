"""``distshard.callkeys.call_key``: equal for callables that compute alike, different
when anything that decides what they compute differs, ``Unkeyable`` when that cannot
be read."""

from __future__ import annotations

import functools
import operator
import re
import tempfile
import threading

import numpy as np
import pytest
import torch

from distshard.callkeys import Unkeyable, call_key


def scaled(d, k=1):
    return [t * k for t in d]


def make_closure(k):
    def inner(d):
        return [t * k for t in d]

    return inner


class Scale:
    def __init__(self, k):
        self.k = k

    def __call__(self, d):
        return [t * self.k for t in d]


class Slotted:
    __slots__ = ("k",)

    def __init__(self, k):
        self.k = k

    def __call__(self, d):
        return d[: self.k]


class Child(Scale):
    def __call__(self, d):
        return super().__call__(d)[::-1]


def countdown(d):
    return countdown(d[1:]) if d else d  # names itself: a cycle through its globals


EQUAL = {  # built twice, separately: the same key
    "function": lambda: scaled,
    "closure": lambda: make_closure(3),
    "partial": lambda: functools.partial(scaled, k=2),
    "instance": lambda: Scale(2),
    "slots": lambda: Slotted(2),
    "subclass with super()": lambda: Child(2),
    "bound method": lambda: Scale(2).__call__,
    "recursive": lambda: countdown,
    "itemgetter": lambda: operator.itemgetter("ids"),
    "regex method": lambda: re.compile("[a-z]+").findall,
    "set in any order": lambda: functools.partial(scaled, k=frozenset(str(i) for i in range(20))),
    "array": lambda: functools.partial(scaled, k=np.arange(6, dtype=np.uint16)),
    "tensor": lambda: functools.partial(scaled, k=torch.arange(6, dtype=torch.bfloat16)),
    "builtin": lambda: torch.from_numpy,
}


@pytest.mark.parametrize("name", list(EQUAL))
def test_alike_callables_get_one_key(name):
    assert call_key(EQUAL[name]()) == call_key(EQUAL[name]())


def test_a_set_is_keyed_in_a_sorted_order():
    words = [str(i) for i in range(30)]
    assert call_key(set(words)) == call_key(set(reversed(words)))


DIFFERENT = {
    "closure cells": (make_closure(2), make_closure(3)),
    "defaults": (functools.partial(scaled), functools.partial(scaled, k=1)),
    "partial keywords": (functools.partial(scaled, k=2), functools.partial(scaled, k=3)),
    "partial functions": (functools.partial(scaled), functools.partial(countdown)),
    "instance state": (Scale(2), Scale(3)),
    "slots": (Slotted(2), Slotted(3)),
    "class": (Scale(2), Child(2)),
    "bound object": (Scale(2).__call__, Scale(3).__call__),
    "itemgetter": (operator.itemgetter("a"), operator.itemgetter("b")),
    "bool and int": (functools.partial(scaled, k=True), functools.partial(scaled, k=1)),
    "array bytes": (np.arange(4, dtype=np.int32), np.arange(1, 5, dtype=np.int32)),
    "array dtype": (np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int64)),
    "bound builtin": ("a b".split, "a-b".split),
}


@pytest.mark.parametrize("name", list(DIFFERENT))
def test_callables_that_compute_differently_get_other_keys(name):
    first, second = DIFFERENT[name]
    assert call_key(first) != call_key(second)


def test_code_with_the_same_name_but_another_body_gets_another_key():
    made = []
    for body in ("d[:1]", "d[:2]"):
        scope: dict = {}
        exec(f"def picked(d):\n    return {body}\n", scope)
        made.append(scope["picked"])
    assert made[0].__qualname__ == made[1].__qualname__
    assert call_key(made[0]) != call_key(made[1])


@pytest.mark.parametrize(
    "make, says",
    [
        (threading.Lock, "_thread.lock"),
        (lambda: (i for i in range(3)), "generator"),
        (tempfile.TemporaryFile, "BufferedRandom"),
        (lambda: list(range(300_000)), "more than 200,000 values"),
    ],
    ids=["lock", "generator", "open file", "too many values"],
)
def test_what_cannot_be_read_is_unkeyable(make, says):
    value = make()
    try:
        with pytest.raises(Unkeyable, match=re.escape(says)):
            call_key(functools.partial(scaled, k=value))
    finally:
        getattr(value, "close", lambda: None)()
