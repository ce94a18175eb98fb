#!/usr/bin/python3
"""openloop_bench: time to first token and inter-token latency under an open-loop load of mixed
prompt lengths, through the real metrale-router and a metrale-worker (figures: docs/PERF.md).

Open loop: request i arrives at a Poisson time of the offered rate, whether or not earlier ones
have finished (a closed loop would slow its arrivals when the server slows, hiding queueing).
Each request draws its prompt length from --prompt-mix and its new tokens from --new-mix (uniform
over the list, prompt then new, request by request; greedy, ignore_eos). Request j of the run
(counted over every rate) has a prompt of its own: its first two tokens spell j in base vocab, so
no two requests share a prefix and a later rate reuses nothing an earlier one left in the
worker's prefix cache. For each rate: offered and served requests/s, output tokens/s, TTFT
p50/p99 (arrival -> first token at the client) and ITL p50/p99 (gaps between consecutive token
messages of a stream) with their ratio (how much worse the worst gaps are than the typical one),
all measured at the gRPC client; the JSON adds the requests that gave all
their tokens.

    bazel build //router:metrale-router //worker:metrale-worker //bench:serving_direct
    bench/openloop_bench.py [--model DIR] [--rates 2,8,32] [--requests 64] [--prompt-mix 16,64,256]
                            [--new-mix 16,64] [--shared-prefix N] [--backend cpu|cuda]
                            [--max-sequences 64] [--worker-args "..."] [--direct] [--json FILE]
    bench/openloop_bench.py --goodput [--slo-ttft-ms 250] [--slo-itl-ms 25] [--goodput-lo 0.5]
                            [--goodput-hi 64] [--goodput-steps 5] [--requests 300] [...]

--goodput: the highest offered rate at which TTFT p99 <= --slo-ttft-ms and ITL p99 <=
--slo-itl-ms both hold, found by bisection between --goodput-lo and --goodput-hi req/s. hi is
probed first: when it meets the SLOs, goodput is reported as at least hi. Then lo: when it misses
them, there is no goodput in the range and the final line says so. Otherwise --goodput-steps
bisection steps follow, each at the geometric mean of the highest rate that met the SLOs and the
lowest that missed them (rates span decades); goodput is the highest that met them. Every probed
rate is a row of the table, with whether it met the SLOs, and the last line is "goodput: X req/s
(TTFT p99 <= ..., ITL p99 <= ...)". A p99 needs >= 300 requests a rate (with fewer it is one of
the few slowest samples, and bisection chases noise): --requests defaults to 300 here, 64 for
--rates.

--shared-prefix N: every prompt starts with the same N tokens (distinct from the per-request
part after them), so the worker's prefix reuse can hit. The worker keeps the state at the last
multiple of its 64-token prefix block of a prompt (leaving one token), so a hit needs N >= 64 and
prompts whose kept boundary falls within the shared part (N + prompt <= 128 keeps exactly 64
when N = 64). The responses' Usage has no cached-token count; the table and the JSON give the
worker's prefix hits instead (GetStats: requests that reused a kept prefix), and their share of
the rate's requests.

--direct: after the served rates, bench/serving_direct runs the same mix (--prompt-mix, --new-mix,
--shared-prefix, --requests, --seed, --max-sequences) with every request submitted at t = 0
straight to the engine, no router: the engine's own figure for the mix, printed as the last row
(its draws are reproducible from the seed but are not the ones Python's random makes here).

The service is the one bench/serving_bench.py starts (router + one worker on loopback), kept up
across every rate. Binaries come from bazel-bin unless METRALE_ROUTER_BIN / METRALE_WORKER_BIN /
METRALE_DIRECT_BIN name others (a gpu-bundle).
"""

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import serving_bench as sb  # noqa: E402  (Service, pct, stubs)


def prompt_tokens(j, plen, shared, vocab):
    """Request j's prompt: `shared` tokens common to every request, then plen of its own (the
    first two spell j in base vocab). bench/serving_direct.c's mix_prompt makes the same."""
    head = [(k * 17 + 3) % vocab for k in range(shared)]
    own = [j % vocab if k == 0 else (j // vocab) % vocab if k == 1 else (j * 131 + k * 7 + 1) % vocab
           for k in range(plen)]
    return head + own


def worker_counts(svc):
    """Summed over the workers: (prefix_hits, prefix_misses, sequences_finished)."""
    from proto.metrale.v1 import metrale_pb2 as pb
    st = svc.stub.GetStats(pb.StatsRequest(), timeout=30)
    return (sum(w.prefix_hits for w in st.workers), sum(w.prefix_misses for w in st.workers),
            sum(w.sequences_finished for w in st.workers))


def settled_counts(svc, finished):
    """worker_counts once they count `finished` sequences: the worker's counters reach GetStats
    with its heartbeat, a little after the last token (at most 5 s waited)."""
    end = time.monotonic() + 5
    c = worker_counts(svc)
    while c[2] < finished and time.monotonic() < end:
        time.sleep(0.05)
        c = worker_counts(svc)
    return c


def measure_rate(svc, rate, a, vocab, rng, first_j):
    """One rate: a.requests Poisson arrivals at `rate` req/s, requests first_j.. of the run.
    Returns the row (figures at the client, plus the worker's prefix hits over the rate)."""
    from proto.metrale.v1 import metrale_pb2 as pb
    n = a.requests
    arrivals, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        arrivals.append(t)
    shapes = [(rng.choice(a.prompt_mix), rng.choice(a.new_mix)) for _ in range(n)]
    ttft, gaps, ntok, errors = [None] * n, [[] for _ in range(n)], [0] * n, []
    before = worker_counts(svc)  # settled: the previous rate's (or the warm-up's) are counted

    def one(i, t0):
        plen, new = shapes[i]
        req = pb.GenerateRequest(
            request_id="ol-%g-%d" % (rate, i),
            prompt_token_ids=prompt_tokens(first_j + i, plen, a.shared_prefix, vocab),
            stopping=pb.StoppingCriteria(max_new_tokens=new, ignore_eos=True))
        arrive = t0 + arrivals[i]
        delay = arrive - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        last = None
        try:
            for resp in svc.stub.Generate(req, timeout=3600):
                now = time.perf_counter()
                if resp.HasField("final") and resp.final.finish_reason == pb.FINISH_REASON_ERROR:
                    errors.append("request %d: %s" % (i, resp.final.error_message))
                if not resp.tokens:
                    continue
                if last is None:
                    ttft[i] = now - arrive
                else:
                    gaps[i].append((now - last) / len(resp.tokens))
                last = now
                ntok[i] += len(resp.tokens)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append("request %d: %s" % (i, e))

    t0 = time.perf_counter() + 0.2
    th = [threading.Thread(target=one, args=(i, t0)) for i in range(n)]
    for x in th:
        x.start()
    for x in th:
        x.join()
    wall = time.perf_counter() - t0
    if errors:
        sys.exit("openloop_bench: %d requests failed at %g req/s, e.g. %s\nthe service's last log lines:\n%s" % (
            len(errors), rate, errors[0], svc.log_tail()))
    after = settled_counts(svc, before[2] + n)
    tt = [x for x in ttft if x is not None]
    gg = [g for gs in gaps for g in gs]
    hits = after[0] - before[0]
    return {"rate": rate, "requests": n, "completed": sum(ntok[i] == shapes[i][1] for i in range(n)),
            "tokens": sum(ntok), "tokens_expected": sum(s[1] for s in shapes),
            "offered_req_s": n / arrivals[-1], "served_req_s": n / wall,
            "tok_per_s": sum(ntok) / wall, "wall_s": wall,
            "ttft_p50_ms": 1e3 * sb.pct(tt, 0.5), "ttft_p99_ms": 1e3 * sb.pct(tt, 0.99),
            "itl_p50_ms": 1e3 * sb.pct(gg, 0.5), "itl_p99_ms": 1e3 * sb.pct(gg, 0.99),
            "itl_p99_over_p50": sb.pct(gg, 0.99) / sb.pct(gg, 0.5) if gg and sb.pct(gg, 0.5) > 0 else None,
            "prefix_hits": hits, "prefix_misses": after[1] - before[1], "prefix_hit_frac": hits / n}


def meets_slo(row, a):
    return row["ttft_p99_ms"] <= a.slo_ttft_ms and row["itl_p99_ms"] <= a.slo_itl_ms


def find_goodput(probe, a):
    """Bisection on the offered rate (see the module doc). probe(rate) measures one rate and
    returns its row. Returns {"goodput_req_s": rate or None, "goodput_bound": "lower" (hi met the
    SLOs: goodput >= hi) | "bisected" | "none" (lo missed them), "goodput_miss_req_s": the lowest
    rate that missed them or None}."""
    if meets_slo(probe(a.goodput_hi), a):
        return {"goodput_req_s": a.goodput_hi, "goodput_bound": "lower", "goodput_miss_req_s": None}
    if not meets_slo(probe(a.goodput_lo), a):
        return {"goodput_req_s": None, "goodput_bound": "none", "goodput_miss_req_s": a.goodput_lo}
    good, bad = a.goodput_lo, a.goodput_hi
    for _ in range(a.goodput_steps):
        mid = math.sqrt(good * bad)
        if meets_slo(probe(mid), a):
            good = mid
        else:
            bad = mid
    return {"goodput_req_s": good, "goodput_bound": "bisected", "goodput_miss_req_s": bad}


def run_direct(a):
    """bench/serving_direct on the same mix, every request at t = 0; its JSON object."""
    cmd = [sb.binary("bench/serving_direct"), "--model", a.model, "--backend", a.backend,
           "--threads", str(a.threads), "--prompt-mix", ",".join(map(str, a.prompt_mix)),
           "--new-mix", ",".join(map(str, a.new_mix)), "--requests", str(a.requests), "--seed", str(a.seed),
           "--shared-prefix", str(a.shared_prefix), "--max-sequences", str(a.max_sequences)]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, universal_newlines=True)
    if out.returncode != 0:
        sys.exit("openloop_bench: serving_direct failed (exit %d): %s" % (out.returncode, " ".join(cmd)))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(sb.ROOT, "tests/fixtures/tiny_a"))
    ap.add_argument("--rates", default="2,8,32", help="offered requests per second, comma-separated")
    ap.add_argument("--requests", type=int, help="requests per rate (default 64; --goodput: 300, "
                    "the fewest a p99 needs)")
    ap.add_argument("--prompt-mix", default="16,64,256")
    ap.add_argument("--new-mix", default="16,64")
    ap.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                    help="the same N-token system prompt before every request's own tokens")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--max-sequences", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--worker-args", default="", help="more metrale-worker options, e.g. \"--mixed-steps\"")
    ap.add_argument("--goodput", action="store_true",
                    help="find the highest rate meeting the SLOs by bisection (instead of --rates)")
    ap.add_argument("--slo-ttft-ms", type=float, default=250.0, help="TTFT p99 bound (default 250)")
    ap.add_argument("--slo-itl-ms", type=float, default=25.0, help="ITL p99 bound (default 25)")
    ap.add_argument("--goodput-lo", type=float, default=0.5, help="lowest rate probed, req/s (default 0.5)")
    ap.add_argument("--goodput-hi", type=float, default=64.0, help="highest rate probed, req/s (default 64)")
    ap.add_argument("--goodput-steps", type=int, default=5, help="bisection steps after hi and lo (default 5)")
    ap.add_argument("--direct", action="store_true",
                    help="then run bench/serving_direct on the same mix, all at t = 0, no router")
    ap.add_argument("--stubs", help="a folder of generated Python stubs (else made here with protoc)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if not a.model.startswith("random:"):
        a.model = os.path.abspath(a.model)
    a.prompt_mix = [int(x) for x in a.prompt_mix.split(",")]
    a.new_mix = [int(x) for x in a.new_mix.split(",")]
    if a.requests is None:
        a.requests = 300 if a.goodput else 64
    if a.goodput and not 0 < a.goodput_lo < a.goodput_hi:
        ap.error("--goodput needs 0 < --goodput-lo < --goodput-hi")
    if a.goodput and a.requests < 300:
        print("openloop_bench: %d requests a rate; a p99 needs >= 300" % a.requests, file=sys.stderr)
    if a.shared_prefix < 0:
        ap.error("--shared-prefix is >= 0")
    rates = [float(x) for x in a.rates.split(",")]
    stubs = a.stubs or tempfile.mkdtemp(prefix="metrale-bench-stubs-")
    rows, goodput = [], None
    try:
        if a.stubs:
            sys.path.insert(0, a.stubs)
        else:
            sb.metrale_client.gen_stubs(stubs)
        from proto.metrale.v1 import metrale_pb2 as pb
        svc = sb.Service(a, a.max_sequences, a.shared_prefix + max(a.prompt_mix) + max(a.new_mix))
        try:
            vocab = svc.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=30).vocab_size
            for _ in svc.stub.Generate(pb.GenerateRequest(request_id="warm", prompt_token_ids=[1, 2, 3],
                                                          stopping=pb.StoppingCriteria(max_new_tokens=4,
                                                                                       ignore_eos=True)), timeout=600):
                pass
            settled_counts(svc, 1)  # the warm-up's, before the first rate's counters are taken
            rng = random.Random(a.seed)

            def probe(r):
                row = measure_rate(svc, r, a, vocab, rng, len(rows) * a.requests)
                if a.goodput:
                    row["meets_slo"] = meets_slo(row, a)
                rows.append(row)
                print("  %g req/s done%s" % (r, "" if not a.goodput else
                                             ": SLOs met" if row["meets_slo"] else ": SLOs missed"),
                      file=sys.stderr, flush=True)
                return row

            if a.goodput:
                goodput = find_goodput(probe, a)
            else:
                for r in rates:
                    probe(r)
        finally:
            svc.close()
        direct = run_direct(a) if a.direct else None
    finally:
        if not a.stubs:
            shutil.rmtree(stubs, True)
    print("metrale openloop_bench: %s, %s backend, prompts %s tokens%s, new %s tokens, %d requests a rate, "
          "Poisson arrivals, through metrale-router + 1 metrale-worker" % (
              a.model if a.model.startswith("random:") else os.path.relpath(a.model, sb.ROOT), a.backend,
              a.prompt_mix, " after a shared %d-token prefix" % a.shared_prefix if a.shared_prefix else "",
              a.new_mix, a.requests))
    extra = [("ITL p99/p50", lambda r: "-" if r["itl_p99_over_p50"] is None else "%.1fx" % r["itl_p99_over_p50"])]
    if a.shared_prefix:
        extra.append(("prefix hits", lambda r: "%d (%.0f%%)" % (r["prefix_hits"], 100 * r["prefix_hit_frac"])))
    if a.goodput:
        extra.append(("SLOs", lambda r: "met" if r["meets_slo"] else "missed"))
    print("| offered req/s | served req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |" +
          "".join(" %s |" % h for h, _ in extra))
    print("|--------------:|-------------:|-------------:|------------:|------------:|-----------:|-----------:|" +
          "".join("%s:|" % ("-" * (len(h) + 1)) for h, _ in extra))
    for r in rows:
        print("| %13.2f | %12.2f | %12.1f | %11.1f | %11.1f | %10.2f | %10.2f |" % (
            r["offered_req_s"], r["served_req_s"], r["tok_per_s"], r["ttft_p50_ms"], r["ttft_p99_ms"],
            r["itl_p50_ms"], r["itl_p99_ms"]) + "".join(" %*s |" % (len(h), f(r)) for h, f in extra))
    if direct:
        print("| direct, all at 0 | %12.2f | %12.1f | %11.1f | %11.1f | %10.2f | %10.2f | %10s |%s" % (
            direct["requests"] / direct["wall_s"], direct["tok_per_s"], direct["ttft_p50_ms"],
            direct["ttft_p99_ms"], direct["itl_p50_ms"], direct["itl_p99_ms"],
            "%.1fx" % (direct["itl_p99_ms"] / direct["itl_p50_ms"]) if direct["itl_p50_ms"] > 0 else "-",
            " %d (%.0f%%) |" % (direct["prefix_hits"], 100.0 * direct["prefix_hits"] / direct["requests"])
            if a.shared_prefix else ""))
        print("(direct: bench/serving_direct, the same mix submitted to the engine in-process, no router)")
    result = {"bench": "openloop_bench", "model": a.model, "backend": a.backend, "prompt_mix": a.prompt_mix,
              "new_mix": a.new_mix, "shared_prefix": a.shared_prefix, "requests": a.requests, "seed": a.seed,
              "max_sequences": a.max_sequences, "rows": rows}
    if a.goodput:
        slo = "TTFT p99 <= %g ms, ITL p99 <= %g ms" % (a.slo_ttft_ms, a.slo_itl_ms)
        g = goodput["goodput_req_s"]
        if goodput["goodput_bound"] == "none":
            print("goodput: none: even %g req/s misses the SLOs (%s)" % (a.goodput_lo, slo))
        elif goodput["goodput_bound"] == "lower":
            print("goodput: >= %g req/s (%s; the highest rate probed, --goodput-hi, meets them)" % (g, slo))
        else:
            print("goodput: %.3g req/s (%s; %.3g req/s misses them)" % (g, slo, goodput["goodput_miss_req_s"]))
        result.update(goodput)
        result.update({"slo_ttft_ms": a.slo_ttft_ms, "slo_itl_ms": a.slo_itl_ms, "goodput_lo": a.goodput_lo,
                       "goodput_hi": a.goodput_hi, "goodput_steps": a.goodput_steps})
    if direct:
        result["direct"] = direct
    sb.emit_json(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
