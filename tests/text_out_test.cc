// A sequence's streamed text (worker/text/text_out.h) on the glm_tok fixture: for random id lists
// (vocabulary, special and byte tokens that make invalid UTF-8), the pieces are whole UTF-8
// characters, each push's text only grows the stream, and the concatenation equals tok_decode of
// the ids, cut at the first occurrence of the stop string (before it, or after it with
// include_stop), matched across token boundaries.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "worker/text/text_out.h"
#include "worker/text/tokenizer.h"

namespace {

struct Fixture : ::testing::Test {
    void SetUp() override {
        mt_error err;
        ASSERT_EQ(tok_load("tests/fixtures/glm_tok", &t, &err), MT_OK) << err.msg;
    }
    void TearDown() override { tok_free(t); }
    std::string Decode(const std::vector<int32_t> &ids, bool skip) {
        tok_text out = {};
        mt_error err;
        EXPECT_EQ(tok_decode(t, ids.data(), ids.size(), skip, &out, &err), MT_OK);
        std::string s(out.s ? out.s : "", out.n);
        tok_text_free(&out);
        return s;
    }
    tok_tokenizer *t = nullptr;
};

bool ValidUtf8(const std::string &s) {
    size_t i = 0;
    while (i < s.size()) {
        const unsigned char c = s[i];
        int n = c < 0x80 ? 1 : c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
        if (!n || i + n > s.size()) return false;
        for (int k = 1; k < n; k++)
            if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return false;
        i += n;
    }
    return true;
}

struct Streamed {
    std::string text;
    int stop = -1;
    size_t ids_used = 0;
    bool pieces_valid = true;
};

Streamed Stream(const tok_tokenizer *t, const std::vector<int32_t> &ids, const std::vector<std::string> &stops,
                bool include, bool skip) {
    std::vector<const char *> sp;
    for (const auto &s : stops) sp.push_back(s.c_str());
    txt_out_params p = { sp.data(), sp.size(), include, skip };
    txt_out *o = nullptr;
    mt_error err;
    EXPECT_EQ(txt_out_new(t, &p, &o, &err), MT_OK) << err.msg;
    Streamed r;
    for (int32_t id : ids) {
        tok_text piece = {};
        int stop = -1;
        EXPECT_EQ(txt_out_push(o, id, &piece, &stop, &err), MT_OK);
        const std::string s(piece.s ? piece.s : "", piece.n);
        r.pieces_valid &= ValidUtf8(s);
        r.text += s;
        tok_text_free(&piece);
        r.ids_used++;
        if (stop >= 0) {
            r.stop = stop;
            EXPECT_STREQ(txt_out_stop_string(o), stops[stop].c_str());
            break;
        }
    }
    tok_text rest = {};
    EXPECT_EQ(txt_out_finish(o, &rest, &err), MT_OK);
    if (r.stop < 0 && txt_out_stop_string(o)) r.stop = 0;  // matched in the final U+FFFD (one stop here)
    const std::string s(rest.s ? rest.s : "", rest.n);
    r.pieces_valid &= ValidUtf8(s);
    r.text += s;
    tok_text_free(&rest);
    txt_out_free(o);
    return r;
}

TEST_F(Fixture, StreamedTextEqualsDecodeCutAtTheStopString) {
    std::mt19937 rng(7);
    const int V = tok_vocab_size(t);
    int cases = 0, stopped = 0, across = 0;
    for (int c = 0; c < 3000; c++) {
        std::vector<int32_t> ids;
        const int n = 1 + (int)(rng() % 24);
        for (int i = 0; i < n; i++) {
            const int kind = (int)(rng() % 10);
            // mostly ordinary tokens; some single-byte tokens (ids 0..255 carry bytes in byte-level
            // vocabularies, splitting characters) and the top ids (the added tokens)
            ids.push_back(kind < 7 ? (int32_t)(rng() % V) : kind < 9 ? (int32_t)(rng() % 256) : V - 1 - (int32_t)(rng() % 12));
        }
        const bool skip = rng() % 2, include = rng() % 2;
        const std::string full = Decode(ids, skip);
        std::vector<std::string> stops;
        if (c % 4 && full.size() > 2) {  // a piece of the text itself, at a character boundary
            size_t a = rng() % full.size(), len = 1 + rng() % 6;
            while (a > 0 && (static_cast<unsigned char>(full[a]) & 0xc0) == 0x80) a--;
            size_t b = std::min(full.size(), a + len);
            while (b < full.size() && (static_cast<unsigned char>(full[b]) & 0xc0) == 0x80) b++;
            stops.push_back(full.substr(a, b - a));
        } else if (c % 8 == 0) {
            stops.push_back("\xe2\x96\x81never-in-it\x01");
        }
        const Streamed got = Stream(t, ids, stops, include, skip);
        std::string want = full;
        int want_stop = -1;
        if (!stops.empty()) {
            const size_t at = full.find(stops[0]);
            if (at != std::string::npos) {
                want = full.substr(0, at + (include ? stops[0].size() : 0));
                want_stop = 0;
            }
        }
        EXPECT_TRUE(got.pieces_valid) << "case " << c;
        ASSERT_EQ(got.text, want) << "case " << c << " stop '" << (stops.empty() ? "" : stops[0]) << "'";
        ASSERT_EQ(got.stop, want_stop) << "case " << c;
        if (want_stop >= 0) {
            stopped++;
            // a match whose start came from an earlier id than its end
            const std::vector<int32_t> last(ids.begin() + (long)got.ids_used - 1, ids.begin() + (long)got.ids_used);
            if (Decode(last, skip).find(stops[0]) == std::string::npos) across++;
        }
        cases++;
    }
    EXPECT_GT(stopped, 1000);
    EXPECT_GT(across, 100);
    printf("%d cases, %d ended by a stop string (%d across token boundaries)\n", cases, stopped, across);
}

TEST_F(Fixture, HoldsBackOnlyWhatCouldStillBeAStopString) {
    // "Hello world" as single-byte tokens: with stop "wor!", "wor" is held until "l" shows it is not one
    std::vector<int32_t> ids;
    tok_ids enc = {};
    tok_encoder *e = tok_encoder_new(t);
    mt_error err;
    ASSERT_EQ(tok_encode(e, "Hello world", 11, false, &enc, &err), MT_OK);
    ids.assign(enc.ids, enc.ids + enc.n);
    tok_ids_free(&enc);
    tok_encoder_free(e);
    const char *stops[] = { "o w", "xyz" };
    txt_out_params p = { stops, 2, false, true };
    txt_out *o = nullptr;
    ASSERT_EQ(txt_out_new(t, &p, &o, &err), MT_OK);
    std::string sent;
    int stop = -1;
    for (int32_t id : ids) {
        tok_text piece = {};
        ASSERT_EQ(txt_out_push(o, id, &piece, &stop, &err), MT_OK);
        sent += std::string(piece.s ? piece.s : "", piece.n);
        tok_text_free(&piece);
        if (stop >= 0) break;
    }
    EXPECT_EQ(stop, 0);
    EXPECT_EQ(sent, "Hell");
    txt_out_free(o);

    const char *empty[] = { "" };
    p = { empty, 1, false, true };
    EXPECT_EQ(txt_out_new(t, &p, &o, &err), MT_ERR_INVALID);
}

}  // namespace
