"""`hybrid-opt` command line: `demo` (the main job) and `plan` (the capacity planner)."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {
        "demo": "train a small GPT over all three tiers next to torch.optim.AdamW",
        "plan": "predict the best placement, memory per tier and step time for a model "
        "on a machine (cost model)",
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: hybrid-opt COMMAND [options]\n\ncommands:")
        for name, what in commands.items():
            print(f"  {name:8s} {what}")
        return 0 if (not argv or argv[0] in ("-h", "--help")) else 2
    if argv[0] == "demo":
        from hybrid_opt.demo import main as demo

        return demo(argv[1:])
    if argv[0] == "plan":
        from hybrid_opt.placement.plan_report import main as plan

        return plan(argv[1:])
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
