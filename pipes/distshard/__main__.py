"""Command line: ``python -m distshard demo``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distshard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="exactly-once check of dist_shard on a real gloo group")
    demo.add_argument("--world-size", type=int, default=4)
    demo.add_argument("--num-workers", type=int, default=4)
    demo.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        return run(args.world_size, args.num_workers, args.timeout)
    return 2  # unreachable: argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
