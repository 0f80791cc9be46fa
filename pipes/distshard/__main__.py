"""Command line.

``python -m distshard demo``
    The classic gist's exactly-once check, on records that are not integers.
``python -m distshard check pkg.module:build --world-size 4 --num-workers 2``
    Run your pipeline factory on a real gloo group and check exactly-once.
    Exit status: 0 exactly-once held, 1 violations found, 2 could not run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from typing import Any, Callable

EXIT_OK, EXIT_VIOLATED, EXIT_COULD_NOT_RUN = 0, 1, 2


class CouldNotRun(Exception):
    """The check could not run (bad factory path, import error, ...)."""


def load_factory(path: str) -> Callable[[], Any]:
    """``pkg.module:name`` -> the callable, with a clear error for every way it can fail."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise CouldNotRun(f"{path!r} is not of the form pkg.module:function (note the colon)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CouldNotRun(f"could not import {module_name!r}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module raised while importing
        raise CouldNotRun(f"importing {module_name!r} raised {type(exc).__name__}: {exc}") from None
    factory = module
    for name in attribute.split("."):
        try:
            factory = getattr(factory, name)
        except AttributeError:
            raise CouldNotRun(f"{module_name!r} has no attribute {attribute!r}") from None
    if not callable(factory):
        raise CouldNotRun(f"{path} is a {type(factory).__name__}, not a callable that builds the pipeline")
    return factory  # type: ignore[return-value]


def _estimated_reads(factory: Callable[[], Any], num_slots: int) -> str:
    from .context import forced_distributed
    from .datapipe import shards_in

    with forced_distributed(0, 1):
        shards = shards_in(factory())
    if not shards:
        return f"no dist_shard in the pipeline: every slot may read everything ({num_slots}x)"
    shard = shards[0]
    if shard.mode == "sized_units" or shard.read_plan().sequence is not None:
        return "1 read per element (random access)"
    if shard.mode == "units":
        return "whole units per slot; leftover units read by a few slots"
    return f"{num_slots} reads per element of the stream (every slot walks it)"


def check(args: argparse.Namespace) -> int:
    from .verify import verify

    started = time.monotonic()
    try:
        factory = load_factory(args.factory)
    except CouldNotRun as exc:
        return _could_not_run(args, str(exc))
    interactive = sys.stderr.isatty() and not args.json
    last = [time.monotonic()]

    def progress(line: str) -> None:
        if interactive:  # one line, rewritten in place
            print(f"\r  {line}   ", end="", file=sys.stderr, flush=True)
        elif not args.json and time.monotonic() - last[0] >= 10:  # logs: a line every 10 s
            last[0] = time.monotonic()
            print(f"  {line}", file=sys.stderr, flush=True)

    if not args.json:
        print(f"checking {args.factory} on {args.world_size} ranks x {args.num_workers} workers "
              f"(gloo on 127.0.0.1, workers by {args.start_method})...", file=sys.stderr)
    try:
        report = verify(
            factory, world_size=args.world_size, num_workers=args.num_workers,
            even=args.even if args.even is not None else "auto", start_method=args.start_method,
            epochs=args.epochs, timeout=args.timeout, loader=args.loader, progress=progress,
            step_collective=False,  # count what each slot yields; no DDP step to deadlock on
        )
        reads = _estimated_reads(factory, args.world_size * max(1, args.num_workers))
    except Exception as exc:  # noqa: BLE001 - building the reference run failed
        return _could_not_run(args, f"{type(exc).__name__}: {exc}")
    if interactive:
        print(file=sys.stderr)
    if report.violated:
        status, verdict = EXIT_VIOLATED, "VIOLATIONS FOUND"
    elif report.error is not None:
        status, verdict = EXIT_COULD_NOT_RUN, "COULD NOT RUN"
    else:
        status, verdict = EXIT_OK, "EXACTLY-ONCE"
    if args.json:
        print(json.dumps({
            "status": status, "verdict": verdict, "factory": args.factory,
            "world_size": report.world_size, "num_workers": report.num_workers, "even": report.even,
            "epochs": report.epochs, "expected_per_epoch": report.expected, "received": report.received,
            "per_rank": report.per_rank, "per_slot": report.per_slot,
            "duplicates": report.duplicate_count, "missing": report.missing_count,
            "allowed_duplicates": report.allowed_duplicates * report.epochs,
            "allowed_missing": report.allowed_missing * report.epochs,
            "duplicate_examples": dict(list(report.duplicates.items())[:10]),
            "missing_examples": dict(list(report.missing.items())[:10]),
            "reads": reads, "error": report.error, "seconds": round(time.monotonic() - started, 2),
        }, indent=2))
    else:
        print(report.summary().replace("  verdict: " + ("EXACTLY-ONCE" if report.ok else "VIOLATED"), "").rstrip())
        print(f"  reads: {reads}")
        print(f"  time: {time.monotonic() - started:.1f}s")
        print(f"  verdict: {verdict}")
    return status


def _could_not_run(args: argparse.Namespace, why: str) -> int:
    if args.json:
        print(json.dumps({"status": EXIT_COULD_NOT_RUN, "verdict": "COULD NOT RUN", "error": why}))
    else:
        print(f"could not run: {why}", file=sys.stderr)
    return EXIT_COULD_NOT_RUN


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distshard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="exactly-once check of dist_shard on a real gloo group")
    demo.add_argument("--world-size", type=_positive, default=4)
    demo.add_argument("--num-workers", type=_non_negative, default=4)
    demo.add_argument("--timeout", type=float, default=120.0)
    chk = sub.add_parser("check", help="check your pipeline factory for exactly-once",
                         description="Exit status: 0 exactly-once held, 1 violations found, 2 could not run.")
    chk.add_argument("factory", help="pkg.module:function returning the pipeline each rank builds")
    chk.add_argument("--world-size", type=_positive, required=True)
    chk.add_argument("--num-workers", type=_non_negative, default=0)
    chk.add_argument("--even", choices=["drop", "pad"], default=None,
                     help="also require equal counts per slot (default: the pipeline's own even)")
    chk.add_argument("--start-method", choices=["fork", "spawn", "forkserver"], default="fork")
    chk.add_argument("--loader", choices=["torch", "stateful", "none"], default="torch")
    chk.add_argument("--epochs", type=_positive, default=1)
    chk.add_argument("--timeout", type=float, default=120.0)
    chk.add_argument("--json", action="store_true", help="print a JSON report instead")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        return run(args.world_size, args.num_workers, args.timeout)
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
