"""Errors by kind (docs/contract.md, "Errors by kind"): each error distshard raises on
purpose is a ``distshard.DistshardError`` of its kind *and* the built-in it always was,
so ``except ValueError`` keeps working and a caller can tell a bad argument from a
file that changed."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
from torch.utils.data.datapipes.iter import IterableWrapper

import distshard
from distshard import errors


def raised(kind: type[BaseException], builtin: type[BaseException], match: str, call) -> BaseException:
    """``call()`` raises ``kind``, which is a ``DistshardError`` and a ``builtin``."""
    with pytest.raises(kind, match=match) as info:
        call()
    assert isinstance(info.value, distshard.DistshardError), type(info.value)
    assert isinstance(info.value, builtin), type(info.value)
    return info.value


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_an_argument_value_is_an_option_error():
    raised(
        distshard.OptionError,
        ValueError,
        r"world_size=0 must be at least 1",
        lambda: IterableWrapper(range(4)).dist_shard(rank=0, world_size=0),
    )
    raised(
        distshard.OptionError,
        ValueError,
        r"samples=-1",
        lambda: distshard.weighted_sample(IterableWrapper(list("ab")), [1, 1], samples=-1),
    )


def test_an_argument_type_is_an_option_type_error():
    raised(
        distshard.OptionTypeError,
        TypeError,
        r"seq_len='4' must be an int",
        lambda: distshard.pack(IterableWrapper([[1, 2]]), seq_len="4"),
    )
    raised(distshard.OptionTypeError, TypeError, r"read_options", lambda: distshard.jsonl(["x.jsonl"], read_options={}))


def test_what_cannot_be_exact_is_unsupported():
    raised(
        distshard.UnsupportedError,
        ValueError,
        r"needs random access",
        lambda: distshard.weighted_sample(IterableWrapper(iter("abc")).filter(bool), [1, 1, 1], samples=2),
    )
    raised(
        distshard.UnsupportedError,
        ValueError,
        r"reorders them every epoch",
        lambda: distshard.pack(IterableWrapper([[1, 2], [3]]).shuffle(), seq_len=2),
    )


def test_a_state_of_nothing_distshard_wrote_is_a_state_mismatch():
    pipeline = distshard.StatefulPipeline(IterableWrapper(range(4)).dist_shard(rank=0, world_size=1))
    raised(
        distshard.StateMismatchError,
        ValueError,
        r"no distshard state found",
        lambda: pipeline.load_state_dict({"something": "else"}),
    )


def test_a_file_changed_since_it_was_indexed_is_a_source_changed_error(tmp_path):
    url = write_jsonl(tmp_path / "a.jsonl", [{"i": i} for i in range(4)])
    sequence = distshard.jsonl([url]).__distshard_sequence__()
    assert sequence[1] == {"i": 1}
    write_jsonl(tmp_path / "a.jsonl", [{"i": i} for i in range(6)])
    error = raised(distshard.SourceChangedError, ValueError, r"changed after it was indexed", lambda: sequence[0])
    assert url in str(error)


def test_a_file_that_is_not_there_is_a_source_missing_error(tmp_path):
    missing = str(tmp_path / "gone.jsonl")
    raised(distshard.SourceMissingError, FileNotFoundError, r"gone\.jsonl", lambda: list(distshard.jsonl([missing])))
    raised(
        distshard.SourceMissingError,
        FileNotFoundError,
        r"no such file",
        lambda: distshard.tokens(str(tmp_path / "absent")).__distshard_sequence__(),
    )


def test_data_that_is_not_what_was_declared_is_a_source_data_error(tmp_path):
    units = IterableWrapper(["u", "v"]).dist_shard(rank=0, world_size=1, expand=lambda u: [u] * 2, sizes=[2, 3])
    raised(distshard.SourceDataError, ValueError, r"unit 'v' has 2 elements but sizes says 3", lambda: list(units))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"i": 0}\n{"i": \n')
    raised(distshard.SourceDataError, ValueError, r"bad\.jsonl", lambda: list(distshard.jsonl([str(bad)])))


def test_a_loop_around_the_pipe_that_cannot_be_exact_is_a_setup_error():
    raised(
        distshard.SetupError, RuntimeError, r"initialized torch.distributed", lambda: list(distshard.stop_together([1]))
    )


def test_an_environment_without_this_rank_is_an_unknown_rank_error(monkeypatch):
    for name in ("RANK", "NODE_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    raised(distshard.UnknownRankError, ValueError, r"RANK is not set", distshard.current_context)


def error_classes() -> list[type[BaseException]]:
    return [getattr(errors, name) for name in errors.__all__]


def public_error_classes() -> list[type[BaseException]]:
    """distshard's own errors a caller may meet by name: the kinds, those the package
    exports, and the timeouts and remote errors the contract names."""
    from distshard.sources.formats.index_cache import IndexLockTimeout
    from distshard.sources.transport.remote import RemoteReadTimeout
    from distshard.waits import CollectiveTimeout

    exported = [getattr(distshard, name) for name in distshard.__all__ if name != "DistShardNode"]
    own = [cls for cls in exported if isinstance(cls, type) and issubclass(cls, distshard.DistshardError)]
    return [*error_classes(), *own, CollectiveTimeout, RemoteReadTimeout, IndexLockTimeout]


def test_every_kind_is_exported_and_also_a_builtin():
    assert error_classes()[0] is distshard.DistshardError
    for cls in error_classes():
        assert getattr(distshard, cls.__name__) is cls, cls
        assert cls.__name__ in distshard.__all__, cls
        assert issubclass(cls, distshard.DistshardError), cls
        if cls is not distshard.DistshardError:
            builtins = [base for base in inspect.getmro(cls) if base.__module__ == "builtins" and base is not object]
            assert builtins[0] is not Exception, f"{cls.__name__} is no built-in's kind"


def test_every_kind_is_in_the_contracts_table():
    contract = (Path(__file__).parent.parent / "docs" / "contract.md").read_text()
    section = contract[contract.index("**Errors by kind.**") :]
    table = section[: section.index("\n\n", section.index("| class |"))]
    listed = set(re.findall(r"`(\w+)`", table))
    for cls in public_error_classes():
        if cls is distshard.DistshardError:
            continue
        assert cls.__name__ in listed, f"{cls.__name__} is missing from docs/contract.md's table"


def test_a_stored_index_raises_the_same_kind_on_every_rank():
    # the collective index exchange sends an error as (class name, message); every kind
    # must come back as itself on the other ranks, not as a RuntimeError
    from distshard.sources.formats.index_cache import _ERRORS

    for cls in error_classes():
        assert _ERRORS[cls.__name__] is cls
