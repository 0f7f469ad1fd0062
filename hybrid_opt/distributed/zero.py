"""process_group mode (ZeRO-2 style) over plain, replicated params: `ZeroSharding` owns the buckets,
the order of a backward's reductions, and the parts that reduce grads and gather params.

Each rank steps only its dim-0 chunk of every param (FSDP2's sharding, so one DCP path serves
both); grads are reduce-scattered per bucket during backward and the updated chunks sent back after
the step. Invariant: every rank issues the same collectives in the same order (buckets strictly in
order, the missing ones issued at the end of backward). Design notes: docs/internals.md."""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybrid_opt.distributed.local_shards import chunk_rows, has_public_dtensor, is_dtensor, zero_maps
from hybrid_opt.distributed.zero_counts import GradCounts
from hybrid_opt.distributed.zero_edits import GradEdits, GradReads
from hybrid_opt.distributed.zero_gather import ParamGather, check_shard_owner
from hybrid_opt.distributed.zero_group import Collectives, group_timeout, wait_collective  # noqa: F401 (re-exported)
from hybrid_opt.distributed.zero_pool import CommWindow
from hybrid_opt.distributed.zero_reduce import GradReduction
from hybrid_opt.distributed.zero_release import GradRelease

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# elements per reduce-scatter / all-gather bucket (2 MiB of fp32): a comm slot holds about one
# (zero_pool.py), so this sizes the window; a larger param is a bucket of its own, reduced
# straight from p.grad into its chunk (zero_reduce.py)
BUCKET_NUMEL = 1 << 19
# which collectives carry a bucket: None picks by backend — gloo "all_to_all" (each rank's
# segment sent to its owner by all_to_all_single and summed there, in rank order; params sent
# back by one broadcast per rank from the chunk's owner, at 2 ranks one all_to_all_single),
# any other "reduce_scatter"
# (reduce-scatter + all-gather); "all_reduce" (each rank keeps its segment of the sum; params
# broadcast) where a backend has no reduce-scatter. Measured on gloo (torch 2.13, 2 ranks, one
# 16 MB bucket, idle cores): reduce_scatter_tensor 32 ms, all_reduce 20 ms, all_gather_into_
# tensor 25 ms, a broadcast of each rank's half 10 ms in all; 12 such buckets back to back
# (loaded cores): all_to_all 127 ms, all_reduce 187 ms, reduce_scatter ~360 ms. gloo's
# reduce-scatter costs more than an all-reduce of the same bytes, not half as NCCL's does.
# Tests set it to run every path on gloo.
COLLECTIVES = None
_KINDS = ("all_to_all", "reduce_scatter", "all_reduce")


@dataclass(eq=False)
class ZeroSpec:
    """Where a sharded plain param's chunk lives: this rank of `world` over `mesh`; `owner`: a
    weakref of the ZeroSharding whose reduce hooks it carries."""

    mesh: DeviceMesh
    rank: int
    world: int
    owner: weakref.ref[ZeroSharding] | None = None


def _chunk_numel(p: torch.Tensor, rank: int, world: int) -> int:
    a, b = chunk_rows(p.shape[0], rank, world)
    return (b - a) * (p.numel() // p.shape[0] if p.shape[0] else 0)


class Bucket:
    """A run of params (one dtype and device) reduced and gathered together: its layout, fixed
    at construction and read by every part, and its own buffer, written in place by the
    reduction (zero_reduce.py) and read by the step."""

    def __init__(self, params: list, index: int, world: int):
        self.params = params  # the params, in bucket order
        self.index = index  # its place in the issue order
        self.dtype, self.device = params[0].dtype, params[0].device
        self.numels = [[_chunk_numel(p, r, world) for r in range(world)] for p in params]  # [k][r]
        self.offsets = []  # offsets[k][r]: param k's chunk offset within rank r's segment
        acc = [0] * world
        for n in self.numels:
            self.offsets.append(list(acc))
            acc = [a + k for a, k in zip(acc, n)]
        self.width = max(acc) if acc else 0  # elements per rank of the chunks (longest rank's)
        # the bucket's own: out, then one has-grad count per param
        self.buf = torch.zeros(self.seg, dtype=self.dtype, device=self.device)
        self.out = self.buf[: self.width]  # this rank's averaged chunks (grad views point here)
        # one param whose dim-0 chunks split evenly IS its own rank-segmented buffer: reduced
        # straight from p.grad, no packing copy (its has-grad count rides a tiny collective of
        # its own); not under all_reduce, which would write the sum into p.grad
        self.direct = len(params) == 1 and params[0].numel() == world * self.width and self.width > 0

    @property
    def seg(self) -> int:  # one rank's segment of a reduce-scatter: chunks, then has-grad counts
        return self.width + len(self.params)


def make_buckets(params: list, cap: int, world: int) -> list:
    """The buckets, in issue order: reverse param order, each of one dtype and device and at
    most `cap` elements (a larger param alone)."""
    runs: list[list] = []
    run: list = []
    for p in reversed(params):
        if run and (
            run[0].dtype != p.dtype
            or run[0].device != p.device
            or sum(q.numel() for q in run) + p.numel() > cap
        ):
            runs.append(run)
            run = []
        run.append(p)
    if run:
        runs.append(run)
    return [Bucket(r, i, world) for i, r in enumerate(runs)]


class ZeroSharding:
    """The collectives of process_group mode for one optimizer (module docstring). It owns the
    order of a backward's reductions (which buckets fired, the next to issue) and these parts,
    each of which owns its own state:

    - `reduction` (GradReduction, zero_reduce.py): the reductions in flight, and their averages;
    - `counts` (GradCounts, zero_counts.py): the has-grad counts, and each reduced param's delivery;
    - `gathers` (ParamGather, zero_gather.py): the gathers of updated params, and when they land;
    - `window` (CommWindow, zero_pool.py): the comm slots the reductions and gathers borrow;
    - `release` (GradRelease, zero_release.py): release_grads' placeholders;
    - `edits` (GradEdits, zero_edits.py): the grad edits refused at step();

    over shared records: `buckets` (their layout), `comm` (Collectives, zero_group.py: the group,
    rank, world and kind) and `reads` (GradReads: the grads each reduction read)."""

    active = True  # its twin, sharding.NoSharding, is not

    def __init__(self, params: list, group, bucket_numel: int | None = None, release_grads: bool = False):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "process_group= needs torch.distributed initialised "
                "(torch.distributed.init_process_group) before the optimizer is built"
            )
        if not has_public_dtensor():
            raise RuntimeError(
                f"process_group= needs torch >= 2.5 (tested from 2.6): its state_dict() holds "
                f"DTensors of torch.distributed.tensor, which this torch ({torch.__version__}) "
                f"does not have. Upgrade torch"
            )
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if world != dist.get_world_size():
            raise NotImplementedError(
                f"process_group= over {world} of the "
                f"{dist.get_world_size()} ranks: the step's one decision "
                f"(norm, found_inf) is reduced over the default group; pass "
                f"torch.distributed.group.WORLD (or a group of every rank)"
            )
        for p in params:
            if is_dtensor(p):
                raise ValueError(
                    "process_group= shards plain (replicated) parameters; this "
                    "optimizer got DTensor parameters (FSDP2), which are sharded "
                    "already: build it without process_group"
                )
            if p.dim() == 0:
                raise ValueError(
                    "process_group= shards each parameter on dim 0; a 0-dim "
                    "parameter has none: make it shape (1,)"
                )
            if not p.is_contiguous():
                raise ValueError(
                    f"process_group= needs contiguous parameters (a dim-0 chunk is "
                    f"then one range of memory), got shape {tuple(p.shape)} stride "
                    f"{p.stride()}: make it contiguous before building the optimizer"
                )
        from torch.distributed.device_mesh import DeviceMesh

        device_type = params[0].device.type if params else "cpu"
        self.mesh = DeviceMesh.from_group(group, device_type)  # the state's DTensors: the user's group
        self.dist, self.rank, self.world = dist, rank, world
        # our collectives on a group of their own: a DDP wrapper (accelerate and HF Trainer add
        # one) issues its own on the default group from hooks that interleave with ours, in an
        # order that can differ between ranks (find_unused_parameters with a param unused on
        # one rank: gloo reported a collective mismatch); on separate groups the order of each
        # group's collectives is all that must agree. Collective: every rank builds its optimizer.
        # Its timeout is the user's group's (new_group's default is torch's, 30 min on gloo),
        # and so is each wait's bound (zero_group.py)
        timeout = group_timeout(dist, group, device_type)
        self.group = dist.new_group(
            ranks=dist.get_process_group_ranks(group), backend=dist.get_backend(group), timeout=timeout
        )
        spec = ZeroSpec(self.mesh, rank, world, weakref.ref(self))
        registry, _ = zero_maps()
        for p in params:
            # a param still hooked by an older ZeroSharding (an optimizer dropped but not
            # collected yet: one in a reference cycle, as a Trainer's is, lives until the cyclic
            # gc runs, and that moment differs between ranks) is taken over: the older one's
            # hooks come off here, at construction, on every rank alike — else it would go on
            # issuing its reductions on the ranks where it is not collected yet, and the ranks'
            # collectives would no longer pair
            older = registry.get(p)
            older = older.owner() if older is not None and older.owner is not None else None
            if older is not None:
                older.remove()
            registry[p] = spec
        self.params = list(params)
        self.buckets = make_buckets(params, bucket_numel or BUCKET_NUMEL, world)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._arrived: dict = {}  # bucket id -> set of param ids whose grads arrived
        self._fired: set = set()  # buckets whose grads all arrived, waiting for their turn
        self._next = 0  # the next bucket to issue this step (buckets issue in order)
        self._in_backward = False  # a reducing backward is running (its end callback queued)
        self._handles: list = []
        self._is_boundary = lambda: True
        self._adopted = 0  # stats["adopted"]: replaced grads holding their average (finish)
        self._replaced: list = []  # this step's replaced grads' params, refused (finish)
        kind = COLLECTIVES or ("all_to_all" if dist.get_backend(group) == "gloo" else "reduce_scatter")
        if kind not in _KINDS:
            raise ValueError(
                f"hybrid_opt.distributed.zero.COLLECTIVES must be None or one of {_KINDS}, got {kind!r}"
            )
        # the kind is fixed per backend: the same on every rank
        self.comm = Collectives(dist, self.group, rank, world, kind, timeout)
        self.reads = GradReads()  # the grad each reduction read, and its version (zero_edits.py)
        self.release = GradRelease(self.buckets, self.reads, release_grads)
        self.counts = GradCounts(rank, world, self.reads, self.release)
        self.window = CommWindow(self.buckets, self.comm)  # the slots the collectives borrow
        self.reduction = GradReduction(self.comm, self.window, self.counts, self.reads, self.release)
        self.gathers = ParamGather(self.buckets, self.comm, self.window)
        self.window.completes_with(reduce=self.reduction.complete, gather=self.gathers.land)
        self.edits = GradEdits(self.params, self.buckets, rank, world, self.reads)

    @property
    def release_grads(self) -> bool:
        return self.release.enabled

    @property
    def stats(self) -> dict:
        """Counts of this optimizer's collectives, and its comm buffers' bytes (a new dict)."""
        return dict(
            reduce_scatters=self.reduction.launches,
            all_gathers=self.gathers.launches,
            adopted=self._adopted,
            collectives=self.comm.kind,
            all_gathers_landed_in_forward=self.gathers.landed_in_forward,
            buffer_bytes=self.window.nbytes() + self.counts.nbytes(),
            count_reads=self.counts.count_reads,
        )

    # ------------------------------------------------------------------ grads
    def install(self, on_reduced, is_boundary) -> None:
        """Hooks on every trainable param; `on_reduced(p)` runs once p's averaged chunk is in
        place (the optimizer's speculation hook); `is_boundary()` False: reduce nothing."""
        self.remove()
        self.counts.install(on_reduced)
        self._is_boundary = is_boundary
        for p in self.params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _on_grad(self, p) -> None:
        b = self._bucket_of.get(id(p))
        if b is None:  # not a param: a hook before this one returned a tensor (torch refuses it next)
            return
        if self.release.lost:
            self.release.grad_arrived()  # release_grads: a failed step's grads are not missed
        if not self._is_boundary():
            return  # an accumulation micro-step: grads accumulate locally, nothing is reduced
        if not self._in_backward:
            self.release.check_rereduce()  # release_grads: the last backward's full grads are gone
            # a backward's first grad: a backward after one that issued every bucket (grads
            # accumulated without the boundary flag) reduces every bucket again, in order
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            if self._next == len(self.buckets):
                self._next = 0
                self._fired.clear()
                self._arrived.clear()
        arrived = self._arrived.setdefault(id(b), set())
        arrived.add(id(p))
        if len(arrived) == sum(1 for q in b.params if q.requires_grad):
            arrived.clear()
            self._fired.add(b.index)
            self._issue_in_order()
        # release_grads: p's own bucket is not delivered (its full grads released) from p's hook:
        # the hooks registered on p after ours have not run yet, and an in-place edit of theirs
        # must land on the grad whose version the reduction noted, not on a placeholder
        self.reduction.poll(hold=b if self.release.enabled else None)

    def _end_of_backward(self) -> None:
        """The autograd engine's callback at the end of a backward that reduced: the buckets
        that did not fire (a param without a grad on this rank) are issued now, in order, so
        every backward issues every bucket once on every rank (ranks run the same backwards)."""
        self._in_backward = False
        self._issue_in_order(upto=len(self.buckets))
        self.poll(wait=True)  # a direct bucket reads p.grad while in flight: done before it returns
        self.release.hide()  # release_grads: p.grad reads None after backward (zero_release.py)

    def _issue_in_order(self, upto: int | None = None) -> None:
        """Issues the fired buckets from the next one in order (every bucket before `upto`,
        fired or not): every rank then issues the same reduce-scatters in the same order."""
        while self._next < len(self.buckets) and (
            self._next in self._fired or (upto is not None and self._next < upto)
        ):
            self._fired.discard(self._next)
            self._next += 1
            self.reduction.launch(self.buckets[self._next - 1])

    def poll(self, wait: bool = False, until: Bucket | None = None) -> None:
        """Completes the launched reductions in launch order (all of them when `wait`; with
        `until`, up to and including that bucket's): GradReduction.poll."""
        self.reduction.poll(wait, until)

    def complete_reductions(self) -> None:
        """Before step(): the buckets not issued yet are issued, in order (fired or not: a
        param without a grad here may have one on another rank), and every pending reduction
        is waited for. A grad replaced since its reduction read the one before (`p.grad = t`
        after backward, or in a grad hook registered after the optimizer's) is not reduced
        again: that would be a collective on this rank alone whenever the ranks differ (the
        others would wait for it in their next collective). It is refused as an in-place edit
        is (grad_edit_error), unless it holds its averaged chunk (a DDP wrapper writing its
        average into a grad it made): then it reads as that chunk."""
        if any(p.requires_grad for p in self.params):
            self._issue_in_order(upto=len(self.buckets))
        self.poll(wait=True)  # a bucket's buffers are reused: its reduction done before another
        self.counts.read()  # counts kept on the device (zero_counts.py): one read, zero grads made
        self.release.restore()  # release_grads: the placeholders the step reads (zero_release.py)
        self._replaced = self._replaced_grads()
        if self.buckets and not self.release.enabled:
            self.edits.check_ddp(self.buckets[0])

    def _replaced_grads(self) -> list:
        """The params whose grads were replaced since their reduction read another (finish()),
        those holding their averaged chunk adopted: the others."""
        replaced = [
            (p, b, k)
            for b in self.buckets
            if not self.release.has_released(b)
            for k, p in enumerate(b.params)
            if p.grad is not None and not self.reads.saw(p)
        ]
        if replaced and self.edits.hold_averages([p for p, _, _ in replaced]):
            for p, b, k in replaced:
                self.counts.map_chunk(b, k, p.grad)
                self.reads.note(p)
            self._adopted += len(replaced)
            return []
        return [p for p, _, _ in replaced]

    def begin_step(self, failure, found, grad_scale, scaler, key) -> tuple:
        """step()'s start: the last step's params landed and every grad's averaged chunk in
        place; (found_inf — with release_grads this rank's chunks' flag added for GradScaler
        `scaler`, zero_release.py — and the failure so far, the refusal of a grad edit the
        reductions did not see included: zero_edits.py). `found`, `grad_scale`: GradScaler's
        for optimizer `key` (its id)."""
        self.wait_gathered()
        self.complete_reductions()
        found, refused = self.release.scaler_found_inf(found, scaler, key)
        failure = failure or refused
        # GradScaler.step hands no grad_scale for grads unscaled already (unscale_)
        return found, failure or self.grad_edit_error(found is not None and grad_scale is None)

    def grad_edit_error(self, unscaled: bool):
        """After finish(): the refusal of this step — a grad given to a released bucket
        (zero_release.py), a grad changed in place since its reduction read it, or
        (`unscaled`) GradScaler.step found it unscaled (zero_edits.py) — or None."""
        released = self.release.error()
        if released is not None:
            return released
        return self.edits.error(unscaled, self._replaced)

    def zero_grad(self, set_to_none: bool) -> None:
        """The optimizer's zero_grad: with release_grads, set_to_none=False keeps the released
        grads as zeros for the reductions to count (zero_release.py)."""
        self.release.zero_grad(set_to_none)

    def shard(self) -> dict | None:
        """(rank, world) whose chunks this optimizer's state holds."""
        return {"rank": self.rank, "world": self.world}

    def check_owner(self, saved: dict | None) -> None:
        """load_state_dict: check_shard_owner (zero_gather.py), agreed by every rank."""
        check_shard_owner(saved, self)

    def end_step(self, stepped: bool = True) -> None:
        """After step() (taken or skipped: `stepped`; or failed): the next backward starts a new
        reduction."""
        self._arrived.clear()
        self.reads.clear()
        self._replaced = []
        self._fired.clear()
        self._next = 0
        self._in_backward = False  # a backward that raised before its end callback
        self.counts.clear()
        self.release.end_step(stepped)
        self.gathers.reset()

    # ------------------------------------------------------------------ params
    def expect_commits(self, pending: dict, direct: bool) -> None:
        """ParamGather.expect_commits (zero_gather.py)."""
        self.gathers.expect_commits(pending, direct)

    def committed(self, key) -> None:
        """ParamGather.committed (zero_gather.py)."""
        self.gathers.committed(key)

    def gather(self, direct: bool = False) -> None:
        """ParamGather.gather (zero_gather.py): the rest of this step's gathers launched."""
        self.gathers.gather(direct)

    def reset_gather(self) -> None:
        """After a step (taken or not): the next one launches from the first bucket again."""
        self.gathers.reset()

    def wait_gathered(self) -> None:
        """Lands every pending all-gather (bounded waits): the params are then current."""
        self.gathers.wait_gathered()

    def close(self) -> None:
        """The grad hooks removed; pending gathers landed (a failed one is warned about: the
        other ranks' chunks of those params are then the previous step's)."""
        self.remove()
        try:
            self.wait_gathered()
        except RuntimeError as e:
            warnings.warn(
                f"process_group: closing with an all-gather that failed ({e}); this "
                f"rank's params hold the other ranks' chunks of the step before",
                stacklevel=3,
            )
        finally:
            self.gathers.forget_pending()

    def comm_tensors(self) -> list:
        """Every tensor of the comm figure (allocated.py): the slots (and tensors of their own
        while borrowed), each bucket's averaged chunks with their counts, a direct bucket's counts."""
        return self.window.tensors() + [t for b in self.buckets for t in (b.buf, self.counts.of(b))]

    def state_numel(self) -> int:
        """Elements of state this rank keeps (its chunks)."""
        return sum(b.numels[k][self.rank] for b in self.buckets for k in range(len(b.params)))
