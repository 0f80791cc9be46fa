"""The Hugging Face Hub (``hf://datasets/<org>/<name>/...``) as a store of its own.

- **Pinned to a commit.** When a source is built (:func:`pin`, from
  :func:`.urls.expand_urls`) each repository's revision (``main`` when the URL
  names none) is resolved once to its commit (one ``repo_info`` request) and the
  URLs name it (``hf://datasets/org/name@<commit>/path``): the listing and every
  read of the job are of that commit, whatever is pushed meanwhile. A URL that
  already names a commit is kept as it is; buckets (no commits) are not pinned.
- **Identity from the Hub.** A file's stamp is what the Hub says of its bytes:
  ``sha256:<hex>`` (an LFS file's sha256) or ``blob:<git blob id>``, from the
  folder's tree listing (made once, then served from ``HfFileSystem``'s listing
  cache, so a glob's files cost no request each). :func:`.files.key_of` names a
  file without its pin, so caches and stored indexes serve a file unchanged
  between commits, and never another version: the stamp names the bytes.
- **Reads through distshard's own HTTP client.** ``GET
  <endpoint>/<type>s/<repo>/resolve/<commit>/<path>`` with ``Range`` and the
  token as a header (``huggingface_hub.utils.build_hf_headers``), following the
  Hub's redirect of LFS files to its CDN; every answer's ``X-Linked-Etag`` (LFS)
  or ``ETag`` is compared with the indexed stamp, its ``Content-Range`` with the
  size. No ``HfFileSystem`` file (its buffered reads fetched 5 MiB past every
  range) and no retries of huggingface_hub's nested in distshard's.
- **Errors by status.** ``HfHubHTTPError`` is an ``OSError`` and looked
  transient: here a 404 (repository, revision or file) is a missing file at
  once, 401/403 a refusal, 429/5xx transient (retried within ``ReadOptions``).
- **Read-only.** Writing (the index command's default location beside the data)
  is refused: ``--out`` says where.

The endpoint is ``storage_options["endpoint"]``, else ``HF_ENDPOINT``, else
huggingface_hub's default; the token ``storage_options["token"]``, else
huggingface_hub's own (``HF_TOKEN``, the stored login).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
from typing import Any, Callable, Mapping, TypeVar
from urllib.parse import quote

from ..read_options import ReadOptions
from .pins import unpinned
from .ranged import range_header, retried
from .remote import Client
from .responses import Attempts, Changed, Transient, check_content_range, check_status, exact, missing, read_only

__all__ = ["HubClient", "pin", "unpinned"]

T = TypeVar("T")

_PREFIX = {"dataset": "datasets/", "space": "spaces/", "kernel": "kernels/", "model": ""}
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_WILD = re.compile(r"[*?\[]")
_DEFAULT = ReadOptions()


def is_hub(url: str) -> bool:
    return url[:5].lower() == "hf://"


def endpoint_of(storage_options: Mapping[str, Any] | None) -> str:
    from huggingface_hub import constants

    given = (storage_options or {}).get("endpoint")
    return str(given or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _parsed(url: str) -> Any:
    from huggingface_hub.utils import parse_hf_uri

    try:
        return parse_hf_uri(url)
    except ValueError as exc:
        raise ValueError(
            f"{url}: not an hf:// URL of a repository ({exc}): write hf://datasets/<org>/<name>/..."
        ) from None


def sorted_error(url: str, what: str, exc: BaseException) -> BaseException:
    """What a huggingface_hub error means, by its HTTP status: a 404 a missing file,
    401/403 a refusal, 429/5xx transient (:class:`.answers.Transient`); a
    ``FileNotFoundError`` (HfFileSystem's 404s) a missing file; else ``exc``."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(exc, FileNotFoundError) or status == 404:
        return missing(url)
    if isinstance(status, int):
        try:
            check_status(url, status, what)
        except Exception as meant:  # noqa: BLE001 - the error the status means
            return meant
    return exc


def hub_retried(url: str, what: str, call: Callable[[], T], options: ReadOptions = _DEFAULT) -> T:
    """``call()`` (a blocking huggingface_hub call), its errors sorted by status and
    the transient ones retried within ``options`` (:class:`.responses.Attempts`), by
    the one retry loop of the clients (:func:`.ranged.retried`)."""

    def attempt() -> T:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - sorted here, then classified by Attempts
            raise sorted_error(url, what, exc) from None

    return retried(Attempts(url, what, options), attempt)


def pin(url: str, storage_options: Mapping[str, Any] | None, pins: dict[Any, str]) -> str:
    """``url`` naming the commit its revision is now (one ``repo_info`` request per
    repository and revision in ``pins``, the calls' shared memo); a URL that names a
    commit already, or a bucket's, is returned as it is."""
    parsed = _parsed(url)
    if parsed.type not in _PREFIX or (parsed.revision and _COMMIT.match(parsed.revision)):
        return url
    key = (parsed.type, parsed.id, parsed.revision, endpoint_of(storage_options))
    commit = pins.get(key)
    if commit is None:
        from huggingface_hub import HfApi

        options = storage_options or {}
        api = HfApi(endpoint=endpoint_of(options), token=options.get("token"))
        root = f"hf://{_PREFIX[parsed.type]}{parsed.id}"

        def ask() -> str:
            info = api.repo_info(parsed.id, repo_type=parsed.type, revision=parsed.revision)
            return str(info.sha)

        commit = pins[key] = agreed(
            lambda: hub_retried(root, f"the commit of revision {parsed.revision or 'main'}", ask)
        )
    path = f"/{parsed.path_in_repo}" if parsed.path_in_repo else ""
    return f"hf://{_PREFIX[parsed.type]}{parsed.id}@{commit}{path}"


def agreed(resolve: Callable[[], str]) -> str:
    """The commit every rank of the job pins: with ``torch.distributed`` initialized
    (several ranks, not in a DataLoader worker), rank 0's, sent to the others (a
    collective of the default group: every rank builds the source, in the same
    order), so ranks that build around a push still read one commit; else
    ``resolve()`` here."""
    from ...groups import job_ranks

    if job_ranks() is None:
        return resolve()
    import torch.distributed as dist

    found: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            found[0] = resolve()
        except Exception as exc:  # noqa: BLE001 - every rank raises it, none waits
            found[0] = exc
    dist.broadcast_object_list(found, src=0)
    if isinstance(found[0], BaseException):
        raise found[0]
    return str(found[0])


def stamp_of(url: str, info: Mapping[str, Any]) -> tuple[int, str]:
    """``(size, stamp)`` of a file from what the Hub lists of it."""
    size = info.get("size")
    if size is None or info.get("type") == "directory":
        raise missing(url)
    lfs = info.get("lfs")
    if lfs:
        return int(size), f"sha256:{lfs['sha256']}"
    if info.get("blob_id"):
        return int(size), f"blob:{info['blob_id']}"
    return int(size), str(info.get("xet_hash") or info.get("mtime") or "")


def answer_stamp(history: Any, headers: Mapping[str, str]) -> str | None:
    """The stamp a resolve answer names (its redirect's, for an LFS file), or ``None``."""
    for seen in [*(h.headers for h in history), headers]:
        linked = seen.get("X-Linked-Etag")
        if linked:
            return f"sha256:{linked.strip().removeprefix('W/').strip(chr(34))}"
    etag = (history[0].headers if history else headers).get("ETag")
    return f"blob:{etag.strip().removeprefix('W/').strip(chr(34))}" if etag else None


class HubClient(Client):
    """``hf://``: listing and identities through ``HfFileSystem``, reads through
    distshard's own HTTP client on ``resolve/<commit>/...`` (see the module docstring)."""

    def __init__(self, url: str, storage_options: dict[str, Any], client_for: Callable[[str], Any]) -> None:
        self.endpoint = endpoint_of(storage_options)
        self._client_for = client_for  # this process's clients (the endpoint's HTTP one)
        super().__init__(url, "hf", {**storage_options, "endpoint": self.endpoint})
        self.kind = "hf"
        self._headers: dict[str, str] | None = None
        self._listed: dict[str, tuple[int, str]] = {}  # identities the listings gave (see listing)
        self._folders: set[tuple[str, str]] = set()  # (repository root, folder) listed

    def headers(self) -> dict[str, str]:
        """The reads' headers: the token (``storage_options["token"]``; ``None`` or
        ``True``: huggingface_hub's own, unless ``HF_HUB_DISABLE_IMPLICIT_TOKEN``) as
        ``authorization``. Not ``build_hf_headers``: its user agent asks the Hub for a
        registry of agents (a request per process, each DataLoader worker's too)."""
        if self._headers is None:
            from huggingface_hub import constants, get_token

            token = self.storage_options.get("token")
            if token is None and constants.HF_HUB_DISABLE_IMPLICIT_TOKEN:
                token = False
            if token is None or token is True:
                token = get_token()
            self._headers = {"user-agent": "distshard"}
            if isinstance(token, str) and token:
                self._headers["authorization"] = f"Bearer {token}"
        return self._headers

    def resolve_url(self, url: str) -> str:
        parsed = _parsed(url)
        if parsed.type not in _PREFIX:
            raise ValueError(f"{url}: only repositories are read (datasets, models, spaces), not {parsed.type}s")
        revision = quote(parsed.revision or "main", safe="")
        return f"{self.endpoint}/{_PREFIX[parsed.type]}{parsed.id}/resolve/{revision}/{quote(parsed.path_in_repo)}"

    async def _blocking(self, url: str, what: str, call: Callable[[], T]) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(None, call)
        except Exception as exc:  # noqa: BLE001 - sorted by status
            raise sorted_error(url, what, exc) from None

    async def _generic_info(self, url: str) -> dict[str, Any]:
        fs = self.fs
        info: dict[str, Any] = await self._blocking(url, "metadata", lambda: fs.info(self.path_of(url)))
        return info

    async def _identity(self, url: str, options: ReadOptions) -> tuple[int, str]:
        if _parsed(url).type not in _PREFIX:  # a bucket: what HfFileSystem says of it
            return stamp_of(url, await self._generic_info(url))
        return await self._blocking(url, "metadata", lambda: self._known(url))

    async def _answer(self, url: str, what: str, headers: dict[str, str]) -> tuple[Any, bytes]:
        session = await self._client_for(self.endpoint).fs.set_session()
        asked = {**self.headers(), **headers, "Accept-Encoding": "identity"}
        async with session.get(self.resolve_url(url), headers=asked, allow_redirects=True) as r:
            check_status(url, r.status, what)
            try:
                return r, bytes(await r.read())
            except Exception as exc:  # noqa: BLE001 - a cut body: retried
                raise Transient(f"the body was cut: {type(exc).__name__}: {exc}") from None

    async def _get(
        self, url: str, start: int, stop: int, size: int | None, stamp: str | None, options: ReadOptions
    ) -> bytes:
        what = f"bytes [{start}, {stop})"
        r, data = await self._answer(url, what, {"Range": range_header(start, stop)})
        seen = answer_stamp(r.history, r.headers)
        if stamp and seen and seen != stamp:
            raise Changed(f"stamp {stamp} -> {seen}")
        if r.status == 206:
            check_content_range(url, r.headers.get("Content-Range"), start, stop, size)
        elif not (start == 0 and size is not None and stop == size):
            raise Transient(f"HTTP {r.status} without Content-Range for {what}")
        return exact(url, data, start, stop)

    async def _fetch(self, url: str, options: ReadOptions) -> bytes:
        return (await self._answer(url, "the whole file", {}))[1]

    def glob(self, pattern: str) -> list[str]:
        """The files matching ``pattern`` (fsspec's glob rules): one tree listing of
        the deepest folder without a wildcard (recursive when the wildcards reach
        below it; paginated by huggingface_hub), its files' identities kept for
        :meth:`identity` (the commit is pinned: they stay true for the job)."""
        from fsspec.utils import glob_translate

        parsed = _parsed(pattern)
        path = parsed.path_in_repo
        if parsed.type not in _PREFIX or not path:
            fs = self.fs
            found = hub_retried(pattern, "a listing", lambda: fs.glob(self.path_of(pattern)))
            return sorted(fs.unstrip_protocol(p) for p in found)
        words = path.split("/")
        fixed = list(itertools.takewhile(lambda word: not _WILD.search(word), words))
        recursive = len(fixed) < len(words) - 1 or "**" in path
        folder = "/".join(fixed)
        listed = hub_retried(pattern, "a listing", lambda: self.listing(parsed, folder, recursive))
        matches = re.compile(glob_translate(path)).match
        return sorted(url for url, name in listed.items() if matches(name))

    def listing(self, parsed: Any, folder: str, recursive: bool) -> dict[str, str]:
        """``{url: path in the repo}`` of the files in ``folder`` of the repository
        and revision ``parsed`` names (one tree request, paginated by
        huggingface_hub), their identities kept for :meth:`identity`."""
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFile

        api = HfApi(endpoint=self.endpoint, token=self.storage_options.get("token"))
        tree = api.list_repo_tree(
            parsed.id, folder or None, recursive=recursive, revision=parsed.revision, repo_type=parsed.type
        )
        root = f"hf://{_PREFIX[parsed.type]}{parsed.id}" + (f"@{parsed.revision}" if parsed.revision else "")
        found = {}
        for entry in tree:
            if isinstance(entry, RepoFile):
                url = f"{root}/{entry.path}"
                info = {"size": entry.size, "type": "file", "lfs": entry.lfs, "blob_id": entry.blob_id}
                self._listed[url] = stamp_of(url, info)
                found[url] = entry.path
        self._folders.add((root, folder))
        return found

    def _known(self, url: str) -> tuple[int, str]:
        """``url``'s identity from its folder's listing (one request per folder)."""
        parsed = _parsed(url)
        if url not in self._listed and parsed.type in _PREFIX:
            folder = parsed.path_in_repo.rpartition("/")[0]
            root = f"hf://{_PREFIX[parsed.type]}{parsed.id}" + (f"@{parsed.revision}" if parsed.revision else "")
            if (root, folder) not in self._folders:
                self.listing(parsed, folder, False)
        known = self._listed.get(url)
        if known is None:
            raise missing(url)
        return known

    def put(self, url: str, data: bytes) -> None:
        raise read_only(url)
