"""The typed state (``state.State``) reads and writes the wire format of version 3
exactly as it was: states captured as JSON from the code before the typed state
(``tests/``'s builds below, 3 ranks, rank ``r`` stopped after ``r + 1`` elements, and
their merge) load, resume where they stopped, merge to the same dict, and round-trip
unchanged, for every layout (stride, chunks, blocks, units), every ``even`` and every
mode; whole compressed files keep their ``files:`` source on the wire."""

from __future__ import annotations

import json

import pytest
from torch.utils.data.datapipes.iter import IterableWrapper

import distshard
from distshard import merge_states
from distshard.errors import OptionError, StateMismatchError, UnsupportedError
from distshard.layouts import LAYOUTS
from distshard.state import State, find_states, validate_state

N = 23
UNITS = [[f"u{u}-{i}" for i in range(n)] for u, n in enumerate([5, 3, 7, 4, 6])]


def build(kind, even, rank, world):
    """The pipelines the states below were captured from."""
    kw = dict(rank=rank, world_size=world, even=even, seed=7)
    if kind == "stride":
        return IterableWrapper([f"e{i}" for i in range(N)]).dist_shard(**kw)
    if kind == "stride_shuffle":
        return IterableWrapper([f"e{i}" for i in range(N)]).dist_shard(shuffle=True, **kw)
    if kind == "chunks":
        return IterableWrapper([f"e{i}" for i in range(N)]).dist_shard(multiple_of=2, **kw)
    sizes = [len(u) for u in UNITS]
    if kind == "blocks":
        return IterableWrapper(list(range(len(UNITS)))).dist_shard(expand=lambda u: UNITS[u], sizes=sizes, **kw)
    assert kind == "units"
    return IterableWrapper(list(range(len(UNITS)))).dist_shard(expand=lambda u: UNITS[u], **kw)


# per case: the 3 slot states, what each slot yields after loading its state, their merge,
# and what 2 ranks yield after loading the merge (or the merge's refusal)
CAPTURED = json.loads(
    r"""[
{"kind": "stride", "even": null, "states": [{"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": null, "layout": "stride", "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 23, "num_slots": 3, "slot": 0, "taken": 1, "finished": false, "carry_from": null}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": null, "layout": "stride", "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 23, "num_slots": 3, "slot": 1, "taken": 2, "finished": false, "carry_from": null}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": null, "layout": "stride", "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 23, "num_slots": 3, "slot": 2, "taken": 3, "finished": false, "carry_from": null}], "rests": [["e3", "e6", "e9", "e12", "e15", "e18", "e21"], ["e7", "e10", "e13", "e16", "e19", "e22"], ["e11", "e14", "e17", "e20"]], "merged": {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": null, "layout": null, "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": null, "remaining": [[3, 4], [6, 8], [9, 23]], "total": 17, "num_slots": null, "slot": null, "taken": 0, "finished": false, "carry_from": null}, "merged_rests": [["e3", "e7", "e10", "e12", "e14", "e16", "e18", "e20", "e22"], ["e6", "e9", "e11", "e13", "e15", "e17", "e19", "e21"]]},
{"kind": "stride", "even": "drop", "states": [{"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "drop", "layout": "stride", "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 23, "num_slots": 3, "slot": 0, "taken": 1, "finished": false, "carry_from": null}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "drop", "layout": "stride", "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 23, "num_slots": 3, "slot": 1, "taken": 2, "finished": false, "carry_from": null}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "drop", "layout": "stride", "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 23, "num_slots": 3, "slot": 2, "taken": 3, "finished": false, "carry_from": null}], "rests": [["e3", "e6", "e9", "e12", "e15", "e18"], ["e7", "e10", "e13", "e16", "e19"], ["e11", "e14", "e17", "e20"]], "merged": {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "drop", "layout": null, "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": null, "remaining": [[3, 4], [6, 8], [9, 23]], "total": 17, "num_slots": null, "slot": null, "taken": 0, "finished": false, "carry_from": null}, "merged_rests": [["e3", "e7", "e10", "e12", "e14", "e16", "e18", "e20"], ["e6", "e9", "e11", "e13", "e15", "e17", "e19", "e21"]]},
{"kind": "stride", "even": "pad", "states": [{"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "pad", "layout": "stride", "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 23, "num_slots": 3, "slot": 0, "taken": 1, "finished": false, "carry_from": null}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "pad", "layout": "stride", "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 23, "num_slots": 3, "slot": 1, "taken": 2, "finished": false, "carry_from": null}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "pad", "layout": "stride", "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 23, "num_slots": 3, "slot": 2, "taken": 3, "finished": false, "carry_from": null}], "rests": [["e3", "e6", "e9", "e12", "e15", "e18", "e21"], ["e7", "e10", "e13", "e16", "e19", "e22"], ["e11", "e14", "e17", "e20", "e2"]], "merged": {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "pad", "layout": null, "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": null, "remaining": [[3, 4], [6, 8], [9, 23]], "total": 17, "num_slots": null, "slot": null, "taken": 0, "finished": false, "carry_from": null}, "merged_rests": [["e3", "e7", "e10", "e12", "e14", "e16", "e18", "e20", "e22"], ["e6", "e9", "e11", "e13", "e15", "e17", "e19", "e21", "e6"]]},
{"kind": "stride", "even": "carry", "states": [{"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "carry", "layout": "stride", "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 21, "num_slots": 3, "slot": 0, "taken": 1, "finished": false, "carry_from": 0}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "carry", "layout": "stride", "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 21, "num_slots": 3, "slot": 1, "taken": 2, "finished": false, "carry_from": 0}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "carry", "layout": "stride", "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 21, "num_slots": 3, "slot": 2, "taken": 3, "finished": false, "carry_from": 0}], "rests": [["e3", "e6", "e9", "e12", "e15", "e18"], ["e7", "e10", "e13", "e16", "e19"], ["e11", "e14", "e17", "e20"]], "merged": {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "carry", "layout": null, "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": null, "remaining": [[3, 4], [6, 8], [9, null]], "total": null, "num_slots": null, "slot": null, "taken": 0, "finished": false, "carry_from": 0}, "merged_rests": [["e3", "e7", "e10", "e12", "e14", "e16", "e18", "e20"], ["e6", "e9", "e11", "e13", "e15", "e17", "e19", "e21"]]},
{"kind": "stride_shuffle", "even": "pad", "states": [{"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "pad", "layout": "stride", "shuffle": true, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 23, "num_slots": 3, "slot": 0, "taken": 1, "finished": false, "carry_from": null}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "pad", "layout": "stride", "shuffle": true, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 23, "num_slots": 3, "slot": 1, "taken": 2, "finished": false, "carry_from": null}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "pad", "layout": "stride", "shuffle": true, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 23, "num_slots": 3, "slot": 2, "taken": 3, "finished": false, "carry_from": null}], "rests": [["e13", "e4", "e3", "e16", "e0", "e8", "e6"], ["e22", "e7", "e17", "e18", "e21", "e14"], ["e5", "e11", "e9", "e12", "e10"]], "merged": {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "pad", "layout": null, "shuffle": true, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 1, "workers": null, "remaining": [[3, 4], [6, 8], [9, 23]], "total": 17, "num_slots": null, "slot": null, "taken": 0, "finished": false, "carry_from": null}, "merged_rests": [["e13", "e22", "e7", "e16", "e11", "e18", "e8", "e12", "e14"], ["e4", "e3", "e5", "e17", "e0", "e9", "e21", "e6", "e4"]]},
{"kind": "chunks", "even": "drop", "states": [{"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "drop", "layout": "chunks", "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 2, "workers": 1, "remaining": [[0, null]], "total": 23, "num_slots": 3, "slot": 0, "taken": 1, "finished": false, "carry_from": null}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "drop", "layout": "chunks", "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 2, "workers": 1, "remaining": [[0, null]], "total": 23, "num_slots": 3, "slot": 1, "taken": 2, "finished": false, "carry_from": null}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "drop", "layout": "chunks", "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 2, "workers": 1, "remaining": [[0, null]], "total": 23, "num_slots": 3, "slot": 2, "taken": 3, "finished": false, "carry_from": null}], "rests": [["e1", "e6", "e7", "e12", "e13"], ["e8", "e9", "e14", "e15"], ["e11", "e16", "e17"]], "merged": {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "drop", "layout": null, "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 2, "workers": null, "remaining": [[1, 2], [6, 10], [11, 23]], "total": 17, "num_slots": null, "slot": null, "taken": 0, "finished": false, "carry_from": null}, "merged_rests": [["e1", "e6", "e9", "e11", "e14", "e15", "e18", "e19"], ["e7", "e8", "e12", "e13", "e16", "e17", "e20", "e21"]]},
{"kind": "chunks", "even": "carry", "states": [{"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "carry", "layout": "chunks", "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 2, "workers": 1, "remaining": [[0, null]], "total": 18, "num_slots": 3, "slot": 0, "taken": 1, "finished": false, "carry_from": 0}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "carry", "layout": "chunks", "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 2, "workers": 1, "remaining": [[0, null]], "total": 18, "num_slots": 3, "slot": 1, "taken": 2, "finished": false, "carry_from": 0}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "carry", "layout": "chunks", "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 2, "workers": 1, "remaining": [[0, null]], "total": 18, "num_slots": 3, "slot": 2, "taken": 3, "finished": false, "carry_from": 0}], "rests": [["e1", "e6", "e7", "e12", "e13"], ["e8", "e9", "e14", "e15"], ["e11", "e16", "e17"]], "merged": {"distshard": 3, "epoch": 0, "seed": 7, "mode": "element", "even": "carry", "layout": null, "shuffle": false, "length": 23, "source": "sequence:list:23:bd6dca22", "multiple_of": 2, "workers": null, "remaining": [[1, 2], [6, 10], [11, null]], "total": null, "num_slots": null, "slot": null, "taken": 0, "finished": false, "carry_from": 0}, "merged_rests": [["e1", "e6", "e9", "e11", "e14", "e15", "e18", "e19"], ["e7", "e8", "e12", "e13", "e16", "e17", "e20", "e21"]]},
{"kind": "blocks", "even": null, "states": [{"distshard": 3, "epoch": 0, "seed": 7, "mode": "sized_units", "even": null, "layout": "blocks", "shuffle": false, "length": 25, "source": "sized_units:5:25:eec5c7b2", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 25, "num_slots": 3, "slot": 0, "taken": 1, "finished": false, "carry_from": null}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "sized_units", "even": null, "layout": "blocks", "shuffle": false, "length": 25, "source": "sized_units:5:25:eec5c7b2", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 25, "num_slots": 3, "slot": 1, "taken": 2, "finished": false, "carry_from": null}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "sized_units", "even": null, "layout": "blocks", "shuffle": false, "length": 25, "source": "sized_units:5:25:eec5c7b2", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 25, "num_slots": 3, "slot": 2, "taken": 3, "finished": false, "carry_from": null}], "rests": [["u0-1", "u0-2", "u0-3", "u0-4", "u1-0", "u1-1", "u1-2", "u2-0"], ["u2-3", "u2-4", "u2-5", "u2-6", "u3-0", "u3-1"], ["u4-1", "u4-2", "u4-3", "u4-4", "u4-5"]], "merged": {"distshard": 3, "epoch": 0, "seed": 7, "mode": "sized_units", "even": null, "layout": null, "shuffle": false, "length": 25, "source": "sized_units:5:25:eec5c7b2", "multiple_of": 1, "workers": null, "remaining": [[1, 9], [11, 17], [20, 25]], "total": 19, "num_slots": null, "slot": null, "taken": 0, "finished": false, "carry_from": null}, "merged_rests": [["u0-1", "u0-2", "u0-3", "u0-4", "u1-0", "u1-1", "u1-2", "u2-0", "u2-3", "u2-4"], ["u2-5", "u2-6", "u3-0", "u3-1", "u4-1", "u4-2", "u4-3", "u4-4", "u4-5"]]},
{"kind": "blocks", "even": "drop", "states": [{"distshard": 3, "epoch": 0, "seed": 7, "mode": "sized_units", "even": "drop", "layout": "blocks", "shuffle": false, "length": 25, "source": "sized_units:5:25:eec5c7b2", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 25, "num_slots": 3, "slot": 0, "taken": 1, "finished": false, "carry_from": null}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "sized_units", "even": "drop", "layout": "blocks", "shuffle": false, "length": 25, "source": "sized_units:5:25:eec5c7b2", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 25, "num_slots": 3, "slot": 1, "taken": 2, "finished": false, "carry_from": null}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "sized_units", "even": "drop", "layout": "blocks", "shuffle": false, "length": 25, "source": "sized_units:5:25:eec5c7b2", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 25, "num_slots": 3, "slot": 2, "taken": 3, "finished": false, "carry_from": null}], "rests": [["u0-1", "u0-2", "u0-3", "u0-4", "u1-0", "u1-1", "u1-2"], ["u2-2", "u2-3", "u2-4", "u2-5", "u2-6", "u3-0"], ["u4-0", "u4-1", "u4-2", "u4-3", "u4-4"]], "merged": {"distshard": 3, "epoch": 0, "seed": 7, "mode": "sized_units", "even": "drop", "layout": null, "shuffle": false, "length": 25, "source": "sized_units:5:25:eec5c7b2", "multiple_of": 1, "workers": null, "remaining": [[1, 8], [10, 16], [19, 25]], "total": 19, "num_slots": null, "slot": null, "taken": 0, "finished": false, "carry_from": null}, "merged_rests": [["u0-1", "u0-2", "u0-3", "u0-4", "u1-0", "u1-1", "u1-2", "u2-2", "u2-3"], ["u2-4", "u2-5", "u2-6", "u3-0", "u4-0", "u4-1", "u4-2", "u4-3", "u4-4"]]},
{"kind": "blocks", "even": "pad", "states": [{"distshard": 3, "epoch": 0, "seed": 7, "mode": "sized_units", "even": "pad", "layout": "blocks", "shuffle": false, "length": 25, "source": "sized_units:5:25:eec5c7b2", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 25, "num_slots": 3, "slot": 0, "taken": 1, "finished": false, "carry_from": null}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "sized_units", "even": "pad", "layout": "blocks", "shuffle": false, "length": 25, "source": "sized_units:5:25:eec5c7b2", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 25, "num_slots": 3, "slot": 1, "taken": 2, "finished": false, "carry_from": null}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "sized_units", "even": "pad", "layout": "blocks", "shuffle": false, "length": 25, "source": "sized_units:5:25:eec5c7b2", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 25, "num_slots": 3, "slot": 2, "taken": 3, "finished": false, "carry_from": null}], "rests": [["u0-1", "u0-2", "u0-3", "u0-4", "u1-0", "u1-1", "u1-2", "u2-0"], ["u2-3", "u2-4", "u2-5", "u2-6", "u3-0", "u3-1", "u2-1"], ["u4-1", "u4-2", "u4-3", "u4-4", "u4-5", "u3-2"]], "merged": {"distshard": 3, "epoch": 0, "seed": 7, "mode": "sized_units", "even": "pad", "layout": null, "shuffle": false, "length": 25, "source": "sized_units:5:25:eec5c7b2", "multiple_of": 1, "workers": null, "remaining": [[1, 9], [11, 17], [20, 25]], "total": 19, "num_slots": null, "slot": null, "taken": 0, "finished": false, "carry_from": null}, "merged_rests": [["u0-1", "u0-2", "u0-3", "u0-4", "u1-0", "u1-1", "u1-2", "u2-0", "u2-3", "u2-4"], ["u2-5", "u2-6", "u3-0", "u3-1", "u4-1", "u4-2", "u4-3", "u4-4", "u4-5", "u2-5"]]},
{"kind": "blocks", "even": "carry", "states": [{"distshard": 3, "epoch": 0, "seed": 7, "mode": "sized_units", "even": "carry", "layout": "blocks", "shuffle": false, "length": 25, "source": "sized_units:5:25:eec5c7b2", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 24, "num_slots": 3, "slot": 0, "taken": 1, "finished": false, "carry_from": 0}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "sized_units", "even": "carry", "layout": "blocks", "shuffle": false, "length": 25, "source": "sized_units:5:25:eec5c7b2", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 24, "num_slots": 3, "slot": 1, "taken": 2, "finished": false, "carry_from": 0}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "sized_units", "even": "carry", "layout": "blocks", "shuffle": false, "length": 25, "source": "sized_units:5:25:eec5c7b2", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": 24, "num_slots": 3, "slot": 2, "taken": 3, "finished": false, "carry_from": 0}], "rests": [["u0-1", "u0-2", "u0-3", "u0-4", "u1-0", "u1-1", "u1-2"], ["u2-2", "u2-3", "u2-4", "u2-5", "u2-6", "u3-0"], ["u4-0", "u4-1", "u4-2", "u4-3", "u4-4"]], "merged": {"distshard": 3, "epoch": 0, "seed": 7, "mode": "sized_units", "even": "carry", "layout": null, "shuffle": false, "length": 25, "source": "sized_units:5:25:eec5c7b2", "multiple_of": 1, "workers": null, "remaining": [[1, 8], [10, 16], [19, null]], "total": null, "num_slots": null, "slot": null, "taken": 0, "finished": false, "carry_from": 0}, "merged_rests": [["u0-1", "u0-2", "u0-3", "u0-4", "u1-0", "u1-1", "u1-2", "u2-2", "u2-3"], ["u2-4", "u2-5", "u2-6", "u3-0", "u4-0", "u4-1", "u4-2", "u4-3", "u4-4"]]},
{"kind": "units", "even": null, "states": [{"distshard": 3, "epoch": 0, "seed": 7, "mode": "units", "even": null, "layout": "units", "shuffle": false, "length": null, "source": "units:IterableWrapperIterDataPipe(list:5:7914fecd)", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": null, "num_slots": 3, "slot": 0, "taken": 1, "finished": false, "carry_from": null}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "units", "even": null, "layout": "units", "shuffle": false, "length": null, "source": "units:IterableWrapperIterDataPipe(list:5:7914fecd)", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": null, "num_slots": 3, "slot": 1, "taken": 2, "finished": false, "carry_from": null}, {"distshard": 3, "epoch": 0, "seed": 7, "mode": "units", "even": null, "layout": "units", "shuffle": false, "length": null, "source": "units:IterableWrapperIterDataPipe(list:5:7914fecd)", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": null, "num_slots": 3, "slot": 2, "taken": 3, "finished": false, "carry_from": null}], "rests": [["u0-1", "u0-2", "u0-3", "u0-4", "u3-0", "u3-2"], ["u1-2", "u3-1", "u3-3"], ["u2-3", "u2-4", "u2-5", "u2-6", "u4-0", "u4-1", "u4-2", "u4-3", "u4-4", "u4-5"]], "merged": null, "merged_rests": "elastic resume in unit mode needs sizes= (without them nobod"}
]"""
)

# two slots of distshard.jsonl over three .jsonl.gz files (whole compressed files)
WHOLE_FILES = json.loads(
    r"""[{"distshard": 3, "epoch": 0, "seed": 0, "mode": "units", "even": null, "layout": "units", "shuffle": false, "length": null, "source": "files:e49237d9:JsonLinesIterDataPipe", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": null, "num_slots": 2, "slot": 0, "taken": 1, "finished": false, "carry_from": null}, {"distshard": 3, "epoch": 0, "seed": 0, "mode": "units", "even": null, "layout": "units", "shuffle": false, "length": null, "source": "files:e49237d9:JsonLinesIterDataPipe", "multiple_of": 1, "workers": 1, "remaining": [[0, null]], "total": null, "num_slots": 2, "slot": 1, "taken": 1, "finished": false, "carry_from": null}]"""
)

CASES = [pytest.param(case, id=f"{case['kind']}-{case['even']}") for case in CAPTURED]


def test_the_captured_states_cover_every_layout_even_and_mode():
    states = [s for case in CAPTURED for s in case["states"]] + WHOLE_FILES
    assert {s["layout"] for s in states} == set(LAYOUTS)
    assert {s["even"] for s in states} == {None, "drop", "pad", "carry"}
    assert {s["mode"] for s in states} == {"element", "units", "sized_units"}


@pytest.mark.parametrize("case", CASES)
def test_a_state_of_today_round_trips_unchanged(case):
    for wire in [*case["states"], *([case["merged"]] if case["merged"] else [])]:
        typed = State.from_dict(wire)
        assert typed.to_dict() == wire
        assert json.loads(json.dumps(typed.to_dict())) == wire  # plain JSON, the same keys and values
        assert validate_state(wire) == wire
        assert find_states({"nested": [wire]}) == [wire]
        assert (typed.layout.name if typed.layout else None) == wire["layout"]
        assert typed.is_slot == (wire["slot"] is not None)
        assert not typed.whole_files


@pytest.mark.parametrize("case", CASES)
def test_the_states_written_now_are_todays_exactly(case):
    """What a slot reports now is, key for key, what the code before the typed state
    reported at the same point: code of either side reads the other's states."""
    for rank, wire in enumerate(case["states"]):
        pipe = build(case["kind"], case["even"], rank, 3)
        it = iter(pipe)
        for _ in range(rank + 1):
            next(it)
        assert pipe.state_dict() == wire


@pytest.mark.parametrize("case", CASES)
def test_a_state_of_today_resumes_where_it_stopped(case):
    for rank, (wire, rest) in enumerate(zip(case["states"], case["rests"], strict=True)):
        pipe = build(case["kind"], case["even"], rank, 3)
        pipe.load_state_dict(json.loads(json.dumps(wire)))
        assert list(pipe) == rest
        assert pipe.state_dict() != wire or not rest  # it moved on


@pytest.mark.parametrize("case", CASES)
def test_states_of_today_merge_to_the_same_state_and_resume_elastically(case):
    if case["merged"] is None:  # units without sizes: refused, as before
        with pytest.raises(UnsupportedError, match="elastic resume in unit mode needs sizes="):
            merge_states(case["states"])
        assert case["merged_rests"].startswith("elastic resume in unit mode needs sizes=")
        return
    assert merge_states(case["states"]) == case["merged"]
    for rank, rest in enumerate(case["merged_rests"]):
        pipe = build(case["kind"], case["even"], rank, 2)
        pipe.load_state_dict(case["merged"])
        assert list(pipe) == rest


def test_whole_files_are_a_field_of_the_typed_state_and_a_source_prefix_on_the_wire():
    for wire in WHOLE_FILES:
        typed = State.from_dict(wire)
        assert typed.whole_files and typed.layout is LAYOUTS["units"]
        assert typed.to_dict() == wire  # the wire says it as before: source "files:..."
    with pytest.raises(UnsupportedError, match="elastic resume over compressed files cannot be done"):
        merge_states(WHOLE_FILES)
    with pytest.raises(OptionError, match="whole_files=True but source='units:x'"):
        State(epoch=0, mode="units", even=None, source="units:x", whole_files=True)


def test_the_new_error_classes_are_the_builtins_callers_caught():
    a, b = CAPTURED[0]["states"][:2]
    with pytest.raises(StateMismatchError, match="disagree on epoch") as caught:
        merge_states([a, dict(b, epoch=1)])
    assert isinstance(caught.value, ValueError)
    with pytest.raises(OptionError, match="not a valid distshard state: layout='diagonal'") as bad:
        validate_state(dict(a, layout="diagonal"))
    assert isinstance(bad.value, ValueError)
    with pytest.raises(StateMismatchError, match="slot 0 of 3's, but this copy is slot 1 of 3"):
        pipe = build("stride", None, 1, 3)
        pipe.load_state_dict(a)
        list(pipe)
    assert distshard.DistshardError in StateMismatchError.__mro__
