"""The walk of one speculated host subgroup, from its grad hook to its commit (issue #22).

A tracer, not a test: `trace_walk()` trains a small CPU model whose whole state is one host
subgroup (offload 1.0, speculation on, no clipping), warms it up, then runs one more iteration's
backward and step() under `sys.setprofile` (main thread) and keeps the calls into Python
functions defined under hybrid_opt/. The walk is the stretch

- from the hook invocation that makes the subgroup ready and speculates it: the outermost
  hybrid_opt frame on the stack (the one autograd called) when a `speculate` defined in
  hybrid_opt/tiers/ is entered during backward, the last such entry;
- to the return of the last `Subgroup.write` (hybrid_opt/state/layout.py) called during step(): the
  commit of the subgroup's new params into the model.

Both markers are found by module and function name, never by the optimizer's private names,
so the tool measures any composition of the optimizer.

A hop is a call into a function defined in another hybrid_opt module than its caller's (the
caller: the nearest hybrid_opt frame below it). A call that reaches hybrid_opt from code outside
it (autograd running a hook, torch.optim's step wrapper, a torch decorator around a method) is
a hop too, even back into the module it came from. A generator counts once, when first entered
(its resumptions are not calls). `hybrid_opt.lifetime`'s wrappers count like any module.

    PYTHONPATH=$PWD python -m tests.walk        # or: python tests/walk.py [--json PATH]
"""

from __future__ import annotations

import dis
import json
import os
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field

OUTSIDE = "(outside)"  # the caller of a hop that reached hybrid_opt from code outside it
_GEN_FLAGS = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR


@dataclass(frozen=True)
class Hop:
    caller: str  # module of the nearest hybrid_opt frame below, or OUTSIDE
    module: str  # the callee's module (hybrid_opt.x.y)
    function: str  # the callee's qualified name
    via_outside: bool  # its immediate caller was not hybrid_opt code (autograd, torch)
    reentry: bool  # its module was entered earlier in the walk
    callback: bool  # ... and is still running below it (a call back into it)
    phase: str = ""  # "backward" (the hook's launch) or "step" (validation and commit)

    def __str__(self) -> str:
        arrow = "~>" if self.via_outside else "->"
        return f"{short(self.caller)} {arrow} {short(self.module)}.{self.function}"


@dataclass
class Walk:
    sequence: list = field(default_factory=list)  # [Hop], in call order
    start: str = ""  # the hook call the walk starts at
    end: str = ""  # the write it ends at
    committed: int = 0  # the traced step's committed host steps
    speculations: int = 0  # `speculate` entries during backward

    @property
    def hops(self) -> int:
        return len(self.sequence)

    @property
    def modules(self) -> list:
        """Distinct modules the walk hops into, in order of first entry."""
        return list(dict.fromkeys(h.module for h in self.sequence))

    @property
    def visits(self) -> dict:
        """{module: how many hops land in it}."""
        return dict(Counter(h.module for h in self.sequence))

    @property
    def max_visits(self) -> int:
        return max(self.visits.values(), default=0)

    @property
    def phase_visits(self) -> dict:
        """{phase: {module: hops landing in it}}: the launch during backward and the
        validation and commit in step() apart (each layer entered once going down is 1)."""
        out: dict = {}
        for h in self.sequence:
            out.setdefault(h.phase, Counter())[h.module] += 1
        return {p: dict(c) for p, c in out.items()}

    @property
    def max_phase_visits(self) -> int:
        return max((n for c in self.phase_visits.values() for n in c.values()), default=0)

    @property
    def passes(self) -> dict:
        """{module: how many times the walk goes through it}: runs of consecutive hops landing
        in one module count once (a loop calling a helper per param is one pass)."""
        runs = Counter()
        last = None
        for h in self.sequence:
            if h.module != last:
                runs[h.module] += 1
            last = h.module
        return dict(runs)

    @property
    def max_passes(self) -> int:
        return max(self.passes.values(), default=0)

    @property
    def returns_to_left(self) -> int:
        """Hops into a module the walk had entered before and then left (any re-entry from
        another module: a call out to it again, or a call back into it)."""
        return sum(h.reentry for h in self.sequence)

    @property
    def callbacks(self) -> int:
        """The returns_to_left whose module was still running below the hop."""
        return sum(h.callback for h in self.sequence)

    def module_path(self) -> str:
        """The modules landed in, one per hop, runs of the same module collapsed (xN)."""
        out = []
        for m in (short(h.module) for h in self.sequence):
            if out and out[-1][0] == m:
                out[-1][1] += 1
            else:
                out.append([m, 1])
        return " > ".join(m if n == 1 else f"{m} x{n}" for m, n in out)

    def summary(self) -> dict:
        return dict(
            hops=self.hops,
            modules=len(self.modules),
            returns_to_left=self.returns_to_left,
            callbacks=self.callbacks,
            max_visits=self.max_visits,
            max_passes=self.max_passes,
            max_phase_visits=self.max_phase_visits,
            committed=self.committed,
            speculations=self.speculations,
        )

    def format(self) -> str:
        """A closing note's block: the figures, the hops in order, visits per module."""
        s = self.summary()
        lines = [
            f"walk of one speculated host subgroup, hook to commit: {s['hops']} hops through "
            f"{s['modules']} modules, {s['returns_to_left']} back into a module already left "
            f"({s['callbacks']} of them calls back into a module still running), "
            f"max {s['max_visits']} visits to one module (max {s['max_passes']} passes: "
            f"consecutive hops into one module counted once; max {s['max_phase_visits']} "
            f"within backward or within step())",
            f"start: {self.start}",
            f"end:   return of {self.end}",
            "",
            "hops (~> reached through code outside hybrid_opt; * re-entry):",
        ]
        for k, h in enumerate(self.sequence, 1):
            lines.append(f"{k:4d}{'*' if h.reentry else ' '} {h}")
        lines += [
            "",
            "| module | visits | backward | step() | passes | functions entered |",
            "|---|---|---|---|---|---|",
        ]
        passes, phases = self.passes, self.phase_visits
        for m, n in sorted(self.visits.items(), key=lambda kv: (-kv[1], kv[0])):
            fns = Counter(h.function for h in self.sequence if h.module == m)
            lines.append(
                f"| {short(m)} | {n} | {phases.get('backward', {}).get(m, 0)} | "
                f"{phases.get('step', {}).get(m, 0)} | {passes[m]} | "
                + ", ".join(f if c == 1 else f"{f} x{c}" for f, c in fns.items())
                + " |"
            )
        lines += ["", "modules in order: " + self.module_path()]
        return "\n".join(lines)


def short(module: str) -> str:
    """A module's name inside its package (hybrid_opt.tiers.host -> tiers.host)."""
    return module.split(".", 1)[1] if "." in module and module != OUTSIDE else module


# ============================================================================= the tracer
def qualname_in(module, code) -> str:
    """The qualified name of the function in `module` whose code is `code`, found among the
    module's functions and its classes' methods (properties, static and class methods, and
    functools.wraps wrappers unwrapped); a function it cannot find (a nested one) keeps its bare
    name. What `code.co_qualname` says from Python 3.11 on, for the functions a walk meets."""
    owners = list(vars(module).values()) if module is not None else []
    for owner in owners:
        for obj in vars(owner).values() if isinstance(owner, type) else [owner]:
            if isinstance(obj, property):
                obj = obj.fget
            func = getattr(obj, "__func__", obj)  # staticmethod, classmethod
            while hasattr(func, "__wrapped__"):  # functools.wraps, torch.no_grad, step hooks
                func = func.__wrapped__
            if getattr(func, "__code__", None) is code:
                return func.__qualname__
    return code.co_name


class Tracer:
    """sys.setprofile over the calls into one package's Python functions (this thread only).

    Keeps, per 'call' event of a function defined under `root` (a generator's first entry
    only), its module, qualified name, the module of the nearest frame of the package below
    it and whether its immediate caller was outside the package; marks where the walk starts
    and ends (`start_at`, `end_at`: indices into `calls`). `phase` is set by the driver:
    "backward" or "step"."""

    def __init__(
        self,
        root: str,
        package: str = "hybrid_opt",
        *,
        spec_module_prefix: str = "tiers.",
        spec_function: str = "speculate",
        end_module: str = "state.layout",
        end_qualname: str = "Subgroup.write",
    ):
        self.root = os.path.realpath(root)
        self.package = package
        self.spec_prefix = f"{package}.{spec_module_prefix}"
        self.spec_function = spec_function
        self.end_module = f"{package}.{end_module}"
        self.end_qualname = end_qualname
        self.calls: list = []  # (module, qualname, caller module | None, via outside, modules below)
        self.phase = None
        self.start_at = None
        self.end_at = None
        self.speculations = 0
        self._modules: dict = {}  # co_filename -> module, or None when outside the package
        self._first_resume: dict = {}
        self._qualnames: dict = {}  # code -> qualname, found in its module before 3.11
        self._open_end = None  # the frame of the Subgroup.write now running, during step()
        self._index: dict = {}  # id(frame) -> its latest entry in calls

    def module_of(self, code) -> str | None:
        fn = code.co_filename
        try:
            return self._modules[fn]
        except KeyError:
            pass
        path = os.path.realpath(fn) if os.path.isabs(fn) else None
        mod = None
        if path is not None and path.startswith(self.root + os.sep) and path.endswith(".py"):
            rel = os.path.relpath(path, os.path.dirname(self.root))[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            mod = ".".join(rel)
        self._modules[fn] = mod
        return mod

    def qualname_of(self, code, mod: str) -> str:
        """The function's qualified name ("Subgroup.write"): Python 3.11 keeps it on the code
        object; 3.10 does not, so there it is looked up in the function's module."""
        qual = getattr(code, "co_qualname", None)
        if qual is None:
            qual = self._qualnames.get(code)
            if qual is None:
                qual = self._qualnames[code] = qualname_in(sys.modules.get(mod), code)
        return qual

    def _first_entry(self, frame) -> bool:
        code = frame.f_code
        if not code.co_flags & _GEN_FLAGS:
            return True
        if sys.version_info < (3, 11):
            return frame.f_lasti < 0
        first = self._first_resume.get(code)
        if first is None:  # 3.11+: a fresh generator frame stands at its first RESUME
            first = next((i.offset for i in dis.get_instructions(code) if i.opname == "RESUME"), 0)
            self._first_resume[code] = first
        return frame.f_lasti <= first

    def __call__(self, frame, event, arg):
        if event == "call":
            mod = self.module_of(frame.f_code)
            if mod is None or not self._first_entry(frame):
                return
            back = frame.f_back
            below = []  # the modules of the package's frames running below, nearest first
            f = back
            while f is not None:
                m = self.module_of(f.f_code)
                if m is not None:
                    below.append(m)
                f = f.f_back
            outside = back is None or self.module_of(back.f_code) is None
            qual = self.qualname_of(frame.f_code, mod)
            self._index[id(frame)] = len(self.calls)
            self.calls.append((mod, qual, below[0] if below else None, outside, frozenset(below), self.phase))
            if (
                self.phase == "backward"
                and mod.startswith(self.spec_prefix)
                and frame.f_code.co_name == self.spec_function
            ):
                outermost, nested, f = frame, False, frame.f_back
                while f is not None:
                    m = self.module_of(f.f_code)
                    if m is not None:
                        outermost = f
                        # a speculate that delegates to another (a facade's to its part's)
                        nested = nested or (
                            m.startswith(self.spec_prefix) and f.f_code.co_name == self.spec_function
                        )
                    f = f.f_back
                if not nested:
                    self.speculations += 1
                    self.start_at = self._index[id(outermost)]
            elif (
                self.phase == "step"
                and mod == self.end_module
                and self._open_end is None
                and qual == self.end_qualname
            ):
                self._open_end = frame
        elif event == "return" and frame is self._open_end:
            self._open_end = None
            self.end_at = len(self.calls)  # the calls after this one are past the commit

    def walk(self) -> Walk:
        if self.start_at is None:
            raise RuntimeError(
                f"no {self.spec_prefix}*.{self.spec_function} entered during backward: "
                f"nothing was speculated (a clip that bites? speculative=False? "
                f"the subgroup not hooked?)"
            )
        if self.end_at is None or self.end_at <= self.start_at:
            raise RuntimeError(
                f"no {self.end_module}.{self.end_qualname} returned during step() "
                f"after the speculation: the commit was not seen"
            )
        seq, entered = [], []
        for mod, qual, caller, outside, below, phase in self.calls[self.start_at : self.end_at]:
            if caller == mod and not outside:
                continue
            reentry = mod in entered
            seq.append(
                Hop(
                    caller if caller is not None else OUTSIDE,
                    mod,
                    qual,
                    outside,
                    reentry,
                    reentry and mod in below,
                    phase or "",
                )
            )
            if not reentry:
                entered.append(mod)
        return Walk(seq)


# ============================================================================= the run
def trace_walk(
    *, width: int = 32, depth: int = 3, warmup: int = 3, seed: int = 0, settle_s: float = 0.2
) -> Walk:
    """Trains `depth` x Linear(width, width) on CPU with HybridAdamW(offload_fraction=1.0,
    speculative=True, one host subgroup, no clipping) for `warmup` steps, then traces one
    iteration's backward + step(); returns the walk.

    Between backward and step() the trace sleeps `settle_s` (invisible to it: no hybrid_opt
    code runs) so that the worker has finished the speculated step when step() validates it:
    otherwise how often step() polls the worker, and so the hop count, varies with its speed."""
    import gc
    import time

    import torch
    from torch import nn

    import hybrid_opt
    from hybrid_opt import HybridAdamW

    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("trace_walk() profiles the main thread (autograd runs CPU hooks there)")
    torch.manual_seed(seed)
    layers = []
    for k in range(depth):
        layers.append(nn.Linear(width, width))
        if k + 1 < depth:
            layers.append(nn.Tanh())
    model = nn.Sequential(*layers)
    numel = sum(p.numel() for p in model.parameters())
    x = torch.randn(8, width)
    y = torch.randn(8, width)

    def loss_of():
        return ((model(x) - y) ** 2).mean()

    with HybridAdamW(
        model.parameters(),
        lr=1e-3,
        offload_fraction=1.0,
        speculative=True,
        subgroup_numel=max(4096, 1 << (numel - 1).bit_length()),
    ) as opt:
        for _ in range(warmup):
            opt.zero_grad()
            loss_of().backward()
            opt.step()
        opt.zero_grad()
        loss = loss_of()
        tracer = Tracer(os.path.dirname(hybrid_opt.__file__))
        # no collection inside the trace: a __del__ of the package's run by the gc would read
        # as a hop from outside
        gc.collect()
        gc_was = gc.isenabled()
        gc.disable()
        previous = sys.getprofile()
        sys.setprofile(tracer)
        try:
            tracer.phase = "backward"
            loss.backward()
            tracer.phase = None
            time.sleep(settle_s)
            tracer.phase = "step"
            opt.step()
        finally:
            sys.setprofile(previous)
            if gc_was:
                gc.enable()
        spec = opt.stats.get("speculation") or {}
    walk = tracer.walk()
    walk.committed = int(spec.get("committed", 0))
    walk.speculations = tracer.speculations
    mod, qual = tracer.calls[tracer.start_at][:2]
    walk.start = f"{mod}.{qual} (called by autograd)"
    walk.end = f"{tracer.end_module}.{tracer.end_qualname}"
    return walk


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the walk's figures and hops as JSON here")
    args = ap.parse_args(argv)
    walk = trace_walk()
    print(walk.format())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    walk.summary(),
                    visits=walk.visits,
                    start=walk.start,
                    end=walk.end,
                    hops_in_order=[str(h) for h in walk.sequence],
                ),
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
