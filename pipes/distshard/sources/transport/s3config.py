"""Whether an ``s3://`` configuration is read by the direct client, and where its requests go.

:func:`direct_config` gives the direct client's :class:`Config` (endpoint,
addressing, signing region, credentials, certificates) only when the storage
options and the environment leave no doubt about where a request goes and how it
is signed (an explicit endpoint, or real AWS with an explicit region; explicit
credentials or ``anon=True``; no proxy, profile, AWS config or fsspec
configuration that could change it), else the reason it is not: s3fs reads then
(see :mod:`.s3direct` and :func:`.clients.client_for`).
"""

from __future__ import annotations

import configparser
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from .sigv4 import Credentials, encode_key

__all__ = ["ENV", "Config", "direct_config"]

#: the environment variable that picks the S3 client: ``auto``, ``s3fs`` or ``direct``
ENV = "DISTSHARD_S3_CLIENT"

# storage options that do not change what a read reaches or how it is signed
# (s3fs's S3FileSystem and fsspec's AbstractFileSystem arguments), with the
# values they may take (None: any)
_HARMLESS: dict[str, tuple[Any, ...] | None] = {
    "skip_instance_cache": None,
    "use_listings_cache": None,
    "listings_expiry_time": None,
    "max_paths": None,
    "default_block_size": None,
    "default_fill_cache": None,
    "default_cache_type": None,
    "max_concurrency": None,
    "fixed_upload_size": None,
    "local_expiry_check": None,
    "use_ssl": (True,),
    "requester_pays": (False,),
    "version_aware": (False,),
    "cache_regions": (False,),
    "s3_additional_kwargs": (None,),
}
_CREDENTIALS = ("key", "secret", "token", "anon")
# AWS_* variables that change nothing here beyond what direct_config reads
_AWS_VARIABLES = {
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",  # botocore does not read it (checked: tests/test_sources_s3direct.py)
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_CA_BUNDLE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_EC2_METADATA_DISABLED",
    "AWS_METADATA_SERVICE_TIMEOUT",
    "AWS_METADATA_SERVICE_NUM_ATTEMPTS",
    "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE",
}
_PROXIES = ("http_proxy", "https_proxy", "all_proxy")
# keys of an AWS config file's [default] profile that change nothing here
_CONFIG_KEYS = {"aws_access_key_id", "aws_secret_access_key", "aws_session_token", "region", "output"}
_AWS_REGION = re.compile(r"^(us|eu|ap|sa|ca|me|af|il|mx)(-gov)?-[a-z]+-\d+$")
_CN_REGION = re.compile(r"^cn-[a-z]+-\d+$")
_VIRTUAL_BUCKET = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")
_IP = re.compile(r"^\d+\.\d+\.\d+\.\d+$")


@dataclass(frozen=True)
class Config:
    """Where the direct client sends a request and how it signs it.

    ``scheme``, ``host``, ``port``: the endpoint (``aws`` set: real AWS, the host
    then per bucket and region, ``domain`` its partition's); ``region``: the
    signing region; ``credentials``: ``None`` sends unsigned requests
    (``anon=True``); ``ca_bundle``: the certificates of https (``AWS_CA_BUNDLE``,
    else certifi's when importable, else the system's); ``follow_regions``: a
    bucket answered from another region is asked there (real AWS)."""

    scheme: str
    host: str
    port: int | None
    region: str
    credentials: Credentials | None
    aws: bool = False
    domain: str = "amazonaws.com"
    ca_bundle: str | None = None
    follow_regions: bool = False

    def address(self, bucket: str, key: str, region: str) -> tuple[str, str]:
        """``(Host header, path)`` of an object (``key`` empty: the bucket), as botocore addresses it."""
        path = encode_key(key)
        if not self.aws:
            return self._host_header(self.host), f"/{bucket}/{path}" if key else f"/{bucket}"
        base = "s3.amazonaws.com" if region == "us-east-1" else f"s3.{region}.{self.domain}"
        if _VIRTUAL_BUCKET.match(bucket) and not _IP.match(bucket):
            return f"{bucket}.{base}", f"/{path}"
        return base, f"/{bucket}/{path}" if key else f"/{bucket}"

    def _host_header(self, host: str) -> str:
        default = 443 if self.scheme == "https" else 80
        return host if self.port in (None, default) else f"{host}:{self.port}"


def direct_config(storage_options: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> Config | str:
    """The direct client's :class:`Config` for these ``storage_options`` and
    ``environ`` (default ``os.environ``), or why it is not eligible: it is only
    when the outcome is certainly the one s3fs and botocore would reach."""
    env = os.environ if environ is None else environ
    options = dict(storage_options or {})
    reason = _options_reason(options) or _environment_reason(env)
    if reason is not None:
        return reason
    credentials = _credentials(options, env)
    if isinstance(credentials, str):
        return credentials
    return _endpoint_config(options, env, credentials)


def _options_reason(options: Mapping[str, Any]) -> str | None:
    """Why these storage options are not read directly, or ``None``."""
    for name, value in options.items():
        if name in _CREDENTIALS or name in ("endpoint_url", "client_kwargs", "config_kwargs"):
            continue
        if name not in _HARMLESS:
            return f"the storage option {name!r} (only key, secret, token, anon, endpoint_url, client_kwargs are read)"
        allowed = _HARMLESS[name]
        if allowed is not None and value not in allowed and not (value == {} and None in allowed):
            return f"the storage option {name}={value!r}"
    config_kwargs = options.get("config_kwargs") or {}
    if not isinstance(config_kwargs, Mapping) or set(config_kwargs) - {"max_pool_connections"}:
        return f"config_kwargs {config_kwargs!r} (only max_pool_connections)"
    client_kwargs = options.get("client_kwargs") or {}
    if not isinstance(client_kwargs, Mapping) or set(client_kwargs) - {"endpoint_url", "region_name"}:
        return f"client_kwargs {client_kwargs!r} (only endpoint_url and region_name)"
    if "endpoint_url" in client_kwargs and options.get("endpoint_url"):
        return "endpoint_url given twice (in storage_options and client_kwargs)"
    return None


def _environment_reason(env: Mapping[str, str]) -> str | None:
    """Why the environment may change what botocore reaches (a variable, a profile, fsspec's configuration), or ``None``."""
    for name in env:
        upper = name.upper()
        if upper.startswith("AWS_") and upper not in _AWS_VARIABLES and env[name]:
            return f"the environment variable {name}"
        if upper.startswith("FSSPEC_S3"):
            return f"the environment variable {name} (fsspec configuration)"
        if name.lower() in _PROXIES and env[name]:
            return f"a proxy ({name} is set)"
    if env.get("AWS_PROFILE"):
        return "AWS_PROFILE is set (a profile's settings are botocore's to read)"
    fsspec_dir = env.get("FSSPEC_CONFIG_DIR") or os.path.join(os.path.expanduser("~"), ".config", "fsspec")
    if os.path.isdir(fsspec_dir) and os.listdir(fsspec_dir):
        return f"fsspec configuration files in {fsspec_dir}"
    return None


def _credentials(options: Mapping[str, Any], env: Mapping[str, str]) -> Credentials | str | None:
    """The explicit credentials (``None``: ``anon=True``, unsigned), or why there are none."""
    if options.get("anon"):
        if any(options.get(name) for name in ("key", "secret", "token")):
            return "anon=True with credentials"
        return None
    if options.get("key") or options.get("secret") or options.get("token"):
        key, secret, token = options.get("key"), options.get("secret"), options.get("token")
        if not (isinstance(key, str) and key and isinstance(secret, str) and secret):
            return "key and secret are not both given in storage_options"
        if token is not None and not isinstance(token, str):
            return "a token that is not a string"
        return Credentials(key, secret, token)
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return Credentials(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], env.get("AWS_SESSION_TOKEN"))
    return "no explicit credentials (key and secret in storage_options, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or anon=True)"


def _endpoint_config(
    options: Mapping[str, Any], env: Mapping[str, str], credentials: Credentials | None
) -> Config | str:
    """Where requests go (the endpoint, or real AWS in the region's partition), or why it is not certain."""
    client_kwargs = options.get("client_kwargs") or {}
    endpoint = options.get("endpoint_url") or client_kwargs.get("endpoint_url")
    endpoint = endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    region = client_kwargs.get("region_name") or env.get("AWS_DEFAULT_REGION")
    config_file = env.get("AWS_CONFIG_FILE") or os.path.join(os.path.expanduser("~"), ".aws", "config")
    if os.path.exists(config_file):
        if not (endpoint and region):
            return f"the AWS config file {config_file} with no explicit endpoint and region"
        reason = _config_file_reason(config_file)
        if reason is not None:
            return reason
    ca_bundle = env.get("AWS_CA_BUNDLE") or _certifi()
    if endpoint:
        if not isinstance(endpoint, str):
            return f"endpoint_url {endpoint!r} is not a string"
        match = re.match(r"^(https?)://([^/:?#\[\]@]+)(?::(\d+))?/?$", endpoint.strip())
        if match is None:
            return f"the endpoint {endpoint!r} (only scheme://host[:port] is read directly)"
        scheme, host, port = match.group(1), match.group(2).lower(), match.group(3)
        return Config(
            scheme, host, int(port) if port else None, str(region or "us-east-1"), credentials, ca_bundle=ca_bundle
        )
    if not region:
        return "real AWS with no explicit region (client_kwargs region_name or AWS_DEFAULT_REGION)"
    region = str(region)
    if _AWS_REGION.match(region):
        domain = "amazonaws.com"
    elif _CN_REGION.match(region):
        domain = "amazonaws.com.cn"
    else:
        return f"the region {region!r} (a partition read through botocore)"
    return Config(
        "https", "", None, region, credentials, aws=True, domain=domain, ca_bundle=ca_bundle, follow_regions=True
    )


def _config_file_reason(path: str) -> str | None:
    parser = configparser.RawConfigParser()
    try:
        parser.read(path)
    except configparser.Error as exc:
        return f"the AWS config file {path} could not be read ({type(exc).__name__})"
    if parser.has_section("default"):
        for key in parser.options("default"):
            if key not in _CONFIG_KEYS:
                return f"the AWS config file {path} sets {key}"
    return None


def _certifi() -> str | None:
    try:
        import certifi
    except ImportError:
        return None
    return str(certifi.where())
