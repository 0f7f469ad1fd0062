"""Issue #21's targets, read from a bench_peers.py JSON: the ranks' host arenas and nvme files
against one process's, the whole state on nvme against 2 slots x its bytes, process_group's PSS
per rank against DeepSpeed ZeRO-2's, and each HybridAdamW row's iteration against its DeepSpeed
counterpart's. Prints one markdown line per target with the figures and whether it is met.

    python benchmarks/peers_targets.py bench_out/peers.json [PARAMS]   (default: bench_peers' model)
"""

from __future__ import annotations

import json
import sys

MIB = 2**20
STATE_BYTES = 12  # fp32 master and two moments, per param


def _row(records, config, ranks, impl="HybridAdamW"):
    for r in records:
        if r["impl"] == impl and r["config"] == config and r["ranks"] == ranks and not r["skipped"]:
            return r
    return None


def _sum(r, key):
    return sum(a[key] for a in r["allocated"])


def targets(records: list, params: int) -> list:
    out = []

    def say(what, value, limit, unit="MiB", scale=MIB):
        if value is None or limit is None:
            out.append(f"- {what}: not measured")
            return
        out.append(
            f"- {what}: {value / scale:,.1f} vs <= {limit / scale:,.1f} {unit} "
            f"({value / limit:.2f}x of the limit) — {'met' if value <= limit else 'NOT met'}"
        )

    for mode in ("process_group", "FSDP2"):
        one, two = (
            _row(records, f"{mode}, nvme_fraction 0.5", 1),
            _row(records, f"{mode}, nvme_fraction 0.5", 2),
        )
        if one and two:
            say(
                f"{mode}, nvme 0.5: nvme files of 2 ranks vs 1.05x one process's",
                sum(two["nvme_bytes"]),
                1.05 * sum(one["nvme_bytes"]),
            )
        one, two = _row(records, mode, 1), _row(records, mode, 2)
        if one and two:
            say(
                f"{mode}, offload 1.0: host arenas of 2 ranks vs 1.1x one process's + one rank's staging "
                f"(32 MiB)",
                _sum(two, "host"),
                1.1 * _sum(one, "host") + 32 * MIB,
            )
        full = _row(records, f"{mode}, nvme_fraction 1.0", 2)
        if full:
            say(
                f"{mode}, nvme 1.0: files of 2 ranks vs 1.05 x 2 slots x state bytes",
                sum(full["nvme_bytes"]),
                1.05 * 2 * STATE_BYTES * params,
            )
    ds2 = _row(records, "ZeRO-2 + CPU optimizer offload", 2, impl="DeepSpeed")
    for config, factor in (
        ("process_group", 1.25),
        ('process_group, rollback="inverse", release_grads=True', 1.0),
    ):
        r = _row(records, config, 2)
        say(
            f"{config}: PSS per rank vs {factor}x DeepSpeed ZeRO-2 + CPU offload's",
            max(r["pss"]) if r else None,
            factor * max(ds2["pss"]) if ds2 else None,
        )
    for ours, theirs in (
        ("process_group", "ZeRO-2 + CPU optimizer offload"),
        ("FSDP2", "ZeRO-3 + CPU optimizer offload"),
        ("process_group, nvme_fraction 1.0", "ZeRO-3 + nvme optimizer offload"),
        ("FSDP2, nvme_fraction 1.0", "ZeRO-3 + nvme optimizer offload"),
    ):
        a, b = _row(records, ours, 2), _row(records, theirs, 2, impl="DeepSpeed")
        if a and b:
            out.append(
                f"- {ours} vs DeepSpeed {theirs}, iteration: {a['median']:,.0f} vs {b['median']:,.0f} ms "
                f"({a['median'] / b['median']:.2f}x) — {'met' if a['median'] < b['median'] else 'NOT met'}"
            )
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        records = json.load(f)  # bench_peers.py --json: one record per row and rank count
    params = int(argv[1]) if len(argv) > 1 else 23_108_608  # the default model's
    print("\n".join(targets(records, params)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
