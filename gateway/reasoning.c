/* gateway/reasoning.c — a thinking model's answer split into its thinking
 * and the answer proper (see chat.h).
 *
 * Qwen3 writes "<think>\n...\n</think>\n\nThe answer". The text is fed in
 * the pieces it is streamed in; each piece goes out as soon as it is known
 * to be thinking or answer: a tag cut between two pieces, and the
 * whitespace at the end of the thinking or at the start of the answer, wait
 * for the next piece. So the pieces of a stream add up to exactly what the
 * whole text splits into. */
#include <string.h>

#include "gateway/chat.h"

static const char k_open[] = "<think>", k_close[] = "</think>";

static int is_space(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

/* Length of the longest suffix of s[0..n) that is a proper prefix of tag. */
static size_t partial_tag(const char *s, size_t n, const char *tag) {
    size_t tl = strlen(tag);
    for (size_t k = tl - 1 < n ? tl - 1 : n; k > 0; k--)
        if (memcmp(s + n - k, tag, k) == 0) return k;
    return 0;
}

/* Drop the first n bytes of the pending text. */
static void consume(rk_think_split *s, size_t n) {
    memmove(s->pending.s, s->pending.s + n, s->pending.len - n + 1);
    s->pending.len -= n;
}

void rk_think_feed(rk_think_split *s, const char *text, size_t n, int final, rk_strbuf *reasoning,
                   rk_strbuf *content) {
    if (s->harmony) {
        rk_harmony_feed(s, text, n, final, reasoning, content);
        return;
    }
    rk_strbuf_putn(&s->pending, text, n);
    if (!s->pending.s) return;
    for (;;) {
        const char *p = s->pending.s;
        size_t len = s->pending.len, ws = 0;
        while (ws < len && is_space(p[ws])) ws++;
        if (s->state == RK_THINK_START) { /* is it thinking at all? */
            size_t rest = len - ws, ol = sizeof k_open - 1;
            if (rest >= ol && memcmp(p + ws, k_open, ol) == 0) {
                consume(s, ws + ol);
                s->state = RK_THINK_OPENED;
                continue;
            }
            if (!final && (rest == 0 || (rest < ol && memcmp(p + ws, k_open, rest) == 0))) return;
            s->state = RK_THINK_ANSWER;
            continue;
        }
        if (s->state == RK_THINK_OPENED) { /* the thinking starts at its first non-space */
            consume(s, ws);
            if (!s->pending.len && !final) return;
            s->state = RK_THINK_IN;
            continue;
        }
        if (s->state == RK_THINK_IN) {
            const char *close = len ? strstr(p, k_close) : NULL;
            size_t end = close ? (size_t)(close - p) : len;
            if (!close && !final) end -= partial_tag(p, len, k_close);
            size_t keep = end; /* whitespace before the close tag is not thinking */
            while (keep > 0 && is_space(p[keep - 1])) keep--;
            if (keep) rk_strbuf_putn(reasoning, p, keep);
            if (close) {
                consume(s, end + sizeof k_close - 1);
                s->state = RK_THINK_AFTER;
                continue;
            }
            consume(s, final ? len : keep);
            return;
        }
        if (s->state == RK_THINK_AFTER) { /* the answer starts at its first non-space */
            consume(s, ws);
            if (!s->pending.len && !final) return;
            s->state = RK_THINK_ANSWER;
            continue;
        }
        if (len) rk_strbuf_putn(content, p, len);
        consume(s, len);
        return;
    }
}

void rk_think_split_text(const char *text, rk_strbuf *reasoning, rk_strbuf *content) {
    rk_think_split_text_as(0, text, reasoning, content);
}

void rk_think_split_text_as(int harmony, const char *text, rk_strbuf *reasoning,
                            rk_strbuf *content) {
    rk_think_split s = {.harmony = harmony};
    rk_think_feed(&s, text, strlen(text), 1, reasoning, content);
    rk_strbuf_free(&s.pending);
}
