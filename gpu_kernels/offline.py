"""Compiles the kernels for a GPU this machine does not have: every launch inside `compile_for(arch)`
goes through its launcher as usual and is then compiled by Triton for `arch` instead of running.
No GPU and no CUDA driver are needed; CI uses it to check what Triton's interpreter accepts but the
compiler would reject. Run it in a process that has not interpreted a kernel.

    with compile_for("sm_90") as compiled:
        fused_adam_(params, grads, ...)  # CPU tensors stand in for the GPU's memory"""

import contextlib
import re
import threading

from . import _runtime

_lock = threading.Lock()


class _TargetDriver:
    """What `JITFunction.run(..., warmup=True)` asks of Triton's driver: the current device,
    its stream and its target. The target is the named GPU; device and stream are
    placeholders that nothing reads, since nothing is launched."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def parse_arch(arch):
    """ "sm_90" / "sm90" / 90 / "90" -> 90 (the compute capability as Triton's CUDA target
    numbers it)."""
    match = re.fullmatch(r"(?:sm_?)?(\d{2,3})", str(arch).strip().lower())
    if match is None:
        raise ValueError(f"arch must name an NVIDIA compute capability like 'sm_90' or 80, got {arch!r}")
    return int(match.group(1))


@contextlib.contextmanager
def compile_for(arch="sm_90"):
    """Inside the block every gpu_kernels launch compiles for `arch` and runs nothing; yields
    the list the compiled kernels (Triton `CompiledKernel`s, `.asm["ptx"]`, `.asm["cubin"]`)
    are appended to, one per launch. Not reentrant; one thread at a time."""
    triton = _runtime._import_triton()
    if triton is None:
        raise RuntimeError(_runtime.unavailable_reason("cpu"))
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    target = GPUTarget("cuda", parse_arch(arch), 32)
    with _lock:
        compiled = _runtime.begin_offline(target)
        saved = getattr(driver, "_active", None)  # reading driver.active would create the real one
        driver.set_active(_TargetDriver(target))
        try:
            yield compiled
        finally:
            _runtime.end_offline()
            if hasattr(driver, "_active"):
                driver._active = saved
            else:
                driver.reset_active()
