"""A note on an exception that propagates as it is (KeyboardInterrupt in step(), a cleanup's own
failure under the first one), so that what it left reaches the user on every Python.

Python 3.11 has `BaseException.add_note`, and its traceback prints the notes under the error.
Python 3.10 has neither: there the text goes on `__notes__` as 3.11 keeps it (pytest and the
`exceptiongroup` backport print it) and out as a RuntimeWarning now, since 3.10's traceback would
print nothing of it."""

from __future__ import annotations

import warnings


def add_note(e: BaseException, message: str) -> None:
    """Notes `message` on `e` (module docstring)."""
    if hasattr(e, "add_note"):
        e.add_note(message)
    else:
        note_without_add_note(e, message)


def note_without_add_note(e: BaseException, message: str) -> None:
    """Python 3.10's way (module docstring); any Python runs it, so the tests hold it everywhere."""
    notes = getattr(e, "__notes__", None)
    e.__notes__ = [*(notes if isinstance(notes, list) else []), message]  # type: ignore[attr-defined]
    warnings.warn(f"{type(e).__name__}: {message}", RuntimeWarning, stacklevel=3)  # where add_note was called
