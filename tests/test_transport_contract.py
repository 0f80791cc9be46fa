"""Every client :func:`client_for` makes (HTTP, S3 direct and through s3fs, ``hf://``) offers
the declared :class:`Transport` Protocol, with its parameters, checked without calling anything
(``inspect.getattr_static``: no filesystem made, no request)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from distshard.sources.transport import clients
from distshard.sources.transport.contract import Transport

pytest.importorskip("fsspec")


def members(protocol: type) -> dict[str, Any]:
    """The Protocol's declared attributes and methods (its public names)."""
    found: dict[str, Any] = {name: None for name in getattr(protocol, "__annotations__", {})}
    found.update(
        {n: v for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    )
    return found


def missing_from(client: object) -> list[str]:
    """What ``client`` lacks of :class:`Transport`: a name, or a method whose parameters differ
    (the Protocol's in the same order and kind; any more only with defaults)."""
    lacking = []
    for name, declared in members(Transport).items():
        try:
            found = inspect.getattr_static(client, name)
        except AttributeError:
            lacking.append(name)
            continue
        if declared is None or isinstance(declared, property):
            if isinstance(declared, property) and not isinstance(found, property):
                lacking.append(f"{name} (a property)")
            continue
        wanted = list(inspect.signature(declared).parameters.values())[1:]
        given = list(inspect.signature(found).parameters.values())[1:]
        same = [(p.name, p.kind, p.default is p.empty) for p in wanted] == [
            (p.name, p.kind, p.default is p.empty) for p in given[: len(wanted)]
        ]
        if not same or any(p.default is p.empty for p in given[len(wanted) :]):
            lacking.append(f"{name}{inspect.signature(found)}")
    return lacking


@pytest.fixture(autouse=True)
def fresh_clients(monkeypatch, tmp_path):
    """No client from another test; an environment the direct S3 client is eligible in."""
    import os

    for name in list(os.environ):
        if name.upper().startswith(("AWS_", "FSSPEC_")) or name.lower() in ("http_proxy", "https_proxy", "all_proxy"):
            monkeypatch.delenv(name)
    (tmp_path / "fsspec").mkdir()
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("FSSPEC_CONFIG_DIR", str(tmp_path / "fsspec"))
    monkeypatch.delenv("DISTSHARD_S3_CLIENT", raising=False)
    clients.forget_clients()
    yield
    clients.forget_clients()


S3 = {"endpoint_url": "http://127.0.0.1:9", "key": "AK", "secret": "SK"}


def test_the_protocol_names_what_the_callers_use():
    assert {"identity", "tail", "submit_range", "read_range", "cat", "fetch", "open_stream", "put", "glob"} <= set(
        members(Transport)
    )
    assert {"list_identities", "fs", "kind", "warm", "shareable_session", "made_filesystem"} <= set(members(Transport))


def test_an_http_client_is_a_transport():
    pytest.importorskip("aiohttp")
    client = clients.client_for("http://127.0.0.1:9/a.tar")
    assert client.kind == "http" and missing_from(client) == []


def test_both_s3_clients_are_transports(monkeypatch):
    pytest.importorskip("s3fs")
    from distshard.sources.transport.s3direct import DirectS3Client

    direct = clients.client_for("s3://bucket/a.tar", S3)
    assert isinstance(direct, DirectS3Client) and missing_from(direct) == []
    monkeypatch.setenv("DISTSHARD_S3_CLIENT", "s3fs")
    clients.forget_clients()
    via_s3fs = clients.client_for("s3://bucket/a.tar", S3)
    assert not isinstance(via_s3fs, DirectS3Client) and via_s3fs.kind == "s3" and missing_from(via_s3fs) == []


def test_a_hub_client_is_a_transport():
    pytest.importorskip("huggingface_hub")
    client = clients.client_for("hf://datasets/org/name/a.tar", {"endpoint": "http://127.0.0.1:9"})
    assert client.kind == "hf" and missing_from(client) == []


def test_the_check_sees_a_client_that_lacks_a_method():
    class Partial:
        kind, protocol, storage_options = "http", "http", {}

        def identity(self, url, options=None):
            return 0, ""

        def glob(self, pattern, recursive):  # one more parameter without a default
            return []

    lacking = missing_from(Partial())
    assert "cat" in lacking and "fs" in lacking and any(name.startswith("glob(") for name in lacking)
    assert not any(name.startswith("identity") for name in lacking)
