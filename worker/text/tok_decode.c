/* worker/text/tok_decode.c: ids -> text, whole or one id at a time.
 *
 * Both forms run the tokens' bytes through one UTF-8 reader that writes every complete character
 * and one U+FFFD for each maximal prefix of a character that cannot complete (a byte that starts
 * none, or a start whose next byte does not fit), the rule of Rust's String::from_utf8_lossy. It
 * holds back the bytes of a character still open at the end of what it was given; decoding
 * finishes with a U+FFFD for them, streaming waits for the next id. */
#include "worker/text/tokenizer_impl.h"

#include <string.h>

static const uint8_t REPLACEMENT[3] = {0xef, 0xbf, 0xbd}; /* U+FFFD */

/* Length of the character that c starts (1 for ASCII), or 0 when c starts none. */
static int char_len(uint8_t c) {
    if (c < 0x80) return 1;
    if (c >= 0xc2 && c <= 0xdf) return 2;
    if (c >= 0xe0 && c <= 0xef) return 3;
    if (c >= 0xf0 && c <= 0xf4) return 4;
    return 0;
}

/* Whether b may follow lead as the second byte (no overlongs, surrogates, or > U+10FFFF). */
static bool second_fits(uint8_t lead, uint8_t b) {
    switch (lead) {
    case 0xe0: return b >= 0xa0 && b <= 0xbf;
    case 0xed: return b >= 0x80 && b <= 0x9f;
    case 0xf0: return b >= 0x90 && b <= 0xbf;
    case 0xf4: return b >= 0x80 && b <= 0x8f;
    default: return (b & 0xc0) == 0x80;
    }
}

/* Reads p[0..n) after the held bytes of s, writing to o (room for 3n + 3 bytes). Returns the
 * bytes written. */
static size_t feed(tok_stream *s, const uint8_t *p, size_t n, char *o) {
    char *start = o;
    for (size_t i = 0; i < n; i++) {
        uint8_t b = p[i];
        if (s->n_held) {
            uint8_t lead = s->held[0];
            bool fits = s->n_held == 1 ? second_fits(lead, b) : (b & 0xc0) == 0x80;
            if (fits) {
                s->held[s->n_held++] = b;
                if (s->n_held == char_len(lead)) {
                    memcpy(o, s->held, s->n_held);
                    o += s->n_held;
                    s->n_held = 0;
                }
                continue;
            }
            memcpy(o, REPLACEMENT, 3); /* the open character cannot complete; b starts anew */
            o += 3;
            s->n_held = 0;
        }
        int len = char_len(b);
        if (len == 1) {
            *o++ = (char)b;
        } else if (len == 0) {
            memcpy(o, REPLACEMENT, 3);
            o += 3;
        } else {
            s->held[0] = b;
            s->n_held = 1;
        }
    }
    return (size_t)(o - start);
}

/* The bytes id contributes, or NULL when it names no token or is skipped. */
static const uint8_t *contributed(const tok_tokenizer *t, int32_t id, bool skip_special, size_t *len) {
    const uint8_t *p = tok_bytes_of(t, id, len);
    if (p && skip_special && (t->tok_flags[id] & TOK_F_SPECIAL)) return NULL;
    return p;
}

void tok_stream_init(tok_stream *s, bool skip_special_tokens) {
    memset(s, 0, sizeof *s);
    s->skip_special_tokens = skip_special_tokens;
}

void tok_stream_resume(const tok_tokenizer *t, tok_stream *s, const int32_t *ids, size_t n,
                       bool skip_special_tokens) {
    tok_stream_init(s, skip_special_tokens);
    /* Only the last three bytes matter: a character held open is at most three bytes, and it
     * starts at the last byte that is not a continuation byte (every such byte starts afresh). */
    uint8_t tail[3];
    int got = 0;
    for (size_t k = n; k > 0 && got < 3; k--) {
        size_t len;
        const uint8_t *p = contributed(t, ids[k - 1], skip_special_tokens, &len);
        while (p && len > 0 && got < 3) tail[2 - got++] = p[--len];
    }
    const uint8_t *b = tail + 3 - got;
    int from = -1;
    for (int i = 0; i < got; i++)
        if ((b[i] & 0xc0) != 0x80) from = i;
    if (from < 0) return;
    char sink[3 * 3 + 3];
    feed(s, b + from, (size_t)(got - from), sink);
}

mt_status tok_stream_push(const tok_tokenizer *t, tok_stream *s, int32_t id, tok_text *out,
                          mt_error *err) {
    size_t len;
    const uint8_t *p = contributed(t, id, s->skip_special_tokens, &len);
    if (!p || len == 0) return MT_OK;
    if (tok_text_reserve(out, out->n + 3 * len + 9) != MT_OK) /* + the held bytes */
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory");
    out->n += feed(s, p, len, out->s + out->n);
    out->s[out->n] = 0;
    return MT_OK;
}

mt_status tok_stream_finish(tok_stream *s, tok_text *out, mt_error *err) {
    if (tok_text_reserve(out, out->n + 3) != MT_OK)
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory");
    if (s->n_held) {
        memcpy(out->s + out->n, REPLACEMENT, 3);
        out->n += 3;
        s->n_held = 0;
    }
    out->s[out->n] = 0;
    return MT_OK;
}

mt_status tok_decode(const tok_tokenizer *t, const int32_t *ids, size_t n,
                     bool skip_special_tokens, tok_text *out, mt_error *err) {
    size_t total = 0, len;
    for (size_t i = 0; i < n; i++)
        if (contributed(t, ids[i], skip_special_tokens, &len)) total += len;
    if (tok_text_reserve(out, out->n + 3 * total + 3) != MT_OK)
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory decoding %zu ids", n);
    tok_stream s;
    tok_stream_init(&s, skip_special_tokens);
    for (size_t i = 0; i < n; i++) {
        const uint8_t *p = contributed(t, ids[i], skip_special_tokens, &len);
        if (p) out->n += feed(&s, p, len, out->s + out->n);
    }
    return tok_stream_finish(&s, out, err); /* room is reserved: cannot fail */
}
