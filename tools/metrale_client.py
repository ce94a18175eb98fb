#!/usr/bin/python3
"""metrale_client: the bundled gRPC client. Sends a Generate request and prints the token ids as
they stream in, then the finish reason and usage; or prints the model info, stats or health.

    tools/metrale_client.py [--addr 127.0.0.1:50051] [--prompt 1,2,3] [--max-new 32]
                            [--temperature T] [--top-p P] [--top-k K] [--min-p P] [--seed N]
                            [--repetition-penalty R] [--presence-penalty P] [--frequency-penalty F]
                            [--stop 5,6] [--ignore-eos] [--logprobs N] [--timeout S]
    tools/metrale_client.py --info | --stats | --health

Needs Debian's python3-grpcio and python3-protobuf; the Python stubs are generated from proto/ at
start, into a temp dir, with Debian's protoc and grpc_python_plugin (protobuf-compiler-grpc), or
grpc_tools.protoc where that is installed. Exit status: 0 when the stream ended normally, 1 on a
gRPC error (its code and message are printed), 2 on bad arguments.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTOS = ["proto/metrale/v1/metrale.proto", "proto/grpc/health/v1/health.proto"]


def gen_stubs(out):
    try:
        from grpc_tools import protoc  # noqa: F401  (pip's grpcio-tools, when present)
        cmd, plugin = [sys.executable, "-m", "grpc_tools.protoc"], []
    except ImportError:
        if not shutil.which("protoc"):
            sys.exit("metrale_client: protoc not found (Debian: protobuf-compiler, protobuf-compiler-grpc)")
        plugin_path = shutil.which("grpc_python_plugin") or "/usr/bin/grpc_python_plugin"
        cmd, plugin = ["protoc"], ["--plugin=protoc-gen-grpc_python=" + plugin_path]
    subprocess.run(cmd + plugin + ["-I.", "--python_out=" + out, "--grpc_python_out=" + out] + PROTOS,
                   check=True, cwd=ROOT)
    sys.path.insert(0, out)


def ids(s):
    try:
        v = [int(x) for x in s.split(",") if x.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError("expected comma-separated token ids, got %r" % s)
    if any(x < 0 for x in v):
        raise argparse.ArgumentTypeError("token ids are non-negative")
    return v


def main():
    ap = argparse.ArgumentParser(description="metrale gRPC client: streams generated token ids.")
    ap.add_argument("--addr", default="127.0.0.1:50051")
    ap.add_argument("--prompt", type=ids, default=list(range(1, 17)), help="token ids, e.g. 1,2,3")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=0.0)
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", type=ids, default=[], help="stop token ids, e.g. 5,6")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--logprobs", type=int, default=None, metavar="N",
                    help="print each token's logprob and its N most likely alternatives")
    ap.add_argument("--request-id", default="metrale-client")
    ap.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--info", action="store_true", help="print the model info")
    what.add_argument("--stats", action="store_true", help="print the router and worker counters")
    what.add_argument("--health", action="store_true", help="print the health status")
    a = ap.parse_args()

    out = tempfile.mkdtemp(prefix="metrale-client-")
    try:
        gen_stubs(out)
        import grpc
        from proto.grpc.health.v1 import health_pb2, health_pb2_grpc
        from proto.metrale.v1 import metrale_pb2, metrale_pb2_grpc

        ch = grpc.insecure_channel(a.addr)
        stub = metrale_pb2_grpc.GenerationStub(ch)
        try:
            if a.info:
                print(stub.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=a.timeout or 10))
                return 0
            if a.stats:
                print(stub.GetStats(metrale_pb2.StatsRequest(), timeout=a.timeout or 10))
                return 0
            if a.health:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=a.timeout or 10)
                print(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))
                return 0
            sp = metrale_pb2.SamplingParams(
                temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
                repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
                frequency_penalty=a.frequency_penalty, has_seed=a.seed is not None, seed=a.seed or 0)
            req = metrale_pb2.GenerateRequest(
                request_id=a.request_id, prompt_token_ids=a.prompt, sampling=sp,
                stopping=metrale_pb2.StoppingCriteria(max_new_tokens=a.max_new, stop_token_ids=a.stop,
                                                      ignore_eos=a.ignore_eos),
                logprobs=a.logprobs is not None, top_logprobs=a.logprobs or 0)
            print("prompt:", " ".join(map(str, a.prompt)), flush=True)
            if a.logprobs is None:
                print("generated:", end="", flush=True)
            for resp in stub.Generate(req, timeout=a.timeout):
                for t in resp.tokens:
                    if a.logprobs is None:
                        print(" %d" % t.token_id, end="", flush=True)
                    else:
                        alts = " ".join("%d:%.3f" % (x.token_id, x.logprob) for x in t.top_logprobs)
                        print("token %d logprob %.4f%s" % (t.token_id, t.logprob, ("  top " + alts) if alts else ""),
                              flush=True)
                if resp.HasField("final"):
                    f = resp.final
                    if a.logprobs is None:
                        print()
                    print("finish: %s (prompt %d tokens, completion %d)%s" % (
                        metrale_pb2.FinishReason.Name(f.finish_reason), f.usage.prompt_tokens,
                        f.usage.completion_tokens, (": " + f.error_message) if f.error_message else ""))
            return 0
        except grpc.RpcError as e:
            print("\nerror: %s: %s" % (e.code().name, e.details()), file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\ncancelled", file=sys.stderr)
            return 1
    finally:
        shutil.rmtree(out, True)


if __name__ == "__main__":
    sys.exit(main())
