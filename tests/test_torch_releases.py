"""What differs between the torch releases the GPU CI matrix installs (2.4 on; pyproject: torch >= 2.4).

DTensor parameters (FSDP2) and process_group= need torch.distributed.tensor's public DTensor (2.5 on;
tested from 2.6, where fully_shard is public too). An older torch keeps DTensor under
torch.distributed._tensor, which the optimizer does not read: it refuses both with the release
that has them, rather than step a local shard as a whole param. The other features a later torch
added (named parameters, Adam's decoupled_weight_decay) follow the installed torch, as
torch.optim's classes do; the tests that compare with them are skipped on an older torch
(tests/helpers.py says which).

A path only a GPU takes meets an older torch only on a GPU runner: each torch name the code spells
must exist in the installed torch, or be listed with the release that added it.
"""

import pytest
import torch
from helpers import skip_unless

from hybrid_opt import HybridAdamW
from hybrid_opt.distributed.local_shards import has_public_dtensor, is_pre_public_dtensor


def test_the_version_rule_matches_what_torch_has():
    import torch.distributed.tensor

    assert has_public_dtensor() == hasattr(torch.distributed.tensor, "DTensor")
    assert not is_pre_public_dtensor(torch.zeros(2))


@skip_unless(
    not has_public_dtensor(), f"torch {torch.__version__} has a public DTensor (the FSDP2 tests use it)"
)
def test_an_older_torch_s_dtensor_and_process_group_are_refused_naming_the_release(tmp_path):
    import torch.distributed as dist
    from torch.distributed._tensor import DTensor, Shard
    from torch.distributed.device_mesh import DeviceMesh

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        p = torch.nn.Parameter(DTensor.from_local(torch.zeros(8), mesh, [Shard(0)]))
        assert is_pre_public_dtensor(p)
        with pytest.raises(ValueError, match=r"DTensor parameters \(FSDP2\) from torch 2\.6.*Upgrade torch"):
            HybridAdamW([p], offload_fraction=0.0)
        with pytest.raises(RuntimeError, match=r"process_group= needs torch >= 2\.5.*Upgrade torch"):
            HybridAdamW([torch.nn.Parameter(torch.zeros(8))], process_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


# ================================================ every torch name the code spells, in this torch
# The suite runs each path it can on the CPU; a path that only a GPU takes (the device tier's
# launchers, gpu_check's benchmarks) meets an older torch only on a GPU runner. So each torch name
# the package, the kernels and the benchmarks spell out (`torch.a.b`, `from torch.a import b`, an
# alias of either) must exist in the installed torch, unless it is listed here with the release that
# added it and the path that needs it is refused or skipped below that release.
NAMES_ADDED_LATER = {
    # the public DTensor: the optimizer refuses FSDP2 params and process_group= without it
    "torch.distributed.tensor.DTensor": (2, 5),
    "torch.distributed.tensor.Replicate": (2, 5),
    "torch.distributed.tensor.Shard": (2, 5),
    "torch.distributed.tensor._dtensor_spec.DTensorSpec": (2, 5),
    "torch.distributed.tensor._dtensor_spec.TensorMeta": (2, 5),
    "torch.distributed.tensor._utils.compute_local_shape_and_global_offset": (2, 5),
    # FSDP2's public name: the benchmarks' FSDP2 rows (documented from 2.6)
    "torch.distributed.fsdp.fully_shard": (2, 6),
}
SPELLED_IN = ("hybrid_opt", "gpu_kernels", "cpu_kernels", "benchmarks")


def _torch_names(tree) -> set:
    """The dotted torch names a module's syntax tree spells, aliases followed (scopes ignored: an
    alias anywhere in the module counts everywhere, which can only add names)."""
    import ast

    from ownership import _expr as spelled  # the ownership ratchet's dotted-name reader

    aliases, names = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    names.add(a.name)
                    aliases[a.asname or "torch"] = a.name if a.asname else "torch"
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "torch"
        ):
            for a in node.names:
                names.add(f"{node.module}.{a.name}")
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            head, _, rest = spelled(node).partition(".")  # "<expr>" where no name starts it
            if head in aliases:
                names.add(f"{aliases[head]}.{rest}")
    return names


def _resolves(name: str) -> bool:
    import importlib

    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 2):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                return False
    return True


def _spelled_names() -> dict:
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    where: dict = {}
    for folder in SPELLED_IN:
        for path in sorted((root / folder).rglob("*.py")):
            for name in _torch_names(ast.parse(path.read_text(), str(path))):
                where.setdefault(name, []).append(str(path.relative_to(root)))
    return where


def test_every_torch_name_the_code_spells_exists_in_this_torch_or_is_listed_with_its_release():
    from helpers import TORCH, TORCH_VERSION

    where = _spelled_names()
    assert len(where) > 100, "the scan found too few names: is it reading the sources?"
    missing = {name: files for name, files in where.items() if not _resolves(name)}
    unlisted = {name: files for name, files in missing.items() if name not in NAMES_ADDED_LATER}
    assert not unlisted, (
        f"torch {TORCH} has no {sorted(unlisted)} (spelled in {unlisted}): guard the path that needs it "
        "and list it in NAMES_ADDED_LATER with the release that added it"
    )
    stale = [n for n, since in NAMES_ADDED_LATER.items() if n in missing and TORCH_VERSION >= since]
    assert not stale, f"torch {TORCH} should have {stale}: the release listed for them is wrong"
    unused = sorted(set(NAMES_ADDED_LATER) - set(where))
    assert not unused, f"{unused} are spelled nowhere now: take them out of NAMES_ADDED_LATER"


def test_the_name_scan_follows_aliases_and_imports():
    import ast

    tree = ast.parse(
        "import torch\nimport torch.distributed as dist\nfrom torch.cuda import Stream as S\n"
        "def f():\n    torch.cuda.Event(enable_timing=True); dist.all_reduce(x); S.wait_stream\n"
        "    other.torch.thing\n"
    )
    assert _torch_names(tree) == {
        "torch",
        "torch.distributed",
        "torch.cuda.Stream",
        "torch.cuda",
        "torch.cuda.Event",
        "torch.distributed.all_reduce",
        "torch.cuda.Stream.wait_stream",
    }
    assert _resolves("torch.cuda.Event") and _resolves("torch.distributed.fsdp")
    assert not _resolves("torch.cuda.NoSuchThing") and not _resolves("torch.no_such_module.x")
