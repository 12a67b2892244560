"""Where a training step's peak memory is reached: forward (with the loss) or backward (GPU).

For each variant (``bench_training.py``'s variants and knobs, same model, compilation and step),
after two warm-up steps one step runs in phases, each with its own ``max_memory_allocated``:
the forward and the loss, the backward, the optimiser. During the backward it records the memory
allocated when each routing op's backward starts (``_RouteFunction.backward``, host order), so
that the backward's profile by routing site can be read: its largest value and at which call.

    python benchmarks/memory_phases.py --scale 350m --variants prenorm,delta-full-H8,delta-full-H8:save-stream --out OUT
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import sys

import torch

from bench_training import DEVICE, SCALES, knobs, split_variant, training_parts
from lit_mhar.kernels import triton_routing as tr

FIELDS = ["scale", "variant", "fwd_peak_GiB", "after_fwd_GiB", "bwd_peak_GiB", "opt_peak_GiB", "bwd_calls", "bwd_entry_max_GiB", "bwd_entry_argmax", "status"]
GiB = 2**30


def _label(frames: list) -> str:
    """Where an allocation came from: the innermost frame in this project's code (the package or
    the benchmark), as ``path:line (function)``; "(autograd engine)" without a Python frame."""
    for f in frames:
        path = f.get("filename", "")
        for root in ("lit_mhar/", "benchmarks/"):
            if root in path:
                return f"{root}{path.split(root, 1)[1]}:{f.get('line')} ({f.get('name')})"
    if not frames:
        return "(autograd engine)"
    f = frames[0]
    return f"{f.get('filename', '?').rsplit('/', 2)[-1]}:{f.get('line')} ({f.get('name')})"


def live_at_peak(events: list, forward_events: int) -> tuple[int, str, list[tuple[str, int, int]]]:
    """``(bytes, phase, groups)`` at the peak of the memory the recorded ``events`` (the
    allocator's trace of one device) allocated: the largest sum of blocks allocated and not yet
    freed, "forward" or "backward" by whether it falls in the first ``forward_events`` events, and
    the blocks alive then as ``(label, bytes, count)``, largest first. Blocks allocated before the
    recording started are not counted (they are the same in every phase)."""
    live, total, best, best_at = {}, 0, 0, -1
    for i, ev in enumerate(events):
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev["size"]
            total += ev["size"]
            if total > best:
                best, best_at = total, i
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])
    alive: dict[int, dict] = {}
    for ev in events[: best_at + 1]:
        if ev["action"] == "alloc":
            alive[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            alive.pop(ev["addr"], None)
    groups: dict[str, list[int]] = {}
    for ev in alive.values():
        g = groups.setdefault(_label(ev.get("frames", [])), [0, 0])
        g[0] += ev["size"]
        g[1] += 1
    ranked = sorted(((k, b, c) for k, (b, c) in groups.items()), key=lambda r: -r[1])
    return best, "forward" if best_at < forward_events else "backward", ranked


def phases(scale: str, name: str, trace: bool = False) -> dict:
    """The phase peaks (GiB) of one step of variant ``name`` after two warm-up steps; with
    ``trace``, ``peak_trace`` too: :func:`live_at_peak` of the step's forward and backward, and
    ``before_GiB``, what was allocated when the recording started."""
    overrides, knob_names = split_variant(name)
    batch, seq, _ = SCALES[scale]
    with knobs(knob_names):
        _, forward, update = training_parts(scale, overrides, batch, seq, compile_=True)
        for _ in range(2):  # bench_training's step: compiles, allocates the optimiser's state
            forward().backward()
            update()
        entries = []
        original = tr._RouteFunction.backward

        def spy(ctx, *grads):
            entries.append(torch.cuda.memory_allocated())
            return original(ctx, *grads)

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        if trace:
            torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=2_000_000)
        loss = forward()
        torch.cuda.synchronize()
        fwd_peak, after_fwd = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
        n_fwd = len(_events()) if trace else 0
        torch.cuda.reset_peak_memory_stats()
        tr._RouteFunction.backward = staticmethod(spy)
        try:
            loss.backward()
        finally:
            tr._RouteFunction.backward = staticmethod(original)
        torch.cuda.synchronize()
        bwd_peak = torch.cuda.max_memory_allocated()
        if trace:
            events = _events()
            torch.cuda.memory._record_memory_history(enabled=None)
            peak_trace = live_at_peak(events, n_fwd)
            del events
        torch.cuda.reset_peak_memory_stats()
        update()
        torch.cuda.synchronize()
        opt_peak = torch.cuda.max_memory_allocated()
    top = max(range(len(entries)), key=entries.__getitem__) if entries else -1
    extra = dict(peak_trace=peak_trace, before_GiB=before / GiB) if trace else {}
    return dict(**extra,
        fwd_peak_GiB=f"{fwd_peak / GiB:.2f}", after_fwd_GiB=f"{after_fwd / GiB:.2f}", bwd_peak_GiB=f"{bwd_peak / GiB:.2f}",
        opt_peak_GiB=f"{opt_peak / GiB:.2f}", bwd_calls=len(entries),
        bwd_entry_max_GiB=f"{entries[top] / GiB:.2f}" if entries else "", bwd_entry_argmax=top, status="ok",
    )


def _events() -> list:
    """The allocator's recorded events on the current device (a snapshot of the history so far)."""
    return torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]


def trace_markdown(scale: str, name: str, row: dict, top: int = 25) -> str:
    """A variant's tensors alive at the traced step's peak, as markdown."""
    best, phase, groups = row["peak_trace"]
    lines = [
        f"### {scale} {name}", "",
        f"Peak in the {phase}: {best / GiB:.2f} GiB allocated during the step on top of {row['before_GiB']:.2f} GiB "
        f"allocated before it (parameters, gradients, optimiser state).", "",
        "| allocated by | GiB | tensors |", "|---|---|---|",
    ]
    lines += [f"| `{label}` | {b / GiB:.3f} | {c} |" for label, b, c in groups[:top]]
    rest = groups[top:]
    if rest:
        lines.append(f"| ({len(rest)} more lines) | {sum(b for _, b, _ in rest) / GiB:.3f} | {sum(c for _, _, c in rest)} |")
    return "\n".join(lines) + "\n\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=[s for s in SCALES if s != "debug"], default="350m")
    ap.add_argument("--variants", default="prenorm,mhar-full-H8,delta-full-H8,delta-full-H8:save-stream")
    ap.add_argument("--trace", action="store_true", help="also write memory_peak_<scale>.md: the tensors alive at the peak, by allocating line")
    ap.add_argument("--out", required=True, help="folder of memory_phases.csv (rows are appended)")
    args = ap.parse_args(argv)
    if DEVICE != "cuda" or not torch.cuda.is_available():
        raise SystemExit("memory_phases.py needs a CUDA GPU (peak memory is the CUDA allocator's)")
    names = args.variants.split(",")
    for name in names:
        split_variant(name)  # unknown names fail before any work
    path = os.path.join(args.out, "memory_phases.csv")
    with open(path, "a", newline="") as fh:
        w = csv.DictWriter(fh, FIELDS)
        if fh.tell() == 0:
            w.writeheader()
        for name in names:
            try:
                row = dict(scale=args.scale, variant=name, **phases(args.scale, name, args.trace))
            except Exception as e:  # noqa: BLE001 - one variant's failure is a result; the others still run
                row = dict(scale=args.scale, variant=name, status=f"error {e!r}"[:200])
            if "peak_trace" in row:
                with open(os.path.join(args.out, f"memory_peak_{args.scale}.md"), "a") as md:
                    md.write(trace_markdown(args.scale, name, row))
                row.pop("peak_trace")
                row.pop("before_GiB")
            gc.collect()  # the variant's model and optimiser, gone with phases()'s frame
            torch.cuda.empty_cache()
            w.writerow(row)
            fh.flush()
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
