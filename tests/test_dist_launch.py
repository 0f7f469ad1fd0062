"""The launch harness itself (tests/dist_launch.py): launches that run at the same time as
other launches on one machine (pytest-xdist, two CI jobs) never collide on a port, and leave
no torchrun log directory in /tmp."""

import glob
import os
import socket
import tempfile

import dist_launch
import pytest


def _gloo() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


pytestmark = pytest.mark.skipif(
    not _gloo(), reason="torch.distributed with the gloo backend is not available"
)


def test_launches_survive_a_port_taken_before_torchrun_binds_it(tmp_path, monkeypatch):
    """free_port() returns a port another process holds, as a concurrent launch may take the
    one picked in advance before torchrun binds it. A one-node launch lets its store bind a
    port of its own; a several-node launch, which needs a shared port, sees node 0's store
    fail to bind, stops the other nodes and runs again on another port. The one-node launch's
    agent logs under its own folder."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        real = dist_launch.free_port
        handed = []

        def taken_first():
            handed.append(real() if handed else taken)
            return handed[-1]

        monkeypatch.setattr(dist_launch, "free_port", taken_first)
        elastic = set(glob.glob(os.path.join(tempfile.gettempdir(), "torchelastic_*")))
        ranks = dist_launch.launch("ping.py", str(tmp_path / "one"), timeout_s=60)
        assert [r["total"] for r in ranks] == [3.0, 3.0]
        # torchrun's agent logs under the launch's own folder (--log-dir), not in a new
        # /tmp/torchelastic_* that nothing removes, one per launch
        assert set(glob.glob(os.path.join(tempfile.gettempdir(), "torchelastic_*"))) <= elastic
        assert os.path.isdir(tmp_path / "one" / "torchelastic")
        handed.clear()
        ranks = dist_launch.launch_nodes("ping.py", str(tmp_path / "two"), timeout_s=90)
        assert [r["total"] for r in ranks] == [3.0, 3.0]
        assert handed[0] == taken and len(handed) == 2  # one launch lost its port, one retry
