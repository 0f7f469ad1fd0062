"""process_group mode's gradient reductions (zero.py): one bucket's collective, where its input
and output live, and its sum divided by the world size into the bucket's chunk storage.

Each bucket keeps one buffer of its own, `buf`: this rank's averaged chunks (`out`, its first
`width` elements: the grads the step reads) followed by one has-grad count per param. The
reduction's output lands in it wherever the collective allows, so a comm slot (zero_pool.py)
holds only what is sent:

- all_to_all (gloo): each rank sends every other rank that rank's segment and nothing to
  itself (split size 0): its own segment never leaves, so it is never packed either — it is
  added from the grads themselves when the reduction completes. At 2 ranks the one segment
  received lands in `buf` itself; from 3 on the received segments go to the slot after the
  sent ones and are summed from there. A slot then holds (world - 1) segments (half the
  bucket at 2 ranks), and a bucket of one param whose chunks split evenly sends straight from
  p.grad (the other ranks' rows are one range on the first and last rank): no slot at all.
- reduce_scatter (NCCL): every rank's segment in, this rank's segment out, into `buf`.
- all_reduce: in place over every rank's segment in a slot; this rank's segment is then
  divided into `out` and its counts copied after it.

The sum is in rank order, as before: at 2 ranks `received + own` is `s0 + s1` bitwise (IEEE
addition commutes), from 3 ranks the terms are taken in rank order; a param without a grad
here adds zeros (not nothing: -0 + 0 is +0, as when its zeros were packed). So every path gives
the same bits as packing every segment did (tests/test_golden.py, test_distributed*.py).

Hazard kept from before: the own term is read from the grads the bucket's hooks saw, at
completion rather than at launch — the same tensors, unchanged in between, since the end of
backward (and finish()) waits for every pending reduction before anything can edit p.grad.
"""
from __future__ import annotations

import warnings

import torch


class GradReduce:
    """The reduction half of ZeroSharding (zero.py), which owns the buckets and the window."""

    def _reduce_numels(self, b, zeros: bool = False) -> tuple:
        """(sent, received) elements of b's reduction that a comm slot holds (module
        docstring); `zeros`: a one-param bucket without a grad here, which sends zeros."""
        world, me, kind = self.world, self.rank, self._kind
        direct = b.direct and kind != "all_reduce"
        seg = b.width if direct else b.seg
        if kind == "all_to_all":
            if world == 1:
                return 0, 0
            from_grad = direct and not zeros and me in (0, world - 1)
            return (0 if from_grad else (world - 1) * seg), (0 if world == 2 else (world - 1) * seg)
        if kind == "reduce_scatter" and direct:
            return (world * b.width if zeros else 0), 0
        return world * b.seg, 0

    def _all_to_all(self, out, inp, seg: int) -> list:
        """Each other rank's `seg` elements of `inp` sent to it, theirs received into `out`."""
        if self.world == 1:
            return []
        splits = [0 if r == self.rank else seg for r in range(self.world)]
        return [self.dist.all_to_all_single(out, inp, splits, splits, group=self.group, async_op=True)]

    def _pack(self, b, grads: list, ranks, dst: torch.Tensor) -> torch.Tensor:
        """`ranks`' segments of the bucket, in that order, into `dst`: each rank's chunks side
        by side, zero-padded to the width, then one has-grad count per param. A param without a
        grad is zeros in the sum and counts 0."""
        ranks = list(ranks)
        for j, r in enumerate(ranks):  # the padding (a slot another bucket used: rewritten)
            used = sum(n[r] for n in b.numels)
            dst[j * b.seg + used:j * b.seg + b.width].zero_()
        for k, g in enumerate(grads):
            flat = None if g is None else g.detach().reshape(-1)
            starts = [sum(b.numels[k][:r]) for r in range(self.world)]
            for j, r in enumerate(ranks):
                dst[j * b.seg + b.width + k].fill_(0 if flat is None else 1)
                n = b.numels[k][r]
                if n:
                    at = j * b.seg + b.offsets[k][r]
                    region = dst[at:at + n]
                    region.zero_() if flat is None else region.copy_(flat[starts[r]:starts[r] + n])
        return dst

    def _launch(self, b) -> None:
        if any(q[0] is b for q in self._pending):
            self.poll(wait=True, until=b)  # b.buf is rewritten: the last backward's reduction first
        grads = [p.grad for p in b.params]
        if b.direct and self._kind != "all_reduce":
            return self._launch_direct(b, grads)
        sent, received = self._reduce_numels(b)
        slot = self._borrow(b, "reduce", sent + received) if sent + received else None
        kind = self._kind
        if kind == "all_to_all":  # a world of 1 sends nothing: no slot
            others = [r for r in range(self.world) if r != self.rank]
            b.red = self._pack(b, grads, others, slot[:sent]) if others else None
            b.scratch = b.buf if self.world == 2 else (slot[sent:] if others else None)
            works = self._all_to_all(b.scratch, b.red, b.seg)
        else:
            b.red = self._pack(b, grads, range(self.world), slot)
        if kind == "reduce_scatter":
            b.scratch = b.buf
            try:
                # reduce_scatter_single is the newer name (torch 2.13 deprecates _tensor)
                rs = getattr(self.dist, "reduce_scatter_single", None) or self.dist.reduce_scatter_tensor
                works = [rs(b.buf, b.red, group=self.group, async_op=True)]
            except (RuntimeError, NotImplementedError) as e:
                self._no_reduce_scatter(e)
                kind = "all_reduce"  # its input is the same: every rank's segment, packed
        if kind == "all_reduce":
            b.scratch = None
            works = [self.dist.all_reduce(b.red, group=self.group, async_op=True)]
        self._launched(b, works, kind, grads)

    def _launch_direct(self, b, grads: list) -> None:
        """A direct bucket: p.grad itself is the input (zeros when this rank has none), read
        while in flight — the end of backward waits for it, so later in-place changes to p.grad
        (GradScaler.unscale_, a clip) never race it; its count goes in a collective of its own."""
        g, w, me, world = grads[0], b.width, self.rank, self.world
        flat = None if g is None else g.detach().reshape(-1)
        sent, received = self._reduce_numels(b, zeros=flat is None)
        slot = self._borrow(b, "reduce", sent + received) if sent + received else None
        counts = self._counts_buffer(b)
        counts[:world].fill_(0 if g is None else 1)
        if self._kind == "all_to_all":
            if flat is None:
                src = slot[:sent].zero_() if world > 1 else None
            elif sent:  # a middle rank: the other ranks' rows are two ranges of p.grad
                src = slot[:sent]
                src[:me * w].copy_(flat[:me * w])
                src[me * w:].copy_(flat[(me + 1) * w:])
            else:
                src = flat[w:] if me == 0 else flat[:(world - 1) * w]
            b.red = src
            b.scratch = b.buf[:w] if world == 2 else (slot[sent:] if world > 2 else None)
            works = self._all_to_all(b.scratch, src, w)
            works.append(self.dist.all_to_all_single(counts[world:], counts[:world],
                                                     group=self.group, async_op=True))
        else:
            rs = getattr(self.dist, "reduce_scatter_single", None) or self.dist.reduce_scatter_tensor
            b.red = flat if flat is not None else slot[:sent].zero_()
            b.scratch = b.out
            try:
                works = [rs(b.out, b.red, group=self.group, async_op=True)]
            except (RuntimeError, NotImplementedError) as e:
                self._no_reduce_scatter(e)
                self._reduce_done(b)
                return self._launch(b)
            works.append(rs(counts[world:world + 1], counts[:world], group=self.group, async_op=True))
        self._launched(b, works, self._kind, grads)

    def _no_reduce_scatter(self, e: Exception) -> None:
        self._kind = self.stats["collectives"] = "all_reduce"  # the same backend on every rank
        warnings.warn(f"process_group: the {self.dist.get_backend(self.group)} backend has no "
                      f"reduce_scatter_tensor ({e}); each bucket is all-reduced instead (every "
                      f"rank keeps its chunk: twice the traffic)", stacklevel=4)

    def _launched(self, b, works: list, kind: str, grads: list) -> None:
        for p in b.params:
            self._reduced[id(p)] = p.grad
            self._reads.note(p)
        self.stats["reduce_scatters"] += 1
        self._pending.append((b, works, kind, grads))

    def _reduce_done(self, b) -> None:
        """b's reduction is averaged (or abandoned): its slot back, no reference to p.grad kept
        (release_grads frees the full grads next)."""
        self._give_back(b, "reduce")
        b.red = b.scratch = None

    def _own_terms(self, b, grads: list) -> list:
        """This rank's term of b's sum, per param with a chunk here: (offset in out, numel,
        this rank's rows of the grad the hooks saw, or None for zeros)."""
        terms = []
        for k, g in enumerate(grads):
            n = b.numels[k][self.rank]
            if n:
                start = sum(b.numels[k][:self.rank])
                src = None if g is None else g.detach().reshape(-1)[start:start + n]
                terms.append((b.offsets[k][self.rank], n, src))
        return terms

    def _average(self, b, kind: str, grads: list) -> None:
        """A completed reduction's sum over the ranks, divided by the world size, into b.out,
        and its has-grad counts into b.buf after it (read by zero_counts.py)."""
        world = self.world
        if kind == "all_reduce":
            total = b.red[self.rank * b.seg:(self.rank + 1) * b.seg]
            torch.div(total[:b.width], world, out=b.out)
            b.buf[b.width:].copy_(total[b.width:])
            return
        if kind == "reduce_scatter":
            b.out.div_(world)
            return
        direct = b.direct
        seg = b.width if direct else b.seg
        own = self._own_terms(b, grads)
        if world == 2:  # the other rank's term landed in b.buf: s_other + s_own is s0 + s1
            for a, n, src in own:
                b.out[a:a + n].add_(0 if src is None else src)
            if not direct:
                for k, g in enumerate(grads):
                    if g is not None:
                        b.buf[b.width + k].add_(1)
        else:
            received = [r for r in range(world) if r != self.rank]
            for r in range(world):
                if r == self.rank and r == 0:
                    b.out.zero_()
                    for a, n, src in own:
                        if src is not None:
                            b.out[a:a + n].copy_(src)
                elif r == self.rank:
                    for a, n, src in own:
                        b.out[a:a + n].add_(0 if src is None else src)
                else:
                    j = received.index(r) * seg
                    term = b.scratch[j:j + b.width]
                    b.out.copy_(term) if r == 0 else b.out.add_(term)
            if not direct:
                counts = b.buf[b.width:]
                for k, g in enumerate(grads):
                    counts[k].fill_(0 if g is None else 1)
                for j in range(len(received)):
                    counts.add_(b.scratch[j * seg + b.width:(j + 1) * seg])
        b.out.div_(world)
