"""Faithful keys for elements: :func:`canonical` encodes a value so that two
encodings are equal exactly when the values are equal (floats exactly, dicts and
sets order-insensitive, tensors and numpy arrays by dtype, shape and bytes, other
objects by their type's qualified name and pickled state, never ``id`` or a
default ``repr``), and :func:`key` is its SHA-256 digest. ``verify`` and the tests
compare multisets of elements by these keys across processes."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch

from .digests import sha256_hex
from .errors import OptionTypeError

__all__ = ["canonical", "display", "key"]


def canonical(value: Any) -> bytes:
    """A canonical byte encoding of ``value``: equal bytes exactly when the values are
    equal, in any process.

    Handles ``None``, ``bool``, ``int``, ``float`` (exact, ``0.1 + 0.2 != 0.3``),
    ``complex``, ``str``, ``bytes``, lists and tuples (told apart), dicts (in any key
    order), sets, torch tensors and numpy arrays and scalars (dtype, shape and every
    byte), dataclasses, and other objects through their pickling state
    (``__reduce_ex__(4)``: ``__dict__``, ``__slots__``) with their type's qualified
    name; never through an address or a default ``repr``. An object that cannot be
    pickled raises ``TypeError``.

    Example:
        >>> canonical({"a": 1, "b": 2}) == canonical({"b": 2, "a": 1})
        True
        >>> canonical(0.1 + 0.2) == canonical(0.3)
        False
    """
    out: list[bytes] = []
    _encode(value, out, [])
    return b"".join(out)


def key(value: Any) -> str:
    """The SHA-256 digest (hex) of :func:`canonical`: a short string, equal across
    processes exactly when the values are equal, that survives the DataLoader's
    ``default_convert``.

    Example:
        >>> key([1, 2]) == key([1, 2]) != key((1, 2))
        True
    """
    return sha256_hex(canonical(value))


def _put(out: list[bytes], tag: bytes, payload: bytes = b"") -> None:
    out.append(tag + len(payload).to_bytes(8, "big") + payload)


def _name(obj: Any) -> bytes:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}".encode()


def _encode(value: Any, out: list[bytes], active: list[int]) -> None:
    kind = type(value)
    if value is None or kind is bool:
        _put(out, b"c", repr(value).encode())
    elif kind is int:
        _put(out, b"i", hex(value).encode())
    elif kind is float:
        _put(out, b"f", value.hex().encode())
    elif kind is complex:
        _put(out, b"j", f"{value.real.hex()},{value.imag.hex()}".encode())
    elif kind is str:
        _put(out, b"s", value.encode("utf-8", "surrogatepass"))
    elif kind is bytes or kind is bytearray:
        _put(out, b"b" if kind is bytes else b"B", bytes(value))
    elif isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        _put(out, b"g", _name(value))
    elif id(value) in active:  # a cycle: refer to the enclosing value by depth
        _put(out, b"r", str(active.index(id(value))).encode())
    else:
        active.append(id(value))
        try:
            _encode_compound(value, kind, out, active)
        finally:
            active.pop()


def _sub(value: Any, active: list[int]) -> bytes:
    out: list[bytes] = []
    _encode(value, out, active)
    return b"".join(out)


def _encode_compound(value: Any, kind: type, out: list[bytes], active: list[int]) -> None:
    if isinstance(value, torch.Tensor):
        _put(out, b"t", _name(kind) + f"|{value.dtype}|{tuple(value.shape)}".encode())
        _put(out, b"d", _tensor_bytes(value))
    elif (kind.__module__ or "").partition(".")[0] == "numpy" and _encode_numpy(value, kind, out, active):
        pass
    elif isinstance(value, (list, tuple)):
        _put(out, b"l", _name(kind) + f"|{len(value)}".encode())
        for item in value:
            _encode(item, out, active)
    elif isinstance(value, dict):
        pairs = sorted(_sub(k, active) + _sub(v, active) for k, v in value.items())
        _put(out, b"m", _name(kind) + f"|{len(pairs)}".encode())
        out.extend(pairs)
    elif isinstance(value, (set, frozenset)):
        items = sorted(_sub(item, active) for item in value)
        _put(out, b"e", _name(kind) + f"|{len(items)}".encode())
        out.extend(items)
    elif dataclasses.is_dataclass(value):
        fields = dataclasses.fields(value)
        _put(out, b"a", _name(kind) + f"|{len(fields)}".encode())
        for item in fields:
            _encode(item.name, out, active)
            _encode(getattr(value, item.name), out, active)
    else:
        _encode_object(value, kind, out, active)


def _tensor_bytes(value: torch.Tensor) -> bytes:
    try:
        tensor = value.detach()
        if tensor.layout != torch.strided:
            tensor = tensor.to_dense()
        tensor = tensor.cpu().resolve_conj().resolve_neg().contiguous()
        # the elements' bytes in one C call (bytes(storage) asks the storage for every byte in turn)
        return bytes(tensor.reshape(-1).view(torch.uint8).tolist())
    except Exception as exc:  # noqa: BLE001 - quantized, meta, ...: refuse rather than guess
        raise OptionTypeError(f"cannot compare a {value.dtype} {value.layout} tensor faithfully: {exc}") from None


def _encode_numpy(value: Any, kind: type, out: list[bytes], active: list[int]) -> bool:
    """Arrays and scalars of numpy (imported only when the value is numpy's); False for
    other numpy objects."""
    import numpy

    if isinstance(value, numpy.generic):
        array = numpy.asarray(value)
    elif isinstance(value, numpy.ndarray):
        array = value
    else:
        return False
    _put(out, b"n", _name(kind) + f"|{array.dtype.descr}|{array.shape}".encode())
    if array.dtype.hasobject:  # the bytes of an object array are addresses
        _encode(array.tolist(), out, active)
    else:
        _put(out, b"d", array.tobytes())
    return True


def _encode_object(value: Any, kind: type, out: list[bytes], active: list[int]) -> None:
    try:
        reduced = value.__reduce_ex__(4)
    except Exception as exc:  # noqa: BLE001
        raise OptionTypeError(
            f"cannot compare {kind.__module__}.{kind.__qualname__} values faithfully ({exc}); "
            "make the elements picklable, or map them to plain data before checking"
        ) from None
    if isinstance(reduced, str):  # a module-level singleton
        _put(out, b"g", _name(kind) + b"|" + reduced.encode())
        return
    parts = list(reduced)
    for index in (3, 4):  # list items and dict items come as iterators
        if len(parts) > index and parts[index] is not None:
            parts[index] = list(parts[index])
    _put(out, b"o", _name(kind))
    _encode(tuple(parts), out, active)


def display(value: Any, width: int = 60) -> str:
    """A short readable name for reports (display only, never compared)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001
        text = f"<{type(value).__qualname__}>"
    return text if len(text) <= width else text[: width - 3] + "..."


# -- processes ------------------------------------------------------------------------
