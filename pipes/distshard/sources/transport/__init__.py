"""Getting bytes: local and remote file identity and opening (``files.py``), each process's clients
(``clients.py``), what every client offers (``contract.py``: ``Transport``) and the behaviour they share
(``ranged.py``), the clients (``remote.py``: fsspec, with ``over_http.py``'s aiohttp requests, fork-safe;
``s3direct.py``: the direct S3 client over ``http.client`` where ``s3config.py`` finds its outcome certain,
its pool and connections per process in ``s3pool.py``, signing with ``sigv4.py``; ``hub.py``: ``hf://``),
what a store's response means and one request's retries (``responses.py``), one streamed GET a file
(``streamed.py``), URL patterns (``urls.py``) and the per-process LRU (``lru.py``). The lowest room: it
imports no other room, only what stands below them all (``read_options.py``, ``coalesce.py``).
"""
