"""Reading ahead of use: the read-ahead (``fetch.py``; a sample's requests to it, ``sample_requests.py``)
planning with ``extents.py`` over ``../coalesce.py``'s ranges, the local range cache (``cache.py``, checksummed entries)
and what it may serve (``confirm.py``: files whose identity the job confirmed with the store), the order
``shuffle=True`` visits (``order.py``).
"""
