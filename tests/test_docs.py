"""What the README and docs/integrations.md state, checked against the code and the
tests that measure it (a statement the suite does not back is a defect)."""

from __future__ import annotations

import re
from pathlib import Path

from torch.utils.data.datapipes.iter import IterableWrapper

import distshard

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
INTEGRATIONS = (ROOT / "docs" / "integrations.md").read_text()
NUMBERS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_install_says_how_without_a_registry_package():
    """Nothing named distshard is on the registry: every pip line installs from a
    checkout, a git URL or a wheel, extras included (tests/test_install.py runs it)."""
    for name, text in (("README.md", README), ("docs/integrations.md", INTEGRATIONS)):
        registry = re.findall(r"pip install [\"']?distshard(?:\[[^\]]*\])?(?![^\s\"']*\s*@)[\"']?", text)
        assert not registry, f"{name} installs distshard from the registry: {registry}"
    assert 'pip install -e ".[parquet]"' in README or '-e ".[parquet]"' in README
    assert re.search(r'pip install "distshard\[parquet\] @ git\+', README)
    assert "pip wheel" in README and ".whl[parquet]" in README


def test_len_after_a_resume_is_described_as_it_behaves():
    text = _flat(README)
    assert "what is left after `load_state_dict`" not in text
    assert "leaves `len()` at that slot's whole share of the epoch" in text
    assert "makes `len()` the new run's share of what was left" in text
    pipe = IterableWrapper(range(20)).dist_shard(rank=0, world_size=2)
    it = iter(pipe)
    next(it)
    again = IterableWrapper(range(20)).dist_shard(rank=0, world_size=2)
    again.load_state_dict(pipe.state_dict())
    assert len(again) == 10 and len(list(again)) == 9  # the whole share; what is left is yielded
    merged = distshard.merge_states([pipe.state_dict(), IterableWrapper(range(20)).dist_shard(
        rank=1, world_size=2).state_dict()])
    new = IterableWrapper(range(20)).dist_shard(rank=0, world_size=1)
    new.load_state_dict(merged)
    assert len(new) == len(list(new)) == 19  # a merged state: the new run's share of what was left


def test_integrations_claims_match_the_tests():
    lightning = (ROOT / "tests" / "test_lightning.py").read_text()
    text = _flat(INTEGRATIONS)
    if "xfail" not in lightning:
        assert "expected failure" not in text and "currently ends early" not in text
    assert "def test_resume_mid_epoch_without_workers" in lightning and \
        "`test_resume_mid_epoch_without_workers`" in text
    accelerate = (ROOT / "tests" / "test_accelerate.py").read_text()
    assert "'NoneType' and 'int'" in accelerate and "'NoneType' and 'int'" in text  # what really happens
    assert "LoaderStatePerRank callback" in text


def test_the_readme_counts_the_benchmark_scripts():
    scripts = sorted((ROOT / "benchmarks").glob("bench_*.py"))
    found = re.search(r"All (\w+) scripts print", README)
    assert found and found[1] == NUMBERS[len(scripts)], (found and found[1], [s.name for s in scripts])
    for script in scripts:
        assert f"benchmarks/{script.name}" in README, script.name
