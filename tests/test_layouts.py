"""The layout registry (``distshard.layouts``): every layout a state can name has one
object, and each object's positions, runs, leftover and padding agree with each other
(the engine, the merge and ``explain()`` ask these, never the name)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distshard.errors import OptionError, UnsupportedError
from distshard.layouts import LAYOUTS, choose, layout_named
from distshard.state import LAYOUTS as STATE_LAYOUTS


@dataclass(frozen=True)
class At:
    rank: int
    world_size: int
    worker_id: int
    num_workers: int

    @property
    def slot(self) -> int:
        return self.rank * self.num_workers + self.worker_id

    @property
    def num_slots(self) -> int:
        return self.world_size * self.num_workers


def places(world: int, workers: int) -> list[At]:
    return [At(r, world, w, workers) for r in range(world) for w in range(workers)]


def test_one_object_per_name_a_state_stores():
    assert STATE_LAYOUTS == ("stride", "blocks", "units", "chunks")
    assert all(LAYOUTS[name].name == name for name in STATE_LAYOUTS)
    with pytest.raises(OptionError, match="layout='rows' is not one of"):
        layout_named("rows")
    assert [choose(True, True, 2).name, choose(False, True, 2).name, choose(False, False, 2).name] == [
        "units",
        "blocks",
        "chunks",
    ]
    assert choose(False, False, 1).name == "stride"


positional = st.sampled_from([name for name, layout in LAYOUTS.items() if layout.positional])


@settings(max_examples=150, deadline=None)
@given(positional, st.integers(1, 3), st.integers(1, 3), st.sampled_from([1, 2, 3]), st.integers(0, 40), st.data())
def test_positions_runs_and_leftover_agree(name, world, workers, multiple, count, data):
    """Under even='drop' a slot's runs are its positions; what is left after every slot
    took part of its share is exactly what nobody took (the dropped tail included)."""
    layout = LAYOUTS[name]
    multiple = multiple if name == "chunks" else 1
    slots = places(world, workers)
    owned = {at.slot: list(layout.positions(at, count, "drop", multiple, 0)) for at in slots}
    for at in slots:
        assert [p for run in layout.runs(at, count, multiple, 0) for p in run] == owned[at.slot]
        skip = data.draw(st.integers(0, len(owned[at.slot])))
        assert list(layout.positions(at, count, "drop", multiple, skip)) == owned[at.slot][skip:]
    taken = [data.draw(st.integers(0, len(owned[s]))) for s in range(len(slots))]
    left = layout.left_after(taken, len(slots), workers, count, "drop", multiple).clip(count)
    read = {p for s in range(len(slots)) for p in owned[s][: taken[s]]}
    assert list(left.stream(range(count))) == sorted(set(range(count)) - read)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["stride", "blocks"]), st.integers(1, 6), st.integers(0, 30))
def test_padding_is_the_position_pad_repeats(name, num_slots, count):
    layout = LAYOUTS[name]
    for at in places(1, num_slots):
        mine = list(layout.positions(at, count, "pad", 1, 0))
        pad = layout.pad_position(at.slot, num_slots, count)
        assert (mine[-1] if pad is not None else None) == pad
        assert len(mine) == -(-count // num_slots) or not count


def test_units_refuse_what_cannot_be_exact():
    units = LAYOUTS["units"]
    assert "compressed files" in str(units.refuse_merge(True))
    assert "sizes=" in str(units.refuse_resume(False))
    assert all(LAYOUTS[name].refuse_merge(False) is None for name in ("stride", "blocks", "chunks"))
    with pytest.raises(UnsupportedError):
        units.left_after([0], 1, 1, None, None, 1)
    assert not units.carries and LAYOUTS["chunks"].needs_workers
