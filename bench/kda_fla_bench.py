#!/usr/bin/env python3
"""bench/kda_fla_bench.py: flash-linear-attention's Triton KDA kernels (fla.ops.kda: chunk_kda,
fused_recurrent_kda) on the shapes of bench/kda_bench.c, for the combined table of
bench/kda_bench.sh.

  kda_fla_bench.py [--json FILE] [--check DIR] [--fp32]
  kda_fla_bench.py --merge OURS.jsonl FLA.jsonl [--json FILE]

Timing: triton.testing.do_bench (L2 flush, events around each call), median, >= 20 reps; the decode
rows also in steady state (*_steady: 20 calls back to back in a CUDA graph, no flush, as kda_bench.c)
and after a read-only flush (*_clean: L2 cold but clean, as kda_bench.c).
Inputs as fla is normally run in inference: bf16 q/k/v/beta, fp32 g (per-channel log-decay), fp32
state [B, H, K, V]; q/k l2-normalised beforehand (use_qk_l2norm_in_kernel=False, as our kernels
take them normalised), scale = K^-0.5, torch.inference_mode(). --fp32 adds fp32 q/k/v rows.
--check DIR: the small case kda_bench --dump DIR wrote (our inputs and kda_chunked outputs, fp32),
run through fused_recurrent_kda in fp32 and compared (our q is pre-scaled: scale=1).
--merge: the combined table (printed) and JSON of both sides.
"""
import argparse
import json
import math
import os
import statistics
import sys

NH, DK, T_PREFILL = 64, 128, 4096
FLUSH_FLOATS = 64 << 20  # 256 MB, as kda_bench.c's flush buffer


def emit(out, obj):
    line = json.dumps(obj)
    print(line, flush=True)
    if out:
        out.write(line + "\n")
        out.flush()


def bench_fla(args):
    os.environ.setdefault("FLA_FLASH_KDA", "0")  # fla's Triton kernels, not the optional CUTLASS backend
    import torch
    import triton
    from triton.testing import do_bench
    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    import fla

    out = open(args.json, "w") if args.json else None
    dev = "cuda"
    torch.manual_seed(0)
    emit(out, {"impl": "fla", "kind": "env", "fla": fla.__version__, "torch": torch.__version__,
               "triton": triton.__version__, "device": torch.cuda.get_device_name()})

    def make(B, T, H, dt):
        q = torch.nn.functional.normalize(torch.rand(B, T, H, DK, device=dev) * 2 - 1, dim=-1).to(dt)
        k = torch.nn.functional.normalize(torch.rand(B, T, H, DK, device=dev) * 2 - 1, dim=-1).to(dt)
        v = (torch.rand(B, T, H, DK, device=dev) * 2 - 1).to(dt)
        g = -torch.nn.functional.softplus(torch.rand(B, T, H, DK, device=dev) * 10 - 5)  # fp32, (-5, 0)
        beta = (0.02 + 0.96 * torch.rand(B, T, H, device=dev)).to(dt)
        h0 = torch.rand(B, H, DK, DK, device=dev) * 0.2 - 0.1
        return q, k, v, g, beta, h0

    def median_ms(fn):
        fn()
        torch.cuda.synchronize()
        est = do_bench(fn, warmup=5, rep=20, return_mode="median")
        rep = max(100.0, 25 * est)  # >= 20 reps even for the slow rows
        return do_bench(fn, warmup=25, rep=rep, return_mode="median")

    def steady_ms(fn, chain=20, reps=30):
        """Per-call ms with `chain` calls back to back (no flush), as kda_bench.c's *_steady rows;
        the calls are captured in a CUDA graph so that Python's launch cost does not leave the GPU
        idle between them (each call's outputs come from the graph's memory pool)."""
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(chain):
                    fn()
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            graph.replay()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / chain)
        del graph
        return statistics.median(times)

    flush = torch.zeros(FLUSH_FLOATS, device=dev)

    def clean_ms(fn, reps=120):
        """Per-call ms after a read-only pass over a 256 MB buffer (a sum: L2 cold and clean, no
        dirty lines left for the call to write back), as kda_bench.c's *_clean rows; median. Four
        passes, so the GPU is still busy with them while Python launches the call."""
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            for _ in range(4):
                flush.sum()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        return statistics.median(times)

    dtypes = [("bf16", torch.bfloat16)] + ([("fp32", torch.float32)] if args.fp32 else [])
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
    with torch.inference_mode():
        # cheapest first (no autotuning), so a time limit cuts only the tail
        for name, dt in dtypes:
            dlabel = f"{name} q/k/v/beta, fp32 g, fp32 state"
            for B in (32, 256):
                q, k, v, g, beta, h0 = make(B, 1, NH, dt)
                ms = median_ms(lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=h0,
                                                           output_final_state=True))
                sb = 2.0 * B * NH * DK * DK * 4
                emit(out, {"impl": "fla", "kind": "time", "row": f"decode_B{B}", "op": "fused_recurrent_kda",
                           "B": B, "T": 1, "H": NH, "K": DK, "dtype": dlabel, "ms": ms, "state_bytes": sb,
                           "state_gbs": sb / (ms * 1e-3) / 1e9})
                try:
                    ms = steady_ms(lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=h0,
                                                               output_final_state=True))
                    emit(out, {"impl": "fla", "kind": "time", "row": f"decode_B{B}_steady",
                               "op": "fused_recurrent_kda", "B": B, "T": 1, "H": NH, "K": DK, "dtype": dlabel,
                               "ms": ms, "state_bytes": sb, "state_gbs": sb / (ms * 1e-3) / 1e9})
                except Exception as e:  # the flushed row above stands on its own; say why this one is missing
                    emit(out, {"impl": "fla", "kind": "check", "name": f"decode_B{B}_steady not timed",
                               "error": str(e)[:200], "ok": False})
                ms = clean_ms(lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=h0,
                                                          output_final_state=True))
                emit(out, {"impl": "fla", "kind": "time", "row": f"decode_B{B}_clean",
                           "op": "fused_recurrent_kda", "B": B, "T": 1, "H": NH, "K": DK, "dtype": dlabel,
                           "ms": ms, "state_bytes": sb, "state_gbs": sb / (ms * 1e-3) / 1e9})
                del q, k, v, g, beta, h0
                torch.cuda.empty_cache()
        if args.check:
            check(args.check, fused_recurrent_kda, out)
        for name, dt in dtypes:
            dlabel = f"{name} q/k/v/beta, fp32 g, fp32 state"
            q, k, v, g, beta, h0 = make(1, T_PREFILL, NH, dt)
            ms = median_ms(lambda: chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True))
            emit(out, {"impl": "fla", "kind": "time", "row": "prefill_chunked", "op": "chunk_kda", "B": 1,
                       "T": T_PREFILL, "H": NH, "K": DK, "dtype": dlabel, "ms": ms, "state_bytes": 0})
            ms = median_ms(lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True))
            emit(out, {"impl": "fla", "kind": "time", "row": "prefill_recurrent", "op": "fused_recurrent_kda",
                       "B": 1, "T": T_PREFILL, "H": NH, "K": DK, "dtype": dlabel, "ms": ms, "state_bytes": 0})
            # fla's own consistency on the bench shape: chunk (dtype) vs fused_recurrent (fp32)
            o_c, s_c = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
            o_r, s_r = fused_recurrent_kda(q.float(), k.float(), v.float(), g, beta.float(),
                                          initial_state=h0, output_final_state=True)
            emit(out, {"impl": "fla", "kind": "check", "name": f"prefill {name}: chunk_kda vs fused_recurrent fp32",
                       "rel_err_o": rel(o_c, o_r), "rel_err_state": rel(s_c, s_r),
                       "finite": bool(torch.isfinite(o_c).all().item())})
            del q, k, v, g, beta, h0, o_c, o_r, s_c, s_r
            torch.cuda.empty_cache()
    if out:
        out.close()


def check(d, fused_recurrent_kda, out):
    """Ours (kda_chunked, fp32) against fla's fused_recurrent_kda in fp32 on the same inputs."""
    import torch
    meta = json.load(open(os.path.join(d, "meta.json")))
    T, H, K = meta["T"], meta["H"], meta["K"]

    def ld(name, shape):
        with open(os.path.join(d, name + ".f32"), "rb") as f:
            buf = bytearray(f.read())
        return torch.frombuffer(buf, dtype=torch.float32).reshape(shape).cuda()

    q, k, v, g = (ld(n, (1, T, H, K)) for n in ("q", "k", "v", "g"))
    beta = ld("beta", (1, T, H))
    h0 = ld("state0", (1, H, K, K))
    o_ours, s_ours = ld("o_chunked", (1, T, H, K)), ld("state_chunked", (1, H, K, K))
    o_ref, s_ref = fused_recurrent_kda(q, k, v, g, beta, scale=1.0, initial_state=h0, output_final_state=True)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    e_o, e_s = rel(o_ours, o_ref), rel(s_ours, s_ref)
    ok = e_o < 1e-4 and e_s < 1e-4 and bool(torch.isfinite(o_ours).all().item())
    emit(out, {"impl": "fla", "kind": "check", "name": f"ours kda_chunked vs fla fused_recurrent_kda fp32 (T={T}, H={H})",
               "rel_err_o": e_o, "rel_err_state": e_s, "tol": 1e-4, "ok": ok})


TARGETS = {
    "prefill_chunked": "ours >= 1.8x fla",
    "prefill_recurrent": "(info)",
    "decode_B32": "ours >= 90% of copy",
    "decode_B256": "ours >= 90% of copy",
    "decode_B32_steady": "ours >= 90% of copy",
    "decode_B256_steady": "ours >= 90% of copy",
    "decode_B32_clean": "ours >= 90% of copy",
    "decode_B256_clean": "ours >= 90% of copy",
    "copy_B32": "(info: cudaMemcpy of the same bytes)",
    "copy_B256": "(info: cudaMemcpy of the same bytes)",
    "copy_B32_steady": "(info: cudaMemcpy of the same bytes)",
    "copy_B256_steady": "(info: cudaMemcpy of the same bytes)",
    "copy_B32_clean": "(info: cudaMemcpy of the same bytes)",
    "copy_B256_clean": "(info: cudaMemcpy of the same bytes)",
}


def merge(args):
    ours, fla = [], []
    for path, dst in ((args.merge[0], ours), (args.merge[1], fla)):
        if os.path.exists(path):
            for line in open(path):
                line = line.strip()
                if line.startswith("{"):
                    dst.append(json.loads(line))
    copy = next((r["copy_gbs"] for r in ours if r.get("kind") == "copy"), float("nan"))
    device = next((r.get("device") for r in ours if r.get("kind") == "copy"), "?")
    o_t = {r["row"]: r for r in ours if r.get("kind") == "time"}
    f_t = {}
    for r in fla:
        if r.get("kind") == "time":
            f_t.setdefault(r["row"], []).append(r)
    rows = []
    for row in TARGETS:
        o = o_t.get(row)
        for f in f_t.get(row) or [None]:
            ref = o or f
            if ref is None:
                continue
            shape = f"B={ref['B']} T={ref['T']} H={ref['H']} K=V={ref['K']}"
            r = {"row": row, "shape": shape, "ours_op": o and o["op"], "fla_op": f and f["op"],
                 "ours_ms": o and o["ms"], "fla_ms": f and f["ms"], "fla_dtype": f and f["dtype"],
                 "ours_dtype": o and o["dtype"], "copy_gbs": copy, "target": TARGETS[row]}
            r["speedup"] = (f["ms"] / o["ms"]) if (o and f) else None
            sb = ref.get("state_bytes") or 0
            if sb:
                for who, x in (("ours", o), ("fla", f)):
                    if x:
                        gbs = sb / (x["ms"] * 1e-3) / 1e9
                        r[f"{who}_state_gbs"], r[f"{who}_frac_copy"] = gbs, gbs / copy
            if row == "prefill_chunked" and r["speedup"] is not None:
                r["met"] = r["speedup"] >= 1.8
            elif sb and o and row.startswith("decode"):
                r["met"] = r["ours_frac_copy"] >= 0.90
            rows.append(r)

    def f2(x, fmt):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)

    checks = [r for r in ours + fla if r.get("kind") == "check"]
    env = next((r for r in fla if r.get("kind") == "env"), None)
    print()
    if env:
        print(f"fla {env['fla']}, torch {env['torch']}, triton {env['triton']}")
    print(f"KDA kernels, ours (CUDA backend, fp32 I/O) vs flash-linear-attention (Triton) on {device}; "
          f"copy bandwidth {f2(copy, '.0f')} GB/s (cudaMemcpy D2D, read+write); median times")
    for c in checks:
        parts = [f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in c.items()
                 if k not in ("impl", "kind", "name")]
        print(f"  check [{c['impl']}] {c['name']}: " + ", ".join(parts))
    hdr = "| shape | fla op (dtype) | fla ms | ours ms | speedup ours/fla | state GB/s fla / ours | % of copy fla / ours | target | met |"
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for r in rows:
        state = pct = "-"
        if "ours_state_gbs" in r or "fla_state_gbs" in r:
            state = f"{f2(r.get('fla_state_gbs'), '.0f')} / {f2(r.get('ours_state_gbs'), '.0f')}"
            pct = (f"{f2(r.get('fla_frac_copy') and 100 * r['fla_frac_copy'], '.1f')} / "
                   f"{f2(r.get('ours_frac_copy') and 100 * r['ours_frac_copy'], '.1f')}")
        fop = f"{r['fla_op']} ({r['fla_dtype'].split(',')[0]})" if r["fla_op"] else "-"
        met = {True: "yes", False: "NO"}.get(r.get("met"), "-")
        sp = f2(r["speedup"], ".2f") + ("x" if r["speedup"] is not None else "")
        print(f"| {r['row']} {r['shape']} | {fop} | {f2(r['fla_ms'], '.4f')} | {f2(r['ours_ms'], '.4f')} | "
              f"{sp} | {state} | {pct} | {r['target']} | {met} |")
    print("ours: fp32 q/k/v/g/beta, fp32 state; fla dtypes as listed (g and state fp32). "
          "speedup = fla ms / ours ms.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "copy_gbs": copy, "fla_env": env, "rows": rows, "checks": checks}, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--check")
    ap.add_argument("--fp32", action="store_true")
    ap.add_argument("--merge", nargs=2, metavar=("OURS", "FLA"))
    args = ap.parse_args()
    if args.merge:
        merge(args)
    else:
        bench_fla(args)


if __name__ == "__main__":
    sys.exit(main())
