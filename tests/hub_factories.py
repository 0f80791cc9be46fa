"""The model-based history test's ``"remote-hub"`` source (tests/model_factories.py):
the JSON-lines file of ``"e0" .. "e{n-1}"`` in a dataset repository of a loopback Hub
(tests/hub_server.py, started once per process), read as ``hf://`` with the history
test's small reads at the repository's first commit, while same-size rewrites
(``"x0" ..``, then ``"e0" ..`` again) are pushed to ``main`` in the middle of jobs
(:class:`Pusher`): every read stays on the commit the URL names, never a row of
another one, under every loader, worker and resume of the history."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import distshard
from tests.hub_server import HubServer

__all__ = ["remote_hub_jsonl"]

HUB: Any = None  # (pid, HubServer, Pusher) of this process


def version(n: int, letter: str) -> bytes:
    return "".join(json.dumps(f"{letter}{i}") + "\n" for i in range(n)).encode()


class Pusher:
    """The first commit of every ``n`` holds version ``e`` (what the sources read, by
    a URL naming that commit: in-process ranks of one run are built one after the
    other, and a real job's ranks resolving ``main`` apart could pin different
    commits, see docs/files.md); every build arms a push to
    ``main`` after ``2 + n % 5`` reads of the file: a same-size rewrite, version ``x``
    when ``main`` holds ``e`` and ``e`` again when it holds ``x`` (a new commit
    either way)."""

    def __init__(self, hub: HubServer) -> None:
        self.hub, self.lock = hub, threading.Lock()
        self.first: dict[int, str] = {}  # n -> the commit of version e the sources read
        self.heads: dict[int, str] = {}  # n -> the version main holds
        self.pushes: dict[int, int] = {}  # n -> commits pushed while sources read
        self.armed: tuple[int, int] | None = None  # (n, reads left)

    def reset(self, n: int) -> str:
        with self.lock:
            if n not in self.first:
                self.first[n] = self.hub.commit(f"model/e{n}", {f"e{n}.jsonl": version(n, "e")})
                self.heads[n] = "e"
            self.armed = (n, 2 + n % 5)
            return self.first[n]

    def __call__(self, kind: str, path: str) -> None:
        with self.lock:
            if kind != "resolve" or self.armed is None or f"/model/e{self.armed[0]}/" not in path:
                return
            n, left = self.armed
            self.armed = (n, left - 1) if left > 1 else None
            if left == 1:
                self.heads[n] = "x" if self.heads[n] == "e" else "e"
                self.hub.commit(f"model/e{n}", {f"e{n}.jsonl": version(n, self.heads[n])})
                self.pushes[n] = self.pushes.get(n, 0) + 1


def remote_hub_jsonl(n: int) -> Any:
    global HUB
    from huggingface_hub import constants

    from tests.model_factories import jsonl_file, small_reads

    jsonl_file(0)  # the cache directory
    if HUB is None or HUB[0] != os.getpid():
        hub = HubServer(lfs_from=200).start()
        pusher = Pusher(hub)
        hub.on_request = pusher
        HUB = (os.getpid(), hub, pusher)
    hub = HUB[1]
    constants.ENDPOINT = hub.endpoint  # huggingface_hub's own requests (its agent registry) stay on 127.0.0.1
    commit = HUB[2].reset(n)
    return distshard.jsonl(
        f"hf://datasets/model/e{n}@{commit}/e{n}.jsonl",
        read_options=small_reads(),
        storage_options={"endpoint": hub.endpoint},
    )
