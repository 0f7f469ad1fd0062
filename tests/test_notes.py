"""hybrid_opt.notes: what an exception that propagates as it is (Ctrl-C in step()) carries on
Python 3.11 (add_note) and on 3.10 (__notes__ and a RuntimeWarning); the 3.10 way runs here too."""

import sys

import pytest

from hybrid_opt.notes import add_note, note_without_add_note


def test_add_note_puts_the_message_where_the_traceback_prints_it():
    e = KeyboardInterrupt()
    if sys.version_info >= (3, 11):
        add_note(e, "first")
        add_note(e, "second")
    else:
        with pytest.warns(RuntimeWarning, match="KeyboardInterrupt: first"):
            add_note(e, "first")
        with pytest.warns(RuntimeWarning, match="second"):
            add_note(e, "second")
    assert e.__notes__ == ["first", "second"]


def test_the_python_3_10_way_keeps_the_notes_and_says_them_now():
    e = KeyboardInterrupt()
    with pytest.warns(RuntimeWarning, match=r"^KeyboardInterrupt: the step was partly applied$"):
        note_without_add_note(e, "the step was partly applied")
    assert e.__notes__ == ["the step was partly applied"]
    e.__notes__ = "not a list"  # what some other code left there is replaced, not extended
    with pytest.warns(RuntimeWarning):
        note_without_add_note(e, "again")
    assert e.__notes__ == ["again"]
