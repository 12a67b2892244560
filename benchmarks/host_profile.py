"""Where the host's time of a training step goes: enqueue times, implicit synchronisations, a cProfile.

A step of a routed variant is host-bound when the host needs about as long to enqueue it as the
GPU needs to run it (``bench_training.py``'s ``host_ms`` near ``step_ms``). For each variant, after
warm-up steps, this script

1. times the host's enqueue of ``--steps`` single steps onto an idle GPU (synchronised before and
   after each): min, median and max in ms, and of the forward, backward and update apart (medians);
2. runs one step under ``torch.cuda.set_sync_debug_mode("warn")`` and lists the distinct places
   where the host waited for the GPU (a copy to the host, ``.item()``, a pageable copy), by the
   innermost frame of the project's code;
3. runs one step under :mod:`cProfile` (the Python functions run on the calling thread; a backward
   run on one of autograd's own threads would be missing there) and one under ``torch.profiler``
   (CPU activity of every thread), and keeps the rows with the most own time. A synchronisation
   inside the backward is reported when ``backward()`` returns, so it is attributed to torch's
   frames, not to the routing op's.

    python benchmarks/host_profile.py --scale 350m --variants prenorm,mhar-block8-H8 --out results/

Writes ``host_profile_<scale>.md``; the same model, compilation and step as ``bench_training.py``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import time
import traceback
import warnings

import torch

from bench_training import DEVICE, SCALES, knobs, split_variant, training_parts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# the package's folders of a checkout outside lit_mhar/ (pyproject.toml maps lit_mhar.kernels to kernels/, and so on)
CHECKOUT_PACKAGES = ("kernels/", "cli/", "sweeps/")


def _project_frame(stack: list[traceback.FrameSummary], root: str = ROOT) -> str:
    """The innermost frame of the project's code in ``stack`` (the installed package, or a checkout
    at ``root``), as a path inside the package; else the innermost frame outside :mod:`warnings`
    (which reports the synchronisation)."""
    root = root.replace(os.sep, "/").rstrip("/") + "/"
    stack = [f for f in stack if not f.filename.replace(os.sep, "/").endswith("/warnings.py")]  # the warning's own machinery
    for frame in reversed(stack):
        path = frame.filename.replace(os.sep, "/")
        if "/lit_mhar/" in path:
            inside = path.split("/lit_mhar/")[-1]
        elif path.startswith(root) and path[len(root):].startswith(CHECKOUT_PACKAGES):
            inside = path[len(root):]
        else:
            continue
        return f"{inside}:{frame.lineno} ({frame.name})"
    return f"{stack[-1].filename}:{stack[-1].lineno} ({stack[-1].name})" if stack else "?"


def sync_points(step) -> list[tuple[str, int]]:
    """The places (project frame, count) where one ``step()`` synchronised with the GPU."""
    if DEVICE != "cuda":
        return []
    counts: dict[str, int] = {}
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            where = _project_frame(traceback.extract_stack()[:-1])
            counts[where] = counts.get(where, 0) + 1
        else:
            shown(message, category, filename, lineno, file, line)

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown
    torch.cuda.synchronize()
    return sorted(counts.items(), key=lambda kv: -kv[1])


def profile_variant(scale: str, name: str, steps: int, warmup: int, compile_: bool, top: int) -> dict:
    overrides, knob_names = split_variant(name)
    batch, seq, _ = SCALES[scale]
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    with knobs(knob_names):
        model, forward, update = training_parts(scale, overrides, batch, seq, compile_)

        def step():
            forward().backward()
            update()

        for _ in range(warmup):
            step()
        sync()
        host, parts = [], {"forward": [], "backward": [], "update": []}
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            step()
            host.append((time.perf_counter() - t0) * 1e3)
            sync()
            t = [time.perf_counter()]
            loss = forward()
            t.append(time.perf_counter())
            sync()
            t.append(time.perf_counter())
            loss.backward()
            t.append(time.perf_counter())
            sync()
            t.append(time.perf_counter())
            update()
            t.append(time.perf_counter())
            sync()
            for key, (a, b) in zip(parts, ((0, 1), (2, 3), (4, 5))):
                parts[key].append((t[b] - t[a]) * 1e3)
        waits = sync_points(step)
        prof = cProfile.Profile()
        sync()
        prof.enable()
        step()
        prof.disable()
        sync()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as tprof:
            step()
            sync()
    tables = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(key).print_stats(top)
        tables[f"cProfile, by {key}"] = buf.getvalue()
    tables["torch.profiler (CPU), by self CPU time"] = tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=90)
    del model, step, forward, update
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return dict(host=host, parts={k: statistics.median(v) for k, v in parts.items()}, waits=waits, tables=tables)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=list(SCALES), required=True)
    ap.add_argument("--variants", default="prenorm,mhar-block8-H8")
    ap.add_argument("--steps", type=int, default=5, help="single steps whose enqueue is timed")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=30, help="cProfile rows kept per ordering")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    for flag, value, least in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0), ("--top", args.top, 1)):
        if value < least:
            ap.error(f"{flag} {value}: must be >= {least}")
    names = args.variants.split(",")
    for name in names:
        split_variant(name)  # an unknown variant or knob stops here, before any work
    torch._dynamo.config.cache_size_limit = 64
    lines = [f"# Host time of one training step at {args.scale}", "",
             "| variant | host enqueue ms (min / median / max of %d) | forward / backward / update (medians) | GPU synchronisations in one step |" % args.steps,
             "|---|---|---|---|"]
    details = []
    for name in names:
        r = profile_variant(args.scale, name, args.steps, args.warmup, not args.no_compile, args.top)
        h = r["host"]
        n_waits = sum(c for _, c in r["waits"])
        p = r["parts"]
        lines.append(f"| {name} | {min(h):.1f} / {statistics.median(h):.1f} / {max(h):.1f} | {p['forward']:.1f} / {p['backward']:.1f} / {p['update']:.1f} | {n_waits} |")
        print(lines[-1], flush=True)
        details += [f"\n## {name}\n", "Synchronisations (project frame, count): " + (", ".join(f"`{w}` x{c}" for w, c in r["waits"]) or "none"), ""]
        for key, text in r["tables"].items():
            details += [f"One step, {key}:", "", "```", text.strip(), "```", ""]
    path = os.path.join(args.out, f"host_profile_{args.scale}.md")
    with open(path, "w") as fh:
        fh.write("\n".join(lines + details) + "\n")
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
