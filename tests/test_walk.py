"""Issue #22's walk: one speculated host subgroup, hook to commit, measured by tests/walk.py.

The ceilings are ratchets at today's measured figures (3 x Linear(32, 32): six params in one host
subgroup; 40 hops, each module visited at most twice; the git log has the earlier figures). A change that lengthens the walk fails here; one that shortens
it lowers the ceiling in the same commit. #22's "each module at most twice" is MAX_VISITS = 2.
`visits` counts every hop into a module (a helper called once per param counts once per param);
`passes` counts a run of consecutive hops into one module once.
"""

import os
import sys
import textwrap

import pytest
from walk import OUTSIDE, Tracer, qualname_in, trace_walk

MAX_HOPS = 40  # plain grads named in speculation; the slot count inside the staging; HostTier relays none
MAX_VISITS = 2  # issue #22: each module at most twice
MAX_PASSES = 2
MAX_PHASE_VISITS = 2  # within backward's launch, and within step(): each module at most twice


@pytest.fixture(scope="module")
def walk():
    return trace_walk()


def test_the_walk_is_one_committed_speculation(walk):
    assert walk.committed >= 1, "the traced step committed no speculated host step"
    assert walk.speculations == 1, walk.speculations
    assert walk.sequence[0].caller == OUTSIDE and walk.sequence[0].via_outside, walk.sequence[0]
    last = walk.sequence[-1]
    assert (last.module, last.function) == ("hybrid_opt.state.layout", "Subgroup.write"), last


def test_the_walk_is_no_longer_than_today(walk):
    print()
    print(walk.format())
    assert walk.hops <= MAX_HOPS, f"{walk.hops} hops > {MAX_HOPS}:\n{walk.format()}"
    assert walk.max_visits <= MAX_VISITS, f"max visits {walk.max_visits} > {MAX_VISITS}: {walk.visits}"
    assert walk.max_passes <= MAX_PASSES, f"max passes {walk.max_passes} > {MAX_PASSES}: {walk.passes}"
    assert walk.max_phase_visits <= MAX_PHASE_VISITS, (
        f"max visits in one phase > {MAX_PHASE_VISITS}: {walk.phase_visits}"
    )
    assert set(walk.phase_visits) == {"backward", "step"}, walk.phase_visits


@pytest.mark.skipif(
    sys.version_info < (3, 11), reason="Python 3.10's code objects carry no co_qualname to check"
)
def test_qualnames_found_in_modules_are_the_code_objects_own():
    # Python 3.10 has no co_qualname: the tracer finds a function's qualified name in its module
    # instead (qualname_in), so the walk ends at "Subgroup.write" there too. Held here, where
    # co_qualname exists, for every function of hybrid_opt that its module defines under its own name
    import gc
    import importlib
    import pkgutil
    import types

    import hybrid_opt

    for info in pkgutil.walk_packages(hybrid_opt.__path__, "hybrid_opt."):
        if not info.name.endswith("__main__"):  # the CLI: importing it runs it
            importlib.import_module(info.name)
    functions = [
        f
        for f in gc.get_objects()
        if isinstance(f, types.FunctionType)
        and (f.__module__ or "").startswith("hybrid_opt")
        and "<locals>" not in f.__qualname__
        and f.__qualname__ == f.__code__.co_qualname  # not made by a dataclass or a wrapper's wraps
    ]
    wrong = [
        (f.__module__, f.__code__.co_qualname, found)
        for f in functions
        if (found := qualname_in(sys.modules[f.__module__], f.__code__)) != f.__code__.co_qualname
    ]
    assert len(functions) > 500 and not wrong, (len(functions), wrong[:10])
    assert qualname_in(None, functions[0].__code__) == functions[0].__code__.co_name


# ============================================================================= the tracer itself
_A = """
from pkg import b
import ext


def hook():             # what autograd would call: the walk starts at the last one
    b.prepare()
    b.spec()


class A:
    def write(self):
        return b.leaf()


def helper():
    return 1


def step():
    A().write()
    b.after()           # past the end: not in the walk
"""
_B = """
import ext


def prepare():
    return sum(gen())   # a generator: one call, however often it resumes


def gen():
    yield 1
    yield 2


class Part:
    def spec(self):     # a speculate the outer one delegates to: not a second speculation
        return 0


def spec():
    from pkg import a
    return a.helper() + Part().spec()


def leaf():
    return ext.call(cb)  # back into this module through code outside the package


def cb():
    return 2


def after():
    return 3
"""
_EXT = """
def call(fn):
    return fn()
"""


def test_tracer_on_a_two_module_chain(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(textwrap.dedent(_A))
    (pkg / "b.py").write_text(textwrap.dedent(_B))
    (tmp_path / "ext.py").write_text(textwrap.dedent(_EXT))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("pkg", "pkg.a", "pkg.b", "ext"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    from pkg import a

    tracer = Tracer(
        str(pkg), "pkg", spec_module_prefix="b", spec_function="spec", end_module="a", end_qualname="A.write"
    )
    previous = sys.getprofile()
    sys.setprofile(tracer)
    try:
        tracer.phase = "backward"
        a.hook()
        a.hook()
        tracer.phase = "step"
        a.step()
    finally:
        sys.setprofile(previous)
    walk = tracer.walk()
    assert [str(h) for h in walk.sequence] == [
        f"{OUTSIDE} ~> a.hook",
        "a -> b.prepare",
        "a -> b.spec",
        "b -> a.helper",
        f"{OUTSIDE} ~> a.step",
        "a -> b.leaf",
        "b ~> b.cb",
    ]
    assert [(h.reentry, h.callback) for h in walk.sequence] == [
        (False, False),
        (False, False),
        (True, False),
        (True, True),
        (True, False),
        (True, False),
        (True, True),
    ]
    assert walk.hops == 7 and walk.modules == ["pkg.a", "pkg.b"]
    assert walk.visits == {"pkg.a": 3, "pkg.b": 4}
    assert walk.passes == {"pkg.a": 2, "pkg.b": 2}  # b.prepare + b.spec, b.leaf + b.cb: one pass each
    assert walk.returns_to_left == 5 and walk.callbacks == 2
    assert tracer.speculations == 2  # one per hook; Part.spec nested in b.spec
    assert os.path.isdir(tracer.root)
