"""Test set-up shared by every module.

TRITON_INTERPRET is read when `@triton.jit` decorates a kernel, so it must be set before
gpu_kernels is first imported: without a CUDA device the Triton kernels run on CPU tensors
through the interpreter.
"""

import faulthandler
import os
import shutil
import signal
import tempfile

import pytest

# every `gpu` test runs under this limit: pytest-timeout is not a dependency and the GPU
# machine installs nothing, so SIGALRM fails a test that overruns, and faulthandler ends the
# process with every thread's traceback if it is stuck inside a CUDA call, where no Python
# signal handler can run
GPU_TEST_LIMIT_S = 90


def _cuda_available():
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the scheduler's calibration cache: one fresh measurement per test session, never the user's;
# removed when the session ends (pytest_unconfigure) unless the caller named one
_OWN_CACHE_DIR = None
if "HYBRID_OPT_CACHE_DIR" not in os.environ:
    _OWN_CACHE_DIR = os.environ["HYBRID_OPT_CACHE_DIR"] = tempfile.mkdtemp(prefix="hybrid_opt-test-cache-")


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """The tests that collect a background job (the launch-path compile, the q8 quantizers'
    exhaustive proofs) go last, their jobs started now (tests/background_jobs.py): they use the
    cores the rest of the suite leaves idle."""
    import background_jobs

    last = background_jobs.tests_with_jobs(session.items)
    if not last or session.config.option.collectonly:
        return
    session.items[:] = [item for item in session.items if item not in last] + last
    background_jobs.start_in_background(last)


def pytest_sessionfinish(session):
    import background_jobs

    background_jobs.stop()


def pytest_unconfigure(config):
    if _OWN_CACHE_DIR is not None:
        shutil.rmtree(_OWN_CACHE_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def _gpu_time_limit(request):
    if "gpu" not in request.node.keywords:
        yield
        return
    name = request.node.nodeid

    def overran(signum, frame):
        raise TimeoutError(
            f"{name} ran past its {GPU_TEST_LIMIT_S} s limit (tests/conftest.py "
            f"GPU_TEST_LIMIT_S): a wait that never ended, or a far too slow GPU path"
        )

    previous = signal.signal(signal.SIGALRM, overran)
    signal.alarm(GPU_TEST_LIMIT_S)
    faulthandler.dump_traceback_later(GPU_TEST_LIMIT_S + 30, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(params=None)
def simd(request):
    """Runs the test at each SIMD level this CPU offers (cpu_kernels' dispatcher), restoring
    the level in use afterwards."""
    import cpu_kernels as ck

    saved = ck.simd_level()
    ck.set_simd_level(request.param)
    yield request.param
    ck.set_simd_level(saved)


@pytest.fixture
def close_optimizers(monkeypatch):
    """Closes at teardown each HybridAdamW / HybridAdam the test made and left open, for modules
    that build many without a `with` (the collector would warn for each one it frees, and their
    workers would outlive the test until it ran). Not for tests of that warning itself."""
    from hybrid_opt import optimizer

    made = []
    original = optimizer._HybridBase.__init__

    def init(self, *args, **kwargs):
        made.append(self)  # before __init__: one that fails half-way is closed too
        original(self, *args, **kwargs)

    monkeypatch.setattr(optimizer._HybridBase, "__init__", init)
    yield
    for opt in made:
        if not opt.closed:  # (one whose construction failed reads closed: it cleaned up itself)
            opt.close()


@pytest.fixture
def shmem_without_huge_pages(monkeypatch):
    """The path of a kernel whose shared memory takes no 2 MiB pages unasked (its default,
    whatever this host's setting): an arena's background part reserved by fallocate
    (populate.reserve), then populated in the background. Where it takes them, the arena is
    populated whole at construction instead (populate.shmem_takes_huge_pages)."""
    monkeypatch.setenv("HYBRID_OPT_SHMEM_ENABLED", "always within_size advise [never] deny force")


@pytest.fixture
def restore_kernel_threads():
    """cpu_kernels' thread count as it was before the test."""
    import cpu_kernels as ck

    saved = ck.get_num_threads()
    yield
    ck.set_num_threads(saved)


def pytest_generate_tests(metafunc):
    if "simd" in metafunc.fixturenames:
        import cpu_kernels as ck

        metafunc.parametrize("simd", ck.available_simd_levels(), indirect=True)
