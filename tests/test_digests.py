"""distshard.digests: seeds and identity digests, pinned.

The values below were computed with the code before ``digests.py`` existed (the
helpers then spread over plan/, readers/base.py, engine.py, pack.py, sample.py,
keys.py and sources/reading/cache.py): states and caches written then must keep matching."""

from __future__ import annotations

import hashlib
import os
import zlib
from pathlib import Path

from torch.utils.data.datapipes.iter import IterableWrapper

import distshard
from distshard import digests, plan
from distshard.engine import salt_of
from distshard.keys import key
from distshard.readers import SequenceReader, stable_digest
from distshard.sources.reading.cache import RangeCache


def test_seeds_are_the_ones_states_recorded():
    assert digests.mix_seed(0) == 3980143261097177850
    assert digests.mix_seed(1, 2, 3) == 2623250113353451629
    assert digests.mix_seed(2**63 - 1, 7, 0x5EED, 123456) == 2046100521427904384
    assert digests.mix_seed(-1, 2**70) == 5961565333936754605
    for parts in [(), (0,), (5, 9), (2**64 + 3, -7, 11)]:  # plan's copy until it imported this one (it re-exports it)
        assert plan.mix_seed(*parts) == digests.mix_seed(*parts)


def test_identity_digests_are_the_ones_states_recorded():
    assert stable_digest("a", [1, 2], {"k": 3.5}, None, b"x") == "7203943f"
    assert stable_digest(object()) == "99cf6a45"
    assert stable_digest(list(range(100))) == "c6e3ae85"
    reader = SequenceReader(["a", "b", "c"], False)
    assert reader.identity() == "sequence:list:3:2c9cb75a"
    assert salt_of(reader) == digests.salt(reader.identity()) == 2994637186


def test_pack_and_sample_identities_are_the_ones_states_recorded():
    packed = distshard.pack(IterableWrapper([[1, 2, 3], [4, 5], [6]]), seq_len=2, eos=0)
    assert packed.distshard_identity() == (
        "pack seq_len=2 eos=0 pad=0 tokens=document shuffle_documents=False seed=0 documents=3 tokens=9 counts=92ba28ac"
    )
    sampled = distshard.weighted_sample(IterableWrapper(list("abcd")), [1, 2, 3.5, 0], samples=5, seed=3)
    assert sampled._identity == "weighted_sample seed=3 samples=5 n=4 weights=bc2caa23f176b1e9"


def test_element_keys_and_cache_names_are_the_ones_written(tmp_path):
    assert key([1, 2]) == "8e202957ec8c9946303a8084515614fc6d89b12ecea0674d3c59d6e6feac45ee"
    assert key({"a": (1, 2.5)}) == "c2f84c65bb00d86bad76c231b820a61c14a4ba8ee7140c19254ab0c4334f4118"
    cache = RangeCache(str(tmp_path), 1 << 20)
    folder = cache.file("https://h/x.tar", 123, '"etag"')
    # the checksummed layout ("checksummed/2" in the digest): a directory of the unchecked layout before it
    # (a5d8c1d40a1828ae57b0da67c6b57108bca37b42) is never read, and ages out as least recently used
    assert folder is not None and os.path.basename(folder.directory) == "3c9c0f9a6692e4ab7dc47d40132037665548f1ba"


def test_the_primitives_are_the_hashes_they_name():
    assert digests.crc32_hex(b"distshard") == f"{zlib.crc32(b'distshard'):08x}" == "3b32a026"
    assert digests.blake2b_hex(b"distshard", 8) == "991343e49d35df05"
    assert digests.sha256_hex(b"") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

    def double(x: int) -> int:
        return 2 * x

    code = double.__code__
    body = code.co_code + repr(code.co_consts).encode() + repr(code.co_names).encode()
    expected = f"{double.__module__}.{double.__qualname__}:{hashlib.blake2b(body, digest_size=6).hexdigest()}"
    assert digests.code_digest(double) == expected  # the bytes differ by Python version; the formula does not
    assert digests.code_digest(len) == "builtins.len"


def test_the_digests_import_nothing_of_the_package():
    text = Path(digests.__file__).read_text()
    assert "from ." not in text and "import distshard" not in text


def test_a_long_list_given_by_its_head_digests_as_the_list_does():
    """A lazy index's files are digested from their count and first 8 URLs (no page
    fetched): the identity a checkpoint records must be the one the whole list gives,
    so that a state saved over the same files loads whichever way the index was read."""
    from distshard.sources.stored.paged import head_list

    for values in ([f"s3://b/shard-{i:06d}.tar" for i in range(20)], list(range(9)), list(range(3))):
        assert digests.stable_text(head_list(values), [64]) == digests.stable_text(values, [64])
        assert stable_digest(head_list(values), list(values)) == stable_digest(values, values)
