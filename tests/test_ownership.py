"""CONTRIBUTING.md's "State has one owner" held as a ratchet: tests/ownership.py's AST scan of
hybrid_opt/ against the checked-in list of today's findings (tests/ownership_allowlist.py).

A finding not in the list fails (an attribute written outside its owner, a lazy getattr, a
mixin's shared attribute: fix it, do not list it); so does a listed entry no longer found (the
change fixed it: delete it from the list), so the list only shrinks. Issue #22 is done for
ownership when the list holds none of kinds "outside-init", "foreign-write" and "shared-attr".
"""

import textwrap

import pytest
from ownership import LEGITIMATE_ATTRS, Violation, scan, summary
from ownership_allowlist import ALLOWLIST


def _where(sites, found):
    return "\n".join(
        f"  {s.path}:{s.line}: {tuple(s.violation)!r}"
        for s in sorted(sites, key=lambda s: (s.path, s.line))
        if s.violation in found
    )


@pytest.fixture(scope="module")
def package_scan():
    return scan()


def test_no_finding_outside_the_ratchet(package_scan):
    found, sites = package_scan
    print()
    print(summary(found))
    new = found - ALLOWLIST
    assert not new, (
        f"{len(new)} ownership finding(s) not in tests/ownership_allowlist.py (CONTRIBUTING.md, "
        f"State has one owner; tests/ownership.py says what each kind means): give the attribute "
        f"one owner instead of listing it\n" + _where(sites, new)
    )


def test_the_ratchet_only_shrinks(package_scan):
    found, _ = package_scan
    gone = ALLOWLIST - found
    assert not gone, (
        f"{len(gone)} entr(y/ies) of tests/ownership_allowlist.py no longer found: "
        f"delete them (the ratchet only shrinks)\n" + "\n".join(f"  {v!r}," for v in sorted(gone))
    )


_PKG = """
from dataclasses import dataclass
from typing import NamedTuple


@dataclass
class Rec:
    a: int
    b: int = 0


class Row(NamedTuple):
    x: int


class Owner:
    def __init__(self, part):
        self.part = part
        self.n = 0
        self.rec = Rec(1)

    def step(self, t, other):
        self.n += 1                       # set in __init__: fine
        self.later = 1                    # outside-init
        del self.gone                     # outside-init
        self.part.count = 2               # foreign-write through a part
        other.value = 3                   # foreign-write
        t.grad = None                     # legitimate: torch's
        self.rec.b = 4                    # foreign-write (through self, though Rec is local)
        r = Rec(2)
        r.b = 5                           # a record of this module's: fine
        self.x[0] = 1                     # a subscript store: not an attribute write
        getattr(self, "lazy", None)       # lazy-getattr
        getattr(self, "n")                # no default: fine
        self.__dict__.get("cached")       # self-dict
        vars(other)                       # foreign-dict

        def inner():
            self.closure = 1              # outside-init, from a nested function
        inner()


class Mixin:
    def setup(self):
        self.shared = 1                   # outside-init (no __init__) and shared-attr
"""
_OTHER = """
from pkg.a import Mixin


class Facade(Mixin):
    def __init__(self):
        self.shared = 0                   # shared-attr: one family, two modules


def helper(opt):
    opt.flag = True                       # foreign-write from a module function
"""


def test_scanner_on_a_synthetic_package(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(textwrap.dedent(_PKG))
    (pkg / "b.py").write_text(textwrap.dedent(_OTHER))
    found, sites = scan(str(pkg))
    V = Violation
    assert found == {
        V("pkg.a", "Owner", "later", "outside-init"),
        V("pkg.a", "Owner", "gone", "outside-init"),
        V("pkg.a", "Owner", "closure", "outside-init"),
        V("pkg.a", "Owner", "self.part.count", "foreign-write"),
        V("pkg.a", "Owner", "other.value", "foreign-write"),
        V("pkg.a", "Owner", "self.rec.b", "foreign-write"),
        V("pkg.a", "Owner", "lazy", "lazy-getattr"),
        V("pkg.a", "Owner", "cached", "self-dict"),
        V("pkg.a", "Owner", "other.__dict__", "foreign-dict"),
        V("pkg.a", "Mixin", "shared", "outside-init"),
        V("pkg.a", "Mixin", "shared", "shared-attr"),
        V("pkg.b", "Facade", "shared", "shared-attr"),
        V("pkg.b", "<module>", "opt.flag", "foreign-write"),
    }, sorted(found)
    assert all(s.path.startswith("pkg/") and s.line > 0 for s in sites)
    assert "grad" in LEGITIMATE_ATTRS
