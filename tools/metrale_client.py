#!/usr/bin/python3
"""metrale_client: the bundled gRPC client. Sends a Generate request and prints what streams in
(token ids for an ids prompt, text for a text or chat prompt), then the finish reason, the stop
reason and the token counts; or chats, tokenizes, or prints the model info, stats or health.

    tools/metrale_client.py [--addr 127.0.0.1:50051] [--prompt 1,2,3 | --text "..." | --chat]
                            [--system "..."] [--chat-kwargs JSON] [--max-new 32]
                            [--temperature T] [--top-p P] [--top-k K] [--min-p P] [--seed N]
                            [--repetition-penalty R] [--presence-penalty P] [--frequency-penalty F]
                            [--stop STR]... [--include-stop] [--stop-ids 5,6] [--ignore-eos] [--no-speculation]
                            [--logprobs N] [--echo] [--no-special] [--keep-special] [--timeout S]
    tools/metrale_client.py --tokenize (--text "..." | --chat [--system "..."])
    tools/metrale_client.py --info | --stats | --health
    any of them with [--tls | --tls-ca CA.crt] [--tls-cert C.crt --tls-key C.key]
                     [--tls-server-name NAME] [--token-file FILE]

--text sends prompt_text and streams the generated text to stdout as it arrives. --chat reads
user lines from stdin (one turn a line, until end of input), keeps the conversation as messages
and prints each assistant reply as it streams. --tokenize prints the ids (and, for a chat, the
rendered prompt) the model would be fed. The text needs a model with a tokenizer (ModelInfo
has_tokenizer; --info shows it).

Security: --tls connects over TLS trusting the system's CAs, --tls-ca trusting FILE's;
--tls-cert and --tls-key present a client certificate (mutual TLS); --tls-server-name checks the
server's certificate for NAME instead of the address's host; --token-file sends
"authorization: Bearer <token>" (the file's first line) with every call.

Needs Debian's python3-grpcio and python3-protobuf; the Python stubs are generated from proto/ at
start, into a temp dir, with Debian's protoc and grpc_python_plugin (protobuf-compiler-grpc), or
grpc_tools.protoc where that is installed. Exit status: 0 when the stream ended normally, 1 on a
gRPC error (its code and message are printed), 2 on bad arguments.
"""

import argparse
import collections
import json
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


def sampling(a, metrale_pb2):
    return metrale_pb2.SamplingParams(
        temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
        repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty, has_seed=a.seed is not None, seed=a.seed or 0)


def stop_reason(f):
    which = f.WhichOneof("stop_reason")
    if which == "stop_string":
        return ", stop string %r" % f.stop_string
    if which == "stop_token_id":
        return ", stop token %d" % f.stop_token_id
    return ""


def speculation(f):
    if not f.HasField("speculation") or not f.speculation.verify_steps:
        return ""
    s = f.speculation
    return "; drafts accepted %d of %d, %.2f tokens a verify step" % (
        s.accepted_tokens, s.draft_tokens, (s.accepted_tokens + s.verify_steps) / s.verify_steps)


def final_line(f, metrale_pb2):
    return "finish: %s%s (prompt %d tokens, completion %d%s)%s" % (
        metrale_pb2.FinishReason.Name(f.finish_reason), stop_reason(f), f.usage.prompt_tokens,
        f.usage.completion_tokens, speculation(f), (": " + f.error_message) if f.error_message else "")


def token_line(t):
    alts = " ".join("%d:%.3f" % (x.token_id, x.logprob) for x in t.top_logprobs)
    raw = (" bytes %r" % t.bytes) if t.bytes else ""
    return "token %d logprob %.4f%s%s" % (t.token_id, t.logprob, raw, ("  top " + alts) if alts else "")


def stream(stub, req, a, metrale_pb2, text_mode):
    """Runs one Generate and prints it; returns (final, the streamed text)."""
    out = []
    final = None
    at_line_start = True
    for resp in stub.Generate(req, timeout=a.timeout):
        if resp.prompt_logprobs:
            print("prompt logprobs (positions 1..%d):" % len(resp.prompt_logprobs), file=sys.stderr)
            for t in resp.prompt_logprobs:
                print("  " + token_line(t), file=sys.stderr)
        for t in resp.tokens:
            if a.logprobs is not None:
                # beside streamed text the token lines go to stderr, so stdout holds the text
                print(token_line(t), file=sys.stderr if text_mode else sys.stdout, flush=True)
            elif not text_mode:
                print(" %d" % t.token_id, end="", flush=True)
        if resp.text:
            out.append(resp.text)
            if text_mode:
                sys.stdout.write(resp.text)
                sys.stdout.flush()
                at_line_start = resp.text.endswith("\n")
        if resp.HasField("final"):
            final = resp.final
    if (text_mode and not at_line_start) or (not text_mode and a.logprobs is None):
        print()
    return final, "".join(out)


def read_file(path):
    with open(path, "rb") as f:
        return f.read()


def open_channel(a, grpc):
    """The channel --addr and the TLS and token options ask for."""
    if a.tls or a.tls_ca or a.tls_cert:
        creds = grpc.ssl_channel_credentials(read_file(a.tls_ca) if a.tls_ca else None,
                                             read_file(a.tls_key) if a.tls_key else None,
                                             read_file(a.tls_cert) if a.tls_cert else None)
        opts = [("grpc.ssl_target_name_override", a.tls_server_name)] if a.tls_server_name else []
        ch = grpc.secure_channel(a.addr, creds, options=opts)
    else:
        ch = grpc.insecure_channel(a.addr)
    if not a.token_file:
        return ch
    with open(a.token_file) as f:
        token = f.readline().strip()
    md = ("authorization", "Bearer " + token)

    class Details(collections.namedtuple("Details", ("method", "timeout", "metadata", "credentials",
                                                     "wait_for_ready", "compression")), grpc.ClientCallDetails):
        pass

    class WithToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
        def _details(self, d):
            return Details(d.method, d.timeout, list(d.metadata or []) + [md], d.credentials, d.wait_for_ready,
                           d.compression)

        def intercept_unary_unary(self, cont, d, req):
            return cont(self._details(d), req)

        def intercept_unary_stream(self, cont, d, req):
            return cont(self._details(d), req)

    return grpc.intercept_channel(ch, WithToken())


def chat_messages(a, metrale_pb2):
    return [metrale_pb2.ChatMessage(role="system", content=a.system)] if a.system else []


def main():
    ap = argparse.ArgumentParser(description="metrale gRPC client: streams generated tokens or text.")
    ap.add_argument("--addr", default="127.0.0.1:50051")
    prompt = ap.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", type=ids, default=None, help="token ids, e.g. 1,2,3 (default 1..16)")
    prompt.add_argument("--text", default=None, help="a text prompt (prompt_text); streams text")
    prompt.add_argument("--chat", action="store_true", help="chat: user turns from stdin, one a line")
    ap.add_argument("--system", default=None, help="--chat: a system message first")
    ap.add_argument("--chat-kwargs", default=None, metavar="JSON",
                    help='--chat: extra template variables, e.g. \'{"enable_thinking": false}\'')
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=0.0)
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=[], metavar="STR",
                    help="a stop string (repeatable); the text ends before it")
    ap.add_argument("--include-stop", action="store_true", help="keep the matched stop string in the text")
    ap.add_argument("--stop-ids", type=ids, default=[], help="stop token ids, e.g. 5,6")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--no-speculation", action="store_true",
                    help="decode without speculative drafts where the server drafts")
    ap.add_argument("--logprobs", type=int, default=None, metavar="N",
                    help="print each token's logprob and its N most likely alternatives")
    ap.add_argument("--echo", action="store_true", help="print the prompt's logprobs (to stderr)")
    ap.add_argument("--no-special", action="store_true",
                    help="add no special tokens around the prompt (add_special_tokens false)")
    ap.add_argument("--keep-special", action="store_true",
                    help="keep special tokens in the streamed text (skip_special_tokens false)")
    ap.add_argument("--request-id", default="metrale-client")
    ap.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    ap.add_argument("--tls", action="store_true", help="TLS, trusting the system's CAs")
    ap.add_argument("--tls-ca", default=None, metavar="FILE", help="TLS, trusting the CA certificates in FILE")
    ap.add_argument("--tls-cert", default=None, metavar="FILE", help="mutual TLS: this client certificate")
    ap.add_argument("--tls-key", default=None, metavar="FILE", help="... and its key")
    ap.add_argument("--tls-server-name", default=None, metavar="NAME",
                    help="the name the server's certificate must carry (default: --addr's host)")
    ap.add_argument("--token-file", default=None, metavar="FILE",
                    help="send the bearer token on the file's first line with every call")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--info", action="store_true", help="print the model info")
    what.add_argument("--stats", action="store_true", help="print the router and worker counters")
    what.add_argument("--health", action="store_true", help="print the health status")
    what.add_argument("--tokenize", action="store_true", help="print the token ids of --text or --chat")
    a = ap.parse_args()
    if bool(a.tls_cert) != bool(a.tls_key):
        ap.error("--tls-cert and --tls-key go together")
    if a.tokenize and a.text is None and not a.chat:
        ap.error("--tokenize needs --text or --chat")
    if (a.system is not None or a.chat_kwargs is not None) and not a.chat:
        ap.error("--system and --chat-kwargs go with --chat")
    if a.chat_kwargs is not None:
        try:
            if not isinstance(json.loads(a.chat_kwargs), dict):
                raise ValueError("not an object")
        except ValueError as e:
            ap.error("--chat-kwargs must be a JSON object: %s" % e)

    out = tempfile.mkdtemp(prefix="metrale-client-")
    try:
        gen_stubs(out)
        import grpc
        from proto.grpc.health.v1 import health_pb2, health_pb2_grpc
        from proto.metrale.v1 import metrale_pb2, metrale_pb2_grpc

        ch = open_channel(a, grpc)
        stub = metrale_pb2_grpc.GenerationStub(ch)
        special = {}
        if a.no_special:
            special = {"has_add_special_tokens": True, "add_special_tokens": False}
        try:
            if a.info:
                info = stub.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=a.timeout or 10)
                for f in info.DESCRIPTOR.fields:  # every field, false and zero ones too
                    v = getattr(info, f.name)
                    print("%s: %s" % (f.name, " ".join(map(str, v)) if f.label == f.LABEL_REPEATED else v))
                return 0
            if a.stats:
                print(stub.GetStats(metrale_pb2.StatsRequest(), timeout=a.timeout or 10))
                return 0
            if a.health:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=a.timeout or 10)
                print(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))
                return 0
            if a.tokenize:
                if a.chat:
                    msgs = chat_messages(a, metrale_pb2)
                    msgs += [metrale_pb2.ChatMessage(role="user", content=line.rstrip("\n")) for line in sys.stdin]
                    req = metrale_pb2.TokenizeRequest(messages=msgs, chat_template_kwargs=a.chat_kwargs or "",
                                                      **special)
                else:
                    req = metrale_pb2.TokenizeRequest(text=a.text, **special)
                r = stub.Tokenize(req, timeout=a.timeout or 10)
                if a.chat:
                    print("prompt: %r" % r.prompt_text)
                print("ids:", " ".join(map(str, r.token_ids)))
                print("tokens: %d" % len(r.token_ids))
                return 0

            common = dict(
                sampling=sampling(a, metrale_pb2),
                stopping=metrale_pb2.StoppingCriteria(max_new_tokens=a.max_new, stop_token_ids=a.stop_ids,
                                                      ignore_eos=a.ignore_eos, stop=a.stop,
                                                      include_stop_str=a.include_stop),
                logprobs=a.logprobs is not None, top_logprobs=a.logprobs or 0, echo=a.echo,
                no_speculation=a.no_speculation, **special)
            if a.keep_special:
                common.update(has_skip_special_tokens=True, skip_special_tokens=False)

            if a.chat:
                msgs = chat_messages(a, metrale_pb2)
                turn = 0
                if sys.stdin.isatty():
                    print("chat: one user turn a line; end with Ctrl-D", file=sys.stderr)
                for line in sys.stdin:
                    line = line.rstrip("\n")
                    if not line:
                        continue
                    msgs.append(metrale_pb2.ChatMessage(role="user", content=line))
                    req = metrale_pb2.GenerateRequest(request_id="%s-%d" % (a.request_id, turn), messages=msgs,
                                                      chat_template_kwargs=a.chat_kwargs or "", **common)
                    print("assistant: ", end="", flush=True)
                    final, reply = stream(stub, req, a, metrale_pb2, True)
                    print(final_line(final, metrale_pb2), file=sys.stderr)
                    msgs.append(metrale_pb2.ChatMessage(role="assistant", content=reply))
                    turn += 1
                return 0

            if a.text is not None:
                req = metrale_pb2.GenerateRequest(request_id=a.request_id, prompt_text=a.text, **common)
                final, _ = stream(stub, req, a, metrale_pb2, True)
            else:
                prompt_ids = a.prompt if a.prompt is not None else list(range(1, 17))
                req = metrale_pb2.GenerateRequest(request_id=a.request_id, prompt_token_ids=prompt_ids, **common)
                print("prompt:", " ".join(map(str, prompt_ids)), flush=True)
                if a.logprobs is None:
                    print("generated:", end="", flush=True)
                final, text = stream(stub, req, a, metrale_pb2, False)
                if text:
                    print("text: %r" % text)
            if final is not None:
                print(final_line(final, metrale_pb2))
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
