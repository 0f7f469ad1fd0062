"""process_group mode's params side (zero.py): the updated dim-0 chunks sent back to every
rank after a step, landed either at once in the params or, overlapped, when next used; and the
optimizer's entry points that land them (ZeroParamsMixin).

Each bucket's chunks go out as one broadcast per rank from the chunk's owner (the gloo path,
cheaper there than its all-gather: measured in zero.py) or one all-gather (NCCL). When step()
waits for them at once (the default), a bucket of one param lands in the param's own memory
(no staging buffer, no copy: no one can write the param in between); otherwise (overlap_param_
gather=True, or several params in a bucket) in the bucket's persistent staging buffer, copied
into each param not written since its chunks left.
"""
from __future__ import annotations

import torch

from hybrid_opt import distributed as D


class ParamGather:
    """The gather half of ZeroSharding (zero.py), which owns the buckets and buffers."""

    def gather(self, direct: bool = False) -> None:
        """Launches the collectives that send every rank's stepped chunks to every rank, one
        bucket at a time, not waited: each bucket lands when a module whose own params it holds
        is about to run forward, or at wait_gathered() (module docstring). `direct` (the caller
        waits for them at once, before anything can write a param): a bucket of one param lands
        in the param itself, no staging copy; else in the bucket's staging buffer, copied at
        landing into the params not written since."""
        self.wait_gathered()  # step() waited already; a second gather must not race the first
        for b in self.buckets:
            # an all-gather lands in place only where every rank's chunk has the same size
            staged = not (direct and len(b.params) == 1 and (
                self._kind != "reduce_scatter" or b.params[0].numel() == self.world * b.width))
            if staged:
                full = self._buffer(b, "staging", self.world * b.width)
                mine = full[self.rank * b.width:(self.rank + 1) * b.width]
                for k, p in enumerate(b.params):
                    n, a = b.numels[k][self.rank], b.offsets[k][self.rank]
                    if n:
                        mine[a:a + n].copy_(D.zero_chunk(p.data, self.rank, self.world).reshape(-1))
            else:
                full = b.params[0].data.view(-1)
            works = self._send_chunks(b, full, staged)
            # what each param was when its chunks left: a param written since (model.
            # load_state_dict, assign=True, an in-place edit) keeps what was written
            marks = [(p._version, p.data_ptr()) for p in b.params]
            self._gathers[id(b)] = (b, staged, works, marks)
            for p in b.params:
                self._gathering[id(p)] = b
            self.stats["all_gathers"] += 1
        if self._gathers and self._forward_hook is None:
            from torch.nn.modules.module import register_module_forward_pre_hook
            self._forward_hook = register_module_forward_pre_hook(self._before_forward)

    def _send_chunks(self, b, full: torch.Tensor, staged: bool) -> list:
        """The bucket's gather collectives into `full` (the staging segments, or the param):
        one broadcast per rank holding a chunk, from that rank (gloo: cheaper than its
        all-gather), or with reduce_scatter one all-gather of the rank segments."""
        seg = [b.width if staged else b.numels[0][r] for r in range(self.world)]
        at = [r * b.width if staged else sum(b.numels[0][:r]) for r in range(self.world)]
        if self._kind != "reduce_scatter":
            return [self.dist.broadcast(full[at[r]:at[r] + seg[r]], self.dist.get_global_rank(self.group, r),
                                        group=self.group, async_op=True)
                    for r in range(self.world) if any(n[r] for n in b.numels)]
        # in place (NCCL's documented in-place all-gather: the input is the output's own segment)
        ag = getattr(self.dist, "all_gather_single", None) or self.dist.all_gather_into_tensor
        return [ag(full, full[self.rank * b.width:(self.rank + 1) * b.width], group=self.group,
                   async_op=True)]

    def _before_forward(self, module, args) -> None:
        """Global forward pre-hook while gathers are pending: lands the buckets holding the
        module's own params (recurse=False: a parent's hook must not wait for its children)."""
        if not self._gathering:
            return None
        for p in module._parameters.values():
            b = self._gathering.get(id(p)) if p is not None else None
            if b is not None:
                self.stats["all_gathers_landed_in_forward"] += 1
                self._land(b)
        return None

    def wait_gathered(self) -> None:
        """Lands every pending all-gather (bounded waits): the params are then current."""
        for b, *_ in list(self._gathers.values()):
            self._land(b)

    def _land(self, b) -> None:
        _, staged, works, marks = self._gathers.pop(id(b))
        for p in b.params:
            self._gathering.pop(id(p), None)
        try:
            for work in works:
                self._wait(work, "the gather of updated parameters")
            if not staged:
                return  # landed in the param itself
            full = b.staging
            with torch.no_grad():
                for k, p in enumerate(b.params):
                    if (p._version, p.data_ptr()) != marks[k]:
                        continue
                    flat = p.data.view(-1)  # .data: its own version counter, p._version stays
                    start = 0
                    for r in range(self.world):
                        n = b.numels[k][r]
                        if n and r != self.rank:
                            base = r * b.width + b.offsets[k][r]
                            flat[start:start + n].copy_(full[base:base + n])
                        start += n
        finally:
            if not self._gathers and self._forward_hook is not None:
                self._forward_hook.remove()
                self._forward_hook = None


class ZeroParamsMixin:
    """The optimizer's side of the overlapped all-gather: wait_params(), and the entry points
    that read or write params landing every pending gather first (a mixin before the
    checkpoint and placement mixins; step() and close() call wait_params themselves)."""

    def wait_params(self) -> None:
        """process_group mode: makes every param current on this rank (lands the pending
        all-gathers of the last step, each wait bounded). Call it before reading params outside
        a module's forward — an EMA, model.state_dict(), a param used by another module; a
        module's own params land before its forward by themselves. No-op otherwise."""
        zero = getattr(self, "_zero", None)
        if zero is not None:
            zero.wait_gathered()

    def state_dict(self) -> dict:
        self.wait_params()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.wait_params()
        return super().load_state_dict(state_dict)

    def _relayout(self, plan) -> None:
        self.wait_params()
        return super()._relayout(plan)
