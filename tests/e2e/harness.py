"""End-to-end harness: starts the real metrale-router and metrale-worker processes on loopback
(gRPC on a free 127.0.0.1 port, ZeroMQ on an ipc:// endpoint in a temp dir) and talks to them
with Debian's python3-grpcio, like any client would (redis's start_server, in Python).

Stubs are generated from proto/ at import time into a temp dir with Debian's protoc and
grpc_python_plugin (protobuf-compiler-grpc), or grpc_tools.protoc where that exists.

Paths are relative to the Bazel runfiles root (the working directory of `bazel test`); outside
Bazel, run from the workspace root after `bazel build //router/... //worker/... //launcher/...`:
missing runfiles paths fall back to bazel-bin/.
"""

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import grpc

PROTOS = ["proto/metrale/v1/metrale.proto", "proto/grpc/health/v1/health.proto"]
ROUTER_BIN = "router/metrale-router"
WORKER_BIN = "worker/metrale-worker"
LAUNCHER_BIN = "launcher/metrale-serve"
GENERATE_BIN = "worker/cli/metrale-generate"
MODEL_DIR = "tests/fixtures/tiny_a"


def path(rel):
    """A runfile, or its bazel-bin twin when run from the workspace root."""
    if os.path.exists(rel):
        return rel
    alt = os.path.join("bazel-bin", rel)
    if os.path.exists(alt):
        return alt
    raise FileNotFoundError(rel + " (not in the runfiles nor in bazel-bin/)")


def _gen_stubs():
    out = tempfile.mkdtemp(prefix="metrale-stubs-")
    atexit.register(shutil.rmtree, out, True)
    try:
        from grpc_tools import protoc  # noqa: F401  (pip's grpcio-tools, when present)
        cmd = [sys.executable, "-m", "grpc_tools.protoc"]
        plugin = []
    except ImportError:
        plugin_path = shutil.which("grpc_python_plugin") or "/usr/bin/grpc_python_plugin"
        cmd = ["protoc"]
        plugin = ["--plugin=protoc-gen-grpc_python=" + plugin_path]
    subprocess.run(cmd + plugin + ["-I.", "--python_out=" + out, "--grpc_python_out=" + out] + PROTOS,
                   check=True)
    sys.path.insert(0, out)


_gen_stubs()
from proto.grpc.health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from proto.metrale.v1 import metrale_pb2, metrale_pb2_grpc  # noqa: E402

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def wait_for(cond, timeout, what, step=0.02):
    end = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError("timed out after %.1f s waiting for %s" % (timeout, what))
        time.sleep(step)


def request(rid, prompt, max_new=8, **kw):
    """A GenerateRequest; kw goes to the message (sampling=..., logprobs=...)."""
    stopping = kw.pop("stopping", None) or metrale_pb2.StoppingCriteria(max_new_tokens=max_new, ignore_eos=True)
    return metrale_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt, stopping=stopping, **kw)


class Cluster:
    """One router and n workers. Use as a context manager; on exit the router gets SIGTERM (a
    clean drain, so sanitizer builds report) and whatever is left is killed.

    Worker i has id i and identity "w<i>". Logs go to files in self.dir (printed on failure).

    router_args go to the router as they are; connect(addr) makes the client channel (default:
    plaintext) and metadata goes with the calls the harness makes (a bearer token)."""

    def __init__(self, workers=1, queue=None, drain_timeout=None, model=MODEL_DIR, max_sequences=None,
                 worker_args=(), router_args=(), connect=None, metadata=None, metrics=False):
        # A unix socket path is limited to 107 bytes: keep the ipc endpoint short.
        base = tempfile.gettempdir()
        self.dir = tempfile.mkdtemp(prefix="metrale-e2e-", dir=base if len(base) <= 60 else "/tmp")
        self.endpoint = "ipc://" + os.path.join(self.dir, "workers.sock")
        self.model = model
        self.max_sequences = max_sequences
        self.worker_args = list(worker_args)
        self.metadata = metadata
        self.logs = []
        # METRALE_E2E_ROUTER: another router build (e.g. one with -fsanitize=address).
        # Port 0: the router binds a free port and logs it (no race with other tests for a port).
        args = [os.environ.get("METRALE_E2E_ROUTER") or path(ROUTER_BIN), "--listen", "127.0.0.1:0",
                "--workers-endpoint", self.endpoint]
        if queue is not None:
            args += ["--queue", str(queue)]
        if drain_timeout is not None:
            args += ["--drain-timeout", str(drain_timeout)]
        if metrics:  # /metrics on a free port, logged like the gRPC one
            args += ["--metrics", "127.0.0.1:0"]
        self.router = self._spawn("router", args + list(router_args))
        self.workers = {}
        self.channel = None
        try:
            self.port = wait_for(self._logged_port, 10, "the router to log its port")
            self.addr = "127.0.0.1:%d" % self.port
            if metrics:
                self.metrics_addr = "127.0.0.1:%d" % wait_for(
                    lambda: logged_port(self.logs[0][1], rb"metrics on port (\d+)"), 10, "the metrics port")
            for i in range(workers):
                self.start_worker(i)
            self.channel = (connect or grpc.insecure_channel)(self.addr)
            self.gen = metrale_pb2_grpc.GenerationStub(self.channel)
            self.health = health_pb2_grpc.HealthStub(self.channel)
            grpc.channel_ready_future(self.channel).result(timeout=10)
            self.wait_workers(workers)
        except BaseException:
            self.dump_logs()
            self.close()
            raise

    def _logged_port(self):
        if self.router.poll() is not None:
            raise AssertionError("the router exited with %d at start" % self.router.returncode)
        return logged_port(self.logs[0][1], rb"listening on port (\d+)")

    def metrics(self):
        """The router's /metrics, parsed (see parse_metrics)."""
        return parse_metrics(scrape(self.metrics_addr))

    def router_log(self):
        with open(self.logs[0][1], "rb") as f:
            return f.read().decode(errors="replace")

    def health_port(self):
        """The --health-listen port the router logged, or None."""
        m = re.search(r"health port (\d+)", self.router_log())
        return int(m.group(1)) if m else None

    def _spawn(self, name, args):
        fn = os.path.join(self.dir, name + ".log")
        self.logs.append((name, fn))
        with open(fn, "wb") as log:  # the child keeps its own descriptor
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def worker_cmd(self, i):
        # One thread per worker: the model is tiny and CI has 2 cores for everything.
        args = [path(WORKER_BIN), "--model", path(self.model), "--router", self.endpoint, "--id", str(i),
                "--threads", "1"]
        if self.max_sequences:
            args += ["--max-sequences", str(self.max_sequences)]
        return args + self.worker_args

    def start_worker(self, i):
        self.workers[i] = self._spawn("worker%d" % i if i not in self.workers else "worker%d.%d" % (i, time.time_ns()),
                                      self.worker_cmd(i))

    def stats(self):
        return self.gen.GetStats(metrale_pb2.StatsRequest(), timeout=5, metadata=self.metadata)

    def live_workers(self):
        return [w for w in self.stats().workers if w.alive]

    def wait_workers(self, n, timeout=20):
        wait_for(lambda: len(self.live_workers()) >= n, timeout, "%d live workers" % n, step=0.05)

    def check(self, service=""):
        return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def kill_worker(self, i, sig=signal.SIGKILL):
        self.workers[i].send_signal(sig)
        if sig == signal.SIGKILL:
            self.workers[i].wait(5)

    def terminate_router(self, timeout=30):
        """SIGTERM the router; returns its exit code."""
        self.router.send_signal(signal.SIGTERM)
        return self.router.wait(timeout)

    def dump_logs(self, out=sys.stderr):
        for name, fn in self.logs:
            try:
                with open(fn, "rb") as f:
                    data = f.read()[-6000:].decode(errors="replace")
            except OSError:
                continue
            out.write("---- %s (%s) ----\n%s\n" % (name, fn, data))

    def close(self):
        if self.channel is not None:
            self.channel.close()
        if self.router.poll() is None:  # a clean drain, so leak checkers get to report
            self.router.send_signal(signal.SIGTERM)
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for p in [self.router] + list(self.workers.values()):
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.dump_logs()
        self.close()
        return False


def logged_port(log_path, pattern):
    """The port a log line matching pattern (one group) names, or None."""
    with open(log_path, "rb") as f:
        m = re.search(pattern, f.read())
    return int(m.group(1)) if m else None


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy


def scrape(addr, path="/metrics", method="GET"):
    """An HTTP request to http://addr/path; the body as text (an HTTPError for a status >= 400)."""
    req = urllib.request.Request("http://%s%s" % (addr, path), method=method)
    with _DIRECT.open(req, timeout=5) as r:
        return r.read().decode()


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text):
    """Prometheus text format to {name: {frozenset of (label, value): float}}; comments skipped."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise AssertionError("not a sample line: %r" % line)
        labels = frozenset(_LABEL.findall(m.group(2) or ""))
        out.setdefault(m.group(1), {})[labels] = float(m.group(3))
    return out


def children(pid):
    """Pids of the processes whose parent is pid."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                stat = f.read()
        except OSError:
            continue
        # the command name (in parentheses) may hold spaces: the parent pid follows the last ')'
        if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
            out.append(int(d))
    return out


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0")]
    except OSError:
        return []


class Launcher:
    """metrale-serve with the given arguments (the router on a free port), its output in a log
    file. Use as a context manager; on exit it gets SIGTERM, and whatever is left is killed."""

    def __init__(self, args, model=MODEL_DIR):
        self.dir = tempfile.mkdtemp(prefix="metrale-serve-")
        self.log_path = os.path.join(self.dir, "serve.log")
        self.channel = None
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([path(LAUNCHER_BIN), "--model", path(model), "--listen", "127.0.0.1:0",
                                          "--backend", "cpu"] + list(args), stdout=log, stderr=subprocess.STDOUT)

    def log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def _port(self):
        if self.proc.poll() is not None:
            raise AssertionError("metrale-serve exited with %d at start:\n%s" % (self.proc.returncode, self.log()))
        m = re.search(r"listening on port (\d+)", self.log())
        return int(m.group(1)) if m else None

    def connect(self, workers, timeout=30):
        """Waits for the router and `workers` live workers; sets self.gen and self.health."""
        port = wait_for(self._port, timeout, "the router to log its port")
        self.addr = "127.0.0.1:%d" % port
        self.channel = grpc.insecure_channel(self.addr)
        self.gen = metrale_pb2_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        wait_for(lambda: len(self.live_workers()) >= workers, timeout, "%d live workers" % workers, step=0.05)

    def stats(self):
        return self.gen.GetStats(metrale_pb2.StatsRequest(), timeout=5)

    def live_workers(self):
        return [w for w in self.stats().workers if w.alive]

    def ranks(self):
        """{(worker id, rank): pid} of the running metrale-worker children (rank 0 without --tp)."""
        out = {}
        for pid in children(self.proc.pid):
            args = cmdline(pid)
            if not args or not args[0].endswith("metrale-worker"):
                continue
            opt = dict(zip(args[1:], args[2:]))  # each option with the argument after it
            out[(int(opt["--id"]), int(opt.get("--rank", 0)))] = pid
        return out

    def close(self):
        if self.channel is not None:
            self.channel.close()
        if self.proc.poll() is None:
            kids = children(self.proc.pid)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                for pid in kids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            sys.stderr.write("---- metrale-serve ----\n" + self.log()[-12000:] + "\n")
        self.close()
        return False


class Collector:
    """Runs one Generate stream on a thread and records its tokens, final message and status."""

    def __init__(self, stub, req, timeout=None, cancel_after=None):
        self.req = req
        self.tokens = []
        self.responses = []
        self.final = None
        self.code = None
        self.details = None
        self.first_token = threading.Event()
        self.first_token_at = None  # time.monotonic() of the first tokens
        self.done = threading.Event()
        self.ended_at = None
        self.call = stub.Generate(req, timeout=timeout)
        self.cancel_after = cancel_after
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for resp in self.call:
                self.responses.append(resp)
                self.tokens.extend(t.token_id for t in resp.tokens)
                if resp.tokens and self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                    self.first_token.set()
                if resp.HasField("final"):
                    self.final = resp.final
                if self.cancel_after is not None and len(self.tokens) >= self.cancel_after:
                    self.call.cancel()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.code = e.code()
            self.details = e.details()
        finally:
            self.ended_at = time.monotonic()
            self.first_token.set()
            self.done.set()

    def wait(self, timeout=60):
        if not self.done.wait(timeout):
            raise AssertionError("stream %s did not end in %.0f s" % (self.req.request_id, timeout))
        return self
