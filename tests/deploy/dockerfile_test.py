"""The Dockerfile: hadolint finds nothing in it, and its shape is the one the rest relies on.

- both stages are Debian 12 (debian:12 builds, debian:12-slim runs);
- the build stage stages /stage with scripts/stage-image.sh, and the runtime stage copies that
  folder to /opt/metrale and nothing else (so tests/e2e/image_test.py, which serves from a folder
  staged by the same script, tests what the image holds);
- the runtime stage runs as a numeric non-root user, with the entry point the Helm chart's
  command names (/opt/metrale/bin/metrale-serve) and LD_LIBRARY_PATH on the staged libraries.

Run through tests/deploy/pytools.sh (bazel test //tests/deploy:dockerfile_test).
"""

import json
import os
import shlex
import subprocess
import unittest

DOCKERFILE = "Dockerfile"
PREFIX = "/opt/metrale"


def instructions(path):
    """[(INSTRUCTION, arguments)] with continuation lines joined and comments dropped."""
    out, cur = [], ""
    with open(path) as f:
        for line in f:
            s = line.strip()
            if not cur and (not s or s.startswith("#")):
                continue
            if s.startswith("#"):
                continue
            if s.endswith("\\"):
                cur += s[:-1] + " "
                continue
            cur += s
            word, _, rest = cur.partition(" ")
            out.append((word.upper(), rest.strip()))
            cur = ""
    return out


def stages(instrs):
    """[(FROM arguments, [instructions])]"""
    out = []
    for ins, rest in instrs:
        if ins == "FROM":
            out.append((rest, []))
        elif out:
            out[-1][1].append((ins, rest))
    return out


class DockerfileTest(unittest.TestCase):
    def test_hadolint_finds_nothing(self):
        p = subprocess.run(["hadolint", "--no-color", DOCKERFILE], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.assertEqual((p.returncode, p.stdout.decode()), (0, ""))

    def test_stages(self):
        (build_from, build), (run_from, run) = stages(instructions(DOCKERFILE))
        self.assertEqual(build_from, "debian:12 AS build")
        self.assertEqual(run_from, "debian:12-slim")

        runs = [rest for ins, rest in build if ins == "RUN"]
        self.assertTrue(any("scripts/stage-image.sh /stage" in r for r in runs), runs)
        self.assertTrue(any("bazel build //launcher:metrale-serve //tools:mkckpt" in r for r in runs), runs)

        copies = [rest for ins, rest in run if ins in ("COPY", "ADD")]
        self.assertEqual(copies, ["--from=build /stage/ %s/" % PREFIX])
        self.assertEqual([ins for ins, _ in run if ins == "RUN"], [])

        users = [rest for ins, rest in run if ins == "USER"]
        self.assertEqual(len(users), 1)
        uid = users[0].split(":")[0]
        self.assertTrue(uid.isdigit() and int(uid) != 0, users)

        env = " ".join(rest for ins, rest in run if ins == "ENV")
        self.assertIn("LD_LIBRARY_PATH=%s/lib" % PREFIX, shlex.split(env))
        (entry,) = [json.loads(rest) for ins, rest in run if ins == "ENTRYPOINT"]
        self.assertEqual(entry, ["%s/bin/metrale-serve" % PREFIX])
        (cmd,) = [json.loads(rest) for ins, rest in run if ins == "CMD"]
        self.assertEqual(cmd[cmd.index("--model") + 1], "%s/models/cpu-small" % PREFIX)

    def test_dockerignore_keeps_build_outputs_out(self):
        with open(".dockerignore") as f:
            lines = {s.strip() for s in f if s.strip() and not s.startswith("#")}
        self.assertLessEqual({".git", "bazel-*", ".cache"}, lines)
        self.assertTrue(os.path.exists("scripts/stage-image.sh"))


if __name__ == "__main__":
    unittest.main()
