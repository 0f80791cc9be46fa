"""verify can be trusted: elements are compared by a faithful key (never a repr),
every wait is bounded by the timeout, and the rank group listens on 127.0.0.1 only."""

import copy
import dataclasses
import math
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distshard
from distshard.verify import canonical, key, run_on_group

from . import verify_factories as vf

TIMEOUT = 60


# -- the key -------------------------------------------------------------------------


def test_distinct_values_get_distinct_keys():
    a, b = vf.long_arrays(2)
    assert repr(a) == repr(b)  # what the old key compared
    assert key(a) != key(b)
    assert key(0.1 + 0.2) != key(0.3)
    assert key(vf.Plain(1)) != key(vf.Plain(2))
    big_a, big_b = torch.zeros(5000), torch.zeros(5000)
    big_b[2500] = 1
    assert key(big_a) != key(big_b)
    assert key(torch.tensor([1, 2, 3, 4])) != key(torch.tensor([[1, 2], [3, 4]]))  # shape
    assert key(torch.tensor([1, 2])) != key(torch.tensor([1, 2], dtype=torch.int32))  # dtype
    assert key(np.arange(3)) != key(np.arange(3).astype(np.int32))
    assert key(np.array(["a", None], dtype=object)) != key(np.array(["b", None], dtype=object))
    distinct = [None, False, 0, 0.0, "0", b"0", (0,), [0], {0}, {0: 0}, np.int64(0), torch.tensor(0)]
    assert len({key(v) for v in distinct}) == len(distinct)  # types are told apart
    assert key(vf.Slotted(1, 2)) != key(vf.Slotted(1, 3))
    assert key(vf.Point(1.0, 2.0)) != key(vf.Point(1.0, 2.5))


def test_equal_values_get_equal_keys():
    assert key({"a": 1, "b": {"x": [1, 2], "y": 2}}) == key({"b": {"y": 2, "x": [1, 2]}, "a": 1})
    assert key({3, 1, 2}) == key({2, 3, 1})
    assert key(vf.Plain(7)) == key(vf.Plain(7))  # default reprs differ, values do not
    assert key(vf.Slotted(1, [2])) == key(vf.Slotted(1, [2]))
    assert key(torch.arange(10)[2:6]) == key(torch.arange(2, 6))  # a view: its own bytes only
    assert key(torch.arange(6.0).reshape(2, 3).t()) == key(torch.arange(6.0).reshape(2, 3).t().contiguous())
    assert key(np.arange(12).reshape(3, 4).T) == key(np.ascontiguousarray(np.arange(12).reshape(3, 4).T))
    assert key(float("nan")) == key(math.nan)
    cycle: list = [1]
    cycle.append(cycle)
    again: list = [1]
    again.append(again)
    assert key(cycle) == key(again)
    assert canonical("x") == canonical("x") and isinstance(key("x"), str) and len(key("x")) == 64


def test_a_tensors_key_holds_its_elements_bytes_in_every_dtype_and_view():
    """The bytes of a tensor's canonical form are its elements' own, in order (what the
    storage of a contiguous copy holds), whatever its dtype, strides, offset or lazy bits."""
    from distshard.keys import _tensor_bytes

    base = torch.arange(-6, 6, dtype=torch.float64).reshape(3, 4) * 1.25
    cases = [base.to(dtype) for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8)]
    cases += [base.to(torch.int64), base > 0, base.to(torch.complex64), torch.tensor(3), torch.zeros(2, 0)]
    cases += [base.t(), base[1:, 1:3], base[:, ::2], base.to(torch.complex64).conj(), base.to_sparse()]
    for tensor in cases:
        dense = tensor.to_dense() if tensor.layout != torch.strided else tensor
        want = bytes(dense.resolve_conj().clone(memory_format=torch.contiguous_format).untyped_storage())
        assert len(want) == dense.numel() * dense.element_size()
        assert _tensor_bytes(tensor) == want, (tensor.dtype, tensor.shape, tensor.stride())
    assert _tensor_bytes(torch.tensor([1, 2], dtype=torch.int16)) == b"".join(
        i.to_bytes(2, sys.byteorder) for i in (1, 2)
    )  # the elements in order, in the machine's byte order


_plain_data = st.recursive(
    st.none() | st.integers() | st.text(max_size=5) | st.binary(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=3), inner, max_size=4)
        | st.frozensets(st.integers(), max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=120, deadline=None)
@given(_plain_data, _plain_data)
def test_keys_are_equal_exactly_when_values_are(a, b):
    assert (key(a) == key(b)) == (a == b)
    assert key(copy.deepcopy(a)) == key(a)
    if isinstance(a, dict):
        assert key(dict(reversed(list(a.items())))) == key(a)


def test_keys_are_the_same_in_another_process():
    """A fresh interpreter with another hash seed (set iteration order differs)."""
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run(
        [sys.executable, "-c", "from tests.verify_factories import print_sample_keys as p; p()"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [key(value) for value in vf.samples()]


def test_a_value_without_a_faithful_key_is_refused():
    with pytest.raises(TypeError, match="cannot compare .*lock"):
        key(threading.Lock())


def test_dataclass_fields_count():
    @dataclasses.dataclass
    class Local:
        x: int

    assert key(Local(1)) != key(Local(2)) and key(Local(1)) == key(Local(1))


# -- verify on a real group with records that defeat repr -----------------------------


@pytest.mark.parametrize(
    "build, workers, holds",
    [
        (vf.arrays_half, 0, False),  # long numpy arrays: half read twice, repr saw no difference
        (vf.objects_half, 2, False),  # default reprs, half read twice
        (vf.objects_ok, 2, True),  # default reprs differ across processes; the pipeline is right
    ],
    ids=["long-arrays-half-fails", "objects-half-fails", "objects-ok-passes"],
)
def test_verify_compares_values_not_reprs(build, workers, holds):
    report = distshard.verify(build, world_size=2, num_workers=workers, timeout=TIMEOUT)
    assert report.error is None, report.summary()
    assert report.ok is holds, report.summary()
    if not holds:
        assert report.violated
        assert report.duplicate_count == report.missing_count == report.expected // 2 > 0


# -- bounds and errors -----------------------------------------------------------------


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -math.inf, 0, -1])
def test_timeouts_must_be_finite_and_positive(timeout):
    with pytest.raises(ValueError, match="timeout="):
        distshard.verify(vf.strings, world_size=2, timeout=timeout)
    with pytest.raises(ValueError, match="timeout="):
        run_on_group(vf.fds_over_wrappers, world_size=2, args=(1,), timeout=timeout)


@pytest.mark.parametrize("timeout", ["5", True, None])
def test_timeouts_must_be_numbers(timeout):
    with pytest.raises(TypeError, match="timeout="):
        distshard.verify(vf.strings, world_size=2, timeout=timeout)


@pytest.mark.parametrize(
    "build, words",
    [
        (vf.raises, "RuntimeError: this factory is broken on purpose"),
        (vf.exits_zero, "called sys.exit(0)"),
        (vf.os_exit_three, "exited with status 3 before sending a result"),
        (vf.hangs, "was still running at the 10s timeout"),
        (vf.exits_in_ranks, "exited with status 0 before sending a result"),
    ],
    ids=["raises", "sys.exit(0)", "os._exit(3)", "hangs", "ranks-os._exit(0)"],
)
@pytest.mark.spawn_ranks  # the library's default start of the ranks: exits and kills of fresh interpreters
def test_a_factory_that_cannot_run_is_an_error_not_a_verdict(build, words):
    report = distshard.verify(build, world_size=2, timeout=10 if build is vf.hangs else TIMEOUT)
    assert report.error is not None and not report.ok and not report.violated, report.summary()
    assert any(words in reason for reason in report.reasons), report.reasons
    assert "COULD NOT RUN" in report.summary()


# -- the group listens on 127.0.0.1 only -----------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("workers", [0, 2])
def test_the_group_listens_on_loopback_only(workers):
    outcomes = run_on_group(vf.sockets_while_loading, world_size=2, args=(workers,), timeout=TIMEOUT)
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    for o in outcomes:
        assert o.value, "found no listening socket: the check would prove nothing"
        assert all(vf.is_loopback(address) for address in o.value), (o.rank, o.value)


def _environment(rank, world_size, names):
    return {name: os.environ.get(name) for name in names}


def test_ranks_from_a_forkserver_get_the_callers_environment(monkeypatch):
    """A forkserver's children have the environment the server started with; the ranks get
    the caller's at the call, as under spawn (less RANK / WORLD_SIZE, as mp.spawn code)."""
    import multiprocessing.forkserver

    multiprocessing.forkserver.ensure_running()  # started before the change below
    monkeypatch.setenv("DISTSHARD_TEST_SET_AFTER_THE_SERVER", "now")
    monkeypatch.setenv("RANK", "5")
    names = ("DISTSHARD_TEST_SET_AFTER_THE_SERVER", "RANK")
    outcomes = run_on_group(_environment, world_size=2, args=(names,), start_method="forkserver", timeout=TIMEOUT)
    want = {"DISTSHARD_TEST_SET_AFTER_THE_SERVER": "now", "RANK": None}
    assert [(o.value, o.error) for o in outcomes] == [(want, None)] * 2


def test_a_carry_report_tells_the_tail_from_what_is_missing():
    from distshard.verify_report import VerifyReport, split_carried

    def split(not_received, carried):
        report = VerifyReport(2, 2, "carry", 1, carried=carried, missing_count=sum(not_received.values()))
        report.missing = dict(not_received)
        split_carried(report)
        return report

    exact = split({"a": 1, "b": 1, "c": 1}, 3)
    assert exact.ok and exact.missing == {} and exact.carried_elements == {"a": 1, "b": 1, "c": 1}
    short = split({"a": 1, "b": 1, "c": 1, "d": 2}, 3)  # which three are the tail: unknown, all are listed
    assert short.missing_count == 2 and len(short.missing) == 4 and not short.carried_elements
    assert short.violations == [
        "2 missing beyond the carried tail of 3, where even='carry' over 4 slots leaves out exactly 0"
    ]
    assert "(the carried tail is among these)" in short.summary()
    over = split({"a": 1}, 3)
    assert over.violated and over.carried_received == 2 and over.missing_count == 0


def test_verify_checks_carry_over_the_epochs_as_one_stream():
    report = distshard.verify(vf.carry_shuffled, world_size=2, num_workers=2, epochs=3, timeout=TIMEOUT)
    assert report.ok, report.summary()
    assert report.received == 68 and report.carried == 3 * 23 - 68  # 4 slots: 4 * floor(69 / 4)
    assert report.violations == [] and report.missing_count == 0 and report.missing == {}, report.summary()
    assert "missing: 0 (allowed by even: 0)" in report.summary()
    assert "carried: 1 (the last epoch's tail, which opens the next epoch)" in report.summary()
    assert sum(report.carried_elements.values()) == 1
    # what a pipe that drops every epoch's tail would show instead: 3 missing an epoch, not 1 at the end
    dropped = dataclasses.replace(
        report, missing_count=3 * 3 - 1, missing={"s22": 3, "s21": 3, "s20": 3}, carried_elements={}
    )
    assert dropped.violated and "VIOLATED" in dropped.summary()
    assert dropped.violations == [
        "8 missing beyond the carried tail of 1, where even='carry' over 4 slots leaves out exactly 0"
    ]
    # and one that yields the tail in this run instead of leaving it to open the next epoch
    overrun = dataclasses.replace(report, carried_received=1, carried_elements={})
    assert overrun.violated and "VIOLATED" in overrun.summary()
    assert overrun.violations[0].startswith("1 more received than the epochs' carry windows hold")
