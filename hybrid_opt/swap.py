"""NVMe swap files: a private directory of ours under nvme_path, two slots per subgroup.

A step reads the committed slot and writes the other; the slot map flips only on commit, so
rollback and a crash mid-write never tear committed state. Every slot carries a CRC32C, verified
on read. The directory is ours alone, removed at close(), at exit, or by the worker when the
trainer dies; under torch.distributed each rank sweeps only its own. Design notes:
docs/internals.md."""

from __future__ import annotations

import atexit
import errno
import fcntl
import os
import re
import shutil
import tempfile
import weakref

from hybrid_opt import forking
from hybrid_opt.distributed import node

PREFIX = "hybrid_opt-"
LOCK = ".owner.lock"  # held (flock) by the owning process for the directory's lifetime
_STALE = re.compile(r"^hybrid_opt-(\d+)-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner_alive(path: str, pid: int) -> bool:
    """The owner holds an flock on the lock file while it lives; the lock goes with it, even
    in another pid namespace (a container sharing the disk), where its pid means nothing here."""
    try:
        fd = os.open(os.path.join(path, LOCK), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return _pid_alive(pid)  # no lock file: fall back to the pid
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def sweep_stale(nvme_path: str) -> list[str]:
    """Removes directories of ours whose owning process is gone; returns what it removed."""
    removed: list[str] = []
    try:
        entries = os.listdir(nvme_path)
    except OSError:
        return removed
    for name in entries:
        m = _STALE.match(name)
        path = os.path.join(nvme_path, name)
        if not m or int(m.group(1)) == os.getpid() or _owner_alive(path, int(m.group(1))):
            continue
        try:
            if os.stat(path).st_uid != os.getuid():
                continue  # not ours to remove
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def check_nvme_path(nvme_path) -> str:
    """A clear error, before any training work, for a path that cannot hold swap files."""
    if nvme_path is None:
        raise ValueError("nvme_fraction > 0 needs nvme_path: a directory on a local disk")
    path = os.path.abspath(os.fspath(nvme_path))
    if not os.path.exists(path):
        raise FileNotFoundError(
            errno.ENOENT,
            f"nvme_path {path} does not exist; create it (a directory on a local NVMe disk) or pass another",
            path,
        )
    if not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, f"nvme_path {path} is not a directory", path)
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(
            errno.EACCES,
            f"nvme_path {path} is not writable by this user; pick a directory you can write",
            path,
        )
    return path


def rank_root(nvme_path: str, rank) -> str:
    """Where a rank's swap directories live: `nvme_path` itself when not distributed (rank
    None), else its own `hybrid_opt-rank<R>` beneath it (made 0700 if missing)."""
    if rank is None:
        return nvme_path
    path = os.path.join(nvme_path, f"{PREFIX}rank{int(rank)}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    return check_nvme_path(path)


class SwapDir:
    def __init__(self, nvme_path, rank="auto"):
        """`rank`: the global rank whose directory to use ("auto": node.global_rank(); None:
        not distributed)."""
        root = check_nvme_path(nvme_path)
        root = rank_root(root, node.global_rank() if rank == "auto" else rank)
        self.root = root
        self.swept = sweep_stale(root)
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root)  # mode 0700
        self._lock_fd = os.open(os.path.join(self.path, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        self._finalizer = weakref.finalize(self, _remove, self.path, self._lock_fd, os.getpid())
        atexit.register(self._finalizer)
        forking.let_go_in_child(self)

    def let_go(self) -> None:
        """In a forked child (forking.py): its copy of the lock's descriptor closed (the lock is
        the trainer's: a child holding it would keep a dead trainer's directory from being
        swept), and its finalizer dropped: the directory is the trainer's to remove."""
        if self._finalizer.detach() is not None:
            os.close(self._lock_fd)

    def file(self, sg: int) -> str:
        return os.path.join(self.path, f"sg{sg}.state")

    def create(self, sg: int, nbytes: int) -> None:
        fd = os.open(self.file(sg), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)

    def remove(self) -> None:
        self._finalizer()


def _remove(path: str, lock_fd: int, owner: int) -> None:
    """Removes the directory, in the process that made it only: a child of os.fork()
    inherits the finalizer (and its atexit entry) and would delete its parent's files."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)
    try:
        os.close(lock_fd)  # releases the lock
    except OSError:
        pass
