"""process_group mode's gradient reductions (zero.py): one bucket's collective, where its input and
output live, and its sum divided by the world size into the bucket's chunk storage.

Invariant: on gloo every collective path (all_to_all, reduce_scatter, all_reduce) sums the ranks'
segments in rank order, so all give the same bits. NCCL's ring and tree orders are its own: from 3
ranks its sums may differ from gloo's in the last bit, and nothing depends on their agreeing (each
chunk has one owner, which steps it from the one sum it received). Design notes: docs/internals.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hybrid_opt.distributed.zero import Bucket


def reduce_numels(b, comm, zeros: bool = False) -> tuple:
    """(sent, received) elements of b's reduction that a comm slot holds (module docstring),
    under `comm`'s kind (zero_group.Collectives); `zeros`: a one-param bucket without a grad
    here, which sends zeros."""
    world, me, kind = comm.world, comm.rank, comm.kind
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


@dataclass(eq=False)
class Flight:
    """One bucket's reduction, launched and not averaged yet: its collectives, the kind they
    are, the grads its hooks saw (the own term is read from them: module docstring), what it
    sends (a view of a slot borrowed from the comm window, or of p.grad) and where its output
    lands (b.buf itself, or the slot)."""

    bucket: Bucket
    works: list
    kind: str
    grads: list
    red: torch.Tensor | None
    scratch: torch.Tensor | None
    counted: list  # per param: counted as having a grad here (GradRelease.counted)


class GradReduction:
    """ZeroSharding's part (zero.py) for the reductions: the ones in flight, in launch order,
    each one's slot borrowed from the window until it is averaged; the has-grad counts read
    and the params delivered by GradCounts (zero_counts.py)."""

    def __init__(self, comm, window, counts, reads, release):
        self._comm = comm  # Collectives (zero_group.py)
        self._window = window  # CommWindow (zero_pool.py): the slots a reduction sends from
        self._counts = counts  # GradCounts (zero_counts.py): a direct bucket's counts, delivery
        self._reads = reads  # GradReads (zero_edits.py): which grads each reduction read
        self._release = release  # GradRelease (zero_release.py): the grads kept as zeros count
        self._flights: list = []  # [Flight] launched, not yet averaged, in launch order
        self.launches = 0  # stats["reduce_scatters"]

    def in_flight(self) -> list:
        """The buckets whose reductions are launched and not averaged yet, in launch order."""
        return [f.bucket for f in self._flights]

    def _pack(self, b, grads: list, counted: list, ranks, dst: torch.Tensor) -> torch.Tensor:
        """`ranks`' segments of the bucket, in that order, into `dst`: each rank's chunks side
        by side, zero-padded to the width, then one has-grad count per param. A param without a
        grad is zeros in the sum and counts 0 (1 if `counted`: a grad kept as zeros)."""
        ranks = list(ranks)
        for j, r in enumerate(ranks):  # the padding (a slot another bucket used: rewritten)
            used = sum(n[r] for n in b.numels)
            dst[j * b.seg + used : j * b.seg + b.width].zero_()
        for k, g in enumerate(grads):
            flat = None if g is None else g.detach().reshape(-1)
            starts = [sum(b.numels[k][:r]) for r in range(self._comm.world)]
            for j, r in enumerate(ranks):
                dst[j * b.seg + b.width + k].fill_(1 if counted[k] else 0)
                n = b.numels[k][r]
                if n:
                    at = j * b.seg + b.offsets[k][r]
                    region = dst[at : at + n]
                    region.zero_() if flat is None else region.copy_(flat[starts[r] : starts[r] + n])
        return dst

    def launch(self, b) -> None:
        """b's reduction issued, from the grads its params hold now (module docstring)."""
        if any(f.bucket is b for f in self._flights):
            self.poll(wait=True, until=b)  # b.buf is rewritten: the last backward's reduction first
        comm = self._comm
        grads = [p.grad for p in b.params]
        counted = self._release.counted(b.params, grads)
        if b.direct and comm.kind != "all_reduce":
            return self._launch_direct(b, grads, counted)
        sent, received = reduce_numels(b, comm)
        # None only where nothing is sent or received (a world of 1), and then never read: the
        # `type: ignore`s below, which mypy cannot follow
        slot = self._window.borrow(b, "reduce", sent + received) if sent + received else None
        kind = comm.kind
        if kind == "all_to_all":  # a world of 1 sends nothing: no slot
            others = [r for r in range(comm.world) if r != comm.rank]
            red = self._pack(b, grads, counted, others, slot[:sent]) if others else None  # type: ignore[index]
            scratch = b.buf if comm.world == 2 else (slot[sent:] if others else None)  # type: ignore[index]
            works = comm.all_to_all(scratch, red, b.seg)
        else:
            red = self._pack(b, grads, counted, range(comm.world), slot)  # type: ignore[arg-type]
        if kind == "reduce_scatter":
            scratch = b.buf
            try:
                works = [comm.reduce_scatter()(b.buf, red, group=comm.group, async_op=True)]
            except (RuntimeError, NotImplementedError) as e:
                comm.fall_back(e)
                kind = "all_reduce"  # its input is the same: every rank's segment, packed
        if kind == "all_reduce":
            scratch = None
            works = [comm.dist.all_reduce(red, group=comm.group, async_op=True)]
        self._launched(Flight(b, works, kind, grads, red, scratch, counted))

    def _launch_direct(self, b, grads: list, counted: list) -> None:
        """A direct bucket: p.grad itself is the input (zeros when this rank has none), read
        while in flight — the end of backward waits for it, so later in-place changes to p.grad
        (GradScaler.unscale_, a clip) never race it; its count goes in a collective of its own."""
        comm = self._comm
        g, w, me, world = grads[0], b.width, comm.rank, comm.world
        flat = None if g is None else g.detach().reshape(-1)
        sent, received = reduce_numels(b, comm, zeros=flat is None)
        # None only where nothing is sent or received (a world of 1), and then never read: the
        # `type: ignore`s below, which mypy cannot follow
        slot = self._window.borrow(b, "reduce", sent + received) if sent + received else None
        counts = self._counts.buffer(b)
        counts[:world].fill_(1 if counted[0] else 0)
        if comm.kind == "all_to_all":
            if flat is None:
                src = slot[:sent].zero_() if world > 1 else None  # type: ignore[index]
            elif sent:  # a middle rank: the other ranks' rows are two ranges of p.grad
                src = slot[:sent]  # type: ignore[index]
                src[: me * w].copy_(flat[: me * w])
                src[me * w :].copy_(flat[(me + 1) * w :])
            else:
                src = flat[w:] if me == 0 else flat[: (world - 1) * w]
            red = src
            scratch = b.buf[:w] if world == 2 else (slot[sent:] if world > 2 else None)  # type: ignore[index]
            works = comm.all_to_all(scratch, src, w)
            works.append(
                comm.dist.all_to_all_single(counts[world:], counts[:world], group=comm.group, async_op=True)
            )
        else:
            rs = comm.reduce_scatter()
            red = flat if flat is not None else slot[:sent].zero_()  # type: ignore[index]
            scratch = b.out
            try:
                works = [rs(b.out, red, group=comm.group, async_op=True)]
            except (RuntimeError, NotImplementedError) as e:
                comm.fall_back(e)
                self._window.release(b, "reduce")
                return self.launch(b)
            works.append(rs(counts[world : world + 1], counts[:world], group=comm.group, async_op=True))
        self._launched(Flight(b, works, comm.kind, grads, red, scratch, counted))

    def _launched(self, flight: Flight) -> None:
        for p in flight.bucket.params:
            self._reads.note(p)
        self.launches += 1
        self._flights.append(flight)

    def poll(self, wait: bool = False, until=None, hold=None) -> None:
        """Completes the launched reductions in launch order (all of them when `wait`; with
        `until`, up to and including that bucket's; none from bucket `hold` on)."""
        while self._flights:
            f = self._flights[0]
            b = f.bucket
            if f.bucket is hold or (not wait and not all(w.is_completed() for w in f.works)):
                return
            if until is not None and not any(q.bucket is until for q in self._flights):
                return
            for work in f.works:
                self._comm.wait(work, "the reduction of a gradient bucket", b.device.type == "cuda")
            self._flights.pop(0)
            # a buffer of the bucket's own, written in place: its version moves, so a speculation
            # that read the previous reduction (accumulation without the flag) is redone
            self._average(f)  # into b.out
            self._counts.delivered(b, f.kind, f.grads)  # chunks mapped, hooks run (zero_counts.py)
            # its counts were copied out: the slot is free, and no reference to p.grad is kept
            # (release_grads' full grads, replaced by placeholders in delivered, are freed here)
            self._window.release(b, "reduce")
            del f

    def complete(self, b) -> None:
        """Every pending reduction up to and including b's waited for and averaged (the comm
        window frees b's slot so)."""
        self.poll(wait=True, until=b)

    def _own_terms(self, b, grads: list) -> list:
        """This rank's term of b's sum, per param with a chunk here: (offset in out, numel,
        this rank's rows of the grad the hooks saw, or None for zeros)."""
        me = self._comm.rank
        terms = []
        for k, g in enumerate(grads):
            n = b.numels[k][me]
            if n:
                start = sum(b.numels[k][:me])
                src = None if g is None else g.detach().reshape(-1)[start : start + n]
                terms.append((b.offsets[k][me], n, src))
        return terms

    def _average(self, f: Flight) -> None:
        """A completed reduction's sum over the ranks, divided by the world size, into b.out,
        and its has-grad counts into b.buf after it (read by zero_counts.py)."""
        b, kind, grads, counted = f.bucket, f.kind, f.grads, f.counted
        world, me = self._comm.world, self._comm.rank
        if kind == "all_reduce":
            assert f.red is not None  # what an all_reduce sent, and summed in place
            total = f.red[me * b.seg : (me + 1) * b.seg]
            torch.div(total[: b.width], world, out=b.out)
            b.buf[b.width :].copy_(total[b.width :])
            return
        if kind == "reduce_scatter":
            b.out.div_(world)
            return
        direct = b.direct
        seg = b.width if direct else b.seg
        own = self._own_terms(b, grads)
        if world == 2:  # the other rank's term landed in b.buf: s_other + s_own is s0 + s1
            for a, n, src in own:
                b.out[a : a + n].add_(0 if src is None else src)
            if not direct:
                for k in range(len(grads)):
                    if counted[k]:
                        b.buf[b.width + k].add_(1)
        else:
            received = [r for r in range(world) if r != me]
            for r in range(world):
                if r == me and r == 0:
                    b.out.zero_()
                    for a, n, src in own:
                        if src is not None:
                            b.out[a : a + n].copy_(src)
                elif r == me:
                    for a, n, src in own:
                        b.out[a : a + n].add_(0 if src is None else src)
                else:
                    j = received.index(r) * seg
                    term = f.scratch[j : j + b.width]  # type: ignore[index]  # world > 2: it is set
                    b.out.copy_(term) if r == 0 else b.out.add_(term)
            if not direct:
                counts = b.buf[b.width :]
                for k in range(len(grads)):
                    counts[k].fill_(1 if counted[k] else 0)
                for j in range(len(received)):
                    counts.add_(f.scratch[j * seg + b.width : (j + 1) * seg])  # type: ignore[index]  # as above
        b.out.div_(world)
