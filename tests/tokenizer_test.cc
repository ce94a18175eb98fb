// The tokenizer (worker/text/tokenizer.h) against the Hugging Face `tokenizers` library, through
// committed goldens: tests/fixtures/tok_goldens.jsonl.gz holds the library's ids and text for
// 22,500 generated strings and 4,600 id lists: 12,500 and 3,400 on the two fixtures (glm_tok,
// glm_tok_flags) and two variants of glm_tok (ignore_merges; the ByteLevel pre-tokenizer's own
// GPT-2 regex), and 10,000 and 1,200 on the demo model's tokenizer (models/glm5-next-demo, the
// one the service ships; its tokenizer_config.json and generation_config.json are checked in
// DemoModel below). The goldens were made once with the library by
// tests/oracle/make_tokenizer_goldens.py (its header says how and with which version); this test
// does not need the library or the network. Every mismatch fails the test; the first ones are
// printed with the place they differ, and each tokenizer must have had its minimum of records.
#include <gtest/gtest.h>
#include <json-c/json.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include <map>
#include <string>
#include <thread>
#include <vector>

#include "worker/text/tokenizer.h"

namespace {

const char kGoldens[] = "tests/fixtures/tok_goldens.jsonl.gz";
const char kPrefix[] = "[gMASK]<sop>";  // every tokenizer's TemplateProcessing prefix
const char kDemo[] = "models/glm5-next-demo";  // relative to the repository root

// The least each tokenizer of the goldens must have: encoded strings, decoded id lists. A
// tokenizer missing from the goldens, or with fewer records, fails the test.
const std::map<std::string, std::pair<int, int>> kMinRecords = {
    {"glm_tok", {10000, 3000}},
    {"glm_tok_flags", {1500, 300}},
    {"glm_tok+ignore_merges", {500, 50}},
    {"glm_tok+gpt2_regex", {500, 50}},
    {kDemo, {10000, 1000}},
};

// A record's "fx": a directory relative to the repository root when it contains "models/", else
// one under tests/fixtures.
std::string fixture_dir(const std::string &fx) {
    return fx.find("models/") != std::string::npos ? fx : "tests/fixtures/" + fx;
}

struct Tok {
    tok_tokenizer *t = nullptr;
    tok_encoder *e = nullptr;
    ~Tok() {
        tok_encoder_free(e);
        tok_free(t);
    }
};

void load(const std::string &dir, Tok *k) {
    mt_error err;
    ASSERT_EQ(tok_load(dir.c_str(), &k->t, &err), MT_OK) << err.msg;
    k->e = tok_encoder_new(k->t);
    ASSERT_NE(k->e, nullptr);
}

std::vector<int32_t> encode(Tok *k, const std::string &s, bool special) {
    tok_ids v = {};
    mt_error err;
    mt_status st = tok_encode(k->e, s.data(), s.size(), special, &v, &err);
    EXPECT_EQ(st, MT_OK) << err.msg;
    std::vector<int32_t> r(v.ids, v.ids + v.n);
    tok_ids_free(&v);
    return r;
}

std::string decode(const tok_tokenizer *t, const std::vector<int32_t> &ids, bool skip) {
    tok_text out = {};
    mt_error err;
    EXPECT_EQ(tok_decode(t, ids.data(), ids.size(), skip, &out, &err), MT_OK) << err.msg;
    std::string r(out.s ? out.s : "", out.n);
    tok_text_free(&out);
    return r;
}

bool valid_utf8(const std::string &s) {
    for (size_t i = 0; i < s.size();) {
        unsigned char c = (unsigned char)s[i];
        size_t n = c < 0x80 ? 1 : c >= 0xc2 && c < 0xe0 ? 2 : c >= 0xe0 && c < 0xf0 ? 3 : c >= 0xf0 && c < 0xf5 ? 4 : 0;
        if (!n || i + n > s.size()) return false;
        for (size_t k = 1; k < n; k++)
            if (((unsigned char)s[i + k] & 0xc0) != 0x80) return false;
        i += n;
    }
    return true;
}

// Each id through tok_stream_push, checked against tok_stream_resume on the ids before it;
// returns the concatenation, finish included. *ok is false when a piece splits a
// character or resume disagrees.
std::string stream(const tok_tokenizer *t, const std::vector<int32_t> &ids, bool skip, bool *ok) {
    tok_stream s, r;
    tok_stream_init(&s, skip);
    std::string all;
    tok_text piece = {}, again = {};
    mt_error err;
    *ok = true;
    for (size_t i = 0; i < ids.size(); i++) {
        piece.n = again.n = 0;
        tok_stream_resume(t, &r, ids.data(), i, skip);
        if (tok_stream_push(t, &s, ids[i], &piece, &err) != MT_OK ||
            tok_stream_push(t, &r, ids[i], &again, &err) != MT_OK)
            *ok = false;
        std::string p(piece.s ? piece.s : "", piece.n), q(again.s ? again.s : "", again.n);
        if (p != q) *ok = false;
        if (!valid_utf8(p)) *ok = false;  // whole characters only
        all += p;
    }
    piece.n = 0;
    tok_stream_finish(&s, &piece, &err);
    all.append(piece.s ? piece.s : "", piece.n);
    tok_text_free(&piece);
    tok_text_free(&again);
    return all;
}

std::vector<int32_t> ids_of(json_object *a) {
    std::vector<int32_t> v;
    for (size_t i = 0; i < json_object_array_length(a); i++)
        v.push_back((int32_t)json_object_get_int64(json_object_array_get_idx(a, i)));
    return v;
}

// A JSON string with its NUL bytes (json_object_get_string stops at the first).
std::string str_of(json_object *v) {
    return std::string(json_object_get_string(v), (size_t)json_object_get_string_len(v));
}

std::string escaped(const std::string &s, size_t max = 160) {
    std::string r;
    for (size_t i = 0; i < s.size() && r.size() < max; i++) {
        unsigned char c = (unsigned char)s[i];
        char b[8];
        if (c == '\\') r += "\\\\";
        else if (c >= 0x20 && c < 0x7f) r += (char)c;
        else { snprintf(b, sizeof b, "\\x%02x", c); r += b; }
    }
    return r.size() >= max ? r + "..." : r;
}

std::string ids_around(const std::vector<int32_t> &v, size_t at) {
    std::string r = "[";
    size_t from = at > 4 ? at - 4 : 0;
    if (from) r += "... ";
    for (size_t i = from; i < v.size() && i < at + 6; i++) r += (i > from ? "," : "") + std::to_string(v[i]);
    if (at + 6 < v.size()) r += " ...";
    return r + "] (" + std::to_string(v.size()) + " ids)";
}

size_t first_diff(const std::vector<int32_t> &a, const std::vector<int32_t> &b) {
    size_t i = 0;
    while (i < a.size() && i < b.size() && a[i] == b[i]) i++;
    return i;
}

size_t first_diff(const std::string &a, const std::string &b) {
    size_t i = 0;
    while (i < a.size() && i < b.size() && a[i] == b[i]) i++;
    return i;
}

// Writes base/tokenizer.json with the given fields (dotted paths) replaced to a new directory under
// TEST_TMPDIR; returns the directory.
std::string write_variant(const std::string &base, json_object *fields) {
    json_object *root = json_object_from_file((base + "/tokenizer.json").c_str());
    EXPECT_NE(root, nullptr) << base;
    json_object_object_foreach(fields, key, val) {
        std::string f = key;
        json_object *parent = root;
        size_t dot = f.find('.');
        if (dot != std::string::npos) {
            parent = json_object_object_get(root, f.substr(0, dot).c_str());
            f = f.substr(dot + 1);
        }
        json_object_object_add(parent, f.c_str(), json_object_get(val));
    }
    const char *tmp = getenv("TEST_TMPDIR");
    std::string dir = std::string(tmp ? tmp : "/tmp") + "/tok_variant_XXXXXX";
    EXPECT_NE(mkdtemp(&dir[0]), nullptr);
    EXPECT_EQ(json_object_to_file((dir + "/tokenizer.json").c_str(), root), 0);
    json_object_put(root);
    return dir;
}

struct Report {
    int mismatches = 0;
    void add(int line, const std::string &what) {
        if (mismatches++ < 12) ADD_FAILURE() << "golden line " << line << ": " << what;
    }
};

void check_text(Report *rep, int line, const char *what, const std::string &want, const std::string &got) {
    if (want == got) return;
    size_t d = first_diff(want, got);
    rep->add(line, std::string(what) + " differs at byte " + std::to_string(d) + "\n  want: " +
                       escaped(want.substr(d > 20 ? d - 20 : 0)) + "\n  got:  " +
                       escaped(got.substr(d > 20 ? d - 20 : 0)));
}

TEST(Tokenizer, MatchesLibraryGoldens) {
    std::map<std::string, Tok> toks;
    gzFile f = gzopen(kGoldens, "rb");
    ASSERT_NE(f, nullptr) << kGoldens;
    std::vector<char> buf(1 << 22);
    ASSERT_NE(gzgets(f, buf.data(), (int)buf.size()), nullptr);
    json_object *header = json_tokener_parse(buf.data());
    ASSERT_NE(header, nullptr);
    printf("goldens from %s, Unicode %s\n", json_object_get_string(json_object_object_get(header, "library")),
           json_object_get_string(json_object_object_get(header, "unicode")));
    json_object *variants = json_object_object_get(header, "variants");

    Report rep;
    int line = 1, n_enc = 0, n_dec = 0, n_ids = 0;
    std::map<std::string, std::pair<int, int>> seen;  // fx -> encoded, decoded
    while (gzgets(f, buf.data(), (int)buf.size())) {
        line++;
        json_object *rec = json_tokener_parse(buf.data());
        ASSERT_NE(rec, nullptr) << "golden line " << line << " does not parse";
        std::string fx = json_object_get_string(json_object_object_get(rec, "fx"));
        Tok &k = toks[fx];
        if (!k.t) {
            size_t plus = fx.find('+');  // a variant of a fixture: header "variants"
            if (plus == std::string::npos) {
                load(fixture_dir(fx), &k);
            } else {
                json_object *fields = json_object_object_get(variants, fx.c_str());
                ASSERT_NE(fields, nullptr) << fx << " is not among the header's variants";
                std::string dir = write_variant(fixture_dir(fx.substr(0, plus)), fields);
                load(dir, &k);
            }
        }
        ASSERT_NE(k.t, nullptr);
        json_object *enc = json_object_object_get(rec, "enc"), *v;
        std::vector<int32_t> ids;
        std::string want_dec, want_skip;
        if (enc) {
            std::string text = str_of(enc);
            bool special = json_object_get_boolean(json_object_object_get(rec, "special"));
            ids = ids_of(json_object_object_get(rec, "ids"));
            std::vector<int32_t> got = encode(&k, text, special);
            if (got != ids) {
                size_t d = first_diff(ids, got);
                rep.add(line, "encode(" + escaped(text) + (special ? ", special" : "") +
                                  ") differs at id " + std::to_string(d) + "\n  want: " +
                                  ids_around(ids, d) + "\n  got:  " + ids_around(got, d));
            }
            want_dec = json_object_object_get_ex(rec, "dec", &v) ? str_of(v)
                                                                : (special ? kPrefix : "") + text;
            want_skip = json_object_object_get_ex(rec, "dec_skip", &v) ? str_of(v) : text;
            n_enc++;
            seen[fx].first++;
        } else {
            ids = ids_of(json_object_object_get(rec, "dec_ids"));
            want_dec = str_of(json_object_object_get(rec, "dec"));
            want_skip = str_of(json_object_object_get(rec, "dec_skip"));
            n_dec++;
            seen[fx].second++;
        }
        n_ids += (int)ids.size();
        check_text(&rep, line, "decode", want_dec, decode(k.t, ids, false));
        check_text(&rep, line, "decode(skip_special_tokens)", want_skip, decode(k.t, ids, true));
        for (bool skip : {false, true}) {
            bool ok;
            std::string s = stream(k.t, ids, skip, &ok);
            check_text(&rep, line, skip ? "stream(skip_special_tokens)" : "stream", skip ? want_skip : want_dec, s);
            if (!ok) rep.add(line, "a streamed piece splits a character or differs from resume + push");
        }
        json_object_put(rec);
    }
    gzclose(f);
    json_object *counts = json_object_object_get(header, "counts");
    for (const auto &[fx, n] : seen) {
        printf("  %-24s %6d encoded strings, %5d decoded id lists\n", fx.c_str(), n.first, n.second);
        json_object *c = json_object_object_get(counts, fx.c_str());  // what the header says
        ASSERT_NE(c, nullptr) << fx << " is not in the header's counts";
        EXPECT_EQ(n.first, json_object_get_int(json_object_object_get(c, "encode"))) << fx;
        EXPECT_EQ(n.second, json_object_get_int(json_object_object_get(c, "decode"))) << fx;
    }
    for (const auto &[fx, min] : kMinRecords) {
        auto it = seen.find(fx);
        std::pair<int, int> n = it == seen.end() ? std::pair<int, int>(0, 0) : it->second;
        EXPECT_GE(n.first, min.first) << fx << ": too few encoded strings in the goldens";
        EXPECT_GE(n.second, min.second) << fx << ": too few decoded id lists in the goldens";
    }
    json_object_put(header);
    printf("checked %d encoded strings and %d decoded id lists (%d ids) on %zu tokenizers: %d mismatches\n",
           n_enc, n_dec, n_ids, seen.size(), rep.mismatches);
    EXPECT_GE(n_enc, 22500);
    EXPECT_GE(n_dec, 4600);
    EXPECT_EQ(rep.mismatches, 0);
}

// The demo model's configs: eos from generation_config.json (tokenizer_config.json's first), pad,
// no bos, the chat template, and which added tokens are special.
TEST(Tokenizer, DemoModel) {
    Tok k;
    load(kDemo, &k);
    ASSERT_NE(k.t, nullptr);
    tok_special_ids sp = tok_special(k.t);
    ASSERT_EQ(sp.n_eos, 3);
    EXPECT_EQ(sp.eos[0], tok_token_to_id(k.t, "<|endoftext|>"));
    EXPECT_EQ(sp.eos[1], tok_token_to_id(k.t, "<|user|>"));
    EXPECT_EQ(sp.eos[2], tok_token_to_id(k.t, "<|observation|>"));
    EXPECT_EQ(sp.eos[0], 6132);
    EXPECT_EQ(sp.bos, -1);
    EXPECT_EQ(sp.pad, 6132);
    ASSERT_NE(tok_chat_template(k.t), nullptr);
    EXPECT_EQ(strncmp(tok_chat_template(k.t), "[gMASK]<sop>", 12), 0);
    EXPECT_EQ(tok_vocab_size(k.t), 6144);
    for (const char *t : {"<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
                          "<|user|>", "<|assistant|>", "<|observation|>"})
        EXPECT_TRUE(tok_is_special(k.t, tok_token_to_id(k.t, t))) << t;
    EXPECT_FALSE(tok_is_special(k.t, tok_token_to_id(k.t, "<think>")));
    EXPECT_FALSE(tok_is_special(k.t, tok_token_to_id(k.t, "</think>")));
    EXPECT_EQ(tok_token_to_id(k.t, "</think>"), 6143);
}

class TokenizerFixture : public ::testing::Test {
  protected:
    void SetUp() override { load("tests/fixtures/glm_tok", &k_); }
    Tok k_;
};

TEST_F(TokenizerFixture, ReadsTheConfigs) {
    tok_special_ids sp = tok_special(k_.t);
    ASSERT_EQ(sp.n_eos, 2);  // generation_config lists both; tokenizer_config's is the first
    EXPECT_EQ(sp.eos[0], tok_token_to_id(k_.t, "<|endoftext|>"));
    EXPECT_EQ(sp.eos[1], tok_token_to_id(k_.t, "<|user|>"));
    EXPECT_EQ(sp.bos, -1);
    EXPECT_EQ(sp.pad, tok_token_to_id(k_.t, "<|endoftext|>"));
    ASSERT_NE(tok_chat_template(k_.t), nullptr);
    EXPECT_EQ(strncmp(tok_chat_template(k_.t), "[gMASK]<sop>", 12), 0);
    EXPECT_EQ(tok_vocab_size(k_.t), 6012);
    EXPECT_TRUE(tok_is_special(k_.t, tok_token_to_id(k_.t, "[gMASK]")));
    EXPECT_FALSE(tok_is_special(k_.t, tok_token_to_id(k_.t, "<think>")));
    EXPECT_FALSE(tok_is_special(k_.t, 5));
    EXPECT_FALSE(tok_is_special(k_.t, -1));
}

TEST_F(TokenizerFixture, AddsTheTemplateAroundTheText) {
    std::vector<int32_t> plain = encode(&k_, "Hello world", false);
    std::vector<int32_t> with = encode(&k_, "Hello world", true);
    ASSERT_EQ(with.size(), plain.size() + 2);
    EXPECT_EQ(with[0], tok_token_to_id(k_.t, "[gMASK]"));
    EXPECT_EQ(with[1], tok_token_to_id(k_.t, "<sop>"));
    EXPECT_TRUE(std::equal(plain.begin(), plain.end(), with.begin() + 2));
}

TEST_F(TokenizerFixture, IdToBytesGivesRawBytes) {
    size_t len;
    const uint8_t *p = tok_id_to_bytes(k_.t, tok_token_to_id(k_.t, "\xc4\xa0"), &len);  // "Ġ"
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(std::string((const char *)p, len), " ");
    p = tok_id_to_bytes(k_.t, tok_token_to_id(k_.t, "<|user|>"), &len);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(std::string((const char *)p, len), "<|user|>");
    // a byte token that is half of a character: its raw byte, not text
    std::vector<int32_t> ids = encode(&k_, "\xe4\xb8\xad", false);  // U+4E2D, three byte tokens here
    ASSERT_EQ(ids.size(), 3u);
    p = tok_id_to_bytes(k_.t, ids[0], &len);
    ASSERT_EQ(len, 1u);
    EXPECT_EQ(p[0], 0xe4);
    EXPECT_EQ(tok_id_to_bytes(k_.t, tok_vocab_size(k_.t), &len), nullptr);
    EXPECT_EQ(tok_id_to_bytes(k_.t, -1, &len), nullptr);
    EXPECT_EQ(tok_token_to_id(k_.t, "no such token"), -1);
}

TEST_F(TokenizerFixture, RefusesInvalidUtf8AndLeavesOutputAlone) {
    tok_ids v = {};
    mt_error err;
    ASSERT_EQ(tok_encode(k_.e, "ab", 2, false, &v, &err), MT_OK);
    size_t n = v.n;
    const char *bad[] = {"a\xff", "\xc0\xaf", "\xed\xa0\x80", "\xe4\xb8", "\xf4\x90\x80\x80"};
    for (const char *s : bad) {
        EXPECT_EQ(tok_encode(k_.e, s, strlen(s), true, &v, &err), MT_ERR_INVALID) << escaped(s);
        EXPECT_NE(strstr(err.msg, "UTF-8"), nullptr) << err.msg;
        EXPECT_EQ(v.n, n);
    }
    // appends after what is there
    ASSERT_EQ(tok_encode(k_.e, "ab", 2, false, &v, &err), MT_OK);
    EXPECT_EQ(v.n, 2 * n);
    tok_ids_free(&v);
    tok_ids_free(&v);
    tok_ids_free(nullptr);
    tok_text_free(nullptr);
    tok_encoder_free(nullptr);
    tok_free(nullptr);
}

TEST_F(TokenizerFixture, StreamHoldsPartialCharacters) {
    std::vector<int32_t> ids = encode(&k_, "\xe4\xb8\xad", false);  // 中 as three byte tokens
    ASSERT_EQ(ids.size(), 3u);
    tok_stream s;
    tok_stream_init(&s, false);
    tok_text out = {};
    mt_error err;
    ASSERT_EQ(tok_stream_push(k_.t, &s, ids[0], &out, &err), MT_OK);
    ASSERT_EQ(tok_stream_push(k_.t, &s, ids[1], &out, &err), MT_OK);
    EXPECT_EQ(out.n, 0u);
    ASSERT_EQ(tok_stream_push(k_.t, &s, ids[2], &out, &err), MT_OK);
    EXPECT_EQ(std::string(out.s, out.n), "\xe4\xb8\xad");

    // A start byte, then a byte that cannot continue it: U+FFFD, then that byte's own text.
    int32_t a = encode(&k_, "a", false)[0];
    out.n = 0;
    ASSERT_EQ(tok_stream_push(k_.t, &s, ids[0], &out, &err), MT_OK);
    EXPECT_EQ(out.n, 0u);
    ASSERT_EQ(tok_stream_push(k_.t, &s, a, &out, &err), MT_OK);
    EXPECT_EQ(std::string(out.s, out.n), "\xef\xbf\xbd" "a");

    // Bytes still held at the end become one U+FFFD; a skipped special token in between is
    // nothing, so the halves on either side of it still join.
    out.n = 0;
    tok_stream_init(&s, true);
    int32_t user = tok_token_to_id(k_.t, "<|user|>");
    for (int32_t id : {ids[0], user, ids[1]}) ASSERT_EQ(tok_stream_push(k_.t, &s, id, &out, &err), MT_OK);
    EXPECT_EQ(out.n, 0u);
    tok_stream resumed;
    std::vector<int32_t> prev = {ids[0], user, ids[1]};
    tok_stream_resume(k_.t, &resumed, prev.data(), prev.size(), true);
    EXPECT_EQ(resumed.n_held, 2);
    ASSERT_EQ(tok_stream_finish(&s, &out, &err), MT_OK);
    EXPECT_EQ(std::string(out.s, out.n), "\xef\xbf\xbd");
    tok_text_free(&out);
}

TEST_F(TokenizerFixture, EncodersOnSeveralThreadsAgree) {
    std::vector<std::string> texts;
    for (int i = 0; i < 200; i++)
        texts.push_back("line " + std::to_string(i * 7919) + ": héllo <|user|> wörld 中文 " +
                        std::string((size_t)(i % 13), ' ') + "x\n");
    std::vector<std::vector<int32_t>> want;
    for (auto &s : texts) want.push_back(encode(&k_, s, true));
    std::vector<int> bad(2, 0);
    std::vector<std::thread> th;
    for (int w = 0; w < 2; w++)
        th.emplace_back([&, w] {
            tok_encoder *e = tok_encoder_new(k_.t);
            tok_ids v = {};
            mt_error err;
            for (int rep = 0; rep < 5; rep++)
                for (size_t i = 0; i < texts.size(); i++) {
                    v.n = 0;
                    if (tok_encode(e, texts[i].data(), texts[i].size(), true, &v, &err) != MT_OK ||
                        std::vector<int32_t>(v.ids, v.ids + v.n) != want[i])
                        bad[w]++;
                }
            tok_ids_free(&v);
            tok_encoder_free(e);
        });
    for (auto &t : th) t.join();
    EXPECT_EQ(bad[0] + bad[1], 0);
}

// The fixture's tokenizer.json with one field replaced, loaded from a temporary directory.
class TokenizerOptions : public ::testing::Test {
  protected:
    mt_status load_with(const char *field, const char *json, std::string *msg) {
        json_object *fields = json_object_new_object();
        json_object_object_add(fields, field, json_tokener_parse(json));
        std::string dir = write_variant("tests/fixtures/glm_tok", fields);
        json_object_put(fields);
        tok_tokenizer *t = nullptr;
        mt_error err = {};
        mt_status st = tok_load(dir.c_str(), &t, &err);
        *msg = err.msg;
        tok_free(t);
        unlink((dir + "/tokenizer.json").c_str());
        rmdir(dir.c_str());
        return st;
    }
};

TEST_F(TokenizerOptions, RefusesWhatItDoesNotImplement) {
    struct {
        const char *field, *json, *says;
    } cases[] = {
        {"normalizer", "{\"type\": \"NFC\"}", "normalizer NFC"},
        {"decoder", "null", "decoder"},
        {"decoder", "{\"type\": \"WordPiece\"}", "WordPiece"},
        {"truncation", "{\"max_length\": 8}", "truncation"},
        {"model.unk_token", "\"<unk>\"", "unk_token"},
        {"model.byte_fallback", "true", "byte_fallback"},
        {"model.type", "\"Unigram\"", "Unigram"},
        {"pre_tokenizer", "{\"type\": \"Whitespace\"}", "Whitespace"},
        {"pre_tokenizer", "{\"type\": \"ByteLevel\", \"add_prefix_space\": true}", "add_prefix_space"},
        {"post_processor", "{\"type\": \"RobertaProcessing\"}", "RobertaProcessing"},
    };
    for (auto &c : cases) {
        std::string msg;
        EXPECT_EQ(load_with(c.field, c.json, &msg), MT_ERR_UNSUPPORTED) << c.field << " = " << c.json;
        EXPECT_NE(msg.find(c.says), std::string::npos) << msg;
        EXPECT_NE(msg.find("tokenizer.json"), std::string::npos) << msg;
    }
}

TEST_F(TokenizerOptions, SaysWhatIsMalformed) {
    std::string msg;
    EXPECT_EQ(load_with("model.merges", "[\"zzq qqz\"]", &msg), MT_ERR_INVALID);
    EXPECT_NE(msg.find("merge 0"), std::string::npos) << msg;
    EXPECT_EQ(load_with("pre_tokenizer",
                        "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", "
                        "\"pattern\": {\"Regex\": \"(\"}, \"behavior\": \"Isolated\", \"invert\": false},"
                        "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": false}]}",
                        &msg),
              MT_ERR_UNSUPPORTED);
    EXPECT_NE(msg.find("PCRE2"), std::string::npos) << msg;
    tok_tokenizer *t = nullptr;
    mt_error err;
    EXPECT_EQ(tok_load("tests/fixtures/no_such_dir", &t, &err), MT_ERR_NOT_FOUND);
    EXPECT_EQ(t, nullptr);
}

}  // namespace
