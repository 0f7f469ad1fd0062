"""Tests come in by the front door (issue #39 item 7; CONTRIBUTING.md, Tests): they check behaviour
through the public API and `hybrid_opt.testing.debug_view`, the one documented introspection
surface; none reaches through `opt.parts`, so an internal move breaks one module, not the suite."""

import inspect
import os
import re

import hybrid_opt.testing as T

TESTS = os.path.dirname(os.path.abspath(__file__))
# an optimizer's parts reached directly: `x.parts.layout`, `x.parts[0]`, or `opt.parts` itself
# (pathlib's `p.parts`, a tuple of names, is neither)
REACH = re.compile(r"\.parts\s*[.\[]|\bopt\.parts\b")


def _test_sources():
    for root, dirs, files in os.walk(TESTS):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in sorted(files):
            path = os.path.join(root, name)
            if name.endswith(".py") and path != os.path.abspath(__file__):
                yield path


def test_no_test_reaches_through_opt_parts():
    found = []
    for path in _test_sources():
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if REACH.search(line):
                    found.append(f"{os.path.relpath(path, TESTS)}:{n}: {line.strip()}")
    assert not found, "use hybrid_opt.testing.debug_view(opt) instead of opt.parts:\n" + "\n".join(found)


def test_the_scan_sees_every_kind_of_reach():
    for line in ("opt.parts.layout.subgroups", "x.parts[0]", "opts['a'].parts.placement", "opt.parts"):
        assert REACH.search(line), line
    assert not REACH.search('if "__pycache__" not in p.parts')  # pathlib, not an optimizer


def test_every_member_of_the_surface_says_what_it_is():
    members = [(name, m) for name, m in vars(T.DebugView).items() if not name.startswith("_")]
    assert len(members) > 10
    for name, member in members:
        doc = member.__doc__ if isinstance(member, property) else inspect.getdoc(member)
        assert doc and doc.strip(), f"DebugView.{name} has no docstring"
    assert T.debug_view.__doc__ and T.__doc__
