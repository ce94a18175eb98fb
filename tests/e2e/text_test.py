"""Text through router + worker, against the references a client would use: the tokenizers library
(tokenize, decode) and jinja2 (the chat template, rendered as transformers renders it).

The model is a random checkpoint (tools/mkckpt, tiny_a's shape) whose vocabulary is the GLM test
tokenizer's (tests/fixtures/glm_tok), with tools/train/chat_template.jinja as its chat template
and two EOS ids. Checked through real gRPC: a text prompt generates what its ids generate; the
streamed texts, each valid UTF-8, join to the decoded ids; a stop string ends the stream with its
text cut before it (or after it); Tokenize of text and of messages equals the references; bad
text and a too-long prompt are INVALID_ARGUMENT; echo returns the prompt's logprobs and bytes;
ModelInfo lists the EOS ids."""

import json
import os
import shutil
import subprocess
import tempfile
import unittest

import grpc
import jinja2
import jinja2.sandbox
import tokenizers

from harness import MODEL_DIR, Cluster, Collector, metrale_pb2, path

MKCKPT_BIN = "tools/mkckpt"
TOK_DIR = "tests/fixtures/glm_tok"
TEMPLATE = "tools/train/chat_template.jinja"
EOS = [6000, 6007]  # <|endoftext|>, <|user|>
MAX_NEW = 24
INVALID = grpc.StatusCode.INVALID_ARGUMENT
STOP = metrale_pb2.StoppingCriteria
M = metrale_pb2.ChatMessage

TEXT = "The quick brown fox jumps over the lazy dog. Caf\u00e9 \u00fcber na\u00efve r\u00e9sum\u00e9, 12345!"
CHAT = [("system", "You are terse."), ("user", "Hello there"), ("assistant", "Hi."), ("user", "What is 2+2?")]


def byte_decoder():
    """GPT-2's ByteLevel alphabet, character -> byte (the tokenizer's ByteLevel pre-tokenizer)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def make_model(out):
    """A random checkpoint of tiny_a's shape with the GLM test tokenizer's vocabulary, its
    tokenizer files, the demo chat template and an EOS list. Returns the tokenizer."""
    tok = tokenizers.Tokenizer.from_file(path(os.path.join(TOK_DIR, "tokenizer.json")))
    with open(path(os.path.join(MODEL_DIR, "config.json"))) as f:
        cfg = json.load(f)
    cfg["text_config"]["vocab_size"] = tok.get_vocab_size(with_added_tokens=True)
    cfg_path = os.path.join(out, "config.in.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    model = os.path.join(out, "model")
    subprocess.run([path(MKCKPT_BIN), "--config", cfg_path, "--out", model, "--seed", "7"], check=True,
                   capture_output=True)
    shutil.copy(path(os.path.join(TOK_DIR, "tokenizer.json")), model)
    with open(path(os.path.join(TOK_DIR, "tokenizer_config.json"))) as f:
        tcfg = json.load(f)
    with open(path(TEMPLATE)) as f:
        tcfg["chat_template"] = f.read()
    with open(os.path.join(model, "tokenizer_config.json"), "w") as f:
        json.dump(tcfg, f)
    with open(os.path.join(model, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": EOS, "pad_token_id": EOS[0]}, f)
    return model, tok, tcfg["chat_template"]


def render(template, messages, add_generation_prompt=True, **kwargs):
    """The chat template as transformers renders it (trim_blocks, lstrip_blocks, raise_exception)."""
    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=[{"role": r, "content": c} for r, c in messages],
                                            add_generation_prompt=add_generation_prompt, **kwargs)


def greedy(rid, max_new=MAX_NEW, stopping=None, **kw):
    return metrale_pb2.GenerateRequest(request_id=rid, stopping=stopping or STOP(max_new_tokens=max_new,
                                                                                 ignore_eos=True), **kw)


class TextTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="metrale-text-")
        cls.model, cls.tok, cls.template = make_model(cls.dir)
        cls.bytes_of = byte_decoder()
        cls.cluster = Cluster(workers=1, model=cls.model)

    @classmethod
    def tearDownClass(cls):
        cls.cluster.close()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def run_stream(self, req, code=grpc.StatusCode.OK):
        s = Collector(self.cluster.gen, req, timeout=60).wait(60)
        if s.code != code:
            self.cluster.dump_logs()
        self.assertEqual(s.code, code, "%s: %s" % (req.request_id, s.details))
        return s

    def texts(self, s):
        return [r.text for r in s.responses]

    def token_bytes(self, tid):
        """A token's raw bytes: its ByteLevel characters mapped back, or an added token's text."""
        piece = self.tok.id_to_token(tid)
        if tid >= self.tok.get_vocab_size(with_added_tokens=False):
            return piece.encode()
        return bytes(self.bytes_of[ch] for ch in piece)

    def test_model_info_lists_the_tokenizer_and_eos(self):
        info = self.cluster.gen.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=5)
        self.assertEqual(info.vocab_size, self.tok.get_vocab_size(with_added_tokens=True))
        self.assertEqual(list(info.eos_token_ids), EOS)
        self.assertEqual(info.eos_token_id, EOS[0])
        self.assertTrue(info.has_tokenizer)
        self.assertTrue(info.has_chat_template)

    def test_text_prompt_equals_its_ids_and_streams_the_decoded_text(self):
        ids = self.tok.encode(TEXT).ids  # with [gMASK]<sop>: prompt_text's default
        a = self.run_stream(greedy("ids", prompt_token_ids=ids))
        b = self.run_stream(greedy("text", prompt_text=TEXT))
        self.assertEqual(b.tokens, a.tokens)
        self.assertEqual(b.final.usage.prompt_tokens, len(ids))
        self.assertEqual(b.final.usage.completion_tokens, MAX_NEW)
        self.assertEqual(b.final.finish_reason, metrale_pb2.FINISH_REASON_LENGTH)
        for piece in self.texts(b):
            piece.encode("utf-8")  # strict: a lone surrogate would raise
        self.assertEqual("".join(self.texts(b)), self.tok.decode(b.tokens, skip_special_tokens=True))
        # skip_special_tokens false keeps them in the text
        c = self.run_stream(greedy("keep", prompt_text=TEXT, has_skip_special_tokens=True,
                                   skip_special_tokens=False))
        self.assertEqual(c.tokens, a.tokens)
        self.assertEqual("".join(self.texts(c)), self.tok.decode(c.tokens, skip_special_tokens=False))
        # add_special_tokens false: the ids without [gMASK]<sop>
        plain = self.tok.encode(TEXT, add_special_tokens=False).ids
        d = self.run_stream(greedy("plain", prompt_text=TEXT, has_add_special_tokens=True, add_special_tokens=False))
        self.assertEqual(d.final.usage.prompt_tokens, len(plain))
        self.assertEqual(d.tokens, self.run_stream(greedy("plain-ids", prompt_token_ids=plain)).tokens)

    def test_stop_string_cuts_the_text(self):
        full = self.run_stream(greedy("full", prompt_text=TEXT))
        text = "".join(self.texts(full))
        start = len(text) // 3
        stop = None
        for i in range(start, len(text) - 3):
            cand = text[i:i + 3]
            if "\ufffd" not in cand and cand.strip():
                stop = cand
                break
        if stop is None:
            self.skipTest("the greedy text has no usable stop string: %r" % text)
        cut = text.index(stop)  # the first match ends the stream
        for include in (False, True):
            s = self.run_stream(greedy("stop-%d" % include, prompt_text=TEXT,
                                       stopping=STOP(max_new_tokens=MAX_NEW, ignore_eos=True, stop=["\x01never", stop],
                                                     include_stop_str=include)))
            self.assertEqual(s.final.finish_reason, metrale_pb2.FINISH_REASON_STOP)
            self.assertEqual(s.final.WhichOneof("stop_reason"), "stop_string")
            self.assertEqual(s.final.stop_string, stop)
            got = "".join(self.texts(s))
            self.assertEqual(got, text[:cut + (len(stop) if include else 0)])
            self.assertTrue(got.endswith(stop) if include else stop not in got)
            self.assertEqual(s.tokens, full.tokens[:len(s.tokens)])  # a prefix, through the token that completed it
            self.assertIn(stop, self.tok.decode(s.tokens, skip_special_tokens=True))
            self.assertEqual(s.final.usage.completion_tokens, len(s.tokens))

    def test_eos_stops_with_its_id(self):
        # Without ignore_eos the stream may end at an EOS id: then the final names it.
        s = self.run_stream(greedy("eos", prompt_text=TEXT, stopping=STOP(max_new_tokens=MAX_NEW,
                                                                          stop_token_ids=list(range(6000, 6012)))))
        if s.final.finish_reason == metrale_pb2.FINISH_REASON_STOP:
            self.assertEqual(s.final.WhichOneof("stop_reason"), "stop_token_id")
            self.assertEqual(s.final.stop_token_id, s.tokens[-1])

    def test_tokenize_text_and_messages(self):
        gen = self.cluster.gen
        r = gen.Tokenize(metrale_pb2.TokenizeRequest(text=TEXT), timeout=10)
        self.assertEqual(list(r.token_ids), self.tok.encode(TEXT).ids)
        self.assertEqual(r.prompt_text, TEXT)
        r = gen.Tokenize(metrale_pb2.TokenizeRequest(text=TEXT, has_add_special_tokens=True, add_special_tokens=False),
                         timeout=10)
        self.assertEqual(list(r.token_ids), self.tok.encode(TEXT, add_special_tokens=False).ids)
        msgs = [M(role=a, content=b) for a, b in CHAT]
        for kw, rkw in [({}, {}),
                        ({"no_generation_prompt": True}, {"add_generation_prompt": False}),
                        ({"chat_template_kwargs": '{"enable_thinking": false}'}, {"enable_thinking": False})]:
            want = render(self.template, CHAT, **rkw)
            r = gen.Tokenize(metrale_pb2.TokenizeRequest(messages=msgs, **kw), timeout=10)
            self.assertEqual(r.prompt_text, want, kw)
            self.assertEqual(list(r.token_ids), self.tok.encode(want, add_special_tokens=False).ids, kw)
        # Generate with messages feeds exactly those ids
        want_ids = self.tok.encode(render(self.template, CHAT), add_special_tokens=False).ids
        a = self.run_stream(greedy("chat", messages=msgs))
        b = self.run_stream(greedy("chat-ids", prompt_token_ids=want_ids))
        self.assertEqual(a.final.usage.prompt_tokens, len(want_ids))
        self.assertEqual(a.tokens, b.tokens)
        # a role the template does not know: the worker's template error
        with self.assertRaises(grpc.RpcError) as e:
            gen.Tokenize(metrale_pb2.TokenizeRequest(messages=[M(role="robot", content="x")]), timeout=10)
        self.assertEqual(e.exception.code(), INVALID)
        self.assertIn("robot", e.exception.details())
        s = self.run_stream(greedy("robot", messages=[M(role="robot", content="x")]), code=INVALID)
        self.assertIn("robot", s.details)

    def test_bad_text_is_invalid_argument(self):
        info = self.cluster.gen.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=5)
        before = self.cluster.stats().requests_rejected
        # Not UTF-8: protobuf's Python refuses such a str, so the field is appended as raw bytes
        # (field 7, length-delimited) to an otherwise valid request.
        raw = self.cluster.channel.unary_stream("/metrale.v1.Generation/Generate", request_serializer=lambda b: b,
                                                response_deserializer=metrale_pb2.GenerateResponse.FromString)
        bad = b"ab\xff\xfe"
        msg = greedy("bad-utf8").SerializeToString() + bytes([7 << 3 | 2, len(bad)]) + bad
        with self.assertRaises(grpc.RpcError) as e:
            list(raw(msg, timeout=10))
        self.assertEqual(e.exception.code(), INVALID)
        self.assertIn("prompt_text is not valid UTF-8", e.exception.details())
        # Too long once tokenized: the worker refuses it before it starts
        long_text = "hello world " * info.max_context
        s = self.run_stream(greedy("too-long", max_new=4, prompt_text=long_text), code=INVALID)
        self.assertTrue(s.details)
        self.assertEqual(s.tokens, [])
        # after both refusals the worker still serves
        self.run_stream(greedy("after", max_new=4, prompt_text="fine"))
        self.assertEqual(self.cluster.stats().requests_rejected - before, 2)
        self.assertEqual(self.cluster.stats().worker_restarts, 0)

    def test_echo_returns_prompt_logprobs_and_bytes(self):
        ids = self.tok.encode(TEXT).ids
        s = self.run_stream(greedy("echo", max_new=4, prompt_text=TEXT, echo=True, logprobs=True, top_logprobs=2))
        plp = [t for r in s.responses for t in r.prompt_logprobs]
        self.assertEqual(len(plp), len(ids) - 1)
        self.assertTrue(s.responses[0].prompt_logprobs, "the prompt logprobs come on the first message")
        self.assertEqual([t.token_id for t in plp], ids[1:])
        for t in plp:
            self.assertLessEqual(t.logprob, 0.0)
            self.assertEqual(t.bytes, self.token_bytes(t.token_id), t.token_id)
            self.assertEqual(len(t.top_logprobs), 2)
        for t in (t for r in s.responses for t in r.tokens):
            self.assertLessEqual(t.logprob, 0.0)
            self.assertEqual(t.bytes, self.token_bytes(t.token_id), t.token_id)


if __name__ == "__main__":
    unittest.main(verbosity=2)
