"""Training tokens/s at one and at eight routing heads, against compiled prenorm, for one or two checkouts.

Variants (the issue's table of head counts): Block AttnRes H = 1 in 8 blocks, Block MHAR H = 8,
full AttnRes H = 1, full MHAR H = 8, Delta block H = 8, each against prenorm compiled whole, at
20m, 100m and 350m (``--scales``). One worker process per (scale, checkout) builds each model,
compiles it as ``LitLM(compile=True)`` does (``LM.compile_for_training("auto")``), trains it on
random tokens (bf16 autocast, fused AdamW, clipping) and times ``--steps`` steps after
``--warmup``; the ratio is against prenorm measured in the same process. With ``--before DIR`` (an
extracted ``git archive`` of another commit) the same measurement runs for that checkout too,
alternating with this one scale by scale (and in reverse order on odd ``--rounds``), so both
see the same GPU. Needs only torch and triton: each checkout is imported from a package view
(``lit_mhar`` with its ``kernels/`` inside, as the install maps it), nothing installed.

    python benchmarks/head_counts.py --out $OUT                                  # this checkout
    git archive 85cbf51 | (mkdir -p /tmp/before && tar -x -C /tmp/before)
    python benchmarks/head_counts.py --before /tmp/before --out $OUT             # side by side

Writes ``$OUT/head_counts.csv`` (one row per measurement) and ``$OUT/head_counts.md`` (ratios to
prenorm by variant and scale, per checkout, and the peak memory ratio), and prints each row.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCALES = {"20m": (64, 1024, 8), "100m": (64, 2048, 12), "350m": (32, 1024, 24), "1b": (32, 1024, 36), "debug": (2, 64, 4)}  # batch, seq, layers
VARIANTS = {  # name -> ModelConfig fields; "8blocks": S = 2L / 8
    "prenorm": dict(residual="prenorm"),
    "attnres-block8-H1": dict(residual="attnres", heads=1, block_size="8blocks"),
    "mhar-block8-H8": dict(residual="attnres", heads=8, block_size="8blocks"),
    "attnres-full-H1": dict(residual="attnres", heads=1, block_size=1),
    "mhar-full-H8": dict(residual="attnres", heads=8, block_size=1),
    "delta-block8-H8": dict(residual="delta", heads=8, block_size="8blocks"),
}
FIELDS = ["scale", "checkout", "round", "variant", "tokens_per_s", "ratio_vs_prenorm", "step_ms", "peak_GiB", "mem_ratio_vs_prenorm",
          "compile_s", "loss", "status", "note"]


def package_view(checkout: Path, into: Path) -> Path:
    """A folder holding ``lit_mhar`` as the install lays it out (``checkout/lit_mhar``'s files with
    ``checkout/kernels`` as its ``kernels``), made of symbolic links; returns the folder for
    ``PYTHONPATH``. Raises FileNotFoundError for a folder that is not a lit-mhar checkout."""
    if not (checkout / "lit_mhar" / "model.py").is_file() or not (checkout / "kernels" / "__init__.py").is_file():
        raise FileNotFoundError(f"{checkout} is not a lit-mhar checkout (lit_mhar/model.py and kernels/__init__.py)")
    package = into / "lit_mhar"
    package.mkdir(parents=True)
    for item in (checkout / "lit_mhar").iterdir():
        if item.name != "__pycache__":
            (package / item.name).symlink_to(item.resolve())
    (package / "kernels").symlink_to((checkout / "kernels").resolve())
    return into


def measure(scale: str, variant: str, steps: int, warmup: int) -> dict:
    """Tokens/s, step time, peak memory and compile time of ``variant`` at ``scale`` (in this process)."""
    import torch

    from lit_mhar import LM, ModelConfig

    batch, seq, layers = SCALES[scale]
    fields = dict(VARIANTS[variant])
    if fields.get("block_size") == "8blocks":
        fields["block_size"] = 2 * layers // 8
    cfg = ModelConfig.from_name(scale, **fields)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = LM(cfg)
    if device == "cuda":
        model.compile_for_training("auto")
        torch.cuda.reset_peak_memory_stats()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device == "cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device, generator=gen)
    x, y = idx[:, :-1], idx[:, 1:]

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t0 = time.time()
    for _ in range(warmup):
        loss = step()
    sync()
    compile_s = time.time() - t0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    return dict(tokens_per_s=batch * seq / ms * 1e3, step_ms=ms, peak_GiB=peak, compile_s=compile_s, loss=float(loss))


def worker(scale: str, variants: list[str], steps: int, warmup: int) -> None:
    """Measure ``variants`` (prenorm first) at ``scale`` in this process; one JSON line per variant."""
    import torch

    import lit_mhar

    view = os.environ["PYTHONPATH"].split(os.pathsep)[0]
    if not Path(lit_mhar.__file__).parent.parent == Path(view):  # another lit_mhar shadows the checkout's
        raise SystemExit(f"head_counts worker: lit_mhar imported from {lit_mhar.__file__}, not from {view}")
    torch._dynamo.config.cache_size_limit = 64  # one entry per module class and shape; never fall back to eager
    for variant in variants:
        try:
            row = dict(variant=variant, status="ok", **measure(scale, variant, steps, warmup))
        except Exception as e:  # noqa: BLE001 - a variant failing is a result; the others go on
            row = dict(variant=variant, status="error", note=repr(e)[:300])
        print("ROW " + json.dumps(row), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_checkout(view: Path, scale: str, variants: list[str], args) -> list[dict]:
    """The worker's rows for one checkout (its package view first on ``PYTHONPATH``) at ``scale``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(view), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--scales", scale, "--variants", ",".join(variants),
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    proc = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True)
    rows = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    if proc.returncode != 0 or len(rows) != len(variants):
        sys.stderr.write(proc.stderr[-4000:])
        done = {r["variant"] for r in rows}
        rows += [dict(variant=v, status="error", note=f"worker exited {proc.returncode}") for v in variants if v not in done]
    return rows


def markdown(rows: list[dict], scales: list[str], checkouts: list[str]) -> str:
    """Ratios to prenorm's tokens/s (median over rounds) by variant and scale, one column per
    checkout and scale, then peak memory against prenorm's."""
    def cell(variant, scale, checkout, key):
        values = [float(r[key]) for r in rows if (r["variant"], r["scale"], r["checkout"]) == (variant, scale, checkout) and r.get(key) not in (None, "")]
        return f"{statistics.median(values):.3f}" if values else "-"

    head = [f"{s} {c}" for s in scales for c in checkouts]
    out = []
    for title, key in (("training tokens/s against compiled prenorm", "ratio_vs_prenorm"), ("peak memory against prenorm", "mem_ratio_vs_prenorm")):
        out += [f"### {title}", "", "| variant | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
        for variant in VARIANTS:
            if variant != "prenorm":
                out.append(f"| {variant} | " + " | ".join(cell(variant, s, c, key) for s in scales for c in checkouts) + " |")
        out.append("")
    prenorm = " ".join(f"{s} {c}: {cell('prenorm', s, c, 'tokens_per_s')}" for s in scales for c in checkouts)
    return "\n".join(out) + f"\nprenorm tokens/s (median): {prenorm}\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="folder of head_counts.csv and head_counts.md (default $OUT)")
    ap.add_argument("--before", help="another lit-mhar checkout (an extracted git archive) measured side by side")
    ap.add_argument("--scales", default="20m,100m,350m", help=f"comma-separated, of {list(SCALES)}")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; prenorm is always measured first")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="measurements per (scale, checkout), alternating the order")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    scales = args.scales.split(",")
    variants = ["prenorm"] + [v for v in args.variants.split(",") if v != "prenorm"]
    for name, values, valid in (("--scales", scales, SCALES), ("--variants", variants, VARIANTS)):
        unknown = [v for v in values if v not in valid]
        if unknown:
            ap.error(f"{name}: unknown {unknown}; valid: {list(valid)}")
    for flag, value, least in (("--steps", args.steps, 1), ("--warmup", args.warmup, 1), ("--rounds", args.rounds, 1)):
        if value < least:
            ap.error(f"{flag} {value}: must be >= {least}")
    if args.worker:
        worker(scales[0], variants, args.steps, args.warmup)
        return 0
    out = Path(args.out or os.environ.get("OUT") or ".")
    out.mkdir(parents=True, exist_ok=True)
    views_root = Path(tempfile.mkdtemp(prefix="head_counts_"))
    checkouts = {"this": package_view(ROOT, views_root / "this")}
    if args.before:
        try:
            checkouts["before"] = package_view(Path(args.before).resolve(), views_root / "before")
        except FileNotFoundError as e:
            ap.error(f"--before: {e}")
    rows = []
    with open(out / "head_counts.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, FIELDS)
        writer.writeheader()
        for r in range(args.rounds):
            for scale in scales:
                order = list(checkouts) if r % 2 == 0 else list(reversed(checkouts))
                for checkout in order:
                    t0 = time.time()
                    got = run_checkout(checkouts[checkout], scale, variants, args)
                    base = next((g for g in got if g["variant"] == "prenorm" and g["status"] == "ok"), None)
                    for g in got:
                        row = dict(scale=scale, checkout=checkout, round=r, **g)
                        if base and g["status"] == "ok":
                            row["ratio_vs_prenorm"] = f"{g['tokens_per_s'] / base['tokens_per_s']:.3f}"
                            row["mem_ratio_vs_prenorm"] = f"{g['peak_GiB'] / max(base['peak_GiB'], 1e-9):.3f}"
                        for key, fmt in (("tokens_per_s", "{:.0f}"), ("step_ms", "{:.1f}"), ("peak_GiB", "{:.2f}"), ("compile_s", "{:.0f}"), ("loss", "{:.4f}")):
                            if key in row:
                                row[key] = fmt.format(row[key])
                        writer.writerow(row)
                        fh.flush()
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                    print(f"{scale} {checkout}: {time.time() - t0:.0f} s", flush=True)
    table = markdown(rows, scales, list(checkouts))
    (out / "head_counts.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
