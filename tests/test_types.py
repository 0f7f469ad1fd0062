"""hybrid_opt/ passes mypy at the settings of [tool.mypy] in pyproject.toml. mypy runs as a
background job (tests/background_jobs.py): about 50 s of one core without its cache, since it reads
torch's types, taken from the cycles the rest of the suite leaves idle. This test, run last,
collects what it said; run alone, it runs mypy in the foreground."""

import importlib.util

import background_jobs
import pytest

DEADLINE_S = 600  # from when the test starts waiting: conftest.py runs it last


def test_hybrid_opt_passes_mypy():
    if background_jobs.mypy_skip_reason():
        pytest.skip(background_jobs.mypy_skip_reason())
    assert importlib.util.find_spec("mypy"), "mypy is not installed: pip install -e '.[test]'"
    code, out = background_jobs.result("mypy", DEADLINE_S)
    assert code == 0 and "Success: no issues found" in out, (
        f"mypy (exit {code}; None: past {DEADLINE_S} s):\n{out[-6000:]}"
    )
