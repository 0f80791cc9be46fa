"""The stored index, written once beside the data: the manifest and per-file entries
(``manifest.py``), entries packed many to an object and read by range (``entry_packs.py``), building it
(``indexing.py``: ``python -m distshard index``) and deleting what no manifest names (``pruning.py``: its
``--prune``).
"""
