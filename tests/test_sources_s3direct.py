"""The direct S3 client (``distshard.sources.transport.s3direct``): when it is chosen (each
reason it is not), that it addresses and signs as botocore does, that its path
imports no botocore, aiobotocore, aiohttp nor s3fs, faults retried to an exact
multiset through fork workers (a faulty proxy in front of moto's server on
127.0.0.1), a bucket in another region followed once, fork safety. The s3 tests
of ``test_sources_s3.py`` run on both clients."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

import distshard  # noqa: E402
from distshard.sources import ReadOptions  # noqa: E402
from distshard.sources.transport import clients  # noqa: E402
from distshard.sources.transport.s3config import Config, direct_config  # noqa: E402
from distshard.sources.transport.s3direct import DirectS3Client  # noqa: E402
from distshard.verify import free_port  # noqa: E402
from tests.helpers import wait_child  # noqa: E402
from tests.s3_fixtures import BUCKET, bucket, endpoint, key_of, loader_keys, no_real_aws, upload  # noqa: E402,F401
from tests.s3_proxy import S3Proxy  # noqa: E402
from tests.source_factories import isolated_cache as cache  # noqa: E402,F401  (autouse)
from tests.source_factories import write_shards  # noqa: E402

CREDS = {"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK"}


@pytest.fixture(autouse=True)
def fresh_clients(monkeypatch):
    monkeypatch.delenv("DISTSHARD_S3_CLIENT", raising=False)
    clients.forget_clients()
    yield
    clients.forget_clients()


@pytest.fixture
def clean(tmp_path) -> dict[str, str]:
    """An environment with credentials and nothing else that botocore would read
    (no AWS config file, no fsspec configuration)."""
    (tmp_path / "fsspec").mkdir()
    return {**CREDS, "AWS_CONFIG_FILE": str(tmp_path / "none"), "FSSPEC_CONFIG_DIR": str(tmp_path / "fsspec")}


# -- eligibility ----------------------------------------------------------------------------------
NOT_ELIGIBLE = [
    ({"endpoint_url": "http://h:1", "profile": "p"}, {}, "storage option 'profile'"),
    ({"endpoint_url": "http://h:1", "requester_pays": True}, {}, "requester_pays=True"),
    ({"endpoint_url": "http://h:1", "version_aware": True}, {}, "version_aware=True"),
    ({"endpoint_url": "http://h:1", "use_ssl": False}, {}, "use_ssl=False"),
    ({"endpoint_url": "http://h:1", "s3_additional_kwargs": {"SSECustomerKey": "x"}}, {}, "s3_additional_kwargs"),
    ({"endpoint_url": "http://h:1", "session": object()}, {}, "storage option 'session'"),
    ({"endpoint_url": "http://h:1", "config_kwargs": {"s3": {"addressing_style": "virtual"}}}, {}, "config_kwargs"),
    ({"endpoint_url": "http://h:1", "client_kwargs": {"verify": False}}, {}, "client_kwargs"),
    ({"endpoint_url": "http://h:1", "client_kwargs": {"endpoint_url": "http://g:2"}}, {}, "endpoint_url given twice"),
    ({"endpoint_url": "http://h:1", "key": "a"}, {}, "key and secret are not both given"),
    ({"endpoint_url": "http://h:1", "anon": True, "key": "a", "secret": "b"}, {}, "anon=True with credentials"),
    ({"endpoint_url": "http://h:1"}, {"AWS_ACCESS_KEY_ID": None}, "no explicit credentials"),
    ({"endpoint_url": "http://h:1"}, {"AWS_PROFILE": "dev"}, "AWS_PROFILE"),
    ({"endpoint_url": "http://h:1"}, {"HTTPS_PROXY": "http://p:3128"}, "a proxy"),
    ({"endpoint_url": "http://h:1"}, {"http_proxy": "http://p:3128"}, "a proxy"),
    ({"endpoint_url": "http://h:1"}, {"ALL_PROXY": "socks5://p"}, "a proxy"),
    ({"endpoint_url": "http://h:1"}, {"AWS_USE_FIPS_ENDPOINT": "true"}, "AWS_USE_FIPS_ENDPOINT"),
    ({"endpoint_url": "http://h:1"}, {"AWS_S3_US_EAST_1_REGIONAL_ENDPOINT": "regional"}, "AWS_S3_US_EAST_1"),
    ({"endpoint_url": "http://h:1"}, {"FSSPEC_S3_ENDPOINT_URL": "http://x"}, "fsspec configuration"),
    ({"endpoint_url": "http://h:1/prefix"}, {}, "only scheme://host[:port]"),
    ({}, {}, "real AWS with no explicit region"),
    ({}, {"AWS_REGION": "eu-west-1"}, "real AWS with no explicit region"),  # botocore does not read AWS_REGION
    ({"client_kwargs": {"region_name": "us-iso-east-1"}}, {}, "a partition read through botocore"),
]


@pytest.mark.parametrize("options, env, reason", NOT_ELIGIBLE, ids=[r for _, _, r in NOT_ELIGIBLE])
def test_each_reason_not_to_read_directly_is_named(options, env, reason, clean):
    environ = {**clean, **env}
    environ = {k: v for k, v in environ.items() if v is not None}
    got = direct_config(options, environ)
    assert isinstance(got, str) and reason in got, got


def test_an_aws_config_file_or_fsspec_configuration_makes_it_ineligible_unless_explicit(clean, tmp_path):
    config = tmp_path / "config"
    config.write_text("[default]\nregion = eu-west-3\n")
    env = {**clean, "AWS_CONFIG_FILE": str(config)}
    assert "AWS config file" in direct_config({"endpoint_url": "http://h:1"}, env)  # the file's region would sign
    explicit = {"endpoint_url": "http://h:1", "client_kwargs": {"region_name": "eu-west-1"}}
    assert isinstance(direct_config(explicit, env), Config)
    config.write_text("[default]\ns3 =\n  addressing_style = virtual\n")
    assert "sets s3" in direct_config(explicit, env)
    (tmp_path / "fsspec" / "conf.json").write_text(json.dumps({"s3": {"anon": True}}))
    assert "fsspec configuration files" in direct_config(explicit, {**clean})


def test_eligible_configurations(clean):
    c = direct_config({"endpoint_url": "http://127.0.0.1:9000"}, clean)
    assert isinstance(c, Config) and (c.scheme, c.host, c.port, c.region, c.aws) == (
        "http",
        "127.0.0.1",
        9000,
        "us-east-1",
        False,
    )
    assert c.credentials is not None and (c.credentials.key, c.credentials.token) == ("AK", None)
    c = direct_config(
        {"key": "k", "secret": "s", "token": "t", "skip_instance_cache": True},
        {**clean, "AWS_DEFAULT_REGION": "eu-west-1"},
    )
    assert isinstance(c, Config) and c.aws and c.region == "eu-west-1" and c.credentials.token == "t"
    c = direct_config({"anon": True, "client_kwargs": {"region_name": "us-west-2"}}, {})
    assert isinstance(c, Config) and c.credentials is None
    env = {**clean, "AWS_ENDPOINT_URL": "http://a:1", "AWS_ENDPOINT_URL_S3": "https://b:2", "AWS_CA_BUNDLE": "/x.pem"}
    c = direct_config({}, env)
    assert isinstance(c, Config) and (c.scheme, c.host, c.port, c.ca_bundle) == ("https", "b", 2, "/x.pem")
    assert isinstance(
        direct_config({"endpoint_url": "http://h:1", "config_kwargs": {"max_pool_connections": 64}}, clean), Config
    )


# -- addressing and signing region, as botocore does them -----------------------------------------
ADDRESSING = [
    # endpoint, region, bucket
    ("http://127.0.0.1:5000", None, "shards"),
    ("http://127.0.0.1:5000", "eu-west-1", "my.dotted.bucket"),
    ("http://localhost:9000", None, "shards"),
    ("http://localhost:9000", "ap-south-1", "Upper_Case"),
    ("https://minio.example.org", None, "shards"),
    ("https://storage.example.org:8443/", "eu-west-1", "shards"),
    (None, "us-east-1", "shards"),
    (None, "us-east-1", "my.dotted.bucket"),
    (None, "eu-west-1", "shards"),
    (None, "eu-west-1", "my.dotted.bucket"),
    (None, "us-west-2", "Upper_Case"),
    (None, "cn-north-1", "shards"),
    (None, "us-gov-west-1", "shards"),
]


@pytest.mark.parametrize("endpoint_url, region, bucket_name", ADDRESSING)
def test_the_url_and_signing_region_are_botocores(endpoint_url, region, bucket_name, clean, monkeypatch, tmp_path):
    import boto3

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    kw = {k: v for k, v in {"endpoint_url": endpoint_url, "region_name": region}.items() if v}
    client = boto3.session.Session().client("s3", aws_access_key_id="AK", aws_secret_access_key="SK", **kw)
    seen = {}

    class Stop(Exception):
        pass

    def hook(request, **_):
        auth = request.headers["Authorization"]
        seen["url"], seen["auth"] = request.url, auth.decode() if isinstance(auth, bytes) else auth
        raise Stop

    client.meta.events.register("before-send", hook)
    with pytest.raises(Stop):
        client.get_object(Bucket=bucket_name, Key="dir/a b+c~%.tar", Range="bytes=0-1")
    options = {"endpoint_url": endpoint_url} if endpoint_url else {"client_kwargs": {"region_name": region}}
    if endpoint_url and region:
        options["client_kwargs"] = {"region_name": region}
    config = direct_config(options, clean)
    assert isinstance(config, Config), config
    host, path = config.address(bucket_name, "dir/a b+c~%.tar", config.region)
    assert seen["url"] == f"{config.scheme}://{host}{path}"
    assert seen["auth"].split("/")[2] == config.region


# -- on moto --------------------------------------------------------------------------------------
def test_identity_is_the_one_s3fs_reports(tmp_path, bucket, endpoint, monkeypatch):
    paths, _ = write_shards(tmp_path, shards=1, per_shard=3)
    [url] = upload(bucket, paths, "ident")
    direct = clients.client_for(url, {"endpoint_url": endpoint})
    assert isinstance(direct, DirectS3Client)
    monkeypatch.setenv("DISTSHARD_S3_CLIENT", "s3fs")
    clients.forget_clients()
    via_s3fs = clients.client_for(url, {"endpoint_url": endpoint})
    assert not isinstance(via_s3fs, DirectS3Client)
    assert direct.identity(url) == via_s3fs.identity(url) and direct.identity(url)[1].startswith('"')
    assert direct.fetch(url) == via_s3fs.fetch(url) == Path(paths[0]).read_bytes()
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        direct.fetch(f"s3://{BUCKET}/nothing-here")
    size, stamp = direct.identity(url)
    data = Path(paths[0]).read_bytes()
    for concurrency in (2, 12, 4):  # the pool grows to the largest asked, and never shrinks
        assert direct.read_range(url, 1, 99, size, stamp, ReadOptions(concurrency=concurrency)) == data[1:99]
    assert direct.process.size == 12


def test_the_switch(bucket, endpoint, monkeypatch):
    url = f"s3://{BUCKET}/x"
    monkeypatch.setenv("DISTSHARD_S3_CLIENT", "direct")
    with pytest.raises(ValueError, match="cannot be read directly: the storage option 'profile'"):
        clients.client_for(url, {"endpoint_url": endpoint, "profile": "p"})
    monkeypatch.setenv("DISTSHARD_S3_CLIENT", "fast")
    with pytest.raises(ValueError, match="DISTSHARD_S3_CLIENT='fast'"):
        clients.client_for(url, {"endpoint_url": endpoint, "x": 1})
    monkeypatch.setenv("DISTSHARD_S3_CLIENT", "auto")
    assert not isinstance(clients.client_for(url, {"endpoint_url": endpoint, "use_ssl": False}), DirectS3Client)
    assert isinstance(clients.client_for(url, {"endpoint_url": endpoint}), DirectS3Client)


def test_the_direct_path_imports_no_botocore_aiohttp_or_s3fs(tmp_path, bucket, endpoint):
    """A fresh interpreter reads a stored index and every sample without importing them."""
    from distshard.__main__ import main

    paths, expected = write_shards(tmp_path, shards=3, per_shard=4)
    upload(bucket, paths, "lean")
    pattern = f"s3://{BUCKET}/lean/shard-{{000000..000002}}.tar"
    assert main(["index", pattern, "--storage-options", json.dumps({"endpoint_url": endpoint})]) == 0
    code = f"""
import sys, distshard
source = distshard.webdataset({pattern!r}, storage_options={{"endpoint_url": {endpoint!r}}})
n = sum(1 for _ in source.dist_shard(rank=0, world_size=1))
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("botocore", "aiobotocore", "aiohttp", "s3fs", "boto3"))
print(n, heavy)
"""
    env = {**os.environ, "DISTSHARD_CACHE": str(tmp_path / "fresh"), "DISTSHARD_S3_CLIENT": "direct"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(len(expected)), "[]"], out.stdout


def test_the_index_command_with_the_direct_client_imports_no_s3fs(tmp_path, bucket, endpoint):
    """`python -m distshard index s3://...` in a fresh interpreter, its reads direct
    (a streamed GET a shard, a suffix GET a Parquet file) and its writes too (the
    pack and the manifest: one signed PUT each): no botocore, aiohttp nor s3fs
    imported (``-X importtime`` lists every import); what it wrote reads every sample."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    paths, expected = write_shards(tmp_path, shards=3, per_shard=4)
    upload(bucket, paths, "written")
    pq.write_table(pa.table({"k": [f"r{i}" for i in range(25)]}), tmp_path / "t.parquet", row_group_size=6)
    [table] = upload(bucket, [str(tmp_path / "t.parquet")], "written")
    pattern = f"s3://{BUCKET}/written/shard-{{000000..000002}}.tar"
    options = json.dumps({"endpoint_url": endpoint})
    env = {**os.environ, "DISTSHARD_CACHE": str(tmp_path / "fresh"), "DISTSHARD_S3_CLIENT": "direct"}
    command = [sys.executable, "-X", "importtime", "-m", "distshard", "index", pattern, table]
    out = subprocess.run([*command, "--storage-options", options], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "distshard.sources.transport.s3direct" in imported and "pyarrow.parquet" in imported
    heavy = sorted(m for m in imported if m.split(".")[0] in ("botocore", "aiobotocore", "aiohttp", "s3fs", "boto3"))
    assert heavy == [], heavy
    keys = {o["Key"] for o in bucket.list_objects_v2(Bucket=BUCKET)["Contents"]}
    assert "written/.distshard/manifest.json" in keys and sum(k.endswith(".pack") for k in keys) == 1, keys
    clients.forget_clients()
    source = distshard.webdataset(pattern, storage_options={"endpoint_url": endpoint})
    got = list(source.dist_shard(rank=0, world_size=1))
    assert source._stored is not None and source._indexed_here == 0
    assert Counter(key_of(s) for s in got) == Counter(
        f"s3://{BUCKET}/written/{Path(s['__url__']).name}#{s['__key__']}" for s in expected
    )
    rows = distshard.parquet(table, storage_options={"endpoint_url": endpoint})
    assert sorted(r["k"] for r in rows.dist_shard(rank=0, world_size=1)) == sorted(f"r{i}" for i in range(25))
    assert rows._stored is not None and rows._indexed_here == 0


def test_the_index_command_could_not_run_when_the_store_cannot_be_reached(tmp_path, monkeypatch, capsys):
    """Issue 28 (8): nothing listens at the endpoint (the direct client: a refused
    connection on every attempt): could not run (2), said as such, nothing written."""
    from distshard.__main__ import main

    monkeypatch.setenv("DISTSHARD_S3_CLIENT", "direct")
    options = json.dumps({"endpoint_url": f"http://127.0.0.1:{free_port()}"})
    out = tmp_path / "index"
    assert main(["index", f"s3://{BUCKET}/t/part-{{0..1}}.jsonl", "--out", str(out), "--storage-options", options]) == 2
    err = capsys.readouterr().err
    assert err.count("could not run: ") == 1 and "could not connect to the store" in err, err
    assert "ConnectionRefusedError" in err and "others" not in err and not out.exists()


@pytest.fixture
def proxy(endpoint):
    server = S3Proxy(endpoint, fault_every=3).start()
    try:
        yield server
    finally:
        server.stop()


def test_faults_are_retried_to_an_exact_multiset_through_fork_workers(tmp_path, bucket, proxy):
    """503 SlowDown, a reset connection and a cut body, every third GET, in the
    parent and in forked DataLoader workers: retried, every sample once."""
    paths, expected = write_shards(tmp_path, shards=4, per_shard=6)
    urls = upload(bucket, paths, "faulty")
    keyed = [f"{urls[paths.index(s['__url__'])]}#{s['__key__']}" for s in expected]
    small = ReadOptions(
        budget=8 << 10, max_range=4 << 10, first_range=2 << 10, max_gap=512, window=2 << 10, retry_seconds=30
    )
    source = distshard.webdataset(urls, storage_options={"endpoint_url": proxy.endpoint}, read_options=small)
    assert isinstance(clients.client_for(urls[0], {"endpoint_url": proxy.endpoint}), DirectS3Client)
    got = [k for rank in range(2) for k in loader_keys(source.dist_shard(rank=rank, world_size=2).map(key_of))]
    assert Counter(got) == Counter(keyed)
    assert set(proxy.faulted) == {"slowdown", "reset", "short"}, proxy.faulted


def test_a_bucket_in_another_region_is_asked_there_once(tmp_path, bucket, endpoint):
    """AWS's 301 with x-amz-bucket-region (played by the proxy for requests signed
    for another region): the request is signed again for that region, and the
    bucket's region is remembered."""
    server = S3Proxy(endpoint, region="eu-west-1").start()
    try:
        paths, _ = write_shards(tmp_path, shards=1, per_shard=3)
        [url] = upload(bucket, paths, "moved")
        config = direct_config({"endpoint_url": server.endpoint}, {**CREDS, "AWS_CONFIG_FILE": "/nonexistent"})
        assert isinstance(config, Config) and config.region == "us-east-1"
        client = DirectS3Client("s3", {}, dataclasses.replace(config, follow_regions=True), lambda: None)
        size, stamp = client.identity(url)
        data = Path(paths[0]).read_bytes()
        assert client.read_range(url, 10, 500, size, stamp) == data[10:500]
        assert client.fetch(url) == data
        assert client.tail(url, 100) == (size, stamp, data[-100:])
        assert client._regions == {BUCKET: "eu-west-1"} and server.redirected == 1
        writer = DirectS3Client("s3", {}, dataclasses.replace(config, follow_regions=True), lambda: None)
        writer.put(f"s3://{BUCKET}/moved/written", b"the body, sent again")  # redirected, then sent there
        assert bucket.get_object(Bucket=BUCKET, Key="moved/written")["Body"].read() == b"the body, sent again"
        assert server.redirected == 2
        unfollowed = DirectS3Client("s3", {}, config, lambda: None)  # a custom endpoint: no redirects followed
        with pytest.raises(ValueError, match="HTTP 301 .*the bucket is in eu-west-1"):
            unfollowed.identity(url)
    finally:
        server.stop()


def test_a_forked_child_makes_its_own_connections_and_leaves_the_parents(tmp_path, bucket, endpoint):
    """Through a keep-alive proxy (moto's server closes every connection): the
    child reads on new connections, the parent's stay open and serve it after."""
    keep_alive = S3Proxy(endpoint).start()
    try:
        _fork_check(tmp_path, bucket, keep_alive.endpoint)
    finally:
        keep_alive.stop()


def _fork_check(tmp_path, bucket, endpoint):
    paths, _ = write_shards(tmp_path, shards=1, per_shard=3)
    [url] = upload(bucket, paths, "forked")
    client = clients.client_for(url, {"endpoint_url": endpoint})
    assert isinstance(client, DirectS3Client)
    size, stamp = client.identity(url)
    data = Path(paths[0]).read_bytes()
    assert client.read_range(url, 0, 100, size, stamp) == data[:100]
    parent = client.process
    connections = dict(parent.connections)
    assert connections
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ok = client.read_range(url, 100, 200, size, stamp) == data[100:200] and client.identity(url) == (
                size,
                stamp,
            )
            mine = client.process
            untouched = all(c.sock is not None for c in connections.values())
            code = (
                0
                if ok
                and mine is not parent
                and untouched
                and not (set(mine.connections.values()) & set(connections.values()))
                else 2
            )
        finally:
            os._exit(code)
    assert wait_child(pid, 60, "it waits for a connection of its parent") == 0
    assert client.process is parent and client.read_range(url, 200, 300, size, stamp) == data[200:300]
    assert client.identity(url) == (size, stamp)
    assert all(parent.connections.get(k) is c for k, c in connections.items())  # the same sockets, still in use


def test_the_index_command_streams_through_faults_with_the_direct_client(tmp_path, bucket, proxy, monkeypatch):
    """`python -m distshard index` reads each shard with one streamed GET of the
    direct client (``open_stream``) through SlowDown, resets and cut bodies; the
    stored index then reads every sample once."""
    from distshard.__main__ import main
    from distshard.sources.transport.lru import clear_all

    paths, expected = write_shards(tmp_path, shards=6, per_shard=5)
    upload(bucket, paths, "streamed")
    options = {"endpoint_url": proxy.endpoint}
    pattern = f"s3://{BUCKET}/streamed/shard-{{000000..000005}}.tar"
    monkeypatch.setenv("DISTSHARD_S3_CLIENT", "direct")
    assert main(["index", pattern, "--storage-options", json.dumps(options)]) == 0
    assert proxy.faulted and proxy.requests["HEAD"] == 0, (proxy.faulted, proxy.requests)
    monkeypatch.setenv("DISTSHARD_CACHE", str(tmp_path / "fresh"))
    clear_all()
    got = list(distshard.webdataset(pattern, storage_options=options).dist_shard(rank=0, world_size=1))
    assert Counter(f"{Path(s['__url__']).name}#{s['__key__']}" for s in got) == Counter(
        f"{Path(s['__url__']).name}#{s['__key__']}" for s in expected
    )


def test_explain_says_which_client_reads(bucket, endpoint, monkeypatch):
    url = f"s3://{BUCKET}/x.tar"
    direct = distshard.webdataset(url, storage_options={"endpoint_url": endpoint}).describe()
    assert "S3 read directly" in direct, direct
    slow = distshard.webdataset(url, storage_options={"endpoint_url": endpoint, "use_ssl": False}).describe()
    assert "S3 through s3fs (not read directly: the storage option use_ssl=False)" in slow, slow
    monkeypatch.setenv("DISTSHARD_S3_CLIENT", "s3fs")
    assert (
        "S3 through s3fs (DISTSHARD_S3_CLIENT=s3fs)"
        in distshard.webdataset(url, storage_options={"endpoint_url": endpoint}).describe()
    )


GLOB_KEYS = [
    "data/shard-000000.tar",
    "data/shard-000001.tar",
    "data/shard-000002.tar",
    "data/shard-000010.tar",
    "data/shard-dir/inner.tar",
    "data/sub/x.tar",
    "data/sub2/",
    "data/",
    "data/.hidden.tar",
    "data/a b.tar",
    "data/x+y%z.tar",
    "data/ünï.tar",
    "data/[x].tar",
    "data2/shard-000000.tar",
    "shard-top.tar",
]
GLOBS = [
    "data/shard-*.tar",
    "data/*",
    "data/*.tar",
    "data/shard-00000?.tar",
    "data/shard-[0-0]*",
    "data/shard-[!0]*",
    "data/sub*",
    "data/.h*",
    "data/a *",
    "data/x+y*",
    "data/ü*",
    "data/[[]x].tar",
    "data/?",
    "data/nothing*",
    "shard-*",
    "*.tar",
    "data/sub2/*",
]
DELEGATED = ["data/**/*.tar", "data*/shard-000000.tar", "data/*/x.tar"]  # to s3fs


def test_globs_find_what_s3fs_finds(bucket, endpoint, monkeypatch):
    """The direct client's glob (one ListObjectsV2 listing, continued: two keys a
    page here) against s3fs's on a tree with folders, folder markers, dot files,
    spaces, ``+``, ``%``, unicode and brackets in keys."""
    for key in GLOB_KEYS:
        bucket.put_object(Bucket=BUCKET, Key=key, Body=b"x")
    options = {"endpoint_url": endpoint}
    direct = clients.client_for(f"s3://{BUCKET}/", options)
    assert isinstance(direct, DirectS3Client)
    monkeypatch.setenv("DISTSHARD_S3_CLIENT", "s3fs")
    clients.forget_clients()
    via_s3fs = clients.client_for(f"s3://{BUCKET}/", options)
    found = {}
    for glob in GLOBS + DELEGATED:
        pattern = f"s3://{BUCKET}/{glob}"
        found[glob] = expected = via_s3fs.glob(pattern)
        assert direct.glob(pattern, max_keys=2) == expected, glob
        assert direct.glob(pattern) == expected, glob
        if glob == GLOBS[-1]:
            assert direct._fallback is None  # every pattern so far listed by the direct client
    assert len(found["data/*"]) == 12 and found["data/[[]x].tar"] == [f"s3://{BUCKET}/data/[x].tar"], found


def test_https_with_the_ca_bundle_of_aws_ca_bundle(tmp_path, bucket, endpoint):
    """An https endpoint (the proxy with a self-signed certificate) is read with
    the bundle AWS_CA_BUNDLE names, as botocore does; without it the certificate
    is refused at once, naming the variable."""
    from tests.range_server import self_signed

    made = self_signed(tmp_path)
    if made is None:
        pytest.skip("no openssl command to make a test certificate")
    server = S3Proxy(endpoint, tls=made).start()
    try:
        paths, _ = write_shards(tmp_path, shards=1, per_shard=3)
        [url] = upload(bucket, paths, "tls")
        data = Path(paths[0]).read_bytes()
        env = {**CREDS, "AWS_CONFIG_FILE": "/nonexistent", "AWS_CA_BUNDLE": made[0]}
        config = direct_config({"endpoint_url": server.endpoint}, env)
        assert isinstance(config, Config) and config.scheme == "https" and config.ca_bundle == made[0]
        client = DirectS3Client("s3", {}, config, lambda: None)
        size, stamp = client.identity(url)
        assert client.read_range(url, 5, 700, size, stamp) == data[5:700]
        assert client.fetch(url) == data
        untrusted = DirectS3Client("s3", {}, dataclasses.replace(config, ca_bundle=None), lambda: None)
        with pytest.raises(PermissionError, match="AWS_CA_BUNDLE"):
            untrusted.identity(url)
    finally:
        server.stop()


def test_buckets_botocore_addresses_its_own_way_go_through_s3fs(clean):
    """Access point ARNs and S3 Express directory buckets: botocore's endpoints
    for them are its own, so the direct client hands such URLs to s3fs."""

    class Fallback:
        def __init__(self):
            self.calls = []

        def identity(self, url, options):
            self.calls.append(("identity", url))
            return 3, '"e"'

        def fetch(self, url, options):
            self.calls.append(("fetch", url))
            return b"abc"

    config = direct_config({"client_kwargs": {"region_name": "us-west-2"}}, clean)
    fallback = Fallback()
    client = DirectS3Client("s3", {}, config, lambda: fallback)
    arn = "s3://arn:aws:s3:us-west-2:123456789012:accesspoint/ap/key.tar"
    express = "s3://fast--usw2-az1--x-s3/key.tar"
    assert client.identity(arn) == (3, '"e"') and client.fetch(express) == b"abc"
    assert fallback.calls == [("identity", arn), ("fetch", express)]
