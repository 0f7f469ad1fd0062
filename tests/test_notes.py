"""hybrid_opt.notes: what an exception that propagates as it is (Ctrl-C in step()) carries on
Python 3.11 (add_note) and says on 3.10 (a RuntimeWarning); the 3.10 way runs here too."""

import sys
import warnings

import pytest

from hybrid_opt.notes import add_note, warn_note


def test_add_note_puts_the_message_where_the_traceback_prints_it():
    e = KeyboardInterrupt()
    if sys.version_info >= (3, 11):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # and says nothing else
            add_note(e, "first")
            add_note(e, "second")
        assert e.__notes__ == ["first", "second"]
    else:
        with pytest.warns(RuntimeWarning, match="^KeyboardInterrupt: first$"):
            add_note(e, "first")


def test_the_python_3_10_way_says_the_note_naming_the_error():
    e = KeyboardInterrupt()
    with pytest.warns(RuntimeWarning, match=r"^KeyboardInterrupt: the step was partly applied$"):
        warn_note(e, "the step was partly applied")
    assert not hasattr(e, "__notes__")


def test_where_warnings_are_errors_the_note_goes_to_stderr_and_nothing_is_raised(capsys):
    # python -W error: a RuntimeWarning raised in place of the Ctrl-C would hide it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_note(KeyboardInterrupt(), "parameters [0] only in part (torn)")
    assert capsys.readouterr().err == "hybrid_opt: KeyboardInterrupt: parameters [0] only in part (torn)\n"
