"""JSON logs (--log-format json): every line that metrale-serve, its router and its worker write is
one JSON object with time (RFC 3339 UTC, milliseconds), level, component and event; the router
records each request's life (admitted, first_token, finished with the status and the token counts;
rejected before admission), with the request id and without the prompt unless --log-prompts; the
worker records its weight loading (percent, bytes/s)."""

import json
import re
import signal
import unittest

import grpc

from harness import Cluster, Collector, Launcher, metrale_pb2, request, wait_for

TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
LEVELS = {"debug", "info", "warn", "error"}
PROMPT_KEYS = {"prompt_token_ids", "prompt_text", "prompt_messages"}


def records(text):
    """Every line parsed as JSON (a line that is not fails the test), checked for the common keys."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            r = json.loads(line)
        except ValueError as e:
            raise AssertionError("line %d is not JSON (%s): %r" % (n, e, line))
        if not isinstance(r, dict):
            raise AssertionError("line %d is not an object: %r" % (n, line))
        for key in ("time", "level", "component", "event"):
            if key not in r:
                raise AssertionError("line %d has no %s: %r" % (n, key, line))
        if not TIME.match(r["time"]) or r["level"] not in LEVELS:
            raise AssertionError("line %d: time or level malformed: %r" % (n, line))
        out.append(r)
    return out


def life(recs, rid):
    """{event: record} of request rid in the router (each event once)."""
    evs = {}
    for r in recs:
        if r["component"] == "router" and r.get("request_id") == rid:
            if r["event"] in evs:
                raise AssertionError("two %s records for %s" % (r["event"], rid))
            evs[r["event"]] = r
    return evs


class JsonLogsTest(unittest.TestCase):
    def test_every_line_is_json_with_the_request_life(self):
        with Launcher(["--workers", "1", "--threads", "1", "--log-format", "json"]) as svc:
            svc.connect(1)
            ctx = svc.gen.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=5).max_context
            ok = Collector(svc.gen, request("life-ok", [1, 2, 3], 6)).wait(30)
            self.assertEqual(ok.code, grpc.StatusCode.OK, ok.details)
            gone = Collector(svc.gen, request("life-cancelled", [4, 5], ctx - 4), cancel_after=1).wait(30)
            self.assertEqual(gone.code, grpc.StatusCode.CANCELLED)
            with self.assertRaises(grpc.RpcError) as e:
                list(svc.gen.Generate(request("life-bad", [1, 2], 0), timeout=5))
            self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            wait_for(lambda: svc.stats().active_streams == 0, 10, "the cancelled stream to end")
            svc.proc.send_signal(signal.SIGTERM)
            self.assertEqual(svc.proc.wait(30), 0)
            recs = records(svc.log())

        comps = {r["component"] for r in recs}
        self.assertEqual(comps, {"serve", "router", "worker 0"})
        self.assertFalse([r for r in recs if PROMPT_KEYS & set(r)], "a prompt was logged without --log-prompts")

        ok_life = life(recs, "life-ok")
        self.assertEqual(set(ok_life), {"admitted", "first_token", "finished"})
        adm, first, fin = ok_life["admitted"], ok_life["first_token"], ok_life["finished"]
        self.assertLessEqual(adm["time"], first["time"])
        self.assertLessEqual(first["time"], fin["time"])
        self.assertEqual((adm["prompt_form"], adm["prompt_tokens"], adm["max_new_tokens"]), ("ids", 3, 6))
        self.assertEqual(adm["worker"], "w0")
        self.assertGreaterEqual(first["ttft_ms"], 0)
        self.assertEqual((fin["status"], fin["finish_reason"]), ("OK", "length"))
        self.assertEqual((fin["prompt_tokens"], fin["completion_tokens"]), (3, 6))
        self.assertGreaterEqual(fin["duration_ms"], first["ttft_ms"])

        gone_life = life(recs, "life-cancelled")
        self.assertEqual(set(gone_life), {"admitted", "first_token", "finished"})
        self.assertEqual(gone_life["finished"]["status"], "CANCELLED")
        self.assertGreater(gone_life["finished"]["completion_tokens"], 0)

        bad_life = life(recs, "life-bad")
        self.assertEqual(set(bad_life), {"rejected"})
        self.assertEqual(bad_life["rejected"]["status"], "INVALID_ARGUMENT")
        self.assertIn("max_new_tokens", bad_life["rejected"]["details"])

        worker = [r for r in recs if r["component"] == "worker 0"]
        progress = [r for r in worker if r["event"] == "weights_progress"]
        loaded = [r for r in worker if r["event"] == "weights_loaded"]
        self.assertTrue(progress, "no weights_progress record")
        self.assertEqual([r["percent"] for r in progress], sorted(r["percent"] for r in progress))
        for r in progress:
            self.assertTrue(0 <= r["percent"] <= 100 and r["bytes_per_s"] >= 0 and r["bytes"] > 0, r)
        self.assertEqual(len(loaded), 1)
        self.assertEqual(loaded[0]["percent"], 100)
        self.assertGreater(loaded[0]["bytes"], 0)
        self.assertGreater(loaded[0]["bytes_per_s"], 0)
        # plain messages are records too, without the process's own prefix
        msgs = [r["msg"] for r in recs if r["event"] == "log"]
        self.assertTrue(any(m.startswith("listening on port") for m in msgs), msgs[:5])
        self.assertIn("stopped", msgs)

    def test_log_prompts_puts_the_prompt_in_the_admitted_record(self):
        with Cluster(workers=1, router_args=["--log-format", "json", "--log-prompts"],
                     worker_args=["--log-format", "json"]) as c:
            short = [7, 8, 9, 10]
            long = [i % 300 for i in range(300)]
            for rid, prompt in (("p-short", short), ("p-long", long)):
                s = Collector(c.gen, request(rid, prompt, 2)).wait(30)
                self.assertEqual(s.code, grpc.StatusCode.OK, s.details)
            self.assertEqual(c.terminate_router(), 0)
            with open(c.logs[0][1]) as f:
                recs = records(f.read())
        adm = life(recs, "p-short")["admitted"]
        self.assertEqual(adm["prompt_token_ids"], short)
        self.assertNotIn("prompt_truncated", adm)
        adm = life(recs, "p-long")["admitted"]
        self.assertEqual(adm["prompt_token_ids"], long[:256])
        self.assertIs(adm["prompt_truncated"], True)


if __name__ == "__main__":
    unittest.main(verbosity=2)
