"""The trainer's own descriptors of a host tier's nvme files, open for the tier's lifetime.

Opened once, never again by path: the trainer's reads and writes go through them, and every worker
inherits them, so a file removed from outside stays one file for the optimizer's life (`check`
warns once). Many are numbered past select()'s FD_SETSIZE so the process's later descriptors stay
below it. Design notes: docs/internals.md."""

from __future__ import annotations

import errno
import fcntl
import os
import warnings

from hybrid_opt import forking
from hybrid_opt.worker.protocol import FD_SETSIZE  # select()'s bound on descriptor numbers

MANY = 256  # files from which they are numbered past it


class NvmeFiles:
    """{subgroup: its file's descriptor}, for a SwapDir's files."""

    def __init__(self, swap):
        self.swap = swap
        self._fds: dict = {}
        self._gone: set = set()  # files found removed or replaced (warned once)
        self._high = False  # the files are numbered from FD_SETSIZE up (reserve)
        forking.let_go_in_child(self)

    def reserve(self, n: int) -> None:
        """Room for `n` more open files: the soft RLIMIT_NOFILE raised towards the hard one
        where it is short (a 7B-param model's state on nvme is ~1,700 files at the default
        subgroup size, and the soft limit is often 1,024); where the hard one is short too, an
        error that says so before any file is made."""
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        try:
            fds: list[int] | range = [int(fd) for fd in os.listdir("/proc/self/fd")]
        except OSError:
            fds = range(64)
        now = len(fds)
        need = now + n + 256  # and the worker's pipes, the arena's, torch's own
        self._high = n >= MANY
        if self._high:  # numbered from FD_SETSIZE up, past what is open there (another tier's)
            need = max(need, max(FD_SETSIZE, max(fds) + 1) + n + 256)
        if soft == resource.RLIM_INFINITY or need <= soft:
            return
        if hard != resource.RLIM_INFINITY and now + n + 32 > hard:  # the files themselves do not fit
            raise OSError(
                errno.EMFILE,
                f"hybrid_opt nvme tier: {n} state files (one per nvme subgroup) "
                f"need about {need} open files, but the limit is {hard} (hard; "
                f"`ulimit -Hn`): pass a larger subgroup_numel (fewer, larger "
                f"subgroups) or raise the limit",
            )
        try:
            room = need if hard == resource.RLIM_INFINITY else min(need, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (room, hard))
        except (ValueError, OSError):
            pass  # the opens below say what is short, if anything is

    def open(self, sg: int) -> int:
        from cpu_kernels.aio import open_direct

        # the one open of the file: warns (once per process) where it cannot be O_DIRECT
        fd = open_direct(self.swap.file(sg), os.O_RDWR | os.O_CLOEXEC)
        if self._high and fd < FD_SETSIZE:
            try:  # the lowest free number from FD_SETSIZE up: the same open file, flags included
                fd, low = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, FD_SETSIZE), fd
                os.close(low)
            except OSError:  # the limit left no room up there (the hard one is short): stays low
                pass
        self._fds[sg] = fd
        return fd

    def fd(self, sg: int) -> int:
        return self._fds[sg]

    def items(self):
        return self._fds.items()

    def check(self, sg: int) -> None:
        """Warns, once per file, when `sg`'s file is no longer at its path."""
        if sg in self._gone:
            return
        path = self.swap.file(sg)
        try:
            same = os.path.samestat(os.stat(path), os.fstat(self._fds[sg]))
        except FileNotFoundError:
            same = False
        if not same:
            self._gone.add(sg)
            warnings.warn(
                f"nvme state file {path} (subgroup {sg}'s, in this optimizer's nvme tier under "
                f"nvme_path {self.swap.root}) was removed or replaced from outside this process "
                f"(a tmp cleaner such as systemd-tmpfiles or tmpreaper?). Its state is still read "
                f"and written through the descriptors the optimizer holds open (a restarted worker "
                f"inherits them too), so nothing is lost yet; but a new optimizer or a restarted "
                f"program cannot open it, and its disk space is freed only at close(). Save a "
                f"checkpoint now (state_dict()) and keep nvme_path out of tmp cleaners",
                RuntimeWarning,
                stacklevel=2,
            )

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def let_go(self) -> None:
        """In a forked child (forking.py): its copies of the descriptors closed, so the files'
        disk space is freed when the trainer closes them, whoever lives on."""
        self.close()


class FileSlots:
    """nvme: which of each subgroup's two file slots holds its committed state, and the CRC32C
    of each slot (what a read is verified against)."""

    def __init__(self, ids: list):
        """`ids`: the tier's subgroup ids (HostTier's)."""
        self._committed = dict.fromkeys(ids, 0)
        self._crc = {sg: [0, 0] for sg in ids}

    @property
    def committed(self) -> dict:
        """{subgroup id: the committed slot of its file} (a copy)."""
        return dict(self._committed)

    def slot(self, sg: int) -> int:
        return self._committed[sg]

    def crc(self, sg: int, slot: int) -> int:
        return self._crc[sg][slot]

    def note_crc(self, sg: int, slot: int, crc: int) -> None:
        """The CRC of what `slot` holds now (its committed slot stays as it is)."""
        self._crc[sg][slot] = crc

    def commit(self, sg: int, slot: int, crc: int) -> None:
        """`slot` (holding data of CRC `crc`) is the subgroup's committed slot from now on."""
        self._crc[sg][slot] = crc
        self._committed[sg] = slot
