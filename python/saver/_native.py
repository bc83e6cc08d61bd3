"""The native module, as the rest of the package calls it: every call guarded, so that a Rust
panic never reaches the caller as pyo3's ``PanicException``, a ``BaseException`` that ``except
Exception`` does not catch, but as a :class:`SaverError` naming the call. The native objects a
call returns (a save's handle, a manager) are guarded the same way."""

from __future__ import annotations

import functools
from typing import Any

from . import _saver as _raw

SaverError = _raw.SaverError

# The native classes whose objects calls return: their methods are guarded too.
_GUARDED_TYPES = (_raw.SaveHandle, _raw.Manager, _raw.Opened)


def _is_panic(e: BaseException) -> bool:
    return type(e).__name__ == "PanicException" and type(e).__module__ == "pyo3_runtime"


class _Guarded:
    """``target`` (the module or a native object) with each callable attribute guarded."""

    __slots__ = ("_target",)

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr) or (isinstance(attr, type) and issubclass(attr, BaseException)):
            return attr
        return _guard(attr, name)


def _guard(call: Any, name: str) -> Any:
    @functools.wraps(call)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            out = call(*args, **kwargs)
        except BaseException as e:
            if not _is_panic(e):
                raise
            raise SaverError(f"saver's native {name}() failed unexpectedly (a bug; please report it): {e}") from None
        return _Guarded(out) if isinstance(out, _GUARDED_TYPES) else out

    return guarded


native = _Guarded(_raw)
