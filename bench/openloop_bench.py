#!/usr/bin/python3
"""openloop_bench: time to first token and inter-token latency under an open-loop load of mixed
prompt lengths, through the real metrale-router and a metrale-worker (figures: docs/PERF.md).

Open loop: request i arrives at a Poisson time of the offered rate, whether or not earlier ones
have finished (a closed loop would slow its arrivals when the server slows, hiding queueing).
Each request draws its prompt length from --prompt-mix and its new tokens from --new-mix (uniform
over the list; prompts of distinct tokens, greedy, ignore_eos). For each rate: offered and served
requests/s, output tokens/s, TTFT p50/p99 (arrival -> first token at the client) and ITL p50/p99
(gaps between consecutive token messages of a stream), all measured at the gRPC client.

    bazel build //router:metrale-router //worker:metrale-worker
    bench/openloop_bench.py [--model DIR] [--rates 2,8,32] [--requests 64] [--prompt-mix 16,64,256]
                            [--new-mix 16,64] [--backend cpu|cuda] [--max-sequences 64] [--worker-args "..."] [--json FILE]

The service is the one bench/serving_bench.py starts (router + one worker on loopback). Binaries
come from bazel-bin unless METRALE_ROUTER_BIN / METRALE_WORKER_BIN name others (a gpu-bundle).
"""

import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import serving_bench as sb  # noqa: E402  (Service, pct, stubs)


def run_rate(svc, rate, a, vocab, rng):
    from proto.metrale.v1 import metrale_pb2 as pb
    n = a.requests
    arrivals, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        arrivals.append(t)
    shapes = [(rng.choice(a.prompt_mix), rng.choice(a.new_mix)) for _ in range(n)]
    ttft, gaps, ntok, errors = [None] * n, [[] for _ in range(n)], [0] * n, []

    def one(i, t0):
        plen, new = shapes[i]
        req = pb.GenerateRequest(
            request_id="ol-%g-%d" % (rate, i), prompt_token_ids=[(i * 131 + k * 7 + 1) % vocab for k in range(plen)],
            stopping=pb.StoppingCriteria(max_new_tokens=new, ignore_eos=True))
        arrive = t0 + arrivals[i]
        delay = arrive - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        last = None
        try:
            for resp in svc.stub.Generate(req, timeout=3600):
                now = time.perf_counter()
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
        sys.exit("openloop_bench: %d requests failed at %g req/s, e.g. %s" % (len(errors), rate, errors[0]))
    tt = [x for x in ttft if x is not None]
    gg = [g for gs in gaps for g in gs]
    return {"rate": rate, "requests": n, "offered_req_s": n / arrivals[-1], "served_req_s": n / wall,
            "tok_per_s": sum(ntok) / wall, "wall_s": wall,
            "ttft_p50_ms": 1e3 * sb.pct(tt, 0.5), "ttft_p99_ms": 1e3 * sb.pct(tt, 0.99),
            "itl_p50_ms": 1e3 * sb.pct(gg, 0.5), "itl_p99_ms": 1e3 * sb.pct(gg, 0.99)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(sb.ROOT, "tests/fixtures/tiny_a"))
    ap.add_argument("--rates", default="2,8,32", help="offered requests per second, comma-separated")
    ap.add_argument("--requests", type=int, default=64, help="requests per rate")
    ap.add_argument("--prompt-mix", default="16,64,256")
    ap.add_argument("--new-mix", default="16,64")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--max-sequences", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--worker-args", default="", help="more metrale-worker options, e.g. \"--no-mixed-steps\"")
    ap.add_argument("--stubs", help="a folder of generated Python stubs (else made here with protoc)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if not a.model.startswith("random:"):
        a.model = os.path.abspath(a.model)
    a.prompt_mix = [int(x) for x in a.prompt_mix.split(",")]
    a.new_mix = [int(x) for x in a.new_mix.split(",")]
    rates = [float(x) for x in a.rates.split(",")]
    stubs = a.stubs or tempfile.mkdtemp(prefix="metrale-bench-stubs-")
    try:
        if a.stubs:
            sys.path.insert(0, a.stubs)
        else:
            sb.metrale_client.gen_stubs(stubs)
        from proto.metrale.v1 import metrale_pb2 as pb
        svc = sb.Service(a, a.max_sequences, max(a.prompt_mix) + max(a.new_mix))
        try:
            vocab = svc.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=30).vocab_size
            for _ in svc.stub.Generate(pb.GenerateRequest(request_id="warm", prompt_token_ids=[1, 2, 3],
                                                          stopping=pb.StoppingCriteria(max_new_tokens=4,
                                                                                       ignore_eos=True)), timeout=600):
                pass
            rng = random.Random(a.seed)
            rows = []
            for r in rates:
                rows.append(run_rate(svc, r, a, vocab, rng))
                print("  %g req/s done" % r, file=sys.stderr, flush=True)
        finally:
            svc.close()
    finally:
        if not a.stubs:
            shutil.rmtree(stubs, True)
    print("metrale openloop_bench: %s, %s backend, prompts %s tokens, new %s tokens, %d requests a rate, "
          "Poisson arrivals, through metrale-router + 1 metrale-worker" % (
              a.model if a.model.startswith("random:") else os.path.relpath(a.model, sb.ROOT), a.backend,
              a.prompt_mix, a.new_mix, a.requests))
    print("| offered req/s | served req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |")
    print("|--------------:|-------------:|-------------:|------------:|------------:|-----------:|-----------:|")
    for r in rows:
        print("| %13.2f | %12.2f | %12.1f | %11.1f | %11.1f | %10.2f | %10.2f |" % (
            r["offered_req_s"], r["served_req_s"], r["tok_per_s"], r["ttft_p50_ms"], r["ttft_p99_ms"],
            r["itl_p50_ms"], r["itl_p99_ms"]))
    result = {"bench": "openloop_bench", "model": a.model, "backend": a.backend, "prompt_mix": a.prompt_mix,
              "new_mix": a.new_mix, "rows": rows}
    sb.emit_json(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
