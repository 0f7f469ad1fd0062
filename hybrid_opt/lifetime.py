"""Who holds the optimizer and who acts on it: only the user holds it, and only the optimizer that
built the tiers closes them.

Every hook and callback that outlives a call holds the optimizer weakly (`weak_method`), so one
dropped without close() is collected and closed with an `UnclosedOptimizerWarning`. A wrapper that
forwards reads (Lightning's `LightningOptimizer`) must not act as the optimizer: public methods act
on `owner(self)`. A child of os.fork() (which holds none of the optimizer's memory, files or
worker pipes: forking.py) acts on nothing: its public methods refuse, naming the cause, and
close() only lets its copy go.
Design notes: docs/internals.md."""

from __future__ import annotations

import functools
import os
import sys
import warnings
import weakref


class UnclosedOptimizerWarning(UserWarning):
    """An optimizer collected without close(). A UserWarning, which Python's default filters
    show (a ResourceWarning would be hidden)."""


def mark_owner(opt) -> None:
    """Called first in the optimizer's constructor: `opt` is an optimizer of its own (a
    forwarding wrapper, which never runs the constructor, reads this through its forwarding)."""
    opt.__dict__["_this"] = weakref.ref(opt)
    opt.__dict__["_built_in"] = os.getpid()


def forked_copy(opt) -> bool:
    """Whether `opt` is a forked child's copy of an optimizer another process built."""
    return opt.__dict__.get("_built_in", os.getpid()) != os.getpid()


def _forked_refusal(opt, name: str) -> RuntimeError:
    return RuntimeError(
        f"{type(opt).__name__}.{name}() in process {os.getpid()}: this optimizer was built in "
        f"process {opt.__dict__['_built_in']}, and a forked child holds none of its worker, "
        f"shared memory or files (they stay that process's). Use it there, or build a "
        f"{type(opt).__name__} in this process"
    )


def owner(obj):
    """The optimizer `obj` is: `obj` itself, or the one a forwarding wrapper of it wraps."""
    if is_owner(obj):
        return obj
    try:
        ref = obj._this  # a wrapper: read through its forwarding from the optimizer it wraps
    except AttributeError:
        raise TypeError(
            f"{type(obj).__name__} inherits from a hybrid_opt optimizer but was never "
            f"constructed as one and does not forward to one; wrap the optimizer "
            f"(hold it as an attribute) instead"
        ) from None
    real = ref()
    if real is None:
        raise RuntimeError(
            f"the optimizer that this {type(obj).__name__} wraps was collected; build a new optimizer"
        )
    return real


def acts_on_owner(method):
    """A public method that, called through a forwarding wrapper, runs on the wrapped
    optimizer (module docstring): its writes then land there, not on the wrapper."""
    name = method.__name__

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        real = owner(self)
        if real is not self:
            return getattr(real, name)(*args, **kwargs)
        if name != "close" and forked_copy(self):
            raise _forked_refusal(self, name)
        return method(self, *args, **kwargs)

    return run


def is_owner(obj) -> bool:
    """Whether `obj` is an optimizer of its own (not a wrapper's view of one)."""
    return obj.__dict__.get("_this") is not None


def weak_method(bound):
    """`bound` (a bound method) as a plain function holding its object weakly: once the object
    is collected, a call does nothing and returns None."""
    ref = weakref.WeakMethod(bound)

    def call(*args, **kwargs):
        method = ref()
        return None if method is None else method(*args, **kwargs)

    return call


def weak_call(obj, fn):
    """`fn(obj)` as a function of no arguments holding `obj` weakly (None once it is gone)."""
    ref = weakref.ref(obj)

    def call():
        target = ref()
        return None if target is None else fn(target)

    return call


def collected(opt) -> None:
    """The optimizer's `__del__`: one still open is closed, then warned about. Only the optimizer
    that built the tiers closes them: a forwarding wrapper's __del__ (Lightning's, collected
    when it rebuilds them) must not."""
    if not is_owner(opt) or opt.closed or forked_copy(opt):
        return
    try:
        opt.close()  # first: a warning made an error (-W error) must not keep it open
    except Exception:
        pass
    try:
        warn_unclosed(opt)
    except Exception:
        pass


_STEPPED_BY: dict = {}  # id(param) -> [weakref to each open optimizer stepping it]


def claim(opt, params) -> None:
    """`opt` steps `params`; warns where another open optimizer of ours steps one of them too.
    Each keeps the param's fp32 master and writes the param through memory of its own, which
    no version counter sees: two stepping one param diverge once either offloads it (torch's
    two optimizers over one param each read what the other wrote). Keyed by id, holding no
    reference to the param (torch.utils.swap_tensors refuses a tensor with a weakref): an open
    optimizer keeps its params alive (its layout), so an id it claimed is not reused meanwhile."""
    for k in list(_STEPPED_BY):  # the closed and collected let go of their ids
        _STEPPED_BY[k] = [r for r in _STEPPED_BY[k] if r() is not None and not r().closed]
        if not _STEPPED_BY[k]:
            del _STEPPED_BY[k]
    others: set[str] = set()
    for p in params:
        refs = _STEPPED_BY.setdefault(id(p), [])
        others.update(type(r()).__name__ for r in refs if r() is not opt)
        refs.append(weakref.ref(opt))
    if others:
        warnings.warn(
            f"a {type(opt).__name__} was given parameters that an open {'/'.join(sorted(others))} "
            f"also steps: two hybrid_opt optimizers stepping one parameter diverge. Close "
            f"the other first (or give each its own parameters; param groups serve "
            f"different settings).",
            stacklevel=4,
        )


def warn_unclosed(opt) -> None:
    """From the optimizer's `__del__` while it is still open (not at interpreter exit, where
    everything is freed anyway)."""
    if sys.is_finalizing():
        return
    warnings.warn(
        f"a {type(opt).__name__} was collected without close(): its worker process, "
        f"shared memory and nvme files were freed when nothing held it any more. Call "
        f"opt.close() (or use `with {type(opt).__name__}(...) as opt:`) to free them when "
        f"you are done with it",
        UnclosedOptimizerWarning,
        stacklevel=2,
    )
