"""Faithful keys of what a callable computes, for caches of its results.

:func:`distshard.digests.code_digest` names a function by its name and code: what a
state's identity records and must keep bit-identical. It cannot key a cache of a
function's results: two ``functools.partial``\\ s, two instances of a class with
``__call__``, one function with other closure cells, defaults or globals all get one
name. :func:`call_key` keys everything that decides what a callable returns:

* a function defined outside the installed packages (a script, ``__main__``, a project
  checkout): its code (nested functions and lambdas included, not the line numbers),
  defaults, closure cells, attributes (``functools.wraps``' ``__wrapped__``) and the
  globals its code names (of a module it names, the attributes the code names);
* a class of such code: its methods and attributes and those of its bases; an
  instance: its class and its state as ``pickle`` reads it (``__reduce_ex__``: a
  partial's function, arguments and keywords, an object's ``__dict__`` and
  ``__slots__``, a C object's own state);
* a bound method: its function and the object it is bound to;
* values: primitives, containers (sets in a sorted order), numpy arrays and tensors by
  their bytes;
* functions, classes and builtins of installed packages and the standard library by
  name and the package's version (their code is the installed one), closures of
  theirs with their cells; modules by name.

What cannot be read so (an open file, a lock, a generator, a state larger than
:data:`VALUES` values or :data:`ARRAY_BYTES` bytes of arrays) raises
:class:`Unkeyable` saying what it was: a caller does not cache then. A key is the same
in every process (no ``id()``, ``hash()`` or default ``repr``), so a cache keyed by it
is found again by the next job.

This module imports nothing of the package but :mod:`distshard.digests`.
"""

from __future__ import annotations

import copyreg
import os
import sys
import sysconfig
import types
from typing import Any

from .digests import blake2b_hex

__all__ = ["ARRAY_BYTES", "VALUES", "Unkeyable", "call_key"]

VALUES = 200_000  # values a key reads at most (a vocabulary of that size is keyed)
ARRAY_BYTES = 256 << 20  # bytes of numpy arrays and tensors a key reads at most
_SCALARS = (type(None), bool, int, float, complex, type(Ellipsis), type(NotImplemented))
_TEXTS = (str, bytes, bytearray)
_BUILTINS = (
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.ClassMethodDescriptorType,
    types.GetSetDescriptorType,
    types.MemberDescriptorType,
)
_CLASS_SKIPS = frozenset({"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__", "_abc_impl"})
_LIBRARY: dict[str, bool] = {}  # module name -> whether it is installed code, per process


class Unkeyable(Exception):
    """A value :func:`call_key` cannot key faithfully; the message says which and why."""


def call_key(*values: Any) -> str:
    """A 32-hex-digit key of ``values`` (callables and what they hold): equal for
    callables that compute alike, different when anything that decides what they
    compute differs (see the module docstring). :class:`Unkeyable` otherwise."""
    try:
        text = _Keyer().key(values)
    except Unkeyable:
        raise
    except RecursionError:
        raise Unkeyable("it holds a structure nested too deeply to key") from None
    except Exception as exc:  # a value whose reading failed: not keyed, never a failed pack()
        raise Unkeyable(f"reading it raised {exc!r}") from None
    return blake2b_hex(text.encode("utf-8", "surrogatepass"), 16)


def _library(module: str | None) -> bool:
    """Whether ``module`` is installed code (the standard library, builtins, site-packages)."""
    if not module:
        return False
    found = _LIBRARY.get(module)
    if found is None:
        mod = sys.modules.get(module)
        if mod is None or module == "__main__":
            found = False
        else:
            path = getattr(mod, "__file__", None)
            if path is None:
                found = getattr(mod, "__spec__", None) is not None and getattr(mod, "__path__", None) is None
            else:
                found = os.path.realpath(path).startswith(_installed_roots())
        _LIBRARY[module] = found
    return found


def _installed_roots() -> tuple[str, ...]:
    """Where installed code lies: the standard library and every site-packages folder."""
    import site

    paths = sysconfig.get_paths()
    roots = [paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib") if name in paths]
    roots += getattr(site, "getsitepackages", list)()
    if site.ENABLE_USER_SITE and site.USER_SITE:
        roots.append(site.USER_SITE)
    return tuple(sorted({os.path.join(os.path.realpath(root), "") for root in roots}))


def _version(module: str) -> str:
    top = sys.modules.get(module.split(".", 1)[0])
    version = getattr(top, "__version__", None)
    return version if isinstance(version, str) else sys.version.split()[0]


def _named(value: Any) -> str:
    module = getattr(value, "__module__", None) or ""
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or type(value).__qualname__
    return f"{module}.{name}"


class _Keyer:
    """One key's walk: a text per value, shared and cyclic values referenced by the
    order they were first met (the values stay referenced, so no ``id`` is reused)."""

    def __init__(self) -> None:
        self.memo: dict[int, int] = {}
        self.kept: list[Any] = []
        self.values = VALUES
        self.array_bytes = ARRAY_BYTES

    def key(self, value: Any) -> str:
        self.values -= 1
        if self.values < 0:
            raise Unkeyable(f"it holds more than {VALUES:,} values")
        kind = type(value)
        if kind in _SCALARS:
            return f"{kind.__name__}:{value!r}"
        if kind in _TEXTS:
            data = value.encode("utf-8", "surrogatepass") if kind is str else bytes(value)
            return (
                f"{kind.__name__}{len(value)}:{value!r}"
                if len(value) <= 64
                else f"{kind.__name__}:{blake2b_hex(data, 16)}"
            )
        seen = self.memo.get(id(value))
        if seen is not None:
            return f"@{seen}"
        self.memo[id(value)] = len(self.memo)
        self.kept.append(value)
        return self._compound(value)

    def _compound(self, value: Any) -> str:
        kind = type(value)
        if kind in (list, tuple):
            return f"{kind.__name__}[{','.join(map(self.key, value))}]"
        if kind is dict:
            return "dict{" + ",".join(f"{self.key(k)}:{self.key(v)}" for k, v in value.items()) + "}"
        if kind is types.MappingProxyType:
            return f"mappingproxy{self.key(dict(value))}"
        if kind in (set, frozenset):
            return f"{kind.__name__}{{{','.join(sorted(map(self.key, value)))}}}"
        if isinstance(value, types.ModuleType):
            name = value.__name__
            return f"module:{name}" + (f"@{_version(name)}" if _library(name) else "")
        if isinstance(value, types.FunctionType):
            return self._function(value)
        if isinstance(value, type):
            return self._class(value)
        if isinstance(value, types.MethodType):
            return f"method({self.key(value.__func__)},{self.key(value.__self__)})"
        if isinstance(value, types.CodeType):
            return self._code(value)
        if isinstance(value, _BUILTINS):
            return self._builtin(value)
        if isinstance(value, (staticmethod, classmethod)):
            return f"{kind.__name__}({self.key(value.__func__)})"
        if isinstance(value, property):
            return f"property({self.key(value.fget)},{self.key(value.fset)},{self.key(value.fdel)})"
        array = self._array(value)
        return array if array is not None else self._reduced(value)

    def _function(self, fn: types.FunctionType) -> str:
        name = _named(fn)
        cells = ",".join(self._cell(cell) for cell in fn.__closure__ or ())
        if _library(fn.__module__):
            return f"fn:{name}@{_version(fn.__module__)}({cells})"
        parts = [
            self._code(fn.__code__),
            self.key(fn.__defaults__),
            self.key(fn.__kwdefaults__),
            cells,
            self.key(dict(fn.__dict__)),
            self._globals(fn),
        ]
        return f"fn:{name}({';'.join(parts)})"

    def _cell(self, cell: Any) -> str:
        try:
            return self.key(cell.cell_contents)
        except ValueError:  # an empty cell
            return "<empty>"

    def _globals(self, fn: types.FunctionType) -> str:
        """The globals ``fn``'s code names, and of a module it names the attributes it names."""
        names = sorted(_names(fn.__code__))
        scope = fn.__globals__
        out = []
        for name in names:
            if name not in scope:
                continue
            value = scope[name]
            out.append(f"{name}={self.key(value)}")
            if isinstance(value, types.ModuleType) and not _library(value.__name__):
                attributes = vars(value)
                out += [f"{name}.{a}={self.key(attributes[a])}" for a in names if a in attributes]
        return ",".join(out)

    def _code(self, code: types.CodeType) -> str:
        consts = ",".join(self._code(c) if isinstance(c, types.CodeType) else self.key(c) for c in code.co_consts)
        shape = (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags)
        table = getattr(code, "co_exceptiontable", b"")
        body = blake2b_hex(code.co_code + b"\0" + table, 16)
        names = (code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars)
        return f"code{shape}:{body}[{consts}]{names}"

    def _class(self, cls: type) -> str:
        name = _named(cls)
        if _library(cls.__module__):
            return f"class:{name}@{_version(cls.__module__)}"
        attributes = ",".join(
            f"{k}={self.key(v)}"
            for k, v in sorted(vars(cls).items(), key=lambda kv: str(kv[0]))
            if k not in _CLASS_SKIPS
        )
        bases = ",".join(self.key(base) for base in cls.__bases__)
        meta = "" if type(cls) is type else f"meta={self.key(type(cls))}"
        return f"class:{name}({bases}){meta}{{{attributes}}}"

    def _builtin(self, value: Any) -> str:
        owner = getattr(value, "__objclass__", None)
        name = f"{_named(owner)}.{value.__name__}" if owner is not None else _named(value)
        module = getattr(owner or value, "__module__", None) or "builtins"
        bound = getattr(value, "__self__", None)
        target = "" if bound is None or isinstance(bound, (types.ModuleType, type)) else self.key(bound)
        return f"builtin:{name}@{_version(module)}({target})"

    def _array(self, value: Any) -> str | None:
        """A numpy array or a tensor by its dtype, shape and bytes; ``None`` for anything else."""
        numpy, torch = sys.modules.get("numpy"), sys.modules.get("torch")
        if numpy is not None and isinstance(value, (numpy.ndarray, numpy.generic)):
            if value.dtype.hasobject:
                return f"ndarray-of-objects{value.shape}[{self.key(value.tolist())}]"
            data = numpy.ascontiguousarray(value).tobytes()
            return f"ndarray:{value.dtype!r}{value.shape}:{self._bytes(data, value)}"
        if torch is not None and isinstance(value, torch.Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)
            data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
            return f"tensor:{value.dtype}{tuple(value.shape)}:{self._bytes(data, value)}"
        return None

    def _bytes(self, data: bytes, value: Any) -> str:
        self.array_bytes -= len(data)
        if self.array_bytes < 0:
            raise Unkeyable(f"it holds more than {ARRAY_BYTES >> 20} MiB of arrays (a {type(value).__name__})")
        return blake2b_hex(data, 16)

    def _reduced(self, value: Any) -> str:
        """Any other object as ``pickle`` reads it: its class and state."""
        kind = type(value)
        reduce = copyreg.dispatch_table.get(kind)
        try:
            reduced = reduce(value) if reduce is not None else value.__reduce_ex__(4)
        except Exception as exc:
            raise Unkeyable(f"it holds a {_named(kind)}, whose state cannot be read ({exc})") from None
        if isinstance(reduced, str):  # a global, named (a decorated function of one's own: its code too)
            module = getattr(value, "__module__", None) or kind.__module__
            wrapped = None if _library(module) else getattr(value, "__wrapped__", None)
            return f"global:{module}.{reduced}@{_version(module)}({'' if wrapped is None else self.key(wrapped)})"
        if not isinstance(reduced, tuple) or len(reduced) < 2:
            raise Unkeyable(f"it holds a {_named(kind)}, whose __reduce_ex__ gives {type(reduced).__name__}")
        parts = list(reduced[:3])
        for items in reduced[3:5]:  # iterators of list items and dict items
            parts.append(None if items is None else list(items))
        return f"object:{self.key(kind)}({self.key(tuple(parts))})"


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names ``code`` and the code nested in it name."""
    found = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= _names(const)
    return found
