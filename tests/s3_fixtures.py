"""The S3 tests' shared set-up: moto's S3 server on loopback (one a module), a bucket
emptied after each test, credentials that reach no real AWS, the client every s3:// read
goes through (``s3_client``: a module parametrizes it, direct and s3fs), and what moto logs
of each request. A test module imports the fixtures it uses (``no_real_aws`` and
``s3_client`` are autouse there)."""

from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path
from typing import Iterator

import pytest

from tests.moto_server import start_moto

BUCKET = "shards"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    server, url = start_moto()
    try:
        yield url
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def s3_client(request, monkeypatch) -> str:
    """The client every s3:// read of the test goes through (``direct`` raises
    when the direct client is not eligible, so it is really the one tested)."""
    from distshard.sources.transport import clients

    monkeypatch.setenv("DISTSHARD_S3_CLIENT", request.param)
    clients.forget_clients()
    return request.param


@pytest.fixture(autouse=True)
def no_real_aws(monkeypatch):
    """Credentials and a region for the fake store, nothing that reaches AWS."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def bucket(endpoint) -> Iterator:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    try:
        yield client
    finally:
        for item in client.list_objects_v2(Bucket=BUCKET).get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=item["Key"])
        client.delete_bucket(Bucket=BUCKET)


def upload(client, paths: list[str], prefix: str) -> list[str]:
    urls = []
    for path in paths:
        key = f"{prefix}/{Path(path).name}"
        client.put_object(Bucket=BUCKET, Key=key, Body=Path(path).read_bytes())
        urls.append(f"s3://{BUCKET}/{key}")
    return urls


def loader_keys(pipe) -> list[str]:
    from torch.utils.data import DataLoader

    return list(DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60))


def key_of(sample: dict) -> str:
    return f"{sample['__url__']}#{sample['__key__']}"


class Requests(logging.Handler):
    """moto's server logs every request through werkzeug: ``"GET /bucket/key HTTP/1.1" 206``."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def kinds(self) -> Counter:
        out: Counter = Counter()
        for line in self.lines:
            found = re.search(r'"(GET|HEAD|PUT|POST|DELETE) (\S+)', re.sub(r"\x1b\[[0-9;]*m", "", line))
            if found is None:
                continue
            method, path = found.groups()
            kind = (
                "listing"
                if "list-type=2" in path
                else "manifest"
                if path.endswith("manifest.json")
                else "entry"
                if path.endswith((".idx", ".pack"))
                else "data"
            )
            out[method if method != "GET" else kind] += 1
        return out
