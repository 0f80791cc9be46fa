"""Command line.

``python -m distshard demo``
    The classic gist's exactly-once check, on records that are not integers.
``python -m distshard check pkg.module:build --world-size 4 --num-workers 2``
    Run your pipeline factory on a real gloo group and check exactly-once.
    Exit status: 0 exactly-once held, 1 violations found, 2 could not run.
``python -m distshard index "s3://bucket/train/shard-{000000..001023}.tar"``
    Index a dataset once and store the index beside it (``.distshard/``), so
    that every job starts in a few round trips: one request a remote file (a
    streamed GET, parsed as it flows), ``--workers`` at once. Exit status: 0
    indexed, 1 some files could not be indexed (the others are kept: run it
    again), 2 could not run (bad usage, a store that cannot be reached, no such
    bucket, access denied, a destination that cannot be written). ``--prune``
    then deletes the packs of entries no manifest names that are older than
    ``--prune-after`` seconds (default 3600).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable

EXIT_OK, EXIT_VIOLATED, EXIT_COULD_NOT_RUN = 0, 1, 2
_NO_READS = "unknown (the reference run did not finish)"

if TYPE_CHECKING:
    from .verify import VerifyReport


def _check_progress(args: argparse.Namespace, interactive: bool) -> Callable[[str], None]:
    """How ``check`` shows that it waits: one line rewritten in place on a terminal,
    a line every 10 s in logs, nothing with ``--json``."""
    last = [time.monotonic()]

    def progress(line: str) -> None:
        if interactive:  # one line, rewritten in place
            print(f"\r  {line}   ", end="", file=sys.stderr, flush=True)
        elif not args.json and time.monotonic() - last[0] >= 10:  # logs: a line every 10 s
            last[0] = time.monotonic()
            print(f"  {line}", file=sys.stderr, flush=True)

    return progress


def _check_verdict(report: VerifyReport) -> tuple[int, str]:
    """``(exit status, verdict)``: a violation first, then a run that could not finish."""
    if report.violated:
        return EXIT_VIOLATED, "VIOLATIONS FOUND"
    if report.error is not None:
        return EXIT_COULD_NOT_RUN, "COULD NOT RUN"
    return EXIT_OK, "EXACTLY-ONCE"


def _print_check_json(
    args: argparse.Namespace, report: VerifyReport, status: int, verdict: str, started: float
) -> None:
    print(
        json.dumps(
            {
                "status": status,
                "verdict": verdict,
                "factory": args.factory,
                "world_size": report.world_size,
                "num_workers": report.num_workers,
                "even": report.even,
                "epochs": report.epochs,
                "expected_per_epoch": report.expected,
                "received": report.received,
                "per_rank": report.per_rank,
                "per_slot": report.per_slot,
                "duplicates": report.duplicate_count,
                "missing": report.missing_count,
                "allowed_duplicates": report.allowed_duplicates * report.epochs,
                "allowed_missing": report.allowed_missing * report.epochs,
                "carried": report.carried,
                "carried_examples": dict(list(report.carried_elements.items())[:10]),
                "duplicate_examples": dict(list(report.duplicates.items())[:10]),
                "missing_examples": dict(list(report.missing.items())[:10]),
                "reads": report.reads or _NO_READS,
                "error": report.error,
                "reasons": report.reasons + report.violations,
                "seconds": round(time.monotonic() - started, 2),
            },
            indent=2,
        )
    )


def _print_check_text(report: VerifyReport, status: int, verdict: str, started: float) -> None:
    summary = report.summary().rpartition("\n  verdict: ")[0]
    # the reasons it could not run go to stderr, once, below
    print("\n".join(line for line in summary.splitlines() if not line.startswith("  error: ")))
    print(f"  reads: {report.reads or _NO_READS}")
    print(f"  time: {time.monotonic() - started:.1f}s")
    print(f"  verdict: {verdict}")
    if status == EXIT_COULD_NOT_RUN:
        for reason in report.reasons:
            print(f"could not run: {reason}", file=sys.stderr)


def check(args: argparse.Namespace) -> int:
    """``check``: the factory is imported and called only in child processes, so
    ``--timeout`` bounds the whole run, the user's code included."""
    from .verify import FactoryPath, verify

    started = time.monotonic()
    try:
        factory = FactoryPath(args.factory)
        factory.check_module()  # a module that is not there: at once, without starting anything
    except (ValueError, ImportError) as exc:
        return _could_not_run(args, [str(exc)])
    interactive = sys.stderr.isatty() and not args.json
    if not args.json:
        print(
            f"checking {args.factory} on {args.world_size} ranks x {args.num_workers} workers "
            f"(gloo on 127.0.0.1, workers by {args.start_method}, timeout {args.timeout:g}s)...",
            file=sys.stderr,
        )
    try:
        report = verify(
            factory,
            world_size=args.world_size,
            num_workers=args.num_workers,
            even=args.even if args.even is not None else "auto",
            start_method=args.start_method,
            epochs=args.epochs,
            timeout=args.timeout,
            loader=args.loader,
            progress=_check_progress(args, interactive),
            step_collective=False,  # count what each slot yields; no DDP step to deadlock on
        )
    except Exception as exc:  # noqa: BLE001 - the harness itself failed
        return _could_not_run(args, [f"{type(exc).__name__}: {exc}"])
    if interactive:
        print(file=sys.stderr)
    status, verdict = _check_verdict(report)
    if args.json:
        _print_check_json(args, report, status, verdict, started)
    else:
        _print_check_text(report, status, verdict, started)
    return status


class _IndexConsole(logging.Handler):
    """What ``index`` shows on stderr while it runs: on a terminal, the progress
    line (files, bytes, rate, ETA) rewritten in place; anywhere, the WARNING (and
    above) records the library logs, each on a line of its own (``warning: ...``;
    on a terminal the progress line is cleared first and drawn again below it),
    but a request's later retries: its first retry is shown, every retry counted
    for the summary."""

    def __init__(self, interactive: bool) -> None:
        from .sources.transport.responses import RETRY  # (not at the top: the command imports no torch)

        super().__init__(logging.WARNING)
        self.interactive, self.retry = interactive, RETRY
        self.line = ""  # the progress line last drawn (on a terminal)
        self.retries = 0
        self.retried: set[str] = set()  # the requests retried
        self.drawing = threading.Lock()  # (records come from the threads indexing files)

    def progress(self, done: int, total: int, nbytes: int, seconds: float) -> None:
        if not self.interactive:
            return
        rate = nbytes / seconds if seconds > 0 else 0.0
        eta = seconds / done * (total - done) if done else 0.0
        with self.drawing:
            self.line = (
                f"  {done}/{total} files, {nbytes / 2**20:,.1f} MiB, {rate / 2**20:,.1f} MiB/s, ETA {eta:,.0f} s"
            )
            print(f"\r{self.line}   ", end="", file=sys.stderr, flush=True)

    def emit(self, record: logging.LogRecord) -> None:
        retried = getattr(record, self.retry, None)
        with self.drawing:
            if retried is not None:
                self.retries += 1
                if str(retried) in self.retried:
                    return  # (its first retry was shown)
                self.retried.add(str(retried))
            clear = "\r\x1b[2K" if self.line else ""
            print(f"{clear}{record.levelname.lower()}: {record.getMessage()}", file=sys.stderr, flush=True)
            if self.line:
                print(f"\r{self.line}   ", end="", file=sys.stderr, flush=True)

    def end(self) -> None:
        """Close the progress line (before the command's last words)."""
        with self.drawing:
            if self.line:
                print(file=sys.stderr, flush=True)
            self.line = ""

    def retry_words(self) -> str:
        n, requests = self.retries, len(self.retried)
        if not n:
            return ""
        return f"; {n} retr{'y' if n == 1 else 'ies'} of {requests} request{'s' if requests != 1 else ''}"


def _index_arguments(args: argparse.Namespace) -> tuple[dict | None, float | None] | str:
    """``(storage options, prune grace)`` of ``index``, or why it cannot run."""
    try:
        options = json.loads(args.storage_options) if args.storage_options else None
        if options is not None and not isinstance(options, dict):
            raise ValueError("--storage-options must be a JSON object")
    except ValueError as exc:
        return f"--storage-options: {exc}"
    prune_after = getattr(args, "prune_after", None)
    if prune_after is not None and not args.prune:
        return "--prune-after is the grace period of --prune: add --prune"
    if args.prune and prune_after is None:
        from .sources.stored.pruning import DEFAULT_GRACE

        prune_after = DEFAULT_GRACE
    return options, prune_after


def index(args: argparse.Namespace) -> int:
    """``index``: build what is missing of a stored index. Exit status 0: every
    file indexed; 1: some files could not be indexed (the data: missing, malformed,
    changed while read, still failing after their retries), the others listed;
    2: could not run (see :func:`_index_failure`)."""
    from .sources.stored.indexing import build_stored_index

    arguments = _index_arguments(args)
    if isinstance(arguments, str):
        print(f"could not run: {arguments}", file=sys.stderr)
        return EXIT_COULD_NOT_RUN
    options, prune_after = arguments
    console = _IndexConsole(sys.stderr.isatty())
    logger = logging.getLogger("distshard")
    logger.addHandler(console)
    try:
        built = build_stored_index(
            args.urls,
            fmt=args.format,
            storage_options=options,
            out=args.out,
            workers=args.workers,
            progress=console.progress,
            prune_after=prune_after,
        )
    except Exception as exc:  # noqa: BLE001 - told by kind, below
        console.end()
        return _index_failure(exc)
    finally:
        logger.removeHandler(console)
    console.end()
    pruned = built.pruned
    print(
        f"{built.location}: {len(built.files)} files ({built.built} indexed now), "
        f"{built.total_bytes / 2**20:,.1f} MiB in {built.seconds:.1f} s"
        + (
            ""
            if pruned is None
            else f"; {len(pruned.deleted)} stale packs deleted, {len(pruned.young)} younger than {prune_after:g} s kept"
        )
        + console.retry_words()
    )
    return EXIT_OK


def _index_failure(exc: Exception) -> int:
    """What ``index`` says of a build that did not finish, and its exit status: 1
    for files that could not be indexed; 2 (could not run) for everything else:
    bad arguments, no file to index, a missing bucket, a store that cannot be
    reached, access denied, a destination that cannot be written."""
    from .errors import DistshardError
    from .sources.stored.indexing import IndexBuildError

    if isinstance(exc, IndexBuildError) and not exc.could_not_run:
        print(str(exc), file=sys.stderr)
        return EXIT_VIOLATED
    plain = isinstance(exc, (DistshardError, ValueError, TypeError, ImportError, FileNotFoundError, PermissionError))
    print(f"could not run: {exc if plain else f'{type(exc).__name__}: {exc}'}", file=sys.stderr)
    return EXIT_COULD_NOT_RUN


def index_command_alone() -> int | None:
    """``python -m distshard index ...`` run while Python imports the package, before
    it imports its pipes (torch, seconds): the command's status, or ``None`` when
    this is not that command line (the package then imports as usual). The
    command's modules are imported without the ``sources`` package's own module
    (a stand-in package whose submodules are the real ones)."""
    import os
    import types

    argv = getattr(sys, "orig_argv", [])
    if "-m" not in argv or argv[argv.index("-m") + 1 : argv.index("-m") + 3] != ["distshard", "index"]:
        return None
    package = __name__.rsplit(".", 1)[0]
    # The package's import is still under way (this runs inside it) and holds its
    # module lock: a thread that imports through the package (pickling a function
    # for a worker process does) would wait for that lock while this thread waits
    # for it. Marked imported, the package is used as it is: its submodules.
    spec = getattr(sys.modules[package], "__spec__", None)
    if spec is not None:
        spec._initializing = False
    name = f"{package}.sources"
    if name not in sys.modules:
        stand_in = types.ModuleType(name, "the sources' modules, without importing their package (index command)")
        stand_in.__path__ = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "sources")]
        stand_in.__package__ = name
        sys.modules[name] = stand_in
    return main(sys.argv[1:])


def _could_not_run(args: argparse.Namespace, reasons: list[str]) -> int:
    if args.json:
        print(
            json.dumps(
                {
                    "status": EXIT_COULD_NOT_RUN,
                    "verdict": "COULD NOT RUN",
                    "error": "\n".join(reasons),
                    "reasons": reasons,
                }
            )
        )
    else:
        for reason in reasons:
            print(f"could not run: {reason}", file=sys.stderr)
    return EXIT_COULD_NOT_RUN


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds > 0")
    return value


def _grace(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds >= 0")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be at least 0")
    return value


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the descriptions as written and shows every option's default."""


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    """``demo``'s arguments."""
    demo = sub.add_parser("demo", help="exactly-once check of dist_shard on a real gloo group", formatter_class=_Help)
    demo.add_argument("--world-size", type=_positive, default=4, help="ranks (processes of a gloo group)")
    demo.add_argument("--num-workers", type=_non_negative, default=4, help="DataLoader workers per rank")
    demo.add_argument("--timeout", type=_seconds, default=120.0, help="seconds the whole run may take")


def _check_parser(sub: argparse._SubParsersAction) -> None:
    """``check``'s arguments."""
    chk = sub.add_parser(
        "check",
        help="check your pipeline factory for exactly-once",
        formatter_class=_Help,
        description="Exit status: 0 exactly-once held, 1 violations found, 2 could not run.",
    )
    chk.add_argument("factory", help="pkg.module:function returning the pipeline (an IterDataPipe) each rank builds")
    chk.add_argument(
        "--world-size",
        type=_positive,
        required=True,
        default=argparse.SUPPRESS,
        help="ranks (processes of a gloo group); required",
    )
    chk.add_argument(
        "--num-workers",
        type=_non_negative,
        default=0,
        help="DataLoader workers per rank (0: the rank iterates the pipeline itself)",
    )
    chk.add_argument(
        "--even",
        choices=["drop", "pad"],
        default=None,
        help="also require equal counts per slot; None: what the pipeline's own even= promises",
    )
    chk.add_argument(
        "--start-method", choices=["fork", "spawn", "forkserver"], default="fork", help="how DataLoader workers start"
    )
    chk.add_argument(
        "--loader",
        choices=["torch", "stateful", "none"],
        default="torch",
        help="torch's DataLoader, torchdata's StatefulDataLoader, or no loader",
    )
    chk.add_argument("--epochs", type=_positive, default=1, help="epochs to run, with set_epoch before each")
    chk.add_argument(
        "--timeout",
        type=_seconds,
        default=120.0,
        help="seconds the whole run may take, the factory's own calls included",
    )
    chk.add_argument("--json", action="store_true", help="print a JSON report instead")


def _index_parser(sub: argparse._SubParsersAction) -> None:
    """``index``'s arguments."""
    from .sources.stored.pruning import DEFAULT_GRACE

    idx = sub.add_parser(
        "index",
        help="index a dataset once and store the index beside it",
        formatter_class=_Help,
        description="Exit status: 0 indexed, 1 some files could not be indexed (the others are kept), "
        "2 could not run (bad usage, a store that cannot be reached, no such bucket, access denied, "
        "a destination that cannot be written).",
    )
    idx.add_argument(
        "urls",
        nargs="+",
        help="files: paths or fsspec URLs, globs, brace patterns (as the sources take them); "
        "or one stored index's folder (.distshard) to refresh",
    )
    idx.add_argument("--format", choices=["webdataset", "jsonl", "parquet"], default=None, help="default: by suffix")
    idx.add_argument("--storage-options", default=None, help="JSON handed to fsspec (endpoint, credentials, ...)")
    idx.add_argument("--out", default=None, help="where to store it (local folder or URL); default: .distshard/ beside")
    idx.add_argument(
        "--workers",
        type=_positive,
        default=None,
        help="files indexed at once: remote files by threads, each waiting on one streamed GET "
        "(default 32), local files by processes (default: one per CPU)",
    )
    idx.add_argument(
        "--prune",
        action="store_true",
        help="once the new manifest is written (every file indexed), delete the packs of entries "
        "(entries-*.pack) in the index folder that it does not name and that are older than --prune-after",
    )
    idx.add_argument(
        "--prune-after",
        type=_grace,
        default=argparse.SUPPRESS,
        metavar="SECONDS",
        help=f"with --prune: keep unnamed packs younger than this, for jobs that loaded the previous "
        f"manifest shortly before (default {DEFAULT_GRACE:g})",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distshard", description=__doc__, formatter_class=_Help)
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    _check_parser(sub)
    _index_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "index":
        return index(args)
    if args.command == "demo":
        from .demo import run

        return run(args.world_size, args.num_workers, args.timeout)
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
