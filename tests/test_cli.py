"""The command line, run as a user runs it."""

import contextlib
import io
import json
import os
import subprocess
import sys
import time

import pytest

from .verify_factories import HANG_ON_IMPORT


def test_demo_reports_exactly_once_and_exits_zero():
    done = subprocess.run(
        [sys.executable, "-m", "distshard", "demo"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "TypeError" in out  # the classic recipe on the same records
    # even='carry' over two epochs: every record of both once, the same count a slot each epoch
    assert "even='carry' epochs=2: 2000 received" in out
    assert "per rank: [500, 500, 500, 500]" in out  # 4 x 4 slots
    assert "duplicates: 0 (allowed by even: 0)" in out and "missing: 0 (allowed by even: 0)" in out
    assert "epoch 0: 62 each, epoch 1: 63 each" in out  # epoch 0's tail of 8 opens epoch 1
    assert "verdict: EXACTLY-ONCE" in out
    # even='drop''s tail said for what it is, the records named
    assert "every slot yields 62 an epoch (1000 // 16 slots), and the last 8\n  records" in out
    assert "not a\n  loss" in out and out.count("utt-") >= 3


def test_unknown_command_is_a_usage_error(capsys):
    # argparse's answer, in this process (the demo above runs the real `python -m distshard`)
    from distshard.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["frobnicate"])
    assert exited.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def _check_process(*args, timeout=180, env=None):
    """``python -m distshard check ...`` as a user runs it: a fresh interpreter whose ranks start by
    the library's default (spawn). A few tests run it so; the others call the same entry point in
    this process (``_check``), without the seconds of a fresh interpreter that imports torch."""
    return subprocess.run(
        [sys.executable, "-m", "distshard", "check", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def _check(*args, env=None):
    """``main(["check", ...])`` in this process, its output captured, its exit status as the
    command's (argparse's usage errors exit 2); ``env`` is set for the run (the ranks get it)."""
    from distshard.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(["check", *args])
            except SystemExit as exc:
                code = exc.code
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return subprocess.CompletedProcess(["check", *args], code, out.getvalue(), err.getvalue())


def test_check_passes_a_good_pipeline():
    done = _check_process("tests.builds:dicts_drop", "--world-size", "2", "--num-workers", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verdict: EXACTLY-ONCE" in done.stdout and "per slot: [25, 25, 25, 25]" in done.stdout


def test_check_finds_the_duplicates_of_an_unsynced_sharding_filter():
    done = _check("tests.builds:sharding_filter_unsynced", "--world-size", "3", "--loader", "none", "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["verdict"] == "VIOLATIONS FOUND"
    assert report["duplicates"] == report["missing"] > 0 and report["duplicate_examples"]


def test_check_with_even_requires_equal_slots_and_says_why_not():
    done = _check(
        "tests.builds:strings_none",
        "--world-size",
        "3",
        "--num-workers",
        "1",
        "--even",
        "drop",
        "--timeout",
        "60",
        "--json",
    )
    assert done.returncode == 1, done.stdout + done.stderr  # 1000 over 3 slots cannot be equal
    reasons = json.loads(done.stdout)["reasons"]
    assert any(
        "per-slot counts differ (334, 333, 333), where even='drop' requires every slot to yield the "
        "same (the pipeline's own dist_shard has even=None)" in r
        for r in reasons
    ), reasons


@pytest.mark.parametrize(
    "factory, words",
    [
        ("tests.builds", "not of the form pkg.module:function"),
        ("tests.no_such_module:build", "could not import 'tests.no_such_module'"),
        ("tests.builds:no_such_function", "has no attribute 'no_such_function'"),
        ("tests.builds:NOT_CALLABLE", "is a int, not a callable"),
        ("tests.builds:not_a_pipeline_factory", "this factory is broken on purpose"),
    ],
)
def test_check_could_not_run_is_its_own_exit_status(factory, words):
    # a missing module is found before anything starts, unless the package is imported: here it is
    run = _check_process if "no_such_module" in factory else _check
    done = run(factory, "--world-size", "2", "--timeout", "60")
    assert done.returncode == 2, done.stdout + done.stderr
    assert words in done.stderr


@pytest.mark.parametrize(
    "factory, env, timeout, words",
    [
        ("hangs", {}, 5, "the reference run sent no result: it was still running at the 5s timeout"),
        ("strings", {HANG_ON_IMPORT: "1"}, 5, "was still running at the 5s timeout"),  # hangs on import
        ("hangs_in_ranks", {}, 5, "rank 0 sent no result: it was still running at the 5s timeout"),
        ("exits_zero", {}, 60, "called sys.exit(0) instead of returning"),
        ("os_exit_three", {}, 60, "exited with status 3 before sending a result"),
        ("exits_in_ranks", {}, 60, "rank 0 sent no result: it exited with status 0"),
        ("raises", {}, 60, "RuntimeError: this factory is broken on purpose"),
    ],
    ids=["hangs", "hangs-on-import", "hangs-in-ranks", "sys.exit(0)", "os._exit(3)", "ranks-os._exit(0)", "raises"],
)
def test_check_bounds_the_whole_run_and_never_passes_a_factory_that_cannot_run(factory, env, timeout, words):
    started = time.monotonic()
    done = _check(
        f"tests.verify_factories:{factory}",
        "--world-size",
        "2",
        "--timeout",
        str(timeout),
        env=env,
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 2, done.stdout + done.stderr
    assert "verdict: COULD NOT RUN" in done.stdout and words in done.stderr, done.stdout + done.stderr
    assert elapsed < timeout + 20  # a sanity bound, not a benchmark


@pytest.mark.parametrize("value", ["nan", "0", "-1", "inf", "-inf", "soon"])
def test_check_refuses_a_timeout_that_bounds_nothing(value):
    done = _check("tests.builds:strings_none", "--world-size", "2", f"--timeout={value}")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "argument --timeout" in done.stderr and repr(value) in done.stderr
    assert "checking" not in done.stderr  # refused before anything started


# -- issue 15: errors that help ------------------------------------------------------------


def test_a_factory_that_returns_no_pipeline_is_told_what_to_return():
    done = _check("tests.builds:returns_a_list", "--world-size", "2", "--timeout", "60")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "returned list, not an IterDataPipe: the factory must return the pipeline" in done.stderr
    assert "AttributeError" not in done.stdout + done.stderr


@pytest.mark.parametrize(
    "factory, words, started",
    [
        ("tests.no_such_module:build", "No module named 'tests.no_such_module'", False),  # found missing at once
        ("tests.builds:no_such_function", "'tests.builds' has no attribute 'no_such_function'", True),
    ],
)
def test_a_factory_that_cannot_be_loaded_is_reported_once(factory, words, started):
    done = _check_process(factory, "--world-size", "2", "--timeout", "60")  # three processes, one report
    assert done.returncode == 2, done.stdout + done.stderr
    assert (done.stdout + done.stderr).count(words) == 1, done.stdout + done.stderr
    assert ("checking" in done.stderr) == started  # a missing module: nothing was started


def test_check_multiple_of_allows_its_own_tail():
    done = _check("tests.builds:drop_multiple_of", "--world-size", "2", "--num-workers", "2", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["per_slot"] == [24] * 4 and report["missing"] == report["allowed_missing"] == 7


def test_check_of_an_exact_carry_run_reports_the_tail_as_carried_not_missing():
    done = _check("tests.builds:carry_strings", "--world-size", "2", "--num-workers", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verdict: EXACTLY-ONCE" in done.stdout and "per slot: [5, 5, 5, 5]" in done.stdout
    assert "violation" not in done.stdout, done.stdout
    assert "missing: 0 (allowed by even: 0)" in done.stdout, done.stdout
    assert "carried: 3 (the last epoch's tail, which opens the next epoch)" in done.stdout, done.stdout
    done = _check("tests.builds:carry_strings", "--world-size", "2", "--num-workers", "2", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["verdict"] == "EXACTLY-ONCE" and report["reasons"] == []
    assert report["missing"] == report["allowed_missing"] == 0 and report["carried"] == 3
    assert sum(report["carried_examples"].values()) == 3


def test_help_shows_every_default(capsys):
    from distshard.__main__ import main

    with pytest.raises(SystemExit):
        main(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 0)", "(default: fork)", "(default: torch)", "(default: 1)", "(default: 120.0)"):
        assert default in text, default
    assert "required" in text and "(default: None)" in text  # --even's


def test_the_index_command_starts_without_importing_torch(tmp_path):
    """`python -m distshard index` runs before the package imports its pipes (torch:
    seconds of a fresh process); its output and files are those of the full import."""
    from .source_factories import write_shards

    paths, expected = write_shards(tmp_path / "data", shards=3, per_shard=4)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "DISTSHARD_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "distshard", "index", str(tmp_path / "data" / "shard-*.tar")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "distshard.sources.stored.indexing" in imported and "torch" not in imported
    assert "3 files (3 indexed now)" in done.stdout
    import distshard

    source = distshard.webdataset(str(tmp_path / "data" / "shard-*.tar"))
    assert len(source) == len(expected) and source._stored is not None and source._indexed_here == 0
    # the other commands import the package whole, as before
    done = subprocess.run(
        [sys.executable, "-m", "distshard", "index", "--help"], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0 and "--workers" in done.stdout and "(default 32)" in " ".join(done.stdout.split())
