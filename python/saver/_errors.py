"""The package's errors and warnings: the native module's `SaverError` and what this package adds
to it."""

from __future__ import annotations

from ._native import SaverError

__all__ = ["InputError", "ReplacedError", "SaverError", "SaverWarning"]


class SaverWarning(UserWarning):
    """Something a call did that the caller should know of, such as a restart that fell back to
    an older step."""


class ReplacedError(SaverError):
    """A load through an opened :class:`Checkpoint` failed because another save replaced the
    checkpoint meanwhile (its files removed): open it again and start over. :func:`load` by
    path does so itself."""


class InputError(SaverError, ValueError):
    """An argument saver cannot take: an unsupported dtype, slots of another length than their
    ids, ids that are not integers, a missing ``ids`` array. Raised before anything is written."""
