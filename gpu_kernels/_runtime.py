"""Owns what every Triton kernel here shares: loading triton lazily, choosing the compiled or the
interpreted kernel for a device, and the multi-tensor chunk tables.

Importing it never needs triton or a GPU; `TRITON_INTERPRET` is read at a kernel's first launch.
Invariant: every launch and table copy runs under `device_guard(tensors' device)`, on that device's
current stream. Design notes: docs/internals.md."""

import collections
import contextlib
import os
import threading
import types

import torch

_triton = None
_triton_error = None


def _import_triton():
    global _triton, _triton_error
    if _triton is None and _triton_error is None:
        try:
            import triton
            import triton.language  # noqa: F401  (the kernels' `tl`)

            _triton = triton
        except Exception as exc:  # ImportError, or a broken install that fails on import
            _triton_error = exc
    return _triton


def language():
    """`triton.language` when triton imports, else a stand-in that only carries `constexpr`,
    so kernel signatures (`BLOCK: tl.constexpr`) can be defined without triton."""
    triton = _import_triton()
    if triton is not None:
        return triton.language
    return types.SimpleNamespace(constexpr=_Constexpr)


class _Constexpr:
    def __init__(self, value=None):
        self.value = value


_MIN_INTERPRETER_VERSION = (3, 2)


def _version(text):
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unavailable_reason(device):
    """Why a Triton kernel cannot run on `device` now, or None when it can."""
    device = torch.device(device)
    if _import_triton() is None:
        return (
            f"gpu_kernels needs triton, which failed to import ({_triton_error!r}); "
            "install triton>=3.0 (Linux x86_64)"
        )
    if _offline.target is not None:
        return None  # compiling for a named GPU: the tensors only stand in for its memory
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "gpu_kernels got CUDA tensors but torch.cuda.is_available() is False"
        return None
    if device.type == "cpu":
        if interpreting():
            if _version(_triton.__version__) < _MIN_INTERPRETER_VERSION:
                # measured: triton 3.0's interpreter drops stores through pointers loaded from
                # a table and 3.1's cannot unroll static_range; 3.2 onwards run these kernels
                return (
                    f"Triton's interpreter needs triton>=3.2 for these kernels (found "
                    f"{_triton.__version__}); the compiled kernels on CUDA need triton>=3.0"
                )
            return None
        return (
            "gpu_kernels got CPU tensors: there is no CUDA device in use and TRITON_INTERPRET "
            "is not set to 1; move the tensors to a CUDA device, or set TRITON_INTERPRET=1 to "
            "run the kernels (slowly) through Triton's interpreter"
        )
    return f"gpu_kernels runs on CUDA devices (or on CPU through TRITON_INTERPRET=1), not on {device.type!r}"


def require_runtime(device):
    reason = unavailable_reason(device)
    if reason is not None:
        raise RuntimeError(reason)


def device_guard(device):
    """`torch.cuda.device(device)` for a CUDA device, a no-op context otherwise (CPU tensors
    under the interpreter). Without it a launch for tensors on cuda:1 while cuda:0 is current
    runs in cuda:0's context (an illegal address, or a slow peer access) on cuda:0's stream,
    unordered with the caller's work on cuda:1."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


class LazyKernel:
    """A Triton function built on first use: compiled (`JITFunction`) for CUDA tensors,
    interpreted (`InterpretedFunction`) for CPU tensors under TRITON_INTERPRET=1.

    `triton.jit` picks one of the two from the environment once, at decoration. Here each
    mode gets its own copy of the defining module's namespace in which every `lazy_jit`
    function is replaced by its variant for that mode, so a kernel calling jit helpers
    resolves the helpers of its own mode. (Triton's interpreter patches `triton.language`
    while it runs, so compiling in a process that has interpreted is not supported: the
    tests compile in a subprocess.) `launches` counts kernel launches (tests check one per
    list).
    """

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self.launches = 0

    def for_device(self, device):
        device = torch.device(device)
        require_runtime(device)
        return _namespace(self.fn.__globals__, _mode(device))[self.__name__]

    def launch(self, device, grid, *args, **kwargs):
        """Launches on `device` (the tensors' device), whatever device is current. Under
        `offline.compile_for(arch)` it compiles for that GPU instead and launches nothing."""
        kernel = self.for_device(device)
        self.launches += 1
        if _offline.target is not None:
            _offline.compiled.append(kernel.run(*args, grid=grid, warmup=True, **kwargs))
            return None
        with device_guard(device):
            return kernel[grid](*args, **kwargs)


class _Offline:
    """While `offline.compile_for` runs (through `begin_offline` / `end_offline`): the Triton
    target every launch is compiled for instead of running, and the kernels compiled so far."""

    target = None
    compiled = []


_offline = _Offline()


def begin_offline(target):
    """From now on launches compile for `target` and run nothing; returns the list each
    compiled kernel is appended to."""
    if _offline.target is not None:
        raise RuntimeError("offline compilation is already active; it does not nest")
    _offline.target, _offline.compiled = target, []
    return _offline.compiled


def end_offline():
    _offline.target, _offline.compiled = None, []


def launch_config(configs: dict, device) -> dict:
    """The launch configuration for `device` from a kernel's table: the entry of its GPU
    architecture ("sm_90" for compute capability 9.0, chosen from the benchmark's --sweep on
    such a GPU) where the table has one, else "cuda" for any GPU; "cpu" for the interpreter.
    Compiling offline for a GPU counts as that GPU."""
    device = torch.device(device)
    if _offline.target is not None:
        arch = f"sm_{_offline.target.arch}"
    elif device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        arch = f"sm_{major}{minor}"
    else:
        return configs[device.type]
    return configs.get(arch, configs["cuda"])


def _mode(device):
    if _offline.target is not None:
        # its own JITFunctions: their per-device caches hold the stand-in target, which a
        # real launch in this process must never pick up
        return ("offline", _offline.target.backend, _offline.target.arch, _offline.target.warp_size)
    return "interpret" if device.type == "cpu" else "compile"


_namespaces = {}
_namespaces_lock = threading.Lock()


def _namespace(module_globals, mode):
    """The defining module's namespace with every `lazy_jit` function built for `mode`
    ("interpret", "compile", or an offline target's key), made once per module and mode."""
    key = (module_globals["__name__"], mode)
    with _namespaces_lock:
        namespace = _namespaces.get(key)
        if namespace is None:
            if mode == "interpret":
                from triton.runtime.interpreter import InterpretedFunction as wrap
            else:
                from triton.runtime.jit import JITFunction as wrap
            namespace = dict(module_globals)
            for name, obj in module_globals.items():
                if isinstance(obj, LazyKernel):
                    fn = obj.fn
                    copy = types.FunctionType(
                        fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__
                    )
                    _carry_function_attributes(fn, copy)
                    namespace[name] = wrap(copy)
            _namespaces[key] = namespace
    return namespace


def _carry_function_attributes(fn, copy):
    """Gives the rebuilt function everything `types.FunctionType` leaves behind. The
    annotations above all: Triton finds a kernel's `tl.constexpr` parameters in them, and a
    copy without them compiles `BLOCK`, `GRAD_CODE`... as runtime values — which the
    interpreter runs and the compiler rejects (the first H200 run, 2026-12-04)."""
    copy.__qualname__, copy.__module__ = fn.__qualname__, fn.__module__
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__annotations__ = dict(fn.__annotations__)
    copy.__doc__ = fn.__doc__
    copy.__dict__.update(fn.__dict__)


def lazy_jit(fn):
    """Decorator: a Triton kernel or jit helper compiled on first launch (see `LazyKernel`)."""
    return LazyKernel(fn)


def chunk_rows(numels, chunk):
    """int64 [n_chunks, 2]: (tensor index, chunk index within the tensor) for each program.
    Empty tensors get no row."""
    numels = torch.as_tensor(numels, dtype=torch.int64)
    per_tensor = (numels + (chunk - 1)) // chunk
    total = int(per_tensor.sum())
    tensor_index = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int64), per_tensor)
    first = torch.cumsum(per_tensor, 0) - per_tensor
    chunk_index = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(first, per_tensor)
    return torch.stack([tensor_index, chunk_index], dim=1)


class DeviceTable:
    """An int64 table built on the host and copied to `device` once (pinned, non-blocking: no
    host sync), ready for any stream: `get()` orders a use on another stream after the copy."""

    def __init__(self, table, device):
        device = torch.device(device)
        self.event = self.stream = None
        if device.type == "cuda":
            with device_guard(device):
                # torch's host allocator keeps the pinned buffer alive until the copy completes
                table = table.pin_memory().to(device, non_blocking=True)
                self.stream = torch.cuda.current_stream(device)
                self.event = torch.cuda.Event()
                self.event.record(self.stream)
        self.table, self.device = table, device
        self.nbytes = table.numel() * table.element_size()

    def get(self):
        """The table, usable on the device's current stream (call under its device guard)."""
        if self.event is not None:
            current = torch.cuda.current_stream(self.device)
            if current != self.stream:
                # built on another stream: order its copy before this use, and tell the
                # allocator this stream uses the table too (no host sync either way)
                current.wait_event(self.event)
                self.table.record_stream(current)
        return self.table


class TableCache:
    """Device-resident int64 tables keyed by everything they encode (addresses, sizes,
    chunking), so a repeated step reuses them with no host-to-device copy at all; a key that
    matches is exactly the table that would be built, so an entry is never stale. LRU,
    bounded in entries and bytes (a 1G-element tensor needs a ~4 MB table)."""

    def __init__(self, max_entries=256, max_bytes=64 << 20):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries = collections.OrderedDict()  # key -> DeviceTable
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key, build, device):
        """The DeviceTable for `key` on `device`, built by `build()` (on the host) and copied
        there on a miss, on `device`'s current stream."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry
        with device_guard(device):
            entry = DeviceTable(build(), device)
        with self._lock:
            if key not in self._entries:
                self._entries[key] = entry
                self._bytes += entry.nbytes
            while self._entries and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
                self._bytes -= self._entries.popitem(last=False)[1].nbytes
        return entry

    def clear(self):
        with self._lock:
            self._entries.clear()
            self._bytes = 0


def scalar_tensor_arg(value, name, device, dtypes=None):
    """Checks a 1-element device tensor argument (grad_scale, found_inf, lr)."""
    if value.numel() != 1:
        raise ValueError(f"{name} must have exactly one element, got shape {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(
            f"{name} is on {value.device} but the tensors are on {device}; "
            "pass it on the same device (reading it on the host would sync)"
        )
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(f"{name} must be one of {sorted(str(d) for d in dtypes)}, got {value.dtype}")
    return value


def is_aligned(ptr, nbytes=16):
    return ptr % nbytes == 0
