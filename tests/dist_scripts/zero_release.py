"""Rank script: process_group's bounded comm window (hybrid_opt/distributed/zero_pool.py) and
release_grads=True (hybrid_opt/distributed/zero_release.py), in the configurations named on the command
line. Each trains C.STEPS steps of the common model (buckets of 64 elements: 4 of them) and
saves per step the params (after wait_params), the grads held after backward (p.grad storage
bytes, and the averaged chunks' bytes), opt.allocated_bytes["comm"] against the storages of
the tensors the comm window holds, and the error a refused case raised."""

import common as C
import torch
import torch.distributed as dist

from hybrid_opt import HybridAdamW

# name: (HybridAdamW kwargs, window slots or None (the defaults), case)
from hybrid_opt.distributed import zero, zero_counts, zero_pool
from hybrid_opt.testing import debug_view

CONFIGS = {
    "base": (dict(), None, None),
    "release": (dict(release_grads=True), None, None),
    "window1": (dict(), 1, None),
    "window1_overlap": (dict(overlap_param_gather=True), 1, None),
    "window1_rs": (dict(), 1, None),  # reduce_scatter + all-gather
    "window1_ar_overlap": (dict(overlap_param_gather=True), 1, None),  # all_reduce + broadcasts
    "release_window1_overlap": (dict(release_grads=True, overlap_param_gather=True), 1, None),
    "scaler": (dict(), None, "overflow"),
    "release_scaler": (dict(release_grads=True), None, "overflow"),
    "accumulate": (dict(), None, "micro"),
    "release_accumulate": (dict(release_grads=True), None, "micro"),
    "release_two_backwards": (dict(release_grads=True), None, "two_backwards"),
    "release_grad_set": (dict(release_grads=True), None, "grad_set"),
    "release_zero_grad_keep": (dict(release_grads=True), None, "zero_grad_keep"),
    # zero_grad(set_to_none=False), and params no rank uses at the last step (C.loss_unused_everywhere)
    "zero_grad_keep_unused": (dict(), None, "zero_grad_keep_unused"),
    "release_zero_grad_keep_unused": (dict(release_grads=True), None, "zero_grad_keep_unused"),
    "release_zero_grad_keep_unused_lazy": (dict(release_grads=True), None, "zero_grad_keep_unused"),
    "release_zero_grad_keep_unused_rs": (dict(release_grads=True), None, "zero_grad_keep_unused"),
    "release_zero_grad_keep_unused_ar": (dict(release_grads=True), None, "zero_grad_keep_unused"),
    "late_edit_half": (dict(), None, "late_edit_half"),
    "release_late_edit_half": (dict(release_grads=True), None, "late_edit_half"),
    "late_edit_inf": (dict(), None, "late_edit_inf"),
    "release_late_edit_inf": (dict(release_grads=True), None, "late_edit_inf"),
    "grad_set": (dict(), None, "grad_set"),
    "grad_set_by_hand": (dict(), None, "grad_set_by_hand"),
    "grad_zeroed_early": (dict(), None, "grad_zeroed_early"),
    "late_edit_replace": (dict(), None, "late_edit_replace"),
    "retry_late_edit_replace": (dict(), None, "late_edit_replace"),
    "release_retry_late_edit_replace": (dict(release_grads=True), None, "late_edit_replace"),
    "release_late_edit_replace": (dict(release_grads=True), None, "late_edit_replace"),
}
PATHS = {
    "window1_rs": "reduce_scatter",
    "window1_ar_overlap": "all_reduce",
    "release_zero_grad_keep_unused_rs": "reduce_scatter",
    "release_zero_grad_keep_unused_ar": "all_reduce",
}
LAZY_COUNTS = {"release_zero_grad_keep_unused_lazy"}  # has-grad counts read in step(), as on CUDA
OVERFLOW_STEP = 1
LATE_EDIT_STEP = 1


class LateEdit:
    """A user's post-accumulate-grad hook on the first param registered after the optimizer's:
    it runs once that param's bucket reduction has been launched from the grad (the edit is
    then one the reduction did not read: refused), and edits rank 1's grad at LATE_EDIT_STEP —
    halves it ("half") or writes an inf into it ("inf", an overflow a GradScaler must not lose)."""

    def __init__(self, param, rank: int, how: str):
        self.step, self.rank, self.how = None, rank, how
        param.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p) -> None:
        if self.step == LATE_EDIT_STEP and self.rank == 1:
            with torch.no_grad():
                if self.how == "half":
                    p.grad.mul_(0.5)
                elif self.how == "replace":  # a new tensor, not an in-place edit
                    p.grad = p.grad * 0.5
                else:
                    p.grad.view(-1)[0] = float("inf")


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def run(name: str, rank: int, world: int, tmp: str) -> dict:
    hybrid, window, case = CONFIGS[name]
    saved = (
        zero.BUCKET_NUMEL,
        zero.COLLECTIVES,
        zero_pool.WINDOW,
        zero_pool.WINDOW_FLOOR_BYTES,
        zero_counts.LAZY,
    )
    zero.BUCKET_NUMEL = 64
    zero.COLLECTIVES = PATHS.get(name)
    zero_counts.LAZY = True if name in LAZY_COUNTS else None
    if window is not None:  # every bucket through `window` slots, however small
        zero_pool.WINDOW, zero_pool.WINDOW_FLOOR_BYTES = window, 0
    model = C.build_model()
    params = list(model.parameters())
    out = dict(
        params=[],
        grad_bytes=[],
        chunk_bytes=[],
        comm=[],
        held=[],
        skipped=[],
        error=None,
        message=None,
        grad_none_after_backward=[],
        grad_none_after_step=[],
        slots=[],
        full_bytes=_storage_bytes(params),
    )
    overflow = C.OverflowInBackward(model) if case == "overflow" else None
    late_step = [None]
    if case == "grad_zeroed_early":  # a hook before the optimizer's: its reduction reads the zeros

        def zero_early(p):
            if late_step[0] == 1:
                p.grad.zero_()

        params[0].register_post_accumulate_grad_hook(zero_early)
    try:
        opt = HybridAdamW(
            params,
            lr=C.LR,
            weight_decay=0.01,
            max_grad_norm=1.0,
            subgroup_numel=32,
            offload_fraction=0.5,
            process_group=dist.group.WORLD,
            **hybrid,
        )
        late = (
            LateEdit(params[0], rank, case.rsplit("_", 1)[1]) if str(case).startswith("late_edit") else None
        )
        scaler = None
        if case in ("overflow", "late_edit_inf"):
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
            opt.attach_grad_scaler(scaler)
        out["slots"] = list(debug_view(opt).sharding.window.slot_counts().values())
        for i, x in enumerate(C.batches()):
            opt.zero_grad(set_to_none=not str(case).startswith("zero_grad_keep"))
            if late is not None:
                late.step = i
            late_step[0] = i
            if case == "grad_set_by_hand":  # the recipe for grads set by hand: nothing reduced in backward
                opt.set_gradient_accumulation_boundary(i != 1)
            local = C.local_batch(x, rank, world)
            if overflow is not None and i == OVERFLOW_STEP and rank == 1:
                overflow.arm()  # an inf in rank 1's local grad only
            micro = 2 if case in ("micro", "two_backwards") else 1
            n = local.shape[0] // micro
            try:
                for m in range(micro):
                    if case == "micro":
                        opt.set_gradient_accumulation_boundary(m == micro - 1)
                    if case == "zero_grad_keep_unused":
                        loss = C.loss_unused_everywhere(model, local, rank, world, i)
                    else:
                        loss = C.loss_fn(model, local[m * n : (m + 1) * n]) / micro
                    (scaler.scale(loss) if scaler else loss).backward()
                out["grad_bytes"].append(_storage_bytes(p.grad for p in params))
                out["chunk_bytes"].append(_storage_bytes(b.out for b in debug_view(opt).sharding.buckets))
                out["grad_none_after_backward"].append([p.grad is None for p in params])
                if case in ("grad_set", "grad_set_by_hand") and i == 1:
                    params[0].grad = torch.zeros_like(params[0])
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
            except Exception as e:  # the refused cases: every rank alike
                out.update(error=type(e).__name__, message=str(e), failed_at=i)
                if name.startswith(("retry", "release_retry")):  # step() again, no backward
                    try:
                        opt.step()
                        out["retry"] = None
                    except Exception as e2:
                        out["retry"] = (type(e2).__name__, str(e2))
                    out["params"].append([p.detach().clone() for p in params])
                break
            out["skipped"].append(opt.step_was_skipped)
            out["grad_none_after_step"].append([p.grad is None for p in params])
            out["comm"].append(opt.allocated_bytes["comm"])
            out["held"].append(_storage_bytes(debug_view(opt).sharding.comm_tensors()))
            opt.wait_params()
            out["params"].append([p.detach().clone() for p in params])
        out["zero"] = dict(debug_view(opt).sharding.stats)
        opt.close()
    finally:
        (
            zero.BUCKET_NUMEL,
            zero.COLLECTIVES,
            zero_pool.WINDOW,
            zero_pool.WINDOW_FLOOR_BYTES,
            zero_counts.LAZY,
        ) = saved
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    C.rank_main(run)
