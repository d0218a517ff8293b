/* gateway/reasoning.c — a thinking model's answer split into its thinking
 * and the answer proper (see chat.h).
 *
 * Qwen3 writes "<think>\n...\n</think>\n\nThe answer". The text is fed in
 * the pieces it is streamed in; each piece goes out as soon as it is known
 * to be thinking or answer: a tag cut between two pieces, and the
 * whitespace at the end of the thinking or at the start of the answer, wait
 * for the next piece. So the pieces of a stream add up to exactly what the
 * whole text splits into.
 *
 * Gemma 4 writes "<|channel>thought\n...<channel|>The answer<turn|>" (decoded
 * with its special tokens): the same split with its channel tags, and its
 * end of turn or, after calls, "<|tool_response>" (end-of-generation
 * tokens, decoded) and what follows them belong to neither. */
#include <string.h>

#include "gateway/chat.h"

static const char k_open[] = "<think>", k_close[] = "</think>";
static const char k_g4_open[] = "<|channel>thought", k_g4_close[] = "<channel|>";
/* Gemma 4's ends of an answer: its end of turn, and the opening of a tool's
 * results after its calls (both end generation). */
static const char *const k_g4_ends[] = {"<turn|>", "<|tool_response>"};

static int is_space(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

/* Length of the longest suffix of s[0..n) that is a proper prefix of tag. */
static size_t partial_tag(const char *s, size_t n, const char *tag) {
    size_t tl = strlen(tag);
    for (size_t k = tl - 1 < n ? tl - 1 : n; k > 0; k--)
        if (memcmp(s + n - k, tag, k) == 0) return k;
    return 0;
}

/* Where the first end of an answer is in p (Gemma 4's; none for the
 * others), or NULL; its length into *len. */
static const char *find_end(const rk_think_split *s, const char *p, size_t *len) {
    const char *first = NULL;
    for (size_t i = 0; s->gemma4 && i < sizeof k_g4_ends / sizeof *k_g4_ends; i++) {
        const char *e = strstr(p, k_g4_ends[i]);
        if (e && (!first || e < first)) first = e, *len = strlen(k_g4_ends[i]);
    }
    return first;
}

/* The longest suffix of p[0..n) that may begin an end of an answer. */
static size_t partial_end(const rk_think_split *s, const char *p, size_t n) {
    size_t k = 0;
    for (size_t i = 0; s->gemma4 && i < sizeof k_g4_ends / sizeof *k_g4_ends; i++) {
        size_t ki = partial_tag(p, n, k_g4_ends[i]);
        if (ki > k) k = ki;
    }
    return k;
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
    const char *open = s->gemma4 ? k_g4_open : k_open,
               *close_tag = s->gemma4 ? k_g4_close : k_close;
    rk_strbuf_putn(&s->pending, text, n);
    if (!s->pending.s) return;
    for (;;) {
        const char *p = s->pending.s;
        size_t len = s->pending.len, ws = 0;
        while (ws < len && is_space(p[ws])) ws++;
        if (s->state == RK_THINK_START) { /* is it thinking at all? */
            size_t rest = len - ws, ol = strlen(open);
            if (rest >= ol && memcmp(p + ws, open, ol) == 0) {
                consume(s, ws + ol);
                s->state = RK_THINK_OPENED;
                continue;
            }
            if (!final && (rest == 0 || (rest < ol && memcmp(p + ws, open, rest) == 0))) return;
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
            size_t end_len = 0;
            const char *close = len ? strstr(p, close_tag) : NULL,
                       *e = len ? find_end(s, p, &end_len) : NULL;
            int ended = e && (!close || e < close);
            if (ended) close = e;
            size_t end = close ? (size_t)(close - p) : len;
            if (!close && !final) {
                size_t k = partial_tag(p, len, close_tag), k2 = partial_end(s, p, len);
                end -= k > k2 ? k : k2;
            }
            size_t keep = end; /* whitespace before the close tag is not thinking */
            while (keep > 0 && is_space(p[keep - 1])) keep--;
            if (keep) rk_strbuf_putn(reasoning, p, keep);
            if (close) {
                consume(s, end + (ended ? end_len : strlen(close_tag)));
                s->state = ended ? RK_THINK_END : RK_THINK_AFTER;
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
        if (s->state == RK_THINK_END) { /* after Gemma 4's end of turn: neither */
            consume(s, len);
            return;
        }
        size_t end_len = 0;
        const char *e = len ? find_end(s, p, &end_len) : NULL;
        size_t upto = e ? (size_t)(e - p) : len;
        if (!e && !final) upto -= partial_end(s, p, len);
        if (upto) rk_strbuf_putn(content, p, upto);
        consume(s, upto);
        if (!e) return;
        s->state = RK_THINK_END;
    }
}

void rk_think_split_text(const char *text, rk_strbuf *reasoning, rk_strbuf *content) {
    rk_think_split_text_as(0, text, reasoning, content);
}

void rk_think_split_text_as(int kind, const char *text, rk_strbuf *reasoning, rk_strbuf *content) {
    rk_think_split s = {.harmony = kind == RK_THINK_HARMONY, .gemma4 = kind == RK_THINK_GEMMA4};
    rk_think_feed(&s, text, strlen(text), 1, reasoning, content);
    rk_strbuf_free(&s.pending);
}
