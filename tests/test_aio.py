"""cpu_kernels.aio: the async O_DIRECT file engine and CRC32C, without torch.

Round trips at every size class (one chunk, many chunks, odd page counts), concurrency,
O_DIRECT really in use, the buffered fallback and its single warning, alignment errors,
a full disk (RLIMIT_FSIZE in a child, SIGXFSZ ignored: EFBIG), short reads, bounded waits
and closes, checksums, and no thread left behind.
"""

import errno
import fcntl
import json
import mmap
import os
import pathlib
import pickle
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
from helpers import fs_type

from cpu_kernels import aio, aio_buffers
from cpu_kernels.aio import (
    ALIGNMENT,
    AioAlignmentError,
    AioEngine,
    AioError,
    align_up,
    aligned_buffer,
    checksum,
    checksum_combine,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = ALIGNMENT
MiB = 1 << 20


@pytest.fixture
def disk_dir(tmp_path):
    """A directory on a real disk filesystem (tmp_path unless /tmp is tmpfs)."""
    if fs_type(str(tmp_path)) not in ("tmpfs", "ramfs"):
        yield tmp_path
        return
    os.makedirs(os.path.join(REPO, "bench_out"), exist_ok=True)  # git-ignored
    path = tempfile.mkdtemp(prefix="test_aio_", dir=os.path.join(REPO, "bench_out"))
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def engine():
    eng = AioEngine(threads=4, queue_depth=64, chunk_bytes=MiB)
    yield eng
    eng.close()


def _random_buffer(nbytes: int, seed: int) -> mmap.mmap:
    buf = aligned_buffer(nbytes)
    buf[:] = random.Random(seed).randbytes(nbytes)
    return buf


def _run_child(code: str, timeout=60) -> dict:
    """Runs code in a fresh interpreter (clean warning state, own rlimits); its last stdout
    line is JSON."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------- round trips

# one page, odd page counts, exactly one chunk, and many chunks with an odd tail
SIZES = [PAGE, 3 * PAGE, 255 * PAGE, MiB, 5 * MiB + 7 * PAGE]


@pytest.mark.parametrize("nbytes", SIZES)
def test_write_then_read_round_trips_bytes_and_checksum(engine, disk_dir, nbytes):
    offset = 3 * PAGE  # not chunk-aligned: chunks straddle the file's MiB boundaries
    src, dst = _random_buffer(nbytes, nbytes), aligned_buffer(nbytes)
    fd = engine.open(disk_dir / "f.bin", "w+")
    try:
        w = engine.write(fd, src, nbytes, offset, checksum=True)
        r = engine.read(fd, dst, nbytes, offset, checksum=True)
    finally:
        engine.close_fd(fd)
    assert (w.bytes_done, r.bytes_done) == (nbytes, nbytes)
    assert dst[:] == src[:]
    assert w.crc == r.crc == checksum(src)
    assert os.path.getsize(disk_dir / "f.bin") == offset + nbytes


def test_set_notify_counts_each_finished_request_on_an_eventfd(engine, disk_dir):
    """What the nvme worker sleeps on between requests: every request that finishes (a
    multi-chunk one once, when its last chunk lands) adds 1 to the eventfd, and select()
    sees it readable; -1 stops it."""
    if not hasattr(os, "eventfd"):
        pytest.skip("no eventfd on this platform")
    import select

    efd = os.eventfd(0, os.EFD_NONBLOCK)
    fd = engine.open(disk_dir / "n.bin", "w+")
    try:
        engine.set_notify(efd)
        nbytes = 3 * MiB + PAGE  # 4 chunks of the fixture's 1 MiB: one wake-up all the same
        src, dst = _random_buffer(nbytes, 7), aligned_buffer(nbytes)
        ids = [engine.submit_write(fd, src, nbytes, 0), engine.submit_write(fd, src, PAGE, nbytes)]
        engine.wait(ids)
        assert select.select([efd], [], [], 5.0)[0] == [efd]
        assert os.eventfd_read(efd) == 2
        rid = engine.submit_read(fd, dst, nbytes, 0)
        assert select.select([efd], [], [], 5.0)[0] == [efd]  # before wait(): it says when
        assert engine.done(rid)
        engine.wait([rid])
        assert os.eventfd_read(efd) == 1
        engine.set_notify(-1)
        engine.read(fd, dst, PAGE, 0)
        with pytest.raises(BlockingIOError):
            os.eventfd_read(efd)
        with pytest.raises(ValueError, match="fd must be -1"):
            engine.set_notify(-2)
    finally:
        engine.close_fd(fd)
        os.close(efd)


def test_int_addresses_and_buffer_objects_are_both_accepted(engine, disk_dir):
    import ctypes

    src = _random_buffer(2 * PAGE, 1)
    dst = aligned_buffer(2 * PAGE)
    holder = ctypes.c_char.from_buffer(dst)  # keeps dst mapped while we use its raw address
    fd = engine.open(disk_dir / "f.bin", "w+")
    engine.write(fd, src)  # whole buffer, offset 0
    engine.read(fd, ctypes.addressof(holder), 2 * PAGE, 0)  # raw address + nbytes
    del holder
    engine.close_fd(fd)
    assert dst[:] == src[:]


def test_many_concurrent_requests_land_at_their_offsets(disk_dir):
    n, size = 96, 16 * PAGE
    src = _random_buffer(n * size, 7)
    dst = aligned_buffer(n * size)
    with AioEngine(threads=4, queue_depth=n, chunk_bytes=4 * PAGE) as eng:
        fd = eng.open(disk_dir / "f.bin", "w+")
        order = list(range(n))
        random.Random(0).shuffle(order)  # submitted out of file order
        views_w = [memoryview(src)[i * size : (i + 1) * size] for i in range(n)]
        ids = [eng.submit_write(fd, views_w[i], size, i * size, checksum=True) for i in order]
        assert eng.outstanding == n
        results = eng.wait(timeout_s=30)  # every outstanding request
        assert [r.id for r in results] == ids and eng.outstanding == 0
        for i, res in zip(order, results):
            assert res.crc == checksum(views_w[i])
        views_w = None
        ids = [eng.submit_read(fd, memoryview(dst)[i * size : (i + 1) * size], size, i * size) for i in order]
        eng.wait(ids, timeout_s=30)
        eng.close_fd(fd)
    assert dst[:] == src[:]


def test_full_queue_refuses_the_next_submit_with_eagain(disk_dir):
    buf = aligned_buffer(PAGE)
    with AioEngine(threads=1, queue_depth=4) as eng:
        fd = eng.open(disk_dir / "f.bin", "w+")
        ids = [eng.submit_write(fd, buf, PAGE, i * PAGE) for i in range(4)]
        with pytest.raises(AioError, match=r"queue is full \(4 requests") as e:
            eng.submit_write(fd, buf, PAGE, 4 * PAGE)
        assert e.value.errno == errno.EAGAIN
        eng.wait(ids, timeout_s=10)
        eng.wait(eng.submit_write(fd, buf, PAGE, 4 * PAGE), timeout_s=10)  # room again
        eng.close_fd(fd)


def test_sync_request_and_zero_byte_request_complete(engine, disk_dir):
    fd = engine.open(disk_dir / "f.bin", "w+")
    buf = aligned_buffer(PAGE)
    ids = [
        engine.submit_write(fd, buf),
        engine.submit_sync(fd),
        engine.submit_write(fd, buf, 0, PAGE, checksum=True),
    ]
    res = engine.wait(ids, timeout_s=10)
    assert [r.op for r in res] == ["write", "fdatasync", "write"]
    assert res[2].bytes_done == 0 and res[2].crc == 0
    engine.close_fd(fd)


# --------------------------------------------------------------------------- O_DIRECT


def test_o_direct_is_used_on_a_disk_filesystem(engine, disk_dir):
    fd = engine.open(disk_dir / "f.bin", "w+")
    try:
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        assert engine.is_direct(fd)
    finally:
        engine.close_fd(fd)
    fd = engine.open(disk_dir / "f.bin", "r", direct=False)
    assert not engine.is_direct(fd)
    engine.close_fd(fd)


FALLBACK_CHILD = """
    import json, os, warnings
    REFUSE = {refuse}
    if REFUSE:  # a filesystem that refuses O_DIRECT, as tmpfs did before Linux 6.6
        real_open = os.open
        def refusing_open(path, flags, *args, **kw):
            if flags & os.O_DIRECT:
                raise OSError(22, "Invalid argument", path)
            return real_open(path, flags, *args, **kw)
        os.open = refusing_open
    from cpu_kernels.aio import AioEngine, aligned_buffer
    d = {dir!r}
    out = {{}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with AioEngine(threads=2) as eng:
            fds = [eng.open(os.path.join(d, f"f{{i}}.bin"), "w+") for i in range(3)]
            out["direct"] = [eng.is_direct(fd) for fd in fds]
            src = aligned_buffer(3 * 4096); src[:] = os.urandom(3 * 4096)
            dst = aligned_buffer(3 * 4096)
            eng.write(fds[0], src); eng.read(fds[0], dst)
            out["round_trip"] = dst[:] == src[:]
            if not any(out["direct"]):  # buffered: no alignment rule to enforce
                eng.write(fds[1], memoryview(src)[1:4000], 3999, 7)
                out["unaligned_ok"] = True
            for fd in fds:
                eng.close_fd(fd)
    for i in range(3):
        os.unlink(os.path.join(d, f"f{{i}}.bin"))
    out["warnings"] = [str(w.message) for w in caught]
    print(json.dumps(out))
"""


def test_refused_o_direct_falls_back_to_buffered_with_one_warning(tmp_path):
    out = _run_child(FALLBACK_CHILD.format(refuse=True, dir=str(tmp_path)))
    assert out["direct"] == [False, False, False]
    assert out["round_trip"] and out["unaligned_ok"]
    assert len(out["warnings"]) == 1, out["warnings"]
    assert "refuses O_DIRECT" in out["warnings"][0] and "f0.bin" in out["warnings"][0]


def test_dev_shm_works_direct_or_buffered_with_one_warning():
    """/dev/shm is tmpfs: before Linux 6.6 it refuses O_DIRECT (one warning, then buffered);
    since 6.6 it accepts it (no warning). Either way the files work."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = f"/dev/shm/hybrid_opt_test_aio_{os.getpid()}"
    os.makedirs(d)
    try:
        out = _run_child(FALLBACK_CHILD.format(refuse=False, dir=d))
    finally:
        os.rmdir(d)
    assert out["round_trip"]
    assert len(set(out["direct"])) == 1
    if out["direct"][0]:
        assert out["warnings"] == []
    else:
        assert len(out["warnings"]) == 1 and "refuses O_DIRECT" in out["warnings"][0]


@pytest.mark.parametrize("case", ["address", "length", "offset"])
def test_misaligned_o_direct_request_raises_a_clear_error(engine, disk_dir, case):
    buf = aligned_buffer(4 * PAGE)
    fd = engine.open(disk_dir / "f.bin", "w+")
    view = memoryview(buf)
    args = {
        "address": (view[1 : PAGE + 1], PAGE, 0),
        "length": (buf, PAGE + 512, 0),
        "offset": (buf, PAGE, 100),
    }[case]
    expect = {
        "address": r"buffer address 0x[0-9a-f]+ is not a multiple of 4096",
        "length": r"4608 bytes is not a multiple of 4096 \(pad to align_up\(nbytes\) = 8192\)",
        "offset": r"offset 100 is not a multiple of 4096",
    }[case]
    for submit in (engine.submit_write, engine.submit_read):
        with pytest.raises(AioAlignmentError, match=expect) as e:
            submit(fd, *args)
        assert isinstance(e.value, ValueError) and isinstance(e.value, OSError)
        assert e.value.errno == errno.EINVAL and str(disk_dir / "f.bin") in str(e.value)
    assert engine.outstanding == 0
    engine.write(fd, buf, PAGE, PAGE)  # the engine is unharmed
    engine.close_fd(fd)
    del args, e  # the traceback holds the sliced view too
    view.release()
    buf.close()  # no export left behind by the refused requests


def test_bad_arguments_are_refused_with_named_causes(engine, disk_dir):
    fd = engine.open(disk_dir / "f.bin", "w+")
    ro = engine.open(disk_dir / "f.bin", "r")
    buf = aligned_buffer(PAGE)
    with pytest.raises(AioError, match=r"not an open descriptor for writing") as e:
        engine.submit_write(ro, buf)
    assert e.value.errno == errno.EBADF
    with pytest.raises(TypeError, match="writable"):
        engine.submit_read(fd, b"\0" * PAGE)  # a read needs somewhere to put the bytes
    with pytest.raises(ValueError, match="exceeds the buffer's 4096 bytes"):
        engine.submit_write(fd, buf, 2 * PAGE)
    with pytest.raises(TypeError, match="nbytes is required"):
        engine.submit_write(fd, 4096)
    with pytest.raises(ValueError, match="not outstanding"):
        engine.wait([12345])
    with pytest.raises(ValueError, match="bounded"):
        engine.wait([], timeout_s=float("inf"))
    for f in (fd, ro):
        engine.close_fd(f)


# ------------------------------------------------------------------------------ faults

EFBIG_CHILD = """
    import json, os, resource, signal
    # exceeding RLIMIT_FSIZE sends SIGXFSZ (default: kill the process); ignored, the write
    # fails with EFBIG instead
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = {limit}
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    from cpu_kernels.aio import AioEngine, AioError, aligned_buffer
    path = {path!r}
    n = 8 << 20
    src = aligned_buffer(n); src[:] = bytes(range(256)) * (n // 256)
    out = {{}}
    with AioEngine(threads=4, chunk_bytes=1 << 20) as eng:
        fd = eng.open(path, "w+")
        try:
            eng.write(fd, src, n, 0)
        except AioError as e:
            out.update(errno=e.errno, message=str(e), bytes_done=e.bytes_done,
                       error_offset=e.error_offset, path=e.filename, nbytes=e.nbytes)
        # what did land is intact and readable
        size = os.path.getsize(path)
        dst = aligned_buffer(n)
        if size:
            eng.read(fd, dst, size, 0)
        out["size"] = size
        out["intact"] = dst[:size] == src[:size]
        eng.close_fd(fd)
    print(json.dumps(out))
"""


@pytest.mark.parametrize("limit", [4 * MiB, 4 * MiB + 2 * PAGE], ids=["chunk_edge", "mid_chunk"])
def test_file_size_limit_reports_efbig_with_path_and_byte_counts(disk_dir, limit):
    path = str(disk_dir / "full.bin")
    out = _run_child(EFBIG_CHILD.format(limit=limit, path=path))
    assert out["errno"] == errno.EFBIG
    assert out["bytes_done"] == limit and out["error_offset"] == limit
    assert out["path"] == path and out["nbytes"] == 8 * MiB
    assert out["message"].startswith(
        f"write of 8388608 bytes at offset 0 to {path} failed at "
        f"offset {limit}: File too large (EFBIG); {limit} bytes "
        f"written"
    ), out["message"]
    assert "RLIMIT_FSIZE" in out["message"]
    assert out["size"] == limit and out["intact"]


def test_short_read_past_end_of_file_is_an_error_with_byte_counts(engine, disk_dir):
    fd = engine.open(disk_dir / "f.bin", "w+")
    engine.write(fd, _random_buffer(3 * PAGE, 3))
    dst = aligned_buffer(2 * MiB)
    with pytest.raises(AioError) as e:
        engine.read(fd, dst, 2 * MiB, 0)  # two chunks: the second reads nothing at all
    err = e.value
    assert err.errno == errno.ENODATA and err.bytes_done == 3 * PAGE
    assert err.error_offset == 3 * PAGE
    assert str(err) == (
        f"read of 2097152 bytes at offset 0 from {disk_dir / 'f.bin'} failed: "
        f"short read, end of file at offset 12288 (ENODATA); 12288 bytes read"
    )
    assert err.results[0].bytes_done == 3 * PAGE and err.failures == [err]
    assert engine.outstanding == 0
    engine.close_fd(fd)


def test_one_failure_in_a_wait_still_consumes_and_reports_every_request(engine, disk_dir):
    fd = engine.open(disk_dir / "f.bin", "w+")
    engine.write(fd, _random_buffer(2 * PAGE, 4))
    a, b = aligned_buffer(PAGE), aligned_buffer(PAGE)
    ids = [engine.submit_read(fd, a, PAGE, 0), engine.submit_read(fd, b, PAGE, 5 * PAGE)]
    with pytest.raises(AioError, match="short read") as e:
        engine.wait(ids, timeout_s=10)
    assert [r.bytes_done for r in e.value.results] == [PAGE, 0]
    assert e.value.request_id == ids[1] and engine.outstanding == 0
    engine.close_fd(fd)


def test_aio_error_pickles_with_its_fields():
    e = AioError(
        errno.ENOSPC,
        "write of 8 bytes ... failed",
        path="/x",
        op="write",
        offset=0,
        nbytes=8,
        bytes_done=4,
        error_offset=4,
        request_id=3,
    )
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is AioError and e2.errno == errno.ENOSPC and str(e2) == str(e)
    assert (e2.filename, e2.bytes_done, e2.error_offset) == ("/x", 4, 4)


# ------------------------------------------------------------- bounded waits and close


def _task_count() -> int:
    return len(os.listdir("/proc/self/task"))


def test_wait_on_a_request_that_never_completes_times_out(tmp_path):
    """A read from a FIFO nobody writes to blocks forever in the kernel; the wait must
    give up on time, the request stays waitable, and close() is bounded too."""
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDWR)  # O_RDWR: the open itself does not wait for a writer
    baseline = _task_count()
    eng = AioEngine(threads=2)
    try:
        eng.register(fd, fifo)
        buf = bytearray(64)
        rid = eng.submit_read(fd, buf, 64, None)
        t0 = time.monotonic()
        with pytest.raises(
            AioError,
            match=r"wait timed out after 0.2 s with 1 of 1 request\(s\) "
            r"unfinished, first: read of 64 bytes at the "
            r"descriptor's position from .*fifo",
        ) as e:
            eng.wait([rid], timeout_s=0.2)
        assert e.value.errno == errno.ETIMEDOUT and 0.2 <= time.monotonic() - t0 < 2.0
        assert not eng.done(rid) and eng.outstanding == 1
        os.write(fd, b"x" * 64)  # now it can finish
        assert eng.wait(rid, timeout_s=10)[0].bytes_done == 64 and buf == b"x" * 64

        rid = eng.submit_read(fd, bytearray(64), 64, None)  # stuck again, and never fed
        with pytest.raises(AioError, match="timed out"):  # by now a thread is inside read()
            eng.wait(rid, timeout_s=0.2)
        t0 = time.monotonic()
        with pytest.warns(RuntimeWarning, match="1 I/O thread.*cancelled"):
            eng.close(timeout_s=0.2)
        assert time.monotonic() - t0 < 3.0
    finally:
        eng.close()
        os.close(fd)
    assert _task_count() == baseline


def test_close_is_idempotent_and_leaves_no_threads(disk_dir):
    baseline = _task_count()
    engines = [AioEngine(threads=t) for t in (1, 3, 8)]
    assert _task_count() == baseline + 12
    buf = _random_buffer(4 * PAGE, 5)
    fd = engines[1].open(disk_dir / "f.bin", "w+")
    engines[1].write(fd, buf)
    rid = engines[1].submit_write(fd, buf)  # outstanding at close: dropped, its export released
    for eng in engines:
        eng.close()
        eng.close()
        assert eng.closed
    assert _task_count() == baseline
    buf.close()  # would raise BufferError if a request still held the buffer
    with pytest.raises(ValueError, match="closed"):
        engines[1].submit_write(fd, aligned_buffer(PAGE))
    with pytest.raises(ValueError, match="closed"):
        engines[1].wait([rid])
    os.close(fd)
    with AioEngine(threads=2) as eng:  # the context manager closes too
        assert _task_count() == baseline + 2
    assert eng.closed and _task_count() == baseline


def test_an_in_flight_buffer_cannot_be_closed_under_the_engine(engine, tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDWR)
    buf = aligned_buffer(PAGE)
    rid = engine.submit_read(fd, buf, 16, None)
    with pytest.raises(BufferError):
        buf.close()  # the engine holds an export until the request is waited for
    os.write(fd, b"y" * 16)
    engine.wait(rid, timeout_s=10)
    buf.close()
    os.close(fd)


def test_close_fd_is_refused_while_requests_on_it_are_outstanding(engine, tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDWR)
    engine.register(fd, fifo)
    rid = engine.submit_read(fd, bytearray(8), 8, None)
    with pytest.raises(AioError, match=r"1 request\(s\) on fd .*fifo.* wait\(\) first"):
        engine.close_fd(fd)
    os.write(fd, b"z" * 8)
    engine.wait(rid, timeout_s=10)
    engine.close_fd(fd)


# --------------------------------------------------------------------------- checksums


def test_checksum_is_crc32c():
    assert checksum(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert checksum(b"") == 0
    assert aio.checksum_impl() in ("vpclmulqdq", "sse4.2", "portable")


# every path this CPU has (the best is the default; tests/test_aio.py lowers it to check the others)
_BEST_CHECKSUM = aio.checksum_impl()
CHECKSUM_IMPLS = [name for name in ("vpclmulqdq", "sse4.2") if aio_buffers._set_checksum_impl(name) == name]
aio_buffers._set_checksum_impl(_BEST_CHECKSUM)


@pytest.fixture(params=CHECKSUM_IMPLS or ["portable"])
def checksum_path(request):
    assert aio_buffers._set_checksum_impl(request.param) == request.param
    yield request.param
    aio_buffers._set_checksum_impl(_BEST_CHECKSUM)


@pytest.mark.parametrize(
    "nbytes", [1, 7, 8, 255, 256, 257, 511, 1280 + 13, 4095, 24576, 24577, 3 * 8192 * 7 + 13, MiB + 3]
)
@pytest.mark.parametrize("offset", [0, 3])
def test_checksum_paths_agree_and_chain(nbytes, offset, checksum_path):
    """Each path gives the tables' CRC at every length (the fold takes whole 256-byte blocks, the
    crc32 instruction the rest) and start address, and chains from any seed."""
    data = random.Random(nbytes).randbytes(nbytes + offset)[offset:]
    c = checksum(data)
    assert c == aio._checksum_portable(data) == checksum(bytearray(data))
    k = nbytes // 3
    assert checksum(data[k:], seed=checksum(data[:k])) == c
    assert checksum_combine(checksum(data[:k]), checksum(data[k:]), nbytes - k) == c


def test_checksum_is_deterministic_and_detects_any_flipped_byte():
    data = bytearray(random.Random(9).randbytes(3 * 8192 * 2 + 100))
    c = checksum(data)
    assert all(checksum(bytes(data)) == c for _ in range(3))
    for pos in [0, 1, 8191, 8192, 24575, 24576, len(data) // 2, len(data) - 1]:
        for bit in (0, 7):
            data[pos] ^= 1 << bit
            assert checksum(data) != c, (pos, bit)
            data[pos] ^= 1 << bit
    assert checksum(data) == c


def test_checksum_accepts_addresses_and_buffer_objects():
    import ctypes

    buf = _random_buffer(3 * PAGE, 11)
    holder = ctypes.c_char.from_buffer(buf)
    assert checksum(ctypes.addressof(holder), 3 * PAGE) == checksum(buf) == checksum(buf[:])
    assert checksum(memoryview(buf)[:PAGE]) == checksum(buf, PAGE)
    del holder


def test_align_up_pads_tails():
    assert [align_up(n) for n in (0, 1, 4096, 4097)] == [0, 4096, 4096, 8192]
    assert align_up(1000, 512) == 1024


def test_an_engine_in_a_forked_child_is_closed_there_and_never_waits(tmp_path):
    """os.fork() copies the engine but not its I/O threads (nor a lock one of them held): the
    child's copy is closed at once (using it raises "closed"), and its exit — the finalizer
    shutting the engine down — does not wait for threads that stayed in the parent (it hung
    there). The parent's engine keeps working."""
    script = textwrap.dedent(f"""
        import os, sys, time
        from cpu_kernels.aio import AioEngine, aligned_buffer
        eng = AioEngine(threads=2)
        fd = eng.open({str(tmp_path / "f")!r}, "w+", direct=False)
        buf = aligned_buffer(4096)
        eng.write(fd, buf, 4096, 0)
        pid = os.fork()
        if pid == 0:
            try:
                eng.write(fd, buf, 4096, 0)
                os._exit(3)  # the child's copy must refuse
            except ValueError as e:
                assert "closed" in str(e)
            sys.exit(0)  # the finalizers run: must not wait for the parent's threads
        deadline = time.monotonic() + 30
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, 9); print("CHILD HUNG"); sys.exit(1)
            time.sleep(0.02)
        eng.write(fd, buf, 4096, 4096)
        eng.close_fd(fd); eng.close()
        print("OK")
    """)
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stdout + out.stderr
