"""Markdown tables from ``op_bench.csv`` and ``train_bench.csv`` (the benchmarks' output folder).

    python benchmarks/report.py RESULTS_DIR      # prints, and writes RESULTS_DIR/summary.md

Ratios are taken only between rows of the same run. ``time ratio`` is the fused op's time over
the peer's (below 1: the fused op is faster); a peer whose correctness check failed has no time.
"""

from __future__ import annotations

import csv
import os
import sys
from collections import defaultdict


def _read(path):
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return list(csv.DictReader(fh))


def op_tables(rows) -> list[str]:
    if not rows:
        return []
    by_shape = defaultdict(dict)
    for r in rows:
        by_shape[(r["scale"], int(r["N"]), int(r["H"]))][r["variant"]] = r
    out = [
        "| scale | N | H | fused fwd / bwd / both ms | fwd GB/s (x copy) | bwd GB/s (x copy) | both: fused / eager | / compiled | / fla | / liger |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (scale, n, h), v in by_shape.items():
        t = v.get("triton", {})
        if t.get("status") != "ok":
            out.append(f"| {scale} | {n} | {h} | {t.get('status', 'missing')} {t.get('note', '')} | | | | | | |")
            continue

        def ratio(peer):
            p = v.get(peer)
            if p is None:
                return "-"
            if p["status"] != "ok":
                return p["status"]
            return f"{float(t['both_ms']) / float(p['both_ms']):.2f} ({float(p['both_ms']):.2f} ms)"

        out.append(
            f"| {scale} | {n} | {h} | {float(t['fwd_ms']):.3f} / {float(t['bwd_ms']):.3f} / {float(t['both_ms']):.3f} "
            f"| {t['fwd_GBps']} ({t['fwd_frac_copy']}) | {t['bwd_GBps']} ({t['bwd_frac_copy']}) "
            f"| {ratio('eager')} | {ratio('compiled')} | {ratio('fla')} | {ratio('liger')} |"
        )
    out += ["", "Forward / backward ms of every variant (status, relative errors vs float64):", "",
            "| scale | N | H | variant | status | fwd ms | bwd ms | both ms | fwd x copy | err out / dsrc / dq / dg |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['scale']} | {r['N']} | {r['H']} | {r['variant']} | {r['status']} | {r['fwd_ms']} | {r['bwd_ms']} | {r['both_ms']} "
            f"| {r['fwd_frac_copy']} | {r['err_out']} / {r['err_dsrc']} / {r['err_dq']} / {r['err_dg']} |"
        )
    return out


def train_tables(rows) -> list[str]:
    if not rows:
        return []
    out = [
        "| scale | variant | batch x seq | tokens/s | vs prenorm | MFU (989 / measured peak) | peak GiB | mem vs prenorm | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['scale']} | {r['variant']} | {r['batch']}x{r['seq']} | {r['tokens_per_s']} | {r['ratio_vs_prenorm']} "
            f"| {r['mfu_datasheet']} / {r['mfu_measured']} | {r['peak_mem_GiB']} | {r['mem_ratio_vs_prenorm']} | {r['status']} {r['note']} |"
        )
    return out


def main(argv=None):
    folder = (argv or sys.argv[1:] or ["."])[0]
    lines = op_tables(_read(os.path.join(folder, "op_bench.csv")))
    lines += [""] + train_tables(_read(os.path.join(folder, "train_bench.csv")))
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(folder, "summary.md"), "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
