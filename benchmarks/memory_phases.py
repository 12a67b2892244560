"""Where a training step's peak memory is reached: forward (with the loss) or backward (GPU).

For each variant (``bench_training.py``'s variants and knobs, same model, compilation and step),
after two warm-up steps one step runs in phases, each with its own ``max_memory_allocated``:
the forward and the loss, the backward, the optimiser. During the backward it records the memory
allocated when each routing op's backward starts (``_RouteFunction.backward``, host order), so
that the backward's profile by routing site can be read: its largest value and at which call.

With ``--trace`` the measured step also runs under the CUDA allocator's history
(``torch.cuda.memory._record_memory_history``, Python frames), and ``memory_peak_<scale>.md``
gets, per variant, the tensors alive at the step's peak of allocated memory grouped by the line
of this project's code that allocated them ("(autograd engine)" for what the backward allocated
in C++), and whether the peak fell in the forward or the backward.

    python benchmarks/memory_phases.py --scale 350m --variants prenorm,delta-full-H8,delta-full-H8:save-stream --out OUT
    python benchmarks/memory_phases.py --scale 100m --variants prenorm,delta-block8-H8 --trace --out OUT
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
from lit_mhar.kernels import autograd as routing_autograd

FIELDS = ["scale", "variant", "fwd_peak_GiB", "after_fwd_GiB", "bwd_peak_GiB", "opt_peak_GiB", "bwd_calls", "bwd_entry_max_GiB", "bwd_entry_argmax", "status"]
GiB = 2**30


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _project_path(path: str) -> str | None:
    """``path`` relative to this project's code, or None for a file outside it: the installed
    package (``.../site-packages/lit_mhar/...`` or a ``pip --target`` folder's ``lit_mhar/``), or
    this checkout (``lit_mhar/``, ``kernels/``, ``benchmarks/`` ... under the repository root, not
    its virtual environment)."""
    if "-packages/" in path:
        rest = path.split("-packages/", 1)[1]
        return rest if rest.startswith("lit_mhar/") else None
    if path.startswith(REPO + os.sep):
        rest = path[len(REPO) + 1:]
        return None if rest.startswith((".venv", "venv")) else rest
    return "lit_mhar/" + path.split("/lit_mhar/", 1)[1] if "/lit_mhar/" in path else None


def _label(frames: list) -> str:
    """Where an allocation came from: the innermost frame in this project's code (the package or
    the benchmark), as ``path:line (function)``; else the innermost frame's last two path parts;
    "(autograd engine)" without a Python frame."""
    for f in frames:
        path = _project_path(f.get("filename", ""))
        if path is not None:
            return f"{path}:{f.get('line')} ({f.get('name')})"
    if not frames:
        return "(autograd engine)"
    f = frames[0]
    return f"{'/'.join(f.get('filename', '?').rsplit('/', 2)[-2:])}:{f.get('line')} ({f.get('name')})"


def live_at_peak(events: list, forward_events: int) -> tuple[int, str, list[tuple[str, int, int]]]:
    """``(bytes, phase, groups)`` at the peak of the memory the recorded ``events`` (the
    allocator's trace of one device) allocated: the largest sum of blocks allocated and not yet
    freed, "forward" or "backward" by whether it falls in the first ``forward_events`` events, and
    the blocks alive then as ``(label, bytes, count)``, largest first. A block counts as freed at
    its ``free_requested`` event, where ``torch.cuda.memory_allocated`` drops (its
    ``free_completed`` may wait for another stream's use); a trace without such events counts
    ``free_completed``. Blocks allocated before the recording started are not counted (they are
    the same in every phase)."""
    freed = "free_requested" if any(ev["action"] == "free_requested" for ev in events) else "free_completed"
    live, total, best, best_at = {}, 0, 0, -1
    for i, ev in enumerate(events):
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev["size"]
            total += ev["size"]
            if total > best:
                best, best_at = total, i
        elif ev["action"] == freed and ev["addr"] in live:
            total -= live.pop(ev["addr"])
    alive: dict[int, dict] = {}
    for ev in events[: best_at + 1]:
        if ev["action"] == "alloc":
            alive[ev["addr"]] = ev
        elif ev["action"] == freed:
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
        original = routing_autograd._RouteFunction.backward

        def spy(ctx, *grads):
            entries.append(torch.cuda.memory_allocated())
            return original(ctx, *grads)

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        n_start = 0
        if trace:  # (events from before, if a recording kept any, are not this step's: counted from n_start)
            torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=2_000_000)
            n_start = len(_events())
        try:
            loss = forward()
            torch.cuda.synchronize()
            fwd_peak, after_fwd = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
            n_fwd = len(_events()) if trace else 0
            torch.cuda.reset_peak_memory_stats()
            routing_autograd._RouteFunction.backward = staticmethod(spy)
            try:
                loss.backward()
            finally:
                routing_autograd._RouteFunction.backward = staticmethod(original)
            torch.cuda.synchronize()
            bwd_peak = torch.cuda.max_memory_allocated()
            if trace:
                peak_trace = live_at_peak(_events()[n_start:], n_fwd - n_start)
        finally:
            if trace:
                torch.cuda.memory._record_memory_history(enabled=None)
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
        f"allocated before it (parameters, optimiser state, the inputs).", "",
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
