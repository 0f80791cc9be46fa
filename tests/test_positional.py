"""Random access only where ``[]`` is positional; every other container is streamed,
so the sharded union always equals plain iteration, element for element."""

import array
import mmap
import pickle
from collections import namedtuple
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset
from torch.utils.data.datapipes.datapipe import IterDataPipe
from torch.utils.data.datapipes.iter import IterableWrapper
from torch.utils.data.datapipes.map import SequenceWrapper

import distshard
from distshard.graph import is_positional, plan_pushdown, random_access


class LabelledSeries:
    """Like a pandas Series with its own index: ``[]`` looks a label up, iteration
    yields the values in order."""

    def __init__(self, values, labels):
        self.values, self.labels = list(values), list(labels)

    def __len__(self):
        return len(self.values)

    def __getitem__(self, label):
        return self.values[self.labels.index(label)]

    def __iter__(self):
        return iter(self.values)


class Declared(LabelledSeries):
    """A user type that declares its ``[]`` positional (default labels)."""

    __distshard_positional__ = True

    def __init__(self, values):
        super().__init__(values, range(len(values)))


class ReversedList(list):
    def __iter__(self):
        return reversed(self)


class Lazy:
    """``__len__`` and ``__getitem__`` only: Python iterates it as ``[0], [1], ...``."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if not 0 <= index < self.n:
            raise IndexError(index)
        return f"decoded-{index}"


class LazySequence(Sequence):
    """A ``collections.abc.Sequence``: its inherited ``__iter__`` indexes."""

    def __len__(self):
        return 10

    def __getitem__(self, index):
        if not 0 <= index < 10:
            raise IndexError(index)
        return -index


class MapStyle(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, index):
        if index >= 10:
            raise IndexError(index)
        return {"x": index}


def _plain(value):
    return value.tolist() if hasattr(value, "tolist") else value


def _sharded_union(source, world_size):
    """Every slot's output, put back in position order (position p is in slot p % S)."""
    per_slot = [
        list(IterableWrapper(source, deepcopy=False).dist_shard(rank=r, world_size=world_size))
        for r in range(world_size)
    ]
    total = sum(map(len, per_slot))
    return [_plain(per_slot[p % world_size][p // world_size]) for p in range(total)]


def _iterated(source):
    return [_plain(x) for x in IterableWrapper(source, deepcopy=False)]


@pytest.fixture
def mapped(tmp_path):
    path = tmp_path / "bytes.bin"
    path.write_bytes(bytes(range(65, 85)))
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
        yield view


@pytest.mark.parametrize(
    "labels", [range(19, -1, -1), [7, 3, 11, 0, 19, 5, 1, 14, 2, 9, 4, 18, 6, 13, 8, 16, 10, 17, 12, 15]]
)
@pytest.mark.parametrize("world_size", [1, 3])
def test_label_indexed_series_is_streamed_in_iteration_order(labels, world_size):
    series = LabelledSeries([f"v{i}" for i in range(20)], labels)
    assert plan_pushdown(IterableWrapper(series), True).sequence is None
    assert _sharded_union(series, world_size) == _iterated(series) == [f"v{i}" for i in range(20)]


@pytest.mark.parametrize("world_size", [1, 3])
def test_mmap_is_streamed_as_bytes_not_read_as_ints(mapped, world_size):
    assert random_access(IterableWrapper(mapped)) == (None, False)
    union = _sharded_union(mapped, world_size)
    assert union == _iterated(mapped) == [bytes([b]) for b in range(65, 85)]


def _positional_sources(tmp_path):
    memmap = np.memmap(tmp_path / "m.npy", dtype=np.int64, mode="w+", shape=(10,))
    memmap[:] = np.arange(10)
    Point = namedtuple("Point", "a b c d e f g h i j")
    return {
        "list": list(range(10)),
        "tuple": tuple(range(10)),
        "namedtuple": Point(*range(10)),
        "range": range(10),
        "tensor": torch.arange(10),
        "tensor-2d": torch.arange(20).reshape(10, 2),
        "ndarray": np.arange(10),
        "ndarray-2d": np.arange(20).reshape(10, 2),
        "memmap": memmap,
        "array": array.array("q", range(10)),
        "SequenceWrapper": SequenceWrapper(list(range(10))),
        "SequenceWrapper.map": SequenceWrapper(range(10)).map(str),
        "positional": distshard.positional(LabelledSeries(range(10), range(10))),
        "declared": Declared(list(range(10))),
        "no __iter__": Lazy(10),
        "abc.Sequence": LazySequence(),
        "map-style Dataset": MapStyle(),
    }


@pytest.mark.parametrize(
    "name",
    [
        "list",
        "tuple",
        "namedtuple",
        "range",
        "tensor",
        "tensor-2d",
        "ndarray",
        "ndarray-2d",
        "memmap",
        "array",
        "SequenceWrapper",
        "SequenceWrapper.map",
        "positional",
        "declared",
        "no __iter__",
        "abc.Sequence",
        "map-style Dataset",
    ],
)
def test_positional_sources_take_the_fast_path_with_the_same_elements(name, tmp_path):
    source = _positional_sources(tmp_path)[name]
    sequence, copy_elements = random_access(IterableWrapper(source))
    assert sequence is source and copy_elements is True
    assert _sharded_union(source, 3) == _iterated(source)
    assert len(_iterated(source)) == 10


def test_not_positional():
    for obj in [
        {0: "a", 1: "b"},
        "abc",
        b"abc",
        LabelledSeries("ab", [1, 0]),
        ReversedList([1, 2, 3]),
        torch.tensor(3),
        np.array(3),
        SequenceWrapper({0: "a", 1: "b"}),
        SequenceWrapper({0: "a", 1: "b"}).map(str),
        bytearray(b"ab"),
        iter([1, 2]),
        np.ma.masked_array([1, 2]),
    ]:
        assert not is_positional(obj), obj


def test_hugging_face_dataset_is_recognized_by_its_class_without_importing_datasets():
    Dataset = type(
        "Dataset",
        (),
        {
            "__module__": "datasets.arrow_dataset",
            "__init__": lambda self, rows: setattr(self, "rows", rows),
            "__len__": lambda self: len(self.rows),
            "__getitem__": lambda self, i: self.rows[i],
            "__iter__": lambda self: iter(self.rows),
        },
    )
    Subclass = type("Subclass", (Dataset,), {})
    Overriding = type("Overriding", (Dataset,), {"__getitem__": lambda self, i: self.rows[-1 - i]})
    assert is_positional(Dataset([{"x": 1}])) and is_positional(Subclass([{"x": 1}]))
    assert not is_positional(Overriding([{"x": 1}]))
    assert not is_positional(type("Dataset", (), {"__module__": "mylib"})())


class _Rows(IterDataPipe):
    """A file-like source that offers its rows by position."""

    def __init__(self, rows, offer=True):
        self.rows, self.offer = rows, offer

    def __iter__(self):
        yield from self.rows

    def __distshard_sequence__(self):
        return self.rows if self.offer else None


def _double(x):
    return 2 * x


def test_a_source_offers_its_sequence_through_the_hook():
    rows = list(range(12))
    plan = plan_pushdown(_Rows(rows).map(_double), True)
    assert plan.sequence is rows and plan.copy_elements is False and len(plan.maps) == 1
    assert list(_Rows(rows).map(_double).dist_shard(rank=1, world_size=3)) == [2, 8, 14, 20]
    assert plan_pushdown(_Rows(rows, offer=False), True).sequence is None
    assert list(_Rows(rows, offer=False).dist_shard(rank=1, world_size=3)) == [1, 4, 7, 10]


def test_a_hook_returning_a_non_sequence_is_refused():
    class Broken(_Rows):
        def __distshard_sequence__(self):
            return iter(self.rows)

    with pytest.raises(TypeError, match="Broken.__distshard_sequence__.. returned list_iterator"):
        random_access(Broken([1]))


def test_positional_wrapper():
    series = LabelledSeries(["a", "b", "c"], [0, 1, 2])
    wrapped = distshard.positional(series)
    assert distshard.positional(wrapped) is wrapped
    assert len(wrapped) == 3 and wrapped[1] == "b" and list(wrapped) == ["a", "b", "c"]
    clone = pickle.loads(pickle.dumps(wrapped))
    assert list(clone) == ["a", "b", "c"]
    assert sorted(
        x for r in range(2) for x in IterableWrapper(wrapped).dist_shard(rank=r, world_size=2, shuffle=True)
    ) == ["a", "b", "c"]
    with pytest.raises(TypeError, match=r"positional\(\) needs an object with __len__ and __getitem__, got generator"):
        distshard.positional(x for x in "ab")
