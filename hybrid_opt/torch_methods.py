"""torch.optim.Optimizer's own methods as HybridAdamW calls them: without loading torch._dynamo
in a process where nothing can be compiling.

torch wraps `Optimizer.add_param_group`, `zero_grad`, `state_dict` and `load_state_dict` in
`torch._disable_dynamo`, so that a compiled region does not trace into them. The wrapper imports
torch._dynamo on its first call, and with it sympy, mpmath and Triton: 1.7-2.9 s of a 2-core host's
time, the larger part of what a fresh process pays to build an optimizer. Nothing can be tracing
while torch._dynamo was never imported (torch.compile imports it), so until then the function torch
wrapped is called as it is. Once it is loaded, torch's wrapper is called, as torch.optim.AdamW's
would be. A method that is not torch's own (a subclass or mixin of the user's in between) is called
as it comes.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch


def base(bound: Callable[..., Any]) -> Callable[..., Any]:
    """`bound` (`super().zero_grad`, ...), or torch's function under its wrapper where
    torch._dynamo is not loaded and `bound` is torch.optim.Optimizer's own."""
    if "torch._dynamo" in sys.modules:
        return bound
    func = getattr(bound, "__func__", None)
    name = getattr(func, "__name__", None)
    if name is None or getattr(torch.optim.Optimizer, name, None) is not func:
        return bound
    plain = getattr(func, "__wrapped__", None)
    if plain is None:  # a torch that no longer wraps it
        return bound
    return functools.partial(plain, bound.__self__)  # type: ignore[attr-defined]
