/* gateway/gen_text.c — a generation's text as its tokens are decoded
 * (gen_text.h). */
#include <stdlib.h>
#include <string.h>

#include "gateway/gen_text.h"
#include "gateway/report.h"

/* Look for stop strings ending in the bytes after offset before. */
static void gt_find_stop(rk_gen_text *g, size_t before) {
    size_t from = before > g->max_stop ? before - g->max_stop + 1 : 0;
    for (int k = 0; k < g->n_stop; k++) {
        size_t sl = strlen(g->stop[k]);
        if (g->raw.len < from + sl) continue;
        const char *hit = memmem(g->raw.s + from, g->raw.len - from, g->stop[k], sl);
        if (hit && (g->stop_at < 0 || hit - g->raw.s < g->stop_at)) g->stop_at = hit - g->raw.s;
    }
}

/* Decode tokens [decoded, n) one at a time, until one completes a stop
 * string: the generation ends with that token (the engine may have sampled
 * more before it heard; they are not part of the answer). */
void rk_gt_feed(rk_gen_text *g, const int32_t *tokens, int n) {
    if (n > g->tok_cap) {
        size_t *p = realloc(g->tok_end, (size_t)n * 2 * sizeof *p);
        if (!p) {
            g->raw.oom = 1;
            return;
        }
        g->tok_end = p;
        g->tok_cap = n * 2;
    }
    for (; g->decoded < n && g->stop_at < 0; g->tok_end[g->decoded++] = g->raw.len) {
        int32_t id = tokens[g->decoded];
        char *t;
        size_t tl, before = g->raw.len;
        if (rk_tokenizer_decode(g->tok, &id, 1, g->specials, g->skip_space, &t, &tl)) continue;
        if (tl) rk_strbuf_putn(&g->raw, t, tl);
        free(t);
        if (rk_tokenizer_token_bytes(g->tok, id, 0, NULL, 0) > 0) g->skip_space = 0;
        if (g->n_stop && g->raw.len > before) {
            gt_find_stop(g, before);
            if (g->stop_at >= 0) g->stop_tokens = g->decoded + 1;
        }
    }
}

/* The next piece of text that is final (malloc'ed, valid UTF-8; NULL when
 * nothing new). final: the generation is over, send the rest. */
char *rk_gt_take(rk_gen_text *g, int final) {
    size_t limit = g->stop_at >= 0 ? (size_t)g->stop_at : g->raw.len;
    if (!final && g->stop_at < 0 && g->n_stop)
        limit = g->raw.len > g->max_stop - 1 ? g->raw.len - (g->max_stop - 1) : 0;
    size_t end = g->sent;
    if (final) {
        end = limit > g->sent ? limit : g->sent;
    } else {
        const unsigned char *s = (const unsigned char *)g->raw.s;
        while (end < limit) {
            uint32_t cp;
            int l = rk_utf8_decode(s + end, g->raw.len - end, &cp);
            if (l < 0) break;  /* wait for the rest of the character */
            if (l == 0) l = 1; /* an invalid byte: becomes U+FFFD on its own */
            if (end + (size_t)l > limit) break;
            end += (size_t)l;
        }
    }
    if (end <= g->sent) return NULL;
    char *t = rk_utf8_sanitize(g->raw.s + g->sent, end - g->sent, NULL);
    g->sent = end;
    return t;
}
