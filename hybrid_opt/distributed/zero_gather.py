"""process_group mode's params side (zero.py): the updated dim-0 chunks sent back to every rank
after a step, landed at once in the params or, overlapped, when next used; wait_params() lands all.

A bucket is launched as soon as the step has committed its params here. Invariant: launches follow
one fixed order on every rank (a bucket only after every bucket before it), so ranks that commit in
different orders still issue the same collectives. Design notes: docs/internals.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybrid_opt.distributed.local_shards import zero_chunk

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from hybrid_opt.distributed.zero import Bucket, ZeroSharding


@dataclass(eq=False)
class PendingGather:
    """One bucket's gather, launched and not landed: its collectives, whether it lands in a
    staging slot of the comm window (`staging`) or in the param itself, and what each param
    was when its chunks left (`marks`: (version, data_ptr); a param written since keeps what
    was written)."""

    bucket: Bucket
    staged: bool
    works: list
    marks: list
    staging: torch.Tensor | None = None


class ParamGather:
    """ZeroSharding's part (zero.py) for the gathers of updated params: the ones pending, the
    global forward pre-hook that lands them, and a step's launch order and commit waits."""

    def __init__(self, buckets: list, comm, window):
        self._comm = comm  # Collectives (zero_group.py)
        self._window = window  # CommWindow (zero_pool.py): the staging slots
        self._bucket_of = {id(p): b for b in buckets for p in b.params}
        self._pending: dict = {}  # bucket id -> PendingGather: launched, not landed
        self._gathering: dict = {}  # param id -> its bucket, while that bucket's gather is pending
        # the global forward pre-hook, installed while any is pending
        self._forward_hook: RemovableHandle | None = None
        # a taken step's gathers, launched as its commits complete: in param order (the host
        # tier commits subgroups, and the next forward runs, in that order)
        self._order = list(reversed(buckets))
        self._direct = False
        self._next = 0
        self._blocked: list[int] | None = None  # expect_commits's
        self._waits: dict = {}
        self._launcher = None  # set_launcher: what launches each bucket instead of launch()
        self.launches = 0  # stats["all_gathers"]
        self.landed_in_forward = 0  # stats["all_gathers_landed_in_forward"]

    def expect_commits(self, pending: dict, direct: bool) -> None:
        """A taken step is about to commit: `pending` maps each key (a host subgroup's index,
        or "device") to the params whose chunks that commit writes; committed(key) says it is
        done. A bucket none of whose params waits any more is launched then, in GATHER order
        (module docstring); `direct` as in gather()."""
        self._direct = direct
        self._waits = {}  # key -> indices of the buckets waiting for it
        self._blocked = [0] * len(self._order)  # per bucket: the keys it still waits for
        for key, params in pending.items():
            waits = {self._bucket_of[id(p)].index for p in params}
            self._waits[key] = waits
            for i in waits:
                self._blocked[i] += 1
        self._launch_ready()

    def committed(self, key) -> None:
        """The commit of `key` (expect_commits) has written its params: the buckets it held back
        go out, in order."""
        for i in self._waits.pop(key, ()):
            self._blocked[i] -= 1  # type: ignore[index]  # a key waited for: expect_commits set it
        self._launch_ready()

    def set_launcher(self, launcher) -> None:
        """Tests: each bucket's gather launched by `launcher(b, direct)` instead of launch() —
        a wrapper that logs the launch order and calls launch() (None: launch() again)."""
        self._launcher = launcher

    def _launch_ready(self, every: bool = False) -> None:
        """Launches buckets from the next one in GATHER order while they wait for no commit
        (all of them when `every`)."""
        order = self._order
        while self._next < len(order):
            b = order[self._next]
            if not every and (self._blocked is None or self._blocked[b.index]):
                return
            self._next += 1
            (self._launcher or self.launch)(b, self._direct)

    def gather(self, direct: bool = False) -> None:
        """Launches the collectives that send every rank's stepped chunks to every rank — the
        buckets this step has not launched yet (committed()), in GATHER order — not waited: each
        bucket lands when a module whose own params it holds is about to run forward, or at
        wait_gathered() (module docstring). `direct` (the caller waits for them at once, before
        anything can write a param): a bucket of one param lands in the param itself, no
        staging copy; else in the bucket's staging buffer, copied at landing into the params
        not written since."""
        self._direct = direct
        self._launch_ready(every=True)
        self._blocked = None
        if self._pending and self._forward_hook is None:
            from torch.nn.modules.module import register_module_forward_pre_hook

            self._forward_hook = register_module_forward_pre_hook(self._before_forward)

    def reset(self) -> None:
        """After a step (taken or not): the next one launches from the first bucket again."""
        self._next, self._blocked, self._waits = 0, None, {}

    def pending(self) -> list:
        """The buckets whose gathers are launched and not landed yet."""
        return [g.bucket for g in self._pending.values()]

    def launch(self, b, direct: bool) -> None:
        """b's gather launched, not waited (gather(); `direct` as there)."""
        comm = self._comm
        if id(b) in self._pending:
            self.land(b)  # a gather still pending (an earlier step's) must not race this one
        # an all-gather lands in place only where every rank's chunk has the same size
        staged = not (
            direct
            and len(b.params) == 1
            and (comm.kind != "reduce_scatter" or b.params[0].numel() == comm.world * b.width)
        )
        staging = None
        if staged:  # a slot of the comm window (zero_pool.py), given back as it lands
            full = staging = self._window.borrow(b, "gather", comm.world * b.width)
            mine = full[comm.rank * b.width : (comm.rank + 1) * b.width]
            for k, p in enumerate(b.params):
                n, a = b.numels[k][comm.rank], b.offsets[k][comm.rank]
                if n:
                    mine[a : a + n].copy_(zero_chunk(p.data, comm.rank, comm.world).reshape(-1))
        else:
            full = b.params[0].data.view(-1)
        works = self._send_chunks(b, full, staged)
        # what each param was when its chunks left: a param written since (model.
        # load_state_dict, assign=True, an in-place edit) keeps what was written
        marks = [(p._version, p.data_ptr()) for p in b.params]
        self._pending[id(b)] = PendingGather(b, staged, works, marks, staging)
        for p in b.params:
            self._gathering[id(p)] = b
        self.launches += 1

    def _send_chunks(self, b, full: torch.Tensor, staged: bool) -> list:
        """The bucket's gather collectives into `full` (the staging segments, or the param):
        one broadcast per rank holding a chunk, from that rank (gloo: cheaper than its
        all-gather), or with reduce_scatter one all-gather of the rank segments."""
        comm, world = self._comm, self._comm.world
        seg = [b.width if staged else b.numels[0][r] for r in range(world)]
        at = [r * b.width if staged else sum(b.numels[0][:r]) for r in range(world)]
        if comm.kind == "all_to_all" and world == 2:
            # one collective, not two broadcasts (a bucket of 512Ki elements is latency-bound
            # on gloo: the bench GPT at 2 ranks has 39): this rank's chunks to the other rank,
            # theirs into their own place
            me, other = comm.rank, 1 - comm.rank
            sent = [0 if r == me else seg[me] for r in range(2)]
            got = [0 if r == me else seg[other] for r in range(2)]
            return [
                comm.dist.all_to_all_single(
                    full[at[other] : at[other] + seg[other]],
                    full[at[me] : at[me] + seg[me]],
                    got,
                    sent,
                    group=comm.group,
                    async_op=True,
                )
            ]
        if comm.kind != "reduce_scatter":
            return [
                comm.dist.broadcast(
                    full[at[r] : at[r] + seg[r]],
                    comm.dist.get_global_rank(comm.group, r),
                    group=comm.group,
                    async_op=True,
                )
                for r in range(world)
                if any(n[r] for n in b.numels)
            ]
        # in place (NCCL's documented in-place all-gather: the input is the output's own segment)
        ag = getattr(comm.dist, "all_gather_single", None) or comm.dist.all_gather_into_tensor
        return [
            ag(full, full[comm.rank * b.width : (comm.rank + 1) * b.width], group=comm.group, async_op=True)
        ]

    def _before_forward(self, module, args) -> None:
        """Global forward pre-hook while gathers are pending: lands the buckets holding the
        module's own params (recurse=False: a parent's hook must not wait for its children)."""
        if not self._gathering:
            return None
        for p in module._parameters.values():
            b = self._gathering.get(id(p)) if p is not None else None
            if b is not None:
                self.landed_in_forward += 1
                self.land(b)
        return None

    def wait_gathered(self) -> None:
        """Lands every pending all-gather (bounded waits): the params are then current."""
        for g in list(self._pending.values()):
            self.land(g.bucket)

    def land(self, b) -> None:
        """b's pending gather waited for (bounded) and copied into the params not written
        since its chunks left."""
        g = self._pending.pop(id(b))
        for p in b.params:
            self._gathering.pop(id(p), None)
        landed = False
        try:
            for work in g.works:
                self._comm.wait(work, "the gather of updated parameters", b.device.type == "cuda")
            landed = True
            if not g.staged:
                return  # landed in the param itself
            full, world, me = g.staging, self._comm.world, self._comm.rank
            with torch.no_grad():
                for k, p in enumerate(b.params):
                    if (p._version, p.data_ptr()) != g.marks[k]:
                        continue
                    flat = p.data.view(-1)  # .data: its own version counter, p._version stays
                    start = 0
                    for r in range(world):
                        n = b.numels[k][r]
                        if n and r != me:
                            base = r * b.width + b.offsets[k][r]
                            flat[start : start + n].copy_(full[base : base + n])
                        start += n
        finally:
            if g.staged:  # a gather that failed may still write its slot: a new one replaces it
                self._window.release(b, "gather", lost=not landed)
            if not self._pending and self._forward_hook is not None:
                self._forward_hook.remove()
                self._forward_hook = None

    def forget_pending(self) -> None:
        """close(): the pending gathers forgotten (landed or failed before), the hook off."""
        self._pending.clear()
        self._gathering.clear()
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None


SHARD_KEY = "process_group_shard"


def check_shard_owner(saved: dict | None, zero: ZeroSharding) -> None:
    """A process_group state_dict() holds one rank's chunks: loading it on another rank would
    take them as its own, silently (HF Trainer saves optimizer.pt from rank 0 only). Agreed by
    every rank (one all_reduce of a flag: every rank loads, as every rank steps), so all raise
    together instead of one rank training on while another stopped."""
    # None: a full or DCP-made state (resharded to this rank)
    wrong = saved is not None and (saved["rank"], saved["world"]) != (zero.rank, zero.world)
    if zero.world > 1:
        # on the group's own backend's device (NCCL reduces CUDA tensors: the params' device)
        nccl = zero.dist.get_backend(zero.group) == "nccl"
        device = zero.buckets[0].device if nccl and zero.buckets else torch.device("cpu")
        flag = torch.tensor([1.0 if wrong else 0.0], device=device)
        zero.dist.all_reduce(flag, op=zero.dist.ReduceOp.MAX, group=zero.group)
        if flag.item() and not wrong:
            raise ValueError(
                f"load_state_dict: another rank was given a state_dict that is not "
                f"its own (a process_group= state_dict holds one rank's chunks); "
                f"every rank stops here. Nothing was loaded on this rank (rank "
                f"{zero.rank})"
            )
    if wrong:
        assert saved is not None  # `wrong` says so
        raise ValueError(
            f"load_state_dict: this state_dict holds rank {saved['rank']}'s chunks of a "
            f"{saved['world']}-rank process_group= optimizer, and this is rank {zero.rank} of "
            f"{zero.world}: under process_group= each rank's state_dict() holds only its own "
            f"chunks (Shard(0) DTensors), so one rank's file cannot resume another (HF Trainer "
            f"saves optimizer.pt from rank 0 only). Save and load each rank's own state_dict(), "
            f"or use torch.distributed.checkpoint (get_optimizer_state_dict + dcp.save, then "
            f"dcp.load + set_optimizer_state_dict), which reshards. Nothing was loaded"
        )
