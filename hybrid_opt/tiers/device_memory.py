"""Where the device tier's state lives on a CPU-only host: one memfd arena per set of subgroups
laid out together, each of their tensors in a page-aligned region of its own.

Two things follow, which torch.zeros would not give: state_dict() maps a param's pieces of
several subgroups side by side as one tensor (mapped.py: a checkpoint copies nothing), and a
subgroup that leaves the tier gives its pages back at once (a hole punched in the arena), as
a tensor of its own would. Its pages are allocated on first touch, as torch.zeros' are.
Before a hole is punched, every state_dict() tensor still mapping those pages takes a copy of
its own (HeldViews): it keeps the values it had.
"""

from __future__ import annotations

from hybrid_opt.mapped import HeldViews, Piece
from hybrid_opt.populate import punch_hole
from hybrid_opt.shm import PAGE, ArenaLayout, SharedArena, address
from hybrid_opt.state.state_format import stored_numel


class CpuStateArena:
    """The state tensors of `kinds` ([(subgroup, {name: dtype})], DeviceTier's) in one arena."""

    def __init__(self, kinds: list):
        lay = ArenaLayout()
        self._regions: dict = {}  # (subgroup index, name) -> (byte offset, numel, dtype)
        for sg, tensors in kinds:
            for name, dtype in tensors.items():
                n = stored_numel(name, sg.numel)
                off = lay.add(f"{sg.index}.{name}", n * dtype.itemsize, PAGE)
                self._regions[(sg.index, name)] = (off, n, dtype)
        self.arena = SharedArena(lay.nbytes, "hybrid_opt-device", prefault=False)
        self.held = HeldViews()
        self._live = {index for index, _ in self._regions}

    def tensors(self, index: int) -> dict:
        """{name: a zeroed tensor} of subgroup `index`, views into the arena."""
        return {
            name: self.arena.tensor(off, n, dt)
            for (i, name), (off, n, dt) in self._regions.items()
            if i == index
        }

    def piece(self, index: int, name: str, tensor, a: int, b: int) -> Piece | None:
        """Elements [a, b) of subgroup `index`'s tensor `name` as a file piece (mapped.py), or
        None where `tensor`, the tier's tensor of that name now, is not the arena's (a running
        max added by a move is a tensor of its own)."""
        region = self._regions.get((index, name))
        if region is None or self.arena.closed:
            return None
        off, _, dtype = region
        if tensor.data_ptr() != address(self.arena.mm) + off:
            return None
        return Piece(
            self.arena.fd, off + a * dtype.itemsize, (b - a) * dtype.itemsize, held=self.held, key=index
        )

    def release(self, index: int) -> None:
        """Subgroup `index` left the tier: held tensors over it take copies of their own, then
        its pages go back to the system (the arena itself when it was the last)."""
        self.held.release([index])
        self._live.discard(index)
        if not self._live:
            self.arena.close()
            return
        for (i, _), (off, n, dt) in self._regions.items():
            if i == index:
                # whole pages only: a region starts on one and its tail page is its own
                punch_hole(self.arena.fd, off, -(-n * dt.itemsize // PAGE) * PAGE)

    def close(self) -> None:
        self.held.release_all()
        self.arena.close()

    def __del__(self):  # a tier collected without close(): its descriptor goes too
        try:
            self.close()
        except Exception:
            pass


def cpu_state_arena(kinds: list) -> CpuStateArena | None:
    """The arena of `kinds`' CPU subgroups, or None where they are on an accelerator."""
    kinds = [(sg, t) for sg, t in kinds if sg.device.type == "cpu"]
    return CpuStateArena(kinds) if kinds else None
