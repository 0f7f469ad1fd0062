"""A step that fails: its inputs refused before anything changes, and what a failure part-way
leaves behind, said in the error.

step() checks what the tiers' kernels would refuse before any state changes
(`_check_step_inputs`, before the ranks' decision, so under torch.distributed it rides the
failure flag; `_check_device_scale` after it, as the clip coefficient is known only then): a
sparse grad, a grad whose element count is not its param's, and for the params the device
tier steps a grad of a dtype or device its kernel refuses, a group's hyperparameter out of
range (set after construction) or a non-finite grad scale. Such an error changes nothing: fix
the cause, call step() again, and training continues bitwise as if the failed call never
happened.

What can still fail comes after some work may be done: the host/nvme tier (a worker error, a
full disk, a slot that failed its checksum) commits each subgroup as its step completes, and
the device tier steps in place (a kernel that fails after another call wrote). Neither can be
undone bitwise without a second copy of the state, memory not spent on failures that checked
input makes rare. Instead each parameter is left either *stepped* (all its elements, its step
count advanced) or *untouched* (its state and step count as before the call); only a
parameter whose elements span several subgroups (several kernel calls) can be *torn* — some
elements stepped, others not, its count advanced — and the error names it. When nothing was
stepped (a host tier that fails before its first commit, a device kernel in its first call)
the step counts and the step's bookkeeping are as before the call and step() can simply be
called again; otherwise the error says which parameters stepped and to reload a checkpoint.

A mixin of the optimizer class.
"""
from __future__ import annotations

from hybrid_opt import distributed as D
from hybrid_opt import rank_faults as RF
from hybrid_opt.ledger import StepUndo
from hybrid_opt.plan import DEVICE


NOTHING_STEPPED = ("Nothing was stepped (state and step counts are the previous step's): fix the "
                   "cause and call step() again.")


class StepFailureMixin:
    """Input checks before a step, and the accounting of one that failed part-way."""

    # ------------------------------------------------------------------ before anything changes
    def _check_step_inputs(self) -> None:
        """Refuses, before anything changes, what a tier would fail on part-way (module
        docstring). A param sharded by FSDP2 / process_group has its grad checked by
        `_check_device_scale` instead (its local grad is known only after the reductions)."""
        cls = type(self).__name__
        on_device, sharded = self._check_layout()
        device = self._layout.subgroups[0].device if self._layout.subgroups else None
        i = 0
        for gi, group in enumerate(self.param_groups):
            live_on_device = False
            for p in group["params"]:
                g = p.grad
                if g is not None:
                    if g.is_sparse:
                        raise RuntimeError(f"{cls} does not support sparse gradients")
                    if i not in sharded:
                        if g.numel() != p.numel():
                            self._refuse_grad(i, f"has shape {tuple(g.shape)} ({g.numel()} elements) "
                                                 f"but the parameter has {tuple(p.shape)} ({p.numel()}): "
                                                 f"give it a grad of its own shape", ValueError)
                        # the usual grad (the param's dtype and device) needs no more checks
                        if i in on_device and (g.dtype is not p.dtype or g.get_device() != p.get_device()):
                            self._refuse_grad(i, self._placement.device.refuse_grad(g, p), TypeError)
                    live_on_device = live_on_device or i in on_device
                i += 1
            hp = self._hyper(group, 1.0)  # a Tensor lr of several elements raises here, not mid-step
            why = self._placement.device.refuse_hyper(hp, device) if live_on_device else None
            if why is not None:
                raise ValueError(f"{cls}.step(): param group {gi}: {why} (the device tier's "
                                 f"kernel refuses it). {NOTHING_STEPPED}")

    def _check_layout(self) -> tuple:
        """({params with a slice on the device tier}, {sharded params}) for the layout now,
        made again only when the layout changed (a move, add_param_group)."""
        cache = self.__dict__.get("_check_cache")
        if cache is None or cache[0] is not self._placement.plan or cache[1] != self._placement.plan.tiers or cache[2] != len(self._layout.steps):
            on_device = {sl.param_index for sg in self._layout.subgroups if self._placement.plan.tiers[sg.index] == DEVICE
                         for sl in sg.slices}
            sharded = {i for i, p in enumerate(self._layout.params()) if D.is_sharded(p)}
            cache = self._check_cache = (self._placement.plan, list(self._placement.plan.tiers), len(self._layout.steps), on_device, sharded)
        return cache[3], cache[4]

    def _refuse_grad(self, i: int, why: str | None, kind: type) -> None:
        if why is not None:
            raise kind(f"{type(self).__name__}.step(): {self._layout.param_label(i)}'s grad {why}. {NOTHING_STEPPED}")

    def _check_device_scale(self, device_work: list, scale: float, undo: StepUndo) -> None:
        """After the decision: the combined grad scale, and the grads of sharded params, as
        the device tier's kernel would refuse them; raises with nothing stepped."""
        if not device_work:
            return
        device = self._layout.subgroups[device_work[0].index].device
        why = self._placement.device.refuse_scale(scale, device)
        for sl in (w.slice for w in device_work) if why is None else ():
            if not D.is_sharded(sl.param):
                continue
            g, p = D.local_of(sl.param.grad), D.local_of(sl.param)
            if g.numel() != p.numel():
                why = f"its local grad has {g.numel()} elements, its local shard {p.numel()}"
            why = why or self._placement.device.refuse_grad(g, p)
            if why is not None:
                why = f"{self._layout.param_label(sl.param_index)}'s grad {why}"
                break
        if why is not None:
            self._step_failed(ValueError(why), None, {}, set(), device_work, [], [], undo)

    # ------------------------------------------------------------------ after a failure
    def _step_failed(self, e: BaseException, where: str | None, host_steps: dict, committed: set,
                     device_work: list, done: list, unsure: list, undo: StepUndo) -> None:
        """Raises `e` explained, after putting back the step count of every parameter the
        failed step did not touch (module docstring). host_steps: {subgroup index: HostWork}
        of the host/nvme tiers (step_work.py), `committed` those that committed; device_work:
        the device tier's DeviceWork entries, `done` / `unsure` the positions written / maybe
        written. where: the failing tier, None for input refused."""
        total: dict = {}
        stepped: dict = {}
        for w in host_steps.values():
            for sl in w.live:
                total[sl.param_index] = total.get(sl.param_index, 0) + 1
                stepped[sl.param_index] = stepped.get(sl.param_index, 0) + (w.sg.index in committed)
        for w in device_work:
            total[w.slice.param_index] = total.get(w.slice.param_index, 0) + 1
        for k in done:
            idx = device_work[k].slice.param_index
            stepped[idx] = stepped.get(idx, 0) + 1
        maybe = {device_work[k].slice.param_index for k in unsure}
        whole = sorted(i for i, n in total.items() if stepped.get(i, 0) == n and i not in maybe)
        torn = sorted(i for i, n in total.items() if (0 < stepped.get(i, 0) < n or i in maybe)
                      and i not in whole)
        # untouched: its count as before the call; with nothing stepped (an empty param, no
        # subgroup, too) every count and the step's scalars
        untouched = [i for i in total if not stepped.get(i, 0) and i not in maybe]
        self._ledger.put_back(undo, untouched, nothing_stepped=not whole and not torn)
        self._ledger.sync_torch_state(self.state)
        self._record_versions()  # what was stepped was written by the step, not the user
        if not isinstance(e, Exception):  # KeyboardInterrupt and the like: counts fixed, as it is
            raise e
        if not whole and not torn:
            what = NOTHING_STEPPED
        else:
            what = (f"The step was partly applied: parameters {whole} were stepped (their step "
                    f"counts advanced), " + (f"parameters {torn} only in part (torn), " if torn else "")
                    + "the others not (state and step counts as before). Reload a checkpoint: "
                    "stepping again would step the stepped ones twice.")
        notes = RF.OUT_OF_STEP_NOTE * (D.world_size() > 1) + RF.ZERO_PARAMS_NOTE * (self._zero is not None)
        if where is None:  # refused input (after the decision: the other ranks stepped)
            err = ValueError(f"{type(self).__name__}.step(): {e}. {what}{notes}")
        else:
            err = RuntimeError(f"{type(self).__name__}.step() failed in {where}: {e}\n{what}{notes}")
        if D.world_size() > 1:  # the others stepped: our next step() stops them all
            self._ledger.out_of_step(err)
        if self._zero is not None:
            # the others all-gather their stepped chunks now: this rank joins (its params
            # then hold their new chunks and its own chunk as its tiers left it), so the
            # next collectives still pair in order and its next step() stops every rank
            RF.quietly(self._gather_params, err)
        raise err from e

    def _step_device(self, device_work: list, scale, host_steps: dict, undo: StepUndo) -> None:
        """The device tier's step (after the host tiers committed every subgroup)."""
        self._placement.device.progress = ([], [])
        try:
            self._placement.device.step(device_work, scale)
        except BaseException as e:
            done, unsure = self._placement.device.progress
            self._step_failed(e, "the device tier", host_steps, set(host_steps), device_work,
                              done, unsure, undo)
