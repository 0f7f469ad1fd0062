"""Issue #39, item 3: a package's `__init__.py` is its face — it lists names and defines nothing —
and the cost model (`hybrid-opt plan`'s, the automatic planner's) imports without the tiers.

A face may hold a docstring, imports, `__all__` and the `__version__` string. The top-level face
keeps one definition, a lazy `__getattr__`: the worker process runs `hybrid_opt/__init__.py`
(it imports `hybrid_opt.worker.main`) and must start without torch, which the public classes
import (`import hybrid_opt` takes well under a millisecond; the optimizer module, seconds).
"""

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "hybrid_opt"
MAX_FACE_LINES = 40

FACES = sorted(PACKAGE.rglob("__init__.py"))
LAZY_GETATTR = {"hybrid_opt/__init__.py"}  # the worker starts without torch (docstring above)
NOT_YET_A_FACE: set = set()  # a face that still defines something, named here until it is moved
METADATA = {"__all__", "__version__"}

# what importing the cost model must not bring in: the tiers, the worker, the step
HEAVY = ("hybrid_opt.tiers", "hybrid_opt.worker", "hybrid_opt.stepping", "hybrid_opt.speculation")


def _name(path: Path) -> str:
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name


def definitions(path: Path) -> list:
    """The statements of a face that are neither its docstring, an import, nor metadata."""
    body = ast.parse(path.read_text()).body
    found = []
    for k, node in enumerate(body):
        if k == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if (
            isinstance(node, ast.Assign)
            and all(isinstance(t, ast.Name) and t.id in METADATA for t in node.targets)
            and isinstance(node.value, (ast.List, ast.Tuple, ast.Constant))
        ):
            continue
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__" and _name(path) in LAZY_GETATTR:
            continue
        found.append(f"{_name(path)}:{node.lineno}: {type(node).__name__}")
    return found


@pytest.mark.parametrize("path", [p for p in FACES if _name(p) not in NOT_YET_A_FACE], ids=_name)
def test_a_package_face_defines_nothing(path):
    assert definitions(path) == []
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_FACE_LINES, f"{_name(path)} has {lines} lines > {MAX_FACE_LINES}"


def test_the_exceptions_still_exist():
    # an exception for a face that is gone (or now clean) is removed in the same commit
    names = {_name(p) for p in FACES}
    assert NOT_YET_A_FACE <= names and LAZY_GETATTR <= names
    for name in NOT_YET_A_FACE:
        assert definitions(REPO / name), f"{name} defines nothing now: drop it from NOT_YET_A_FACE"


def test_the_scan_sees_a_definition(tmp_path):
    face = tmp_path / "__init__.py"
    face.write_text('"""doc"""\nimport os\n__all__ = ["os"]\nX = 1\n\n\ndef f():\n    pass\n')
    assert [d.split(": ")[1] for d in definitions(face)] == ["Assign", "FunctionDef"]


def _imported_by(statement: str, stub_placement_face: bool) -> list:
    """The hybrid_opt modules a fresh interpreter holds after `statement`; with
    `stub_placement_face`, hybrid_opt/placement/__init__.py is replaced by an empty face first
    (what it is once it only re-exports names that the cost model does not need)."""
    code = textwrap.dedent(
        f"""
        import json, sys, types
        import hybrid_opt
        if {stub_placement_face!r}:
            face = types.ModuleType("hybrid_opt.placement")
            face.__path__ = [hybrid_opt.__path__[0] + "/placement"]
            sys.modules["hybrid_opt.placement"] = face
        {statement}
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("hybrid_opt"))))
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _heavy(modules: list) -> list:
    return [m for m in modules if m.startswith(HEAVY)]


def test_the_cost_model_itself_imports_no_tier():
    modules = _imported_by("import hybrid_opt.placement.cost_model", stub_placement_face=True)
    assert "hybrid_opt.placement.cost_model" in modules
    assert _heavy(modules) == [], modules


def test_importing_the_cost_model_imports_no_tier():
    modules = _imported_by("import hybrid_opt.placement.cost_model", stub_placement_face=False)
    assert _heavy(modules) == [], modules
