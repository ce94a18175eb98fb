#!/usr/bin/env bash
# gpu_serve_smoke.sh BUNDLE STUBS: the served path on a GPU machine (which has no Bazel, ZeroMQ
# or gRPC of its own): metrale-serve --backend cuda over a fixture checkpoint, one greedy Generate
# through Python grpcio with stubs made elsewhere (protoc + grpc_python_plugin), compared with
# metrale-generate --backend cuda on the same prompt. BUNDLE is a ../shared/tools/gpu-bundle
# folder holding metrale-serve, metrale-router, metrale-worker and metrale-generate:
#   gpu-bundle BUNDLE bazel-bin/launcher/metrale-serve bazel-bin/router/metrale-router \
#     bazel-bin/worker/metrale-worker bazel-bin/worker/cli/metrale-generate
# metrale-serve finds the other two beside itself in BUNDLE/bin.
set -u
bundle=$1 stubs=$2 model=${3:-tests/fixtures/tiny_a} addr=127.0.0.1:50077
lib=$bundle/lib
prompt=3,1,4,1,5,9,2,6,5,3
want=$(LD_LIBRARY_PATH=$lib "$bundle/bin/metrale-generate" --backend cuda --model "$model" --prompt $prompt --max-new 16 2>/dev/null |
       sed -n 's/^generated: //p')
METRALE_ROUTER_BIN=$bundle/bin/metrale-router METRALE_WORKER_BIN=$bundle/bin/metrale-worker \
  LD_LIBRARY_PATH=$lib "$bundle/bin/metrale-serve" --backend cuda --model "$model" --listen $addr --workers 1 > /tmp/serve.log 2>&1 &
serve=$!
PYTHONPATH=$stubs python3 - "$addr" "$prompt" "$want" <<'PY'
import sys, time, grpc
from proto.metrale.v1 import metrale_pb2 as pb, metrale_pb2_grpc as rpc
from proto.grpc.health.v1 import health_pb2, health_pb2_grpc
addr, prompt, want = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], sys.argv[3]
ch = grpc.insecure_channel(addr)
for _ in range(120):
    try:
        if health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
            break
    except grpc.RpcError:
        pass
    time.sleep(0.5)
info = rpc.GenerationStub(ch).GetModelInfo(pb.ModelInfoRequest(), timeout=5)
req = pb.GenerateRequest(request_id="gpu-smoke", prompt_token_ids=prompt,
                         stopping=pb.StoppingCriteria(max_new_tokens=16, ignore_eos=True))
got = []
for r in rpc.GenerationStub(ch).Generate(req, timeout=30):
    got += [t.token_id for t in r.tokens]
    if r.HasField("final"):
        fin = pb.FinishReason.Name(r.final.finish_reason)
got = " ".join(map(str, got))
print("backend:", info.backend, "| served:", got, "|", fin)
print("metrale-generate --backend cuda:", want)
print("MATCH" if got == want else "MISMATCH")
sys.exit(0 if got == want else 1)
PY
rc=$?
kill -TERM $serve; wait $serve
grep -E "live|cuda|error|cannot" /tmp/serve.log | head -5
exit $rc
