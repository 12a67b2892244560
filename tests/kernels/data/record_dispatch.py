"""Record which kernel and tile the code at 85cbf51 (tag ``kernel-knobs-final``) launches for each
routing call the models make; writes ``dispatch_85cbf51.txt.gz``, the table ``test_dispatch.py``
holds the dispatch plan to.

    git archive kernel-knobs-final | tar -x -C /tmp/knobs
    python tests/kernels/data/record_dispatch.py /tmp/knobs tests/kernels/data/dispatch_85cbf51.txt.gz

Runs the depth histories as the model does (routing only, stand-in sublayers) at the presets'
widths and depths, every kernel launch replaced by a recorder (nothing runs) and the tile rule
forced to the GPU's; decoding's warps are the GPU's (the interpreter takes 4). CPU only, a minute.
"""

import gzip
import json
import os
import shutil
import sys
import tempfile

checkout, out_path = sys.argv[1], sys.argv[2]
package = tempfile.mkdtemp()  # lit_mhar with kernels/ inside, as the install maps it
shutil.copytree(os.path.join(checkout, "lit_mhar"), os.path.join(package, "lit_mhar"))
shutil.copytree(os.path.join(checkout, "kernels"), os.path.join(package, "lit_mhar", "kernels"))
sys.path.insert(0, package)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from lit_mhar import routing  # noqa: E402
from lit_mhar.kernels import triton_routing as tr  # noqa: E402
from lit_mhar.kernels import use_backend  # noqa: E402

assert tr.__file__.startswith(package), tr.__file__
SCALES = {"20m": (384, 8), "100m": (512, 12), "350m": (1024, 24), "1b": (1280, 36)}
HEADS = (1, 4, 8, 16)

LOG = []
CTX = {}


class Spy:
    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        def launch(*args, **kw):
            kw = {k: v for k, v in kw.items() if k not in ("DOT_F32",)}
            LOG.append(dict(ctx=dict(CTX), kernel=self.name, grid_rank=len(grid), kw=kw))
        return launch


tr._kernel = lambda name, interpret: Spy(name)
_tile = tr._tile
tr._tile = lambda kind, n, d, h, interpret: _tile(kind, n, d, h, False)
_forward, _backward = tr._forward, tr._backward


def fwd(sources, queries, gains, heads, eps, stream, gate, prior_out, prior_lse, store_scores, save_rstd=False, norm_weight=None, norm_eps=0.0, save_routed=False):
    CTX.clear()
    CTX.update(op="forward", sources=len(sources), sites=queries.shape[0], d=(sources[0] if sources else prior_out).shape[-1], heads=heads,
               dtype=str((sources[0] if sources else prior_out).dtype).split(".")[-1], additive=stream is not None, prior=prior_out is not None,
               norm=norm_weight is not None, scores=bool(store_scores), save_rstd=bool(save_rstd), save_routed=bool(save_routed))
    return _forward(sources, queries, gains, heads, eps, stream, gate, prior_out, prior_lse, store_scores, save_rstd, norm_weight, norm_eps, save_routed)


def bwd(sources, queries, gains, heads, eps, gate, prior_out, prior_lse, lse, grad_outs, grad_lse, rstd=None, norm_weight=None, norm_eps=0.0,
        stream=None, sink=None, stream_replay=False, rebuild=False, saved_routed=False, earlier_outputs=()):
    like = sources[0] if sources else prior_out
    CTX.clear()
    CTX.update(op="backward", sources=1 if rebuild else len(sources), sites=queries.shape[0], d=like.shape[-1], heads=heads,
               dtype=str(like.dtype).split(".")[-1], grad_dtype=str(grad_outs[0].dtype).split(".")[-1], additive=gate is not None,
               prior=prior_out is not None, norm=norm_weight is not None, rstd=rstd is not None and rstd.numel() > 0,
               replay=bool(stream_replay), rebuild=bool(rebuild), saved_routed=bool(saved_routed), earlier=len(earlier_outputs),
               sink=sink is not None, dlse=grad_lse is not None)
    return _backward(sources, queries, gains, heads, eps, gate, prior_out, prior_lse, lse, grad_outs, grad_lse, rstd, norm_weight, norm_eps,
                     stream, sink, stream_replay, rebuild, saved_routed, earlier_outputs)


tr._forward, tr._backward = fwd, bwd
_rnd, _rsd = tr.route_norm_decode, tr.route_sites_decode


def rnd(history, n_sources, pending, accumulate, query, gain, heads, norm_weight, norm_eps, stream=None, gate=None, eps=1e-6,
        prior_out=None, prior_lse=None, n_prior=0):
    CTX.clear()
    CTX.update(op="decode", form="decode-merge" if prior_out is not None else "decode", sources=n_sources - n_prior, sites=1,
               d=history.shape[-1], heads=heads, dtype=str(history.dtype).split(".")[-1], pending=pending is not None)
    return _rnd(history, n_sources, pending, accumulate, query, gain, heads, norm_weight, norm_eps, stream, gate, eps, prior_out, prior_lse, n_prior)


def rsd(history, n_sources, queries, gains, heads=1, eps=1e-6):
    CTX.clear()
    CTX.update(op="decode", form="decode-sites", sources=n_sources, sites=queries.shape[0], d=history.shape[-1], heads=heads,
               dtype=str(history.dtype).split(".")[-1], pending=False)
    return _rsd(history, n_sources, queries, gains, heads, eps)


tr.route_norm_decode, tr.route_sites_decode = rnd, rsd


def train(d, n_layer, heads, block, additive, dtype, tokens=4):
    n = 2 * n_layer
    sites = [routing.RoutingSite(d, heads, additive, 1e-6) for _ in range(n + 1)]
    norms = [nn.RMSNorm(d, eps=1e-6) for _ in range(n + 1)]
    scale = [nn.Parameter(torch.ones(())) for _ in range(n)]
    for s in sites:
        s.query.data.normal_()
    emb = torch.randn(tokens, d, requires_grad=True)
    with use_backend("triton"):
        history = routing.DepthHistory(emb.to(dtype), block, sites, two_phase=True)
        h = emb if additive else None
        for l in range(n):
            if additive:
                h = history.track_stream(h)
            y = history.route_norm(sites[l], norms[l], h)
            out = (y.float() * scale[l]).to(dtype)
            if additive:
                h = history.append(out, l, stream=h)
            else:
                history.append(out, l)
        if additive:
            h = history.track_stream(h)
        y = history.route_norm(sites[n], norms[n], h)
        y.float().sum().backward()


def per_site(d, heads, n_src, additive, dtype, scores, tokens=4):
    """depth_route at one site (probes, the reference-free per-site path): forward and backward."""
    srcs = [torch.randn(tokens, d).to(dtype).requires_grad_() for _ in range(n_src)]
    q, g = torch.randn(d, requires_grad=True), torch.ones(d, requires_grad=True)
    stream = torch.randn(tokens, d, requires_grad=True) if additive else None
    gate = torch.randn(d, requires_grad=True) if additive else None
    with use_backend("triton"):
        from lit_mhar.kernels import depth_route
        out = depth_route(srcs, q, g, heads, stream, gate, return_weights=scores)
    if scores:
        return
    out.float().sum().backward()


def decode(d, n_layer, heads, block, additive, dtype, tokens):
    n = 2 * n_layer
    sites = [routing.RoutingSite(d, heads, additive, 1e-6) for _ in range(n + 1)]
    norms = [nn.RMSNorm(d, eps=1e-6) for _ in range(n + 1)]
    with torch.no_grad(), use_backend("triton"):
        emb = torch.randn(tokens, d)
        history = routing.DecodeHistory(emb.to(dtype), block, n, sites)
        h = emb if additive else None
        for l in range(n):
            y = history.route_norm(sites[l], norms[l], h)
            out = y.to(dtype)
            h = history.append(out, l, stream=h)
        history.route_norm(sites[n], norms[n], h)


def run_all():
    records = []

    def collect(context, fn, *args):
        LOG.clear()
        fn(*args)
        records.append(dict(context=context, launches=list(LOG)))

    for scale, (d, n_layer) in SCALES.items():
        for heads in HEADS:
            for dtype in (torch.bfloat16, torch.float32):
                dt = str(dtype).split(".")[-1]
                for additive in (False, True):
                    for block in (1, 2 * n_layer // 8):
                        for compiled in ((False, True) if dtype == torch.bfloat16 else (False,)):
                            ctx = dict(kind="train", scale=scale, heads=heads, dtype=dt, additive=additive, block=block, compiled=compiled)
                            if compiled:
                                orig = torch.compiler.is_compiling
                                torch.compiler.is_compiling = lambda: True
                                try:
                                    collect(ctx, train, d, n_layer, heads, block, additive, dtype)
                                finally:
                                    torch.compiler.is_compiling = orig
                            else:
                                collect(ctx, train, d, n_layer, heads, block, additive, dtype)
                        for tokens in (1, 4):
                            collect(dict(kind="decode", scale=scale, heads=heads, dtype=dt, additive=additive, block=block, tokens=tokens),
                                    decode, d, n_layer, heads, block, additive, dtype, tokens)
                    for n_src in sorted({1, 2, 3, 8, 9, 2 * n_layer + 1}):
                        for scores in (False, True):
                            collect(dict(kind="per_site", scale=scale, heads=heads, dtype=dt, additive=additive, sources=n_src, scores=scores),
                                    per_site, d, heads, n_src, additive, dtype, scores)
    return records




old = run_all()
for r in old:
    for launch in r["launches"]:
        if launch["kernel"] == "decode":
            launch["kw"]["num_warps"] = {0: tr.DECODE_WARPS, 1: 8, 2: 4, 3: tr.DECODE_SITES_WARPS}[launch["kw"]["PHASE"]]
old = json.loads(json.dumps(old, default=str))
RENAME = {"ONE": "KEEP_SOURCE", "TILE_PF": "PREFETCH_TILE"}
PLAN_KEYS = {
    "fwd": ("BS", "BM", "BH", "BDH", "DT", "num_warps"),
    "fwd_sites_mix": ("BS", "BSO", "BN", "BM", "num_warps"),
    "fwd_sites_dot": ("DHP", "DT", "BS", "BN", "BM", "num_warps"),
    "bwd": ("BS", "BM", "BH", "BDH", "DT", "num_warps", "KEEP_SOURCE", "PREFETCH_TILE"),
    "bwd_stats": ("BM", "BH", "BDH", "DT", "num_warps", "HAS_RSTD"),
    "bwd_sources": ("BM", "BH", "BDH", "DT", "num_warps", "HAS_RSTD"),
    "bwd_stats_dot": ("DHP", "DT", "BS", "BN", "BM", "STORE_SA", "STORE_T", "num_warps"),
    "bwd_sources_dot": ("BH", "DHP", "DT", "BS", "BN", "BM", "num_warps", "num_stages"),
    "decode": ("BH", "BDH", "CH", "NSP", "PHASE", "num_warps"),
}
def form(c):
    if c["op"] == "decode":
        return c["form"]
    name = ("merge" if c["prior"] else "route") + ("-norm" if c["norm"] else "")
    return name + ("-additive" if c["additive"] else "")
rows = {}
for r in old:
    groups = []
    for l in r["launches"]:
        c = l["ctx"]
        if not groups or groups[-1][0] != c or (l["kernel"] in ("fwd", "fwd_sites_mix", "fwd_sites_dot", "bwd") and groups[-1][1]) and c["op"] != "decode" and c["op"] != "backward":
            groups.append((c, []))
        groups[-1][1].append(l)
    for c, ls in groups:
        # one call's launches: forward = 1 launch; backward = 1 (bwd) or 2+ (site loop); decode = 1 or 2
        calls = []
        if c["op"] == "forward":
            calls = [[l] for l in ls]
        elif c["op"] == "backward":
            cur = []
            for l in ls:
                if l["kernel"] in ("bwd", "bwd_stats", "bwd_stats_dot") and cur:
                    calls.append(cur); cur = []
                cur.append(l)
            calls.append(cur)
        else:
            cur = []
            for l in ls:
                if l["kw"]["PHASE"] in (0, 1, 3) and cur:
                    calls.append(cur); cur = []
                cur.append(l)
            calls.append(cur)
        for call in calls:
            if c["op"] == "decode":
                key = (c["form"], c["sources"], c["sites"], c["d"], c["heads"], c["dtype"], c["dtype"], True, False, True, c["pending"])
            else:
                eager = c.get("saved_routed", True) if c["op"] == "backward" else True
                if c["op"] == "backward" and form(c) == "merge-norm" and c["sources"] >= 3:
                    eager = c["saved_routed"]
                key = (form(c), c["sources"], c["sites"], c["d"], c["heads"], c["dtype"], c.get("grad_dtype", c["dtype"]),
                       eager, c.get("rebuild", False), c.get("rstd", True) if c["op"] == "backward" else True, False)
            launches = []
            for l in call:
                kw = {RENAME.get(k, k): v for k, v in l["kw"].items()}
                launches.append([l["kernel"], {k: kw[k] for k in PLAN_KEYS[l["kernel"]] if k in kw}])
            side = "backward" if c["op"] == "backward" else "forward"
            rows.setdefault(key, {}).setdefault(side, [])
            prev = rows[key][side]
            if prev and prev != launches:
                raise SystemExit(f"two answers for {key}: {prev} {launches}")
            rows[key][side] = launches


def fmt(launches):
    if not launches:
        return "-"
    return " + ".join(k + "(" + ",".join(f"{a}={int(v) if isinstance(v, bool) else v}" for a, v in m.items()) + ")" for k, m in launches)


lines = [
    "# The dispatch of lit-mhar at 85cbf51 (tag kernel-knobs-final): for each routing call the models make",
    "# (d 384 / 512 / 1024 / 1280 with L 8 / 12 / 24 / 36; H 1, 4, 8, 16; full and 8-block routing; MHAR and",
    "# Delta; bf16 and float32; eager and compiled; decoding; single sites), the kernels launched and their tiles.",
    "# Recorded by tests/kernels/data/record_dispatch.py from the kernels' launches. Columns: form N S d H dtype",
    "# grad eager rebuild rstd pending | forward launches | backward launches.",
]
for key, sides in sorted(rows.items(), key=lambda kv: str(kv[0])):
    form_, n, s, d, h, dt, gdt, eager, rebuild, rstd, pending = key
    lines.append(
        f"{form_} {n} {s} {d} {h} {dt} {gdt} {int(eager)} {int(rebuild)} {int(rstd)} {int(pending)} | "
        f"{fmt(sides.get('forward'))} | {fmt(sides.get('backward'))}"
    )
with open(out_path, "wb") as fh:
    fh.write(gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0))
print(len(lines) - 5, "calls")
