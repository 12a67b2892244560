"""Routing-op benchmark: forward / backward / both, median of ``triton.testing.do_bench``.

Shapes of the 100m / 350m / 1b presets (tokens per step 64x2048, 32x1024, 32x1024), N = 9 sources
(8 blocks) and N = 2L + 1 (full routing), H = 1 and 8, bfloat16 sources, float32 query and gain.
Variants: the fused Triton op (``triton-siteloop`` / ``triton-twopass``: forced to one backward kernel;
``triton-untuned``: the general rule's tiles, not ``TUNED_TILES``), the eager reference, ``torch.compile`` of the reference, and at
H = 1 fla-core's ``fused_attnres`` and liger-kernel's ``liger_attn_res`` (benchmark-only peers,
imported here and nowhere in the package). Every variant is checked in the same run against a
float64 reference computed in token chunks (output, every source gradient, query and gain
gradients); a variant that fails its check gets no time reported.

Achieved bandwidth counts the fewest bytes each direction must move: forward reads N sources and
writes the output; backward reads N sources and the output gradient and writes N source
gradients. It is reported against a device-to-device copy measured in the same process.

    python benchmarks/bench_routing_op.py --scale 350m --out results/   # appends CSV rows

Needs only torch, triton and an installed lit_mhar (plus the peers, optionally).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
import traceback

import torch
from triton.testing import do_bench

from lit_mhar.kernels import dispatch, reference
from lit_mhar.kernels import triton_routing

SCALES = {  # d, layers, tokens per step (batch, seq)
    "100m": (512, 12, (64, 2048)),
    "350m": (1024, 24, (32, 1024)),
    "1b": (1280, 36, (32, 1024)),
    "tiny": (96, 2, (1, 70)),  # a dry run of this script (BENCH_DEVICE=cpu runs it in Triton's interpreter)
}
DEVICE = os.environ.get("BENCH_DEVICE", "cuda")
# variant -> dispatch table entries: which backward kernel autograd runs, or the general rule's tiles
VARIANT_TABLES = {
    "triton": {},
    "triton-siteloop": dict(SITE_LOOP_MIN_SITES=1, SITE_LOOP_MIN_SOURCES=1),
    "triton-twopass": dict(SITE_LOOP_MIN_SITES=10**9, SITE_LOOP_MIN_SOURCES=10**9),
    "triton-untuned": dict(TUNED_TILES={}),
}


def use_backward(variant: str):
    """The dispatch table of ``variant`` (the package's for any other name) for a ``with`` block:
    the backward kernel it forces, and for ``triton-untuned`` the general rule's tiles (no
    ``TUNED_TILES``) in both directions."""
    return dispatch.overrides(**VARIANT_TABLES.get(variant, {}))


TOL = 1e-2  # bf16 sources and outputs: relative L2 error against float64
FIELDS = ["scale", "N", "H", "variant", "status", "fwd_ms", "bwd_ms", "both_ms", "fwd_GBps", "bwd_GBps", "fwd_frac_copy", "bwd_frac_copy",
          "err_out", "err_dsrc", "err_dq", "err_dg", "copy_GBps", "note"]


def _cpu_timer(fn, warmup=0, rep=0, return_mode="median"):
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def copy_bandwidth() -> float:
    """Device-to-device copy in GB/s, counting bytes read plus bytes written (2 GiB tensors)."""
    x = torch.empty(2**30 if DEVICE == "cuda" else 2**20, dtype=torch.bfloat16, device=DEVICE).normal_()
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return 2 * x.numel() * x.element_size() / ms / 1e6


def peers():
    """Peer implementations at H = 1, (name -> fn(sources, query, gain) -> out), when installed."""
    found = {}
    try:
        from fla.ops.attnres import fused_attnres

        found["fla"] = lambda srcs, q, g: fused_attnres(q, srcs, g, rms_eps=1e-6)
    except Exception as e:  # noqa: BLE001 - report, don't fail: peers are optional
        print(f"fla unavailable: {e!r}", flush=True)
    try:
        from liger_kernel.transformers.functional import liger_attn_res

        # liger-kernel 0.8.5 documents a list of sources but indexes V.shape: it takes the stacked
        # [N, ..., d] tensor, so the stack a model would need is part of its time
        found["liger"] = lambda srcs, q, g: liger_attn_res(torch.stack(srcs), q, g, eps=1e-6)
    except Exception as e:  # noqa: BLE001
        print(f"liger unavailable: {e!r}", flush=True)
    return found


def reference_grads(sources, q, g, heads, dout, chunk=2048):
    """float64 output, source / query / gain gradients, computed over token chunks (fits in memory)."""
    M = dout.shape[0]
    out = torch.empty(M, dout.shape[1], dtype=torch.float64, device=DEVICE)
    dsrc = [torch.empty_like(s, dtype=torch.float32) for s in sources]  # float32 storage of float64 math
    dq = torch.zeros(q.shape, dtype=torch.float64, device=DEVICE)
    dg = torch.zeros_like(dq)
    q64, g64 = q.detach().double(), g.detach().double()
    for a in range(0, M, chunk):
        b = min(M, a + chunk)
        sl = [s.detach()[a:b].double().requires_grad_() for s in sources]
        qq, gg = q64.clone().requires_grad_(), g64.clone().requires_grad_()
        o = reference.depth_route(sl, qq, gg, heads)
        grads = torch.autograd.grad(o, sl + [qq, gg], dout[a:b].double())
        out[a:b] = o.detach()
        for i in range(len(sl)):
            dsrc[i][a:b] = grads[i]
        dq += grads[-2]
        dg += grads[-1]
    return out, dsrc, dq, dg


def rel(x, ref) -> float:
    x = x.detach()
    if not torch.isfinite(x).all():
        return math.inf
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def rel_list(xs, refs) -> float:
    num = sum(((x.double() - r.double()) ** 2).sum().item() for x, r in zip(xs, refs))
    den = sum((r.double() ** 2).sum().item() for r in refs)
    if any(not torch.isfinite(x).all() for x in xs):
        return math.inf
    return math.sqrt(num / den)


def op_inputs(scale: str, n: int, heads: int, device: str = DEVICE) -> tuple[list, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sources, query, gain, dout)`` of one routing site at ``scale``'s width and tokens per step:
    ``n`` bf16 sources ``[tokens, d]`` (scaled 0.5 / 1.5 / 2.5 in turn) with gradients, a query and
    gain ``[d]`` float32 with gradients, and an output gradient ``[tokens, d]`` bf16; seeded."""
    d, _, (batch, seq) = SCALES[scale]
    M = batch * seq
    gen = torch.Generator(device=device).manual_seed(0)
    sources = [(torch.randn(M, d, device=device, generator=gen) * (0.5 + i % 3)).to(torch.bfloat16).requires_grad_() for i in range(n)]
    q = (2.0 * (heads / d) ** 0.5 * torch.randn(d, device=device, generator=gen)).requires_grad_()
    g = (1 + 0.3 * torch.randn(d, device=device, generator=gen)).requires_grad_()
    dout = torch.randn(M, d, device=device, generator=gen).to(torch.bfloat16)
    return sources, q, g, dout


def bench_shape(scale, n, heads, variants, copy_gbps, writer, fh):
    d, _, (batch, seq) = SCALES[scale]
    M = batch * seq
    sources, q, g, dout = op_inputs(scale, n, heads)
    ref_out, ref_dsrc, ref_dq, ref_dg = reference_grads(sources, q, g, heads, dout)
    inputs = sources + [q, g]
    esize = 2
    fwd_bytes = (n + 1) * M * d * esize
    bwd_bytes = (2 * n + 1) * M * d * esize
    for name, fn in variants.items():
        row = dict(scale=scale, N=n, H=heads, variant=name, copy_GBps=round(copy_gbps, 1))
        with use_backward(name):  # the backward kernel is chosen when autograd runs it
            try:
                out = fn(sources, q, g)
                grads = torch.autograd.grad(out, inputs, dout)
                errs = dict(err_out=rel(out, ref_out), err_dsrc=rel_list(grads[:n], ref_dsrc), err_dq=rel(grads[n], ref_dq), err_dg=rel(grads[n + 1], ref_dg))
                row.update({k: f"{v:.2e}" for k, v in errs.items()})
                del out, grads
                if max(errs.values()) > TOL:
                    row["status"] = "FAILED correctness"
                    writer.writerow(row)
                    fh.flush()
                    print(json.dumps(row), flush=True)
                    continue
                out = fn(sources, q, g)
                fwd = do_bench(lambda: fn(sources, q, g), warmup=10, rep=100, return_mode="median")
                bwd = do_bench(lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True), warmup=10, rep=100, return_mode="median")
                both = do_bench(lambda: torch.autograd.grad(fn(sources, q, g), inputs, dout), warmup=10, rep=100, return_mode="median")
                del out
                row.update(
                    status="ok", fwd_ms=f"{fwd:.4f}", bwd_ms=f"{bwd:.4f}", both_ms=f"{both:.4f}",
                    fwd_GBps=f"{fwd_bytes / fwd / 1e6:.0f}", bwd_GBps=f"{bwd_bytes / bwd / 1e6:.0f}",
                    fwd_frac_copy=f"{fwd_bytes / fwd / 1e6 / copy_gbps:.3f}", bwd_frac_copy=f"{bwd_bytes / bwd / 1e6 / copy_gbps:.3f}",
                )
            except torch.cuda.OutOfMemoryError:
                row.update(status="OOM")
            except Exception as e:  # noqa: BLE001 - a peer failing at a shape is a result
                row.update(status="error", note=repr(e)[:200])
                traceback.print_exc()
        torch.cuda.empty_cache()
        writer.writerow(row)
        fh.flush()
        print(json.dumps(row), flush=True)


def bench_phase_one(scale, n, heads, copy_gbps, writer, fh):
    """Phase one of Block AttnRes (``route_sites``): S = 2L / 8 sites against ``n`` completed blocks,
    forward + backward (gradients of the outputs and of the log-sum-exp, as the merge gives them),
    backward by the site-loop kernels and by the two-pass kernel (which holds every site's gradient
    of a token), each checked against float64 first. Rows: variant ``phase1-siteloop`` / ``phase1-twopass``."""
    d, layers, (batch, seq) = SCALES[scale]
    M, S = batch * seq, max(2, 2 * layers // 8)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    sources = [(torch.randn(M, d, device=DEVICE, generator=gen) * (0.5 + i % 3)).to(torch.bfloat16).requires_grad_() for i in range(n)]
    q = (2.0 * (heads / d) ** 0.5 * torch.randn(S, d, device=DEVICE, generator=gen)).requires_grad_()
    g = (1 + 0.3 * torch.randn(S, d, device=DEVICE, generator=gen)).requires_grad_()
    douts = [torch.randn(M, d, device=DEVICE, generator=gen).to(torch.bfloat16) for _ in range(S)]
    dlse = torch.randn(S, M, heads, device=DEVICE, generator=gen)
    inputs = sources + [q, g]

    ref = [torch.zeros(s.shape, dtype=torch.float32, device=DEVICE) for s in sources] + [torch.zeros(q.shape, dtype=torch.float64, device=DEVICE) for _ in range(2)]
    for a in range(0, M, 2048):  # float64 reference gradients over token chunks
        sl = [s.detach()[a:a + 2048].double().requires_grad_() for s in sources]
        qq, gg = q.detach().double().requires_grad_(), g.detach().double().requires_grad_()
        outs, lse = reference.route_sites(sl, qq, gg, heads)
        grads = torch.autograd.grad(sum((o * t[a:a + 2048].double()).sum() for o, t in zip(outs, douts)) + (lse * dlse[:, a:a + 2048].double()).sum(), sl + [qq, gg])
        for i in range(n):
            ref[i][a:a + 2048] = grads[i]
        ref[n] += grads[n]
        ref[n + 1] += grads[n + 1]
    bwd_bytes = (2 * n + S) * M * d * 2
    for name in ("phase1-siteloop", "phase1-twopass"):
        with use_backward(name.replace("phase1", "triton")):
            row = dict(scale=scale, N=n, H=heads, variant=name, copy_GBps=round(copy_gbps, 1), note=f"S={S}")
            try:
                outs, lse = triton_routing.route_sites(sources, q, g, heads)
                grads = torch.autograd.grad([*outs, lse], inputs, [*douts, dlse], retain_graph=True)
                errs = dict(err_dsrc=rel_list(grads[:n], ref[:n]), err_dq=rel(grads[n], ref[n]), err_dg=rel(grads[n + 1], ref[n + 1]))
                row.update({k: f"{v:.2e}" for k, v in errs.items()})
                del grads
                if max(errs.values()) > TOL:
                    row["status"] = "FAILED correctness"
                else:
                    fwd = do_bench(lambda: triton_routing.route_sites(sources, q, g, heads), warmup=10, rep=100, return_mode="median")
                    bwd = do_bench(lambda: torch.autograd.grad([*outs, lse], inputs, [*douts, dlse], retain_graph=True), warmup=10, rep=100, return_mode="median")
                    row.update(status="ok", fwd_ms=f"{fwd:.4f}", bwd_ms=f"{bwd:.4f}", both_ms=f"{fwd + bwd:.4f}",
                               bwd_GBps=f"{bwd_bytes / bwd / 1e6:.0f}", bwd_frac_copy=f"{bwd_bytes / bwd / 1e6 / copy_gbps:.3f}")
                del outs, lse
            except Exception as e:  # noqa: BLE001 - the two-pass kernel refuses too many sites at wide d
                row.update(status="error", note=f"S={S} " + repr(e)[:200])
        torch.cuda.empty_cache()
        writer.writerow(row)
        fh.flush()
        print(json.dumps(row), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=list(SCALES), required=True)
    ap.add_argument("--out", default=".")
    ap.add_argument("--heads", default="1,8")
    ap.add_argument("--sources", default="block,full", help="shapes: block (N = 9), full (N = 2L + 1), or both")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile of the reference")
    ap.add_argument("--variants", default="triton,triton-siteloop,triton-twopass,phase1,fla,liger,eager,compiled",
                    help="comma-separated subset to run (phase1: Block AttnRes's phase one, site-loop against two-pass backward)")
    args = ap.parse_args(argv)
    kinds = args.sources.split(",")
    if not kinds or any(k not in ("block", "full") for k in kinds):
        ap.error(f"--sources {args.sources!r}: give block, full or block,full")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.config.cache_size_limit = 64
    torch._functorch.config.donated_buffer = False  # the backward timing replays one graph (retain_graph)
    d, layers, _ = SCALES[args.scale]
    if DEVICE == "cpu":  # dry run: no events, no do_bench
        global do_bench
        do_bench = _cpu_timer
    copy_gbps = copy_bandwidth()
    print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    path = os.path.join(args.out, "op_bench.csv")
    new = not os.path.exists(path)
    peer_fns = peers()
    compiled = torch.compile(reference.depth_route, dynamic=False)
    with open(path, "a", newline="") as fh:
        writer = csv.DictWriter(fh, FIELDS)
        if new:
            writer.writeheader()
        # full routing at the end: a peer that crashes with an illegal address at the largest shape
        # leaves the CUDA context unusable, so it runs last in this process
        heads_list = [int(h) for h in args.heads.split(",")]
        if "phase1" in args.variants.split(","):
            for heads in heads_list:
                t0 = time.time()
                bench_phase_one(args.scale, 8, heads, copy_gbps, writer, fh)
                print(f"{args.scale} phase one N=8 H={heads}: {time.time() - t0:.0f}s", flush=True)
        shapes = [(9, h) for h in heads_list if "block" in kinds] + [(2 * layers + 1, h) for h in reversed(heads_list) if "full" in kinds]
        for n, heads in shapes:
            variants = {"triton": lambda s, q, g, h=heads: triton_routing.depth_route(s, q, g, h)}
            variants["triton-siteloop"] = variants["triton-twopass"] = variants["triton"]  # same forward, one backward each
            variants["triton-untuned"] = variants["triton"]  # the general rule's tiles (use_backward)
            if heads == 1:
                for k in ("liger", "fla"):
                    if k in peer_fns:
                        variants[k] = peer_fns[k]
            variants["eager"] = lambda s, q, g, h=heads: reference.depth_route(s, q, g, h)
            if not args.no_compile:
                variants["compiled"] = lambda s, q, g, h=heads: compiled(s, q, g, h)
            variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
            t0 = time.time()
            bench_shape(args.scale, n, heads, variants, copy_gbps, writer, fh)
            print(f"{args.scale} N={n} H={heads}: {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
