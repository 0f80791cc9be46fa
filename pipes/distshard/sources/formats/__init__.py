"""The file formats: each names the byte spans a sample needs and parses the bytes it is handed
(``tar.py``: WebDataset shards, ``jsonl.py``, ``parquet.py``, ``megatron.py``: Megatron ``.bin``/``.idx``
pairs), the contract they offer (``contract.py``: ``Format``), and the index they build of a file
(``file_index.py``) with its cache, built once per job (``index_cache.py``). A format opens files only
through ``transport/files.py`` and imports no remote client.
"""
