"""moto's S3 server on 127.0.0.1, for the tests that need an S3 API (started by
the caller, which stops it): one place that picks the port and quiets its log."""

from __future__ import annotations

import logging
from typing import Any

from distshard.verify import free_port


def start_moto() -> tuple[Any, str]:
    """``(server, endpoint URL)`` of a started ``ThreadedMotoServer`` on 127.0.0.1;
    ``server.stop()`` stops it."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{port}"
