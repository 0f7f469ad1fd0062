"""A note on an exception that propagates as it is (KeyboardInterrupt in step(), a cleanup's own
failure under the first one), so that what it left reaches the user on every Python.

Python 3.11 has `BaseException.add_note`, and its traceback prints the notes under the error.
Python 3.10 has neither: there the note goes out as a RuntimeWarning when it is made, just
before the error's own traceback."""

from __future__ import annotations

import sys
import warnings


def add_note(e: BaseException, message: str) -> None:
    """Notes `message` on `e` (module docstring)."""
    if hasattr(e, "add_note"):
        e.add_note(message)
    else:
        warn_note(e, message)


def warn_note(e: BaseException, message: str) -> None:
    """Python 3.10's way (module docstring); any Python runs it, so the tests hold it everywhere.
    Never raises: where warnings are errors (`-W error`) the note goes to stderr, and the error in
    hand (a Ctrl-C) propagates as it is rather than a RuntimeWarning in its place."""
    text = f"{type(e).__name__}: {message}"
    try:
        warnings.warn(text, RuntimeWarning, stacklevel=3)  # where add_note was called
    except Warning:
        print(f"hybrid_opt: {text}", file=sys.stderr)
