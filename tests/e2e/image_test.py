"""What the container image holds, served: scripts/stage-image.sh stages /opt/metrale into a temp
folder exactly as the Dockerfile's runtime stage copies it (tests/deploy/dockerfile_test.py checks
that the runtime stage copies that folder and nothing else). Then:

- every shared library the staged binaries need resolves inside the folder, except glibc's (the
  image's Debian 12 has them) and the NVIDIA driver's (mounted from the node);
- the staged metrale-serve, started from an empty working directory with only
  LD_LIBRARY_PATH=<folder>/lib (as the image sets it), runs the staged router and worker (not the
  build tree's), with every library mapped from the folder or glibc, and streams a request on
  the CPU backend: once with a fixture model given by --model (as the Helm chart's PVC, hostPath
  and init sources give one), once with the image's own default model; SIGTERM drains it to
  exit status 0.
"""

import os
import re
import shutil
import signal
import subprocess
import tempfile
import unittest

import grpc

from harness import (LAUNCHER_BIN, MODEL_DIR, SERVING, health_pb2, health_pb2_grpc, metrale_pb2,
                     metrale_pb2_grpc, path, request, wait_for)

BINARIES = ["metrale-serve", "metrale-router", "metrale-worker"]
# glibc's own libraries and the driver's: not in the image's folder, by design (stage-image.sh)
OUTSIDE = re.compile(r"^(linux-vdso|ld-linux|libc\.so|libm\.so|libmvec\.so|libdl\.so|libpthread\.so|librt\.so|"
                     r"libresolv\.so|libutil\.so|libanl\.so|libnsl\.so|libnss_|libcuda\.so|libnvidia-)")


def descendants(pid):
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/%s/stat" % d) as f:
                    stat = f.read()
            except OSError:
                continue
            kids.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for k in kids.get(p, []):
            out.append(k)
            todo.append(k)
    return out


class ImageTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="metrale-image-")
        cls.stage = os.path.join(cls.dir, "opt-metrale")
        # the runfiles root holds launcher/, router/, worker/ and tools/ like bazel-bin does
        src = "." if os.path.exists(LAUNCHER_BIN) else "bazel-bin"
        subprocess.run(["scripts/stage-image.sh", "--from", src, cls.stage], check=True)
        cls.lib = os.path.join(cls.stage, "lib")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def env(self):
        return {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": self.lib, "HOME": self.dir}

    def inside(self, p):
        return os.path.realpath(p).startswith(os.path.realpath(self.stage) + os.sep)

    def test_layout(self):
        self.assertEqual(sorted(os.listdir(self.stage)), ["bin", "lib", "models"])
        self.assertEqual(sorted(os.listdir(os.path.join(self.stage, "bin"))), sorted(BINARIES))
        self.assertTrue(os.path.isfile(os.path.join(self.stage, "models/cpu-small/config.json")))
        for root, _, files in os.walk(self.stage):
            for f in files:
                self.assertFalse(os.path.islink(os.path.join(root, f)), "a link: %s" % f)

    def test_libraries_resolve_inside_the_folder(self):
        for b in BINARIES:
            out = subprocess.run(["ldd", os.path.join(self.stage, "bin", b)], env=self.env(), check=True,
                                 stdout=subprocess.PIPE).stdout.decode()
            self.assertNotIn("not found", out)
            for line in out.splitlines():
                m = re.match(r"\s*(\S+) => (\S+)", line)
                if m and not OUTSIDE.match(m.group(1)):
                    self.assertTrue(self.inside(m.group(2)), "%s: %s" % (b, line.strip()))

    def serve_one_request(self, model):
        work = tempfile.mkdtemp(dir=self.dir)  # an empty working directory, as in the container
        log_path = os.path.join(work, "serve.log")
        with open(log_path, "wb") as log:
            serve = subprocess.Popen([os.path.join(self.stage, "bin/metrale-serve"), "--listen", "127.0.0.1:0",
                                      "--backend", "cpu", "--workers", "1", "--threads", "1", "--model", model],
                                     cwd=work, env=self.env(), stdout=log, stderr=subprocess.STDOUT)

        def log_text():
            with open(log_path, "rb") as f:
                return f.read().decode(errors="replace")

        def port():
            if serve.poll() is not None:
                raise AssertionError("metrale-serve exited with %d at start" % serve.returncode)
            m = re.search(r"listening on port (\d+)", log_text())
            return int(m.group(1)) if m else None

        channel = None
        try:
            addr = "127.0.0.1:%d" % wait_for(port, 20, "the router to log its port")
            channel = grpc.insecure_channel(addr)
            health = health_pb2_grpc.HealthStub(channel)
            wait_for(lambda: health.Check(health_pb2.HealthCheckRequest(service="metrale.v1.Generation"),
                                          timeout=5).status == SERVING, 30, "SERVING")

            # the staged router and worker run, with the staged libraries
            kids = descendants(serve.pid)
            exes = sorted(os.path.basename(os.readlink("/proc/%d/exe" % p)) for p in kids)
            self.assertEqual(exes, ["metrale-router", "metrale-worker"])
            for p in [serve.pid] + kids:
                self.assertTrue(self.inside(os.readlink("/proc/%d/exe" % p)), os.readlink("/proc/%d/exe" % p))
                with open("/proc/%d/maps" % p) as f:
                    libs = {line.split()[-1] for line in f if ".so" in line.split()[-1]}
                for lib in libs:
                    if not OUTSIDE.match(os.path.basename(lib)):
                        self.assertTrue(self.inside(lib), "pid %d maps %s" % (p, lib))

            gen = metrale_pb2_grpc.GenerationStub(channel)
            tokens, final = [], None
            for resp in gen.Generate(request("image-1", [1, 2, 3, 4], 8), timeout=30):
                tokens += [t.token_id for t in resp.tokens]
                if resp.HasField("final"):
                    final = resp.final
            self.assertEqual(len(tokens), 8)
            self.assertEqual(final.finish_reason, metrale_pb2.FINISH_REASON_LENGTH)

            serve.send_signal(signal.SIGTERM)
            self.assertEqual(serve.wait(30), 0)
        except BaseException:
            print("---- metrale-serve (%s) ----\n%s" % (model, log_text()[-6000:]))
            raise
        finally:
            if channel is not None:
                channel.close()
            if serve.poll() is None:
                for p in descendants(serve.pid):
                    os.kill(p, signal.SIGKILL)
                serve.kill()
                serve.wait()

    def test_serves_a_fixture_model(self):
        self.serve_one_request(os.path.abspath(path(MODEL_DIR)))

    def test_serves_the_default_model(self):
        self.serve_one_request(os.path.join(self.stage, "models/cpu-small"))


if __name__ == "__main__":
    unittest.main()
