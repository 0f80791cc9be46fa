"""The command line, run as a user runs it."""

import subprocess
import sys


def test_demo_reports_exactly_once_and_exits_zero():
    done = subprocess.run(
        [sys.executable, "-m", "distshard", "demo"],
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verdict: EXACTLY-ONCE" in done.stdout
    assert "per rank: [248, 248, 248, 248]" in done.stdout  # 4 x 4 slots, even='drop'
    assert "TypeError" in done.stdout  # the classic recipe on the same records


def test_unknown_command_is_a_usage_error():
    done = subprocess.run([sys.executable, "-m", "distshard", "frobnicate"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "invalid choice" in done.stderr
