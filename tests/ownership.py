"""Who writes which attribute: an AST scan of every module under hybrid_opt/ (CONTRIBUTING.md,
"State has one owner"; issue #22: "No attribute is written outside the part that owns it").

Each finding is a `Violation(module, cls, attr, kind)`; `kind` is one of

- "outside-init": `self.x = ...`, `self.x += ...` or `del self.x` in a method of a class whose
  own `__init__` (or `__post_init__`) never assigns `self.x`. A dataclass's or NamedTuple's
  fields count as assigned by its `__init__`; a class without `__init__` (a mixin) that
  assigns attributes in its methods has every one of them here.
- "foreign-write": `obj.x = ...` (or `+=`, `del`) where `obj` is not the method's `self` —
  `other.x`, `self.part.x`, `Class.x` — unless the write is (1) legitimate (LEGITIMATE_ATTRS,
  LEGITIMATE_OBJECTS: the protocol of an object the package does not own, such as a tensor's
  `.grad` or a ctypes prototype)
  or (2) a same-module record write: `x` is an attribute of a class defined in the module
  doing the write (a mutable record its own module fills in: `spec.bank = None` in
  tiers/host_step.py, which defines `_Speculation`). `attr` is the target as written
  (`plan.spare_banks`); `cls` the enclosing class, or "<module>" in a module-level function.
- "lazy-getattr": `getattr(self, "x", default)` — an attribute that may not exist yet.
- "self-dict": `self.__dict__` used (`attr`: the constant key, or "__dict__"), and
  "foreign-dict": another object's `__dict__` (`vars(obj)` too).
- "shared-attr": the mixin smell: `self.x` assigned (anywhere, `__init__` included) by classes
  of one family — classes that end up in one object's MRO, such as `_HybridBase` and its
  mixins, or `HostTier` and `HostStepping` — in two or more modules. One entry per assigning
  (module, class). Unrelated classes sharing a name (`self.closed`) are not a finding.

Name resolution is syntactic: bases are matched to the package's classes by name (class names
are unique in the package), and a record write is recognised by the attribute's name only.

`scan()` returns the set; `python -m tests.ownership` prints the summary and
`python -m tests.ownership --write` regenerates tests/ownership_allowlist.py (the ratchet that
tests/test_ownership.py holds the code to).
"""

from __future__ import annotations

import ast
import os
import sys
from collections import Counter, defaultdict
from typing import NamedTuple

KINDS = ("outside-init", "foreign-write", "lazy-getattr", "self-dict", "foreign-dict", "shared-attr")
PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hybrid_opt")
CONSTRUCTORS = ("__init__", "__post_init__")

# attribute names that are another library's protocol, written on objects the package does
# not own, whatever the object's expression
LEGITIMATE_ATTRS = {
    "grad": "torch.Tensor: a param's .grad is torch's slot for it (released, replaced, zeroed)",
    "data": "torch.Tensor: .data rebinds a param's storage (layout.own_contiguous)",
    "requires_grad": "torch.Tensor: autograd's flag",
    "argtypes": "ctypes: a foreign function's prototype",
    "restype": "ctypes: a foreign function's prototype",
    "__cause__": "exceptions: chaining a cause onto an error raised elsewhere",
}
# (module, name of the written object): locals of a foreign type filled for one call
LEGITIMATE_OBJECTS = {
    ("hybrid_opt.worker.arena_steps", "a"): "the kernel's ctypes argument Structure (AdamArgs / "
    "InverseArgs / Q8AdamArgs), filled field by field for one C call",
    ("hybrid_opt.worker.main", "a"): "the kernel's ctypes argument Structure, its length set for the "
    "fault injection's half call",
}


class Violation(NamedTuple):
    module: str
    cls: str
    attr: str
    kind: str


class Site(NamedTuple):
    violation: Violation
    path: str
    line: int


def legitimate_foreign(module: str, base: str, attr: str) -> str | None:
    """Why `base.attr = ...` in `module` is legitimate, or None."""
    if attr in LEGITIMATE_ATTRS:
        return LEGITIMATE_ATTRS[attr]
    return LEGITIMATE_OBJECTS.get((module, base))


# ============================================================================= the scan
def _module_name(path: str, root: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(root))[:-3].split(os.sep)
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join(rel)


def _targets(node):
    """The expressions a statement stores to or deletes."""
    if isinstance(node, ast.Assign):
        out = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        out = [node.target] if not isinstance(node, ast.AnnAssign) or node.value is not None else []
    elif isinstance(node, ast.Delete):
        out = list(node.targets)
    elif isinstance(node, (ast.For, ast.AsyncFor)):
        out = [node.target]
    elif isinstance(node, (ast.With, ast.AsyncWith)):
        out = [i.optional_vars for i in node.items if i.optional_vars is not None]
    else:
        return []
    flat = []
    while out:
        t = out.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            out.extend(t.elts)
        elif isinstance(t, ast.Starred):
            out.append(t.value)
        else:
            flat.append(t)
    return flat


def _expr(node) -> str:
    """A dotted name as written (`self._auto`, `p.task`); anything else "<expr>"."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return "<expr>"
    return ".".join([node.id] + parts[::-1])


def _is_name(node, name) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _walk_no_classes(node):
    """ast.walk below `node`, not into nested class bodies (their methods are their own)."""
    todo = list(ast.iter_child_nodes(node))
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, ast.ClassDef):
            todo.extend(ast.iter_child_nodes(n))


def _decorator_names(node) -> set:
    names = set()
    for d in node.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        names.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return names


def _base_names(cls: ast.ClassDef) -> list:
    out = []
    for b in cls.bases:
        b = b.value if isinstance(b, ast.Subscript) else b
        out.append(b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", ""))
    return out


class _Class:
    def __init__(self, module: str, path: str, node: ast.ClassDef):
        self.module, self.path, self.node, self.name = module, path, node, node.name
        self.bases = _base_names(node)
        record = "dataclass" in _decorator_names(node) or "NamedTuple" in self.bases
        # fields: annotated names of a dataclass / NamedTuple body (ClassVar excluded)
        self.fields = (
            {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign)
                and isinstance(s.target, ast.Name)
                and "ClassVar" not in ast.unparse(s.annotation)
            }
            if record
            else set()
        )
        self.class_names = {t.id for s in node.body for t in _targets(s) if isinstance(t, ast.Name)}
        self.assigned: dict = defaultdict(list)  # attr -> [(method, line)] of self.attr stores
        self.methods = [s for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]

    def self_name(self, fn) -> str | None:
        if "staticmethod" in _decorator_names(fn) or "classmethod" in _decorator_names(fn):
            return None
        args = fn.args.posonlyargs + fn.args.args
        return args[0].arg if args else None

    def constructor_attrs(self) -> set:
        done = set(self.fields)
        for attr, sites in self.assigned.items():
            if any(m in CONSTRUCTORS for m, _ in sites):
                done.add(attr)
        return done


def _classes(tree: ast.Module, module: str, path: str) -> list:
    return [_Class(module, path, n) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]


def scan(root: str = PACKAGE_DIR) -> tuple[set, list]:
    """(violations, sites): every finding of the package under `root`, and where each is."""
    root = os.path.realpath(root)
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".py"))
    sites: list = []
    classes: dict = {}
    trees = {}
    for path in files:
        with open(path) as fh:
            tree = ast.parse(fh.read(), path)
        module = _module_name(path, root)
        trees[path] = (module, tree)
        for c in _classes(tree, module, path):
            classes[c.name] = c
    record_attrs: dict = defaultdict(set)  # module -> attribute names its classes declare

    # pass 1: self-stores per class
    for c in classes.values():
        for fn in c.methods:
            me = c.self_name(fn)
            if me is None:
                continue
            for n in _walk_no_classes(fn):
                for t in _targets(n):
                    if isinstance(t, ast.Attribute) and _is_name(t.value, me):
                        c.assigned[t.attr].append((fn.name, t.lineno))
        record_attrs[c.module] |= c.fields | c.class_names | set(c.assigned)

    def add(module, cls, attr, kind, path, line):
        rel = os.path.relpath(path, os.path.dirname(root))
        sites.append(Site(Violation(module, cls, attr, kind), rel, line))

    # (a) outside the constructor
    for c in classes.values():
        init = c.constructor_attrs()
        for attr, where in c.assigned.items():
            for method, line in where:
                if method not in CONSTRUCTORS and attr not in init:
                    add(c.module, c.name, attr, "outside-init", c.path, line)

    # (b), (c): foreign writes, lazy getattrs, __dict__: per method (its `self` known, its
    # nested functions with it), per module-level function, and the module's own statements
    units = [(c.module, c.path, c.name, c.self_name(fn), fn) for c in classes.values() for fn in c.methods]
    for path, (module, tree) in trees.items():
        for stmt in tree.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                units.append((module, path, "<module>", None, stmt))
            elif not isinstance(stmt, ast.ClassDef):
                units.append((module, path, "<module>", None, ast.Module(body=[stmt], type_ignores=[])))
    for module, path, cls, me, fn in units:
        for n in _walk_no_classes(fn):
            for t in _targets(n):
                if not isinstance(t, ast.Attribute) or (me is not None and _is_name(t.value, me)):
                    continue
                base = _expr(t.value)
                if t.attr == "__dict__" or legitimate_foreign(module, base, t.attr) is not None:
                    continue
                if t.attr in record_attrs[module] and not (me is not None and base.startswith(me + ".")):
                    continue  # a record of this module's, filled in by its module
                add(module, cls, f"{base}.{t.attr}", "foreign-write", path, t.lineno)
            if isinstance(n, ast.Call):
                f = n.func
                if (
                    _is_name(f, "getattr")
                    and len(n.args) == 3
                    and me is not None
                    and _is_name(n.args[0], me)
                    and isinstance(n.args[1], ast.Constant)
                ):
                    add(module, cls, str(n.args[1].value), "lazy-getattr", path, n.lineno)
                if _is_name(f, "vars") and n.args and not (me is not None and _is_name(n.args[0], me)):
                    add(module, cls, _expr(n.args[0]) + ".__dict__", "foreign-dict", path, n.lineno)
            if isinstance(n, ast.Attribute) and n.attr == "__dict__":
                if me is not None and _is_name(n.value, me):
                    add(module, cls, _dict_key(n, fn), "self-dict", path, n.lineno)
                else:
                    add(module, cls, _expr(n), "foreign-dict", path, n.lineno)

    # (d) one family's attribute assigned in two modules
    for family in _families(classes):
        by_attr = defaultdict(set)
        for c in family:
            for attr in c.assigned:
                by_attr[attr].add(c)
        for attr, owners in by_attr.items():
            if len({c.module for c in owners}) > 1:
                for c in owners:
                    add(c.module, c.name, attr, "shared-attr", c.path, c.assigned[attr][0][1])
    return {s.violation for s in sites}, sites


def _dict_key(node: ast.Attribute, fn) -> str:
    """The constant key of `self.__dict__.get("k")`, `[...]`, `.setdefault`, `.pop`, else
    "__dict__"."""
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.value is node:
            if n.args and isinstance(n.args[0], ast.Constant):
                return str(n.args[0].value)
        if isinstance(n, ast.Subscript) and n.value is node and isinstance(n.slice, ast.Constant):
            return str(n.slice.value)
    return "__dict__"


def _families(classes: dict) -> list:
    """Groups of the package's classes that share an MRO: each class with every package class
    it inherits from, merged where they overlap."""

    def ancestors(c, seen):
        for b in c.bases:
            if b in classes and b not in seen:
                seen.add(b)
                ancestors(classes[b], seen)
        return seen

    groups: list = []
    for c in classes.values():
        members = ancestors(c, {c.name})
        if len(members) < 2:
            continue
        merged = [g for g in groups if g & members]
        for g in merged:
            groups.remove(g)
            members |= g
        groups.append(members)
    return [[classes[n] for n in sorted(g)] for g in groups]


# ============================================================================= reporting
def summary(violations: set) -> str:
    by_kind = Counter(v.kind for v in violations)
    by_module = Counter(v.module for v in violations)
    lines = [f"{len(violations)} findings", "", "| kind | findings |", "|---|---|"]
    lines += [f"| {k} | {by_kind.get(k, 0)} |" for k in KINDS]
    lines += ["", "| module | " + " | ".join(KINDS) + " | all |", "|---|" + "---|" * (len(KINDS) + 1)]
    for m, n in sorted(by_module.items(), key=lambda kv: (-kv[1], kv[0])):
        per = Counter(v.kind for v in violations if v.module == m)
        lines.append(f"| {m} | " + " | ".join(str(per.get(k, 0)) for k in KINDS) + f" | {n} |")
    return "\n".join(lines)


def allowlist_source(violations: set) -> str:
    out = [
        '"""The ownership ratchet: every finding of tests/ownership.py in today\'s code, as',
        "(module, class, attr, kind). tests/test_ownership.py fails on a finding not listed here",
        "and on an entry no longer found, so the list only shrinks: delete the entries a change",
        'fixes (regenerate: `PYTHONPATH=$PWD python -m tests.ownership --write`)."""',
        "",
        "ALLOWLIST = {",
    ]
    for v in sorted(violations, key=lambda v: (v.module, v.kind, v.cls, v.attr)):
        out.append(f"    {tuple(v)!r},")
    out += ["}", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="regenerate tests/ownership_allowlist.py")
    ap.add_argument("--sites", action="store_true", help="list every finding with its file:line")
    args = ap.parse_args(argv)
    violations, sites = scan()
    print(summary(violations))
    if args.sites:
        for s in sorted(sites, key=lambda s: (s.path, s.line)):
            print(f"{s.path}:{s.line}: {s.violation.kind} {s.violation.cls}.{s.violation.attr}")
    if args.write:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ownership_allowlist.py")
        with open(path, "w") as f:
            f.write(allowlist_source(violations))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
