"""The device tier: subgroups whose fp32 master and moments stay where the model is.

On CUDA one gpu_kernels.fused_adam_ launch per step count steps every device subgroup; the
combined grad scale is a kernel argument (or a device tensor) and nothing here reads the
device back (no host sync). On a CPU-only host the same subgroups are stepped in the
trainer by the CPU kernel. An fp32 model's params are their own master (stepped in place,
nothing copied); a bf16/fp16 model keeps an fp32 master here and gets its params written in
the same pass. `read_scalars` reads what a step must know on the host in one copy.
"""
from __future__ import annotations

import torch


def read_scalars(values) -> list:
    """Python floats of `values` (1-element tensors, numbers or None, passed through as
    float / None), the tensors of each device read in one small device-to-host copy: the
    values a step must know on the host (found_inf, the loss scale, the grads' norm²) cost
    one host synchronisation together instead of one each."""
    out = [None] * len(values)
    by_device: dict = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise ValueError(f"read_scalars: value {i} has {v.numel()} elements, expected 1")
            by_device.setdefault(v.device, []).append(i)
        elif v is not None:
            out[i] = float(v)
    for indices in by_device.values():
        packed = torch.stack([values[i].detach().reshape(()).to(torch.float64) for i in indices])
        for i, x in zip(indices, packed.tolist()):
            out[i] = x
    return out


class DeviceTier:
    def __init__(self, subgroups: list, amsgrad: bool):
        self.subgroups = {sg.index: sg for sg in subgroups}
        self.master, self.state = {}, {}
        for sg in subgroups:
            master = sg.flat if sg.dtype == torch.float32 else sg.flat.detach().float()
            self.master[sg.index] = master
            st = {"exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master)}
            if amsgrad:
                st["max_exp_avg_sq"] = torch.zeros_like(master)
            self.state[sg.index] = st

    def numel(self) -> int:
        return sum(m.numel() for m in self.master.values())

    def nbytes(self) -> int:
        own = sum(m.numel() * 4 for i, m in self.master.items() if self.subgroups[i].dtype != torch.float32)
        return own + sum(t.numel() * t.element_size() for st in self.state.values() for t in st.values())

    def step(self, work: list, grad_scale, found_inf=None) -> None:
        """work: [(subgroup index, slice, StepInputs-like hyperparameters, step)] — one entry
        per parameter slice to step. grad_scale: float (CPU) or 1-element device tensor."""
        if not work:
            return
        device = self.subgroups[work[0][0]].device
        if device.type == "cuda":
            self._step_cuda(work, grad_scale, found_inf)
        else:
            self._step_cpu(work, float(grad_scale))

    def _views(self, index: int, sl):
        a, b = sl.sub_offset, sl.sub_offset + sl.numel
        st = self.state[index]
        return (self.master[index][a:b], st["exp_avg"][a:b], st["exp_avg_sq"][a:b],
                st["max_exp_avg_sq"][a:b] if "max_exp_avg_sq" in st else None)

    def _step_cpu(self, work: list, grad_scale: float) -> None:
        import cpu_kernels
        for index, sl, hp, step in work:
            p, m, v, vmax = self._views(index, sl)
            sg = self.subgroups[index]
            copy = sg.flat[sl.sub_offset:sl.sub_offset + sl.numel] if sg.dtype != torch.float32 else None
            grad = sl.grad_view()
            if not grad.is_contiguous():
                grad = grad.contiguous()
            cpu_kernels.adam_step_(p, grad, m, v, step=step, lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2,
                                   eps=hp.eps, weight_decay=hp.weight_decay, decoupled=hp.decoupled,
                                   grad_scale=grad_scale * hp.grad_scale,
                                   max_exp_avg_sq=vmax if hp.amsgrad else None, param_copy=copy)

    def _step_cuda(self, work: list, grad_scale, found_inf) -> None:
        import gpu_kernels
        # one launch per distinct (hyperparameters, step): usually exactly one
        launches: dict = {}
        for index, sl, hp, step in work:
            launches.setdefault((hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.decoupled,
                                 hp.amsgrad, hp.grad_scale, step, self.subgroups[index].dtype),
                                []).append((index, sl))
        for (lr, b1, b2, eps, wd, decoupled, amsgrad, sign, step, _), items in launches.items():
            ps, gs, ms, vs, xs, cs = [], [], [], [], [], []
            for index, sl in items:
                p, m, v, vmax = self._views(index, sl)
                sg = self.subgroups[index]
                ps.append(p)
                gs.append(sl.grad_view().contiguous())
                ms.append(m)
                vs.append(v)
                xs.append(vmax)
                if sg.dtype != torch.float32:
                    cs.append(sg.flat[sl.sub_offset:sl.sub_offset + sl.numel])
            # a float scale is a kernel argument (fp32 inside the kernel, as a 1-element fp32
            # tensor would be): no per-step tensor, no host-to-device copy
            scale = (grad_scale * sign).reshape(1) if isinstance(grad_scale, torch.Tensor) \
                else float(grad_scale) * sign
            gpu_kernels.fused_adam_(ps, gs, ms, vs, step=step, lr=lr, beta1=b1, beta2=b2, eps=eps,
                                    weight_decay=wd, decoupled=decoupled, grad_scale=scale,
                                    found_inf=found_inf, max_exp_avg_sqs=xs if amsgrad else None,
                                    param_copies=cs if len(cs) == len(ps) else None)
