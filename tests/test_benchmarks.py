"""The benchmark harness (benchmarks/harness.py): its table printer, its exactly-once
checks, the child protocol, and one small real gloo group collected through it.
No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402
from harness import Col  # noqa: E402


def test_one_table_printer_formats_every_kind_of_cell():
    text = harness.table(
        [
            Col("row"),
            Col("count", 0),
            Col("CPU s", 2),
            Col("ratio", 3, "×"),
            Col("Δ", 1, signed=True),
            Col("check"),
            Col("time", fmt=harness.seconds),
        ],
        [
            ["a", 12345, 1.5, 0.9934, 2.25, True, 0.000113],
            ["b", None, 10.0, None, -3.0, False, 2.891],
            ["failed: it broke"],
        ],
    )
    assert text.splitlines() == [
        "| row | count | CPU s | ratio | Δ | check | time |",
        "|---|---:|---:|---:|---:|---|---:|",
        "| a | 12,345 | 1.50 | 0.993× | +2.2 | ✓ | 113 µs |",
        "| b | — | 10.00 | — | -3.0 | ✗ | 2.89 s |",
        "| failed: it broke |  |  |  |  |  |  |",
    ]
    assert [harness.ratio(r) for r in (0.98, 64.94, 9029.4, None)] == ["0.98×", "64.9×", "9,029×", "—"]


def test_exactly_once_allows_only_what_even_allows():
    keys = [f"k{i}" for i in range(10)]  # 10 over 4 slots: drop may lose 2, pad may repeat 2
    assert harness.exactly_once(keys, keys).cell() == "✓"
    dropped = harness.exactly_once(keys[:8], keys, even="drop", slots=4)
    assert dropped.ok and dropped.cell() == "✓ (drop 2)"
    assert not harness.exactly_once(keys[:7], keys, even="drop", slots=4).ok
    assert not harness.exactly_once(keys[:8], keys, slots=4).ok  # even=None drops nothing
    padded = harness.exactly_once(keys + keys[:2], keys, even="pad", slots=4)
    assert padded.ok and padded.cell() == "✓ (pad 2)"
    assert not harness.exactly_once(keys + keys[:3], keys, even="pad", slots=4).ok
    swapped = harness.exactly_once(keys[1:] + keys[:1] * 2, keys)  # k0 twice: still 10 elements
    assert (swapped.duplicates, swapped.missing) == (1, 0)
    broken = harness.exactly_once(keys[1:] + ["k1"], keys)
    assert broken.cell("Traceback ...\nValueError: boom\n") == "✗ 1 dup, 1 missing; error: ValueError: boom"


def test_epochs_check_holds_carry_and_drop_to_their_streams():
    keys, epochs, unit = list(range(10)), 3, 4  # 30 positions: carry delivers 28, drop 8 an epoch
    carried = Counter(g % 10 for g in range(28))
    workers = [{"epoch": e, "yielded": c} for e, counts in enumerate([(2, 3), (3, 2), (2, 2)]) for c in counts]
    got = harness.epochs_check(carried, keys, workers, epochs=epochs, even="carry", unit=unit, slots=2)
    assert got["exact"] and (got["delivered"], got["dropped"], got["padded"], got["left_for_next_epoch"]) == (
        28,
        0,
        0,
        2,
    )
    assert not got["equal_slots"] and harness.slot_counts(got["per_epoch_slots"]) == "2–3 / 2–3 / 2"
    dropped = Counter(k for _ in range(epochs) for k in keys[:8])
    got = harness.epochs_check(dropped, keys, workers, epochs=epochs, even="drop", unit=unit, slots=2)
    assert got["exact"] and (got["dropped"], got["left_for_next_epoch"]) == (6, 0)
    assert not harness.epochs_check(carried, keys, workers, epochs=epochs, even="drop", unit=unit, slots=2)["exact"]


def test_a_child_returns_what_its_function_returns_or_its_traceback(tmp_path):
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"func": "add", "kwargs": {"a": 2, "b": 3}}))
    harness.child(spec, out, {"add": lambda a, b: {"sum": a + b}})
    assert json.loads(out.read_text()) == {"sum": 5}
    harness.child(spec, out, {"add": lambda a, b: 1 / 0})
    assert "ZeroDivisionError" in json.loads(out.read_text())["errors"][0]


def counted(x: int) -> int:
    harness.count("decodes")
    return x


@dataclass
class SmallJob(harness.Job):
    n: int = 11

    def build(self, rank: int):
        from torch.utils.data.datapipes.iter import IterableWrapper

        import distshard  # noqa: F401

        return IterableWrapper(list(range(self.n))).map(counted).dist_shard()


@pytest.mark.timeout(120)
def test_a_small_gloo_group_is_collected_counted_and_checked():
    run = harness.run_job(SmallJob(world_size=2, num_workers=2, timeout=60, epochs=2))
    assert run.errors == [] and run.complete
    assert Counter(run.values()) == Counter({i: 2 for i in range(11)})  # 2 epochs, each element once
    assert run.total("decodes") == 22  # counted in the workers, summed through their reports
    assert sorted((w["rank"], w["worker"], w["epoch"]) for w in run.workers) == [
        (r, w, e) for r in range(2) for w in range(2) for e in range(2)
    ]
    assert sorted(w["yielded"] for w in run.workers if w["epoch"] == 0) == [2, 3, 3, 3]
    assert run.cpu_s > 0 and run.wall_s > 0 and run.rss_mib > 0
    assert harness.GroupRun.of(json.loads(json.dumps(run.__dict__))).total("decodes") == 22


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py")))
def test_every_script_imports_and_shows_its_options(script):
    """A script whose imports broke (a helper moved into the harness) fails here,
    not when someone next measures."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]


def test_a_failed_round_is_said_not_hidden():
    good, bad = {"complete": True}, {"complete": False, "errors": ["Traceback...\nTimeoutError: timed out after 320s"]}
    assert harness.left_out([good, good], [good, good]) is None
    assert harness.left_out([bad, bad], []) is None  # the row's own cell says it failed
    line = harness.left_out([bad, good, good], [good, good])
    assert line is not None and line.startswith("1 of 3 rounds failed") and "TimeoutError: timed out" in line


@pytest.mark.timeout(120)
def test_the_latency_proxy_counts_each_ranks_requests_by_kind_and_bytes(monkeypatch):
    """bench_remote.py's store: moto's server in its own process behind the proxy; what
    one endpoint relays is counted there by kind (HEAD, GET, LIST) with its body bytes."""
    pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    from latency_proxy import LatencyProxy, MotoProcess, kind_of

    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(name, value)
    assert [kind_of("GET", t) for t in ("/b/k.tar", "/b?list-type=2&prefix=x", "/b/")] == ["GET", "LIST", "LIST"]
    with MotoProcess() as moto, LatencyProxy(moto.endpoint, ports=2) as proxy:
        boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
        direct = boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1")
        direct.put_object(Bucket="bench", Key="x/a.bin", Body=bytes(300_000))
        client = boto3.client("s3", endpoint_url=proxy.endpoints[1], region_name="us-east-1")
        client.head_object(Bucket="bench", Key="x/a.bin")
        assert len(client.get_object(Bucket="bench", Key="x/a.bin", Range="bytes=0-99")["Body"].read()) == 100
        assert len(client.get_object(Bucket="bench", Key="x/a.bin")["Body"].read()) == 300_000
        assert [o["Key"] for o in client.list_objects_v2(Bucket="bench", Prefix="x/")["Contents"]] == ["x/a.bin"]
        proxy.settle()
        general, rank = proxy.snapshot()
    assert general["requests"] == {} and rank["requests"] == {"HEAD": 1, "GET": 2, "LIST": 1}
    assert rank["bytes"]["GET"] == 300_100 and [a[1:] for a in rank["arrivals"][:3]] == [
        ["HEAD", 0],
        ["GET", 100],
        ["GET", 300_000],
    ]


def test_a_row_without_figures_says_why_in_its_cell():
    assert harness.unmeasured({"skipped": "no benchmark venv"}, "cpu_s") == "not run: no benchmark venv"
    failed = {"errors": ["Traceback (most recent call last):\n  ...\nTimeoutError: the group stalled\n  a note"]}
    assert harness.unmeasured(failed, "cpu_s") == "failed: TimeoutError: the group stalled"
    assert harness.unmeasured({"errors": []}, "cpu_s", none="no complete run") == "failed: no complete run"
    assert (
        harness.unmeasured({"errors": ["ValueError: " + "x" * 300]}, "cpu_s", width=20)
        == "failed: ValueError: xxxxxxxx"
    )
    assert harness.unmeasured({"cpu_s": 1.0, "errors": ["ValueError: one round"]}, "cpu_s") is None
