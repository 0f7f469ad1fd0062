"""Rank script: trains the random histories named on the command line (their seeds; drawn by
tests/zero_histories.py) with HybridAdamW / HybridAdam(process_group=WORLD), and saves each one's
params after every step and its skipped steps (any error: its message, so that one history's
failure does not hide the others')."""

import os
import traceback
import warnings

import common as C
import zero_histories as ZH

from hybrid_opt import HybridAdam, HybridAdamW
from hybrid_opt.distributed import zero
from hybrid_opt.distributed.zero import BUCKET_NUMEL


def run(name: str, rank: int, world: int, tmp: str) -> dict:
    mode, seed = name.split(":")  # "process_group:7", "fsdp2:7"
    history = ZH.draw(int(seed), mode)
    zero.BUCKET_NUMEL = 64 if history.small_buckets else BUCKET_NUMEL
    nvme = os.path.join(tmp, f"{name}-rank{rank}")
    os.makedirs(nvme)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the small placements' "the plan has N %"
            return ZH.train(history, HybridAdamW if history.adamw else HybridAdam, rank=rank, nvme_path=nvme)
    except Exception:
        return {"error": traceback.format_exc()}


def main():
    C.rank_main(run)


if __name__ == "__main__":
    main()
