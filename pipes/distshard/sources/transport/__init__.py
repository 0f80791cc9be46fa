"""Getting bytes: local and remote file identity and opening (``files.py``), the remote clients
(``remote.py``: fsspec and aiohttp, fork-safe; ``s3direct.py``: the direct S3 client over ``http.client``,
signing with ``sigv4.py``), what a store's response means and one request's retries (``responses.py``),
one streamed GET a file (``streamed.py``), URL patterns (``urls.py``) and the per-process LRU (``_lru.py``).
The lowest room: it imports no other room (but for the upward imports the layout test lists in ``UPWARD``).
"""
