"""The direct S3 client's Signature V4 (``distshard.sources.transport.sigv4``) against
botocore's ``S3SigV4Auth`` on the same request at the same time: random keys
(unicode, spaces, ``+``, ``~``, ``%``, slashes), query parameters, regions,
credentials with and without a session token, extra headers."""

from __future__ import annotations

import datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distshard.sources.transport import sigv4

botocore_auth = pytest.importorskip("botocore.auth")
from botocore.awsrequest import AWSRequest  # noqa: E402
from botocore.credentials import Credentials  # noqa: E402

NOW = 1_767_225_600.0 + 12_345  # 2026-01-01T03:25:45Z

keys = st.text(
    alphabet=st.one_of(st.sampled_from(list("/ +~%=&?#:@!$'()*,;[]-_.")), st.characters(codec="utf-8")),
    min_size=1,
    max_size=40,
).filter(lambda k: "\x00" not in k)
params = st.lists(
    st.tuples(
        st.sampled_from(["list-type", "prefix", "continuation-token", "delimiter", "versionId", "a b", "x+y"]),
        st.text(max_size=20),
    ),
    max_size=4,
)
hosts = st.sampled_from(
    ["127.0.0.1:9000", "localhost:9000", "s3.eu-west-1.amazonaws.com", "bucket.s3.amazonaws.com", "minio.example.org"]
)
regions = st.sampled_from(["us-east-1", "eu-west-1", "ap-southeast-2", "us-gov-west-1"])
secrets = st.text(st.characters(codec="ascii", min_codepoint=33, max_codepoint=126), min_size=1, max_size=40)


def botocore_headers(method, scheme, host, path, query, headers, creds, region):
    request = AWSRequest(method=method, url=f"{scheme}://{host}{path}", headers=dict(headers), params=dict(query))
    when = datetime.datetime.fromtimestamp(NOW, datetime.timezone.utc).replace(tzinfo=None)
    original = botocore_auth.get_current_datetime
    botocore_auth.get_current_datetime = lambda: when
    try:
        botocore_auth.S3SigV4Auth(creds, "s3", region).add_auth(request)
    finally:
        botocore_auth.get_current_datetime = original
    return {name.lower(): value for name, value in request.headers.items()}


@settings(max_examples=100, deadline=None)
@given(
    key=keys,
    query=params,
    host=hosts,
    region=regions,
    secret=secrets,
    token=st.one_of(st.none(), st.text(st.characters(codec="ascii", min_codepoint=33, max_codepoint=126), min_size=1)),
    method=st.sampled_from(["GET", "HEAD"]),
    scheme=st.sampled_from(["http", "https"]),
    extra=st.fixed_dictionaries(
        {},
        optional={
            "Range": st.sampled_from(["bytes=0-99", "bytes=100-  199"]),
            "If-Match": st.just('"abc"'),
            "User-Agent": st.just("x"),
        },
    ),
)
def test_the_signature_is_botocores(key, query, host, region, secret, token, method, scheme, extra):
    path = "/bucket/" + sigv4.encode_key(key)
    query = list({name: value for name, value in query}.items())  # botocore's params are a dict
    creds = sigv4.Credentials("AKIDEXAMPLE", secret, token)
    ours = sigv4.sign(method, host, path, query, extra, creds, region, now=NOW)
    theirs = botocore_headers(
        method, scheme, host, path, query, extra, Credentials("AKIDEXAMPLE", secret, token), region
    )
    assert ours["authorization"] == theirs["authorization"]
    for name in ("x-amz-date", "x-amz-content-sha256", "x-amz-security-token"):
        assert ours.get(name) == theirs.get(name), name


@settings(max_examples=30, deadline=None)
@given(key=keys, host=hosts, region=regions, body=st.binary(max_size=2000))
def test_a_put_signs_its_body_as_botocore(key, host, region, body):
    """The direct client's writes (the index command's packs and manifest): the
    body's SHA-256 is the signed payload, as botocore signs a PUT over http."""
    import hashlib

    path = "/bucket/" + sigv4.encode_key(key)
    creds = sigv4.Credentials("AKIDEXAMPLE", "secret")
    payload = hashlib.sha256(body).hexdigest()
    ours = sigv4.sign("PUT", host, path, [], {}, creds, region, payload=payload, now=NOW)
    request = AWSRequest(method="PUT", url=f"http://{host}{path}", data=body)
    when = datetime.datetime.fromtimestamp(NOW, datetime.timezone.utc).replace(tzinfo=None)
    original = botocore_auth.get_current_datetime
    botocore_auth.get_current_datetime = lambda: when
    try:
        botocore_auth.S3SigV4Auth(Credentials("AKIDEXAMPLE", "secret"), "s3", region).add_auth(request)
    finally:
        botocore_auth.get_current_datetime = original
    theirs = {name.lower(): value for name, value in request.headers.items()}
    assert theirs["x-amz-content-sha256"] == payload
    assert ours["authorization"] == theirs["authorization"]


def test_the_key_is_encoded_as_botocore_sends_it():
    from botocore.utils import percent_encode

    for key in ["a b/c+d~e%f", "ünï/çødé", "x?y#z", "a//b"]:
        assert sigv4.encode_key(key) == percent_encode(key, safe="/~")


def test_credentials_never_show_the_secret():
    assert "s3cr3t" not in repr(sigv4.Credentials("AK", "s3cr3t", "tok"))
