#!/usr/bin/python3
"""serving_bench: what the router + ZeroMQ path costs, measured against the engine called
directly, at 1, 16 and 64 concurrent streams, in one run (figures: docs/PERF.md).

For each concurrency C, back to back on the same machine and model:
  direct  bazel-bin/bench/serving_direct: C streams submitted to worker/engine in-process;
          token times taken in the engine's on_tokens callback;
  served  the real metrale-router and one metrale-worker (started here, on loopback: gRPC on a
          free 127.0.0.1 port, ZeroMQ on an ipc:// socket), C concurrent Generate streams from
          this Python gRPC client (Debian python3-grpcio); token times taken when each response
          message arrives in the client.
Same requests in both (stream i: prompt (i * 7 + k) % vocab, greedy, ignore_eos, --max-new
tokens). Figures: tokens/s over the run (first submit to last token), time to first token, and
per-token latency = mean interval between consecutive tokens of a stream. "added" is served
minus direct: the cost of gRPC + router + ZeroMQ + the worker loop, as a client sees it.

    bazel build //bench:serving_direct //router:metrale-router //worker:metrale-worker
    bench/serving_bench.py [--model DIR] [--streams 1,16,64] [--max-new 32] [--prompt-len 16]
                           [--backend cpu|cuda] [--threads N] [--json FILE]

Default model: tests/fixtures/tiny_a (a 4-layer, hidden-64 glm5_next), where a step is cheapest
and the serving overhead is the largest share; pass --model .cache/cpu-small for the serve default.
METRALE_SERVICE_LOG=FILE keeps the service's log (router and worker lines) in FILE when it stops.
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import metrale_client  # noqa: E402  (stub generation)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary(rel):
    env = {"router/metrale-router": "METRALE_ROUTER_BIN", "worker/metrale-worker": "METRALE_WORKER_BIN",
           "bench/serving_direct": "METRALE_DIRECT_BIN"}.get(rel)
    if env and os.environ.get(env):  # a gpu-bundle's copy, on a machine without Bazel
        return os.environ[env]
    p = os.path.join(ROOT, "bazel-bin", rel)
    if not os.path.exists(p):
        sys.exit("serving_bench: %s missing; run: bazel build //bench:serving_direct //router:metrale-router "
                 "//worker:metrale-worker" % p)
    return p


def emit_json(result, path):
    """The result as one JSON line on stdout, and into path when given."""
    print(json.dumps(result))
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def pct(xs, q):
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))]


class Service:
    """metrale-router + one metrale-worker on loopback."""

    def __init__(self, a, max_sequences, max_context):
        import grpc
        from proto.grpc.health.v1 import health_pb2, health_pb2_grpc
        from proto.metrale.v1 import metrale_pb2_grpc
        # A unix socket path is limited to 107 bytes: keep the ipc endpoint short (a test's TMPDIR
        # under Bazel is long).
        base = tempfile.gettempdir()
        self.dir = tempfile.mkdtemp(prefix="metrale-bench-", dir=base if len(base) <= 60 else "/tmp")
        ep = "ipc://" + os.path.join(self.dir, "w.sock")
        self.addr = "127.0.0.1:%d" % free_port()
        self.log = open(os.path.join(self.dir, "service.log"), "wb")
        self.procs = [subprocess.Popen([binary("router/metrale-router"), "--listen", self.addr,
                                        "--workers-endpoint", ep], stdout=self.log, stderr=subprocess.STDOUT)]
        self.procs.append(subprocess.Popen(
            [binary("worker/metrale-worker"), "--model", a.model, "--router", ep, "--id", "0",
             "--backend", a.backend, "--threads", str(a.threads), "--max-sequences", str(max_sequences),
             "--max-context", str(max_context)] + (getattr(a, "worker_args", None) or "").split(),
            stdout=self.log, stderr=subprocess.STDOUT))
        self.channel = grpc.insecure_channel(self.addr)
        self.stub = metrale_pb2_grpc.GenerationStub(self.channel)
        health = health_pb2_grpc.HealthStub(self.channel)
        end = time.monotonic() + 60
        while True:
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            if time.monotonic() > end or any(p.poll() is not None for p in self.procs):
                self.close()
                sys.exit("serving_bench: the service did not become SERVING; log: " + self.log.name)
            time.sleep(0.1)

    def log_tail(self, lines=40):
        """The last lines the router and worker wrote, less the router's line a request (for a
        failure's message: close removes them)."""
        self.log.flush()
        try:
            with open(self.log.name, "rb") as f:
                text = f.read().decode("utf-8", "replace").splitlines()
        except OSError as e:
            return "(no service log: %s)" % e
        return "\n".join([t for t in text if " request_id=" not in t][-lines:])

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                p.kill()
        self.channel.close()
        self.log.close()
        if os.environ.get("METRALE_SERVICE_LOG"):  # keep the router's and worker's log lines
            shutil.copyfile(self.log.name, os.environ["METRALE_SERVICE_LOG"])
        shutil.rmtree(self.dir, True)


def served(svc, streams, a, vocab):
    from proto.metrale.v1 import metrale_pb2 as pb

    def req(i, n):
        return pb.GenerateRequest(
            request_id="bench-%d" % i, prompt_token_ids=[(i * 7 + k) % vocab for k in range(a.prompt_len)],
            stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True))

    for _ in svc.stub.Generate(req(0, 2), timeout=120):  # warm-up
        pass
    times = [[] for _ in range(streams)]
    errors = []
    barrier = threading.Barrier(streams + 1)

    def run(i):
        barrier.wait()
        try:
            for resp in svc.stub.Generate(req(i, a.max_new), timeout=3600):
                now = time.perf_counter()
                times[i].extend([now] * len(resp.tokens))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append("stream %d: %s" % (i, e))

    th = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for t in th:
        t.start()
    t0 = time.perf_counter()
    barrier.wait()
    for t in th:
        t.join()
    wall = max(ts[-1] for ts in times if ts) - t0 if any(times) else 0.0
    if errors:
        sys.exit("serving_bench: %d streams failed, e.g. %s\nthe service's last log lines:\n%s" % (
            len(errors), errors[0], svc.log_tail()))
    tokens = sum(len(ts) for ts in times)
    gaps = [b - a_ for ts in times for a_, b in zip(ts, ts[1:])]
    itl = mean([(ts[-1] - ts[0]) / (len(ts) - 1) for ts in times if len(ts) > 1])
    return {"streams": streams, "tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall if wall else 0.0,
            "ttft_ms": 1e3 * mean([ts[0] - t0 for ts in times if ts]), "itl_ms": 1e3 * itl,
            "itl_p50_ms": 1e3 * pct(gaps, 0.5), "itl_p99_ms": 1e3 * pct(gaps, 0.99)}


def direct(streams, a):
    out = subprocess.run([binary("bench/serving_direct"), "--model", a.model, "--streams", str(streams),
                          "--max-new", str(a.max_new), "--prompt-len", str(a.prompt_len), "--backend", a.backend,
                          "--threads", str(a.threads)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "tests/fixtures/tiny_a"))
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0, help="CPU backend threads, both sides (0 = all cores)")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    a.model = os.path.abspath(a.model)
    levels = [int(x) for x in a.streams.split(",")]
    stubs = tempfile.mkdtemp(prefix="metrale-bench-stubs-")
    try:
        metrale_client.gen_stubs(stubs)
        from proto.metrale.v1 import metrale_pb2 as pb
        svc = Service(a, max(levels), a.prompt_len + a.max_new)
        try:
            vocab = svc.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10).vocab_size
            rows = []
            for c in levels:
                d = direct(c, a)
                s = served(svc, c, a, vocab)
                rows.append({"streams": c, "direct": d, "served": s,
                             "added_ms_per_token": s["itl_ms"] - d["itl_ms"],
                             "added_ttft_ms": s["ttft_ms"] - d["ttft_ms"],
                             "served_over_direct_tok_s": s["tok_per_s"] / d["tok_per_s"] if d["tok_per_s"] else 0.0})
                print("  %d streams done" % c, file=sys.stderr, flush=True)
        finally:
            svc.close()
    finally:
        shutil.rmtree(stubs, True)

    print("metrale serving_bench: %s, %s backend, threads %s, prompt %d, %d new tokens per stream, greedy" % (
        os.path.relpath(a.model, ROOT), a.backend, a.threads or "all", a.prompt_len, a.max_new))
    print("direct = worker/engine in-process; served = gRPC client -> metrale-router -> ZeroMQ -> metrale-worker")
    print("| streams | direct tok/s | served tok/s | served/direct | direct ms/token | served ms/token "
          "| added ms/token | direct TTFT ms | served TTFT ms |")
    print("|--------:|-------------:|-------------:|--------------:|----------------:|----------------:"
          "|---------------:|---------------:|---------------:|")
    for r in rows:
        d, s = r["direct"], r["served"]
        print("| %7d | %12.1f | %12.1f | %12.1f%% | %15.3f | %15.3f | %14.3f | %14.1f | %14.1f |" % (
            r["streams"], d["tok_per_s"], s["tok_per_s"], 100 * r["served_over_direct_tok_s"], d["itl_ms"],
            s["itl_ms"], r["added_ms_per_token"], d["ttft_ms"], s["ttft_ms"]))
    result = {"bench": "serving_bench", "model": os.path.relpath(a.model, ROOT), "backend": a.backend,
              "threads": a.threads, "prompt_len": a.prompt_len, "max_new": a.max_new, "rows": rows}
    emit_json(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
