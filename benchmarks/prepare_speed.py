"""How fast ``lit-mhar prepare`` reads, samples, trains a BPE on and tokenizes a multi-shard Parquet corpus.

Generates ``--shards`` Parquet files holding at least ``--gigabytes`` of text (rows are the ``.py``
files the running interpreter can import, cycled with a distinct header line each), then runs
``prepare(source="files")`` on them with ``--num_workers`` processes and writes one CSV row and one
markdown row: input text MB, workers, seconds per phase and MB/s of the whole prepare.

    python benchmarks/prepare_speed.py --workdir /tmp/ps --gigabytes 1 --shards 16 --num_workers 16 --out results/
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import sys
import time
from pathlib import Path


def generate(folder: Path, gigabytes: float, shards: int) -> int:
    """Writes ``shards`` Parquet files of one ``text`` column; returns the UTF-8 bytes of text written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lit_mhar.corpus import _python_files, _decode

    _, files = _python_files()
    sources = [_decode(Path(f.path).read_bytes())[0] for f in files if f.size > 200]
    target = int(gigabytes * 1e9)
    per_shard = target // shards
    written, i = 0, 0
    folder.mkdir(parents=True, exist_ok=True)
    for shard in range(shards):
        rows, size = [], 0
        while size < per_shard:
            text = f"# row {i}\n" + sources[i % len(sources)]
            rows.append(text)
            size += len(text.encode("utf-8"))
            i += 1
        pq.write_table(pa.table({"text": rows}), folder / f"shard-{shard:03d}.parquet", row_group_size=2048)
        written += size
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="scratch folder (created; its shards/ and data/ are deleted at the end)")
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--num_workers", type=int, default=None, help="prepare's workers (default: every core)")
    parser.add_argument("--out", default=".", help="folder for prepare_speed.csv / .md")
    args = parser.parse_args()

    from lit_mhar.corpus import default_workers, prepare

    work = Path(args.workdir)
    t0 = time.perf_counter()
    text_bytes = generate(work / "shards", args.gigabytes, args.shards)
    generated = time.perf_counter() - t0
    workers = args.num_workers or default_workers()
    t0 = time.perf_counter()
    out = prepare(output_dir=str(work / "data"), source="files", files=[str(work / "shards" / "*.parquet")], num_workers=workers)
    seconds = time.perf_counter() - t0
    manifest = json.loads((out / "manifest.json").read_text())
    row = {
        "text_mb": round(text_bytes / 1e6, 1), "shards": args.shards, "workers": workers, "cpus": os.cpu_count(),
        "seconds": round(seconds, 1), "mb_per_s": round(text_bytes / 1e6 / seconds, 2),
        **{f"{k}_s": v for k, v in manifest["phase_seconds"].items()},
        "train_tokens": manifest["splits"]["train"]["tokens"], "val_tokens": manifest["splits"]["val"]["tokens"],
        "tokenizer_sample_mb": round(manifest["tokenizer_sample"]["bytes"] / 1e6, 1), "generate_s": round(generated, 1),
    }
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / "prepare_speed.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        writer.writeheader()
        writer.writerow(row)
    line = "| " + " | ".join(str(v) for v in row.values()) + " |"
    (dest / "prepare_speed.md").write_text("| " + " | ".join(row) + " |\n|" + "---|" * len(row) + "\n" + line + "\n")
    print(json.dumps(row), flush=True)
    shutil.rmtree(work / "shards", ignore_errors=True)
    shutil.rmtree(work / "data", ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
