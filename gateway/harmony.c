/* gateway/harmony.c — the harmony chat format of gpt-oss: the system part of
 * a rendered chat (chat.c renders the turns) and an answer's channels split
 * into reasoning and content (see chat.h).
 *
 * The model answers in messages, each "<|channel|>NAME<|message|>TEXT"
 * closed by <|end|> (another message follows, opened by
 * "<|start|>assistant"), <|return|> or <|call|> (the answer is over). The
 * analysis channel is the thinking (message.reasoning_content); every other
 * channel (final, commentary) is the answer. The text between a message's
 * close and its body (role, channel name, <|constrain|> and its type) is
 * the header and belongs to neither; an answer that never opens a message
 * body is all answer. The pieces of a stream add up to what the whole text
 * gives: a tag cut between two pieces waits for the next. */
#include <string.h>

#include "gateway/chat.h"

static const char *const k_tags[] = {"<|channel|>", "<|message|>", "<|end|>",      "<|start|>",
                                     "<|return|>",  "<|call|>",    "<|constrain|>"};
enum { T_CHANNEL, T_MESSAGE, T_END, T_START, T_RETURN, T_CALL, T_CONSTRAIN, N_TAGS };

/* The first tag in p[0..n): its index and offset in *at; N_TAGS when none. */
static int next_tag(const char *p, size_t n, size_t *at) {
    for (size_t i = 0; i < n; i++) {
        if (p[i] != '<') continue;
        for (int k = 0; k < N_TAGS; k++) {
            size_t tl = strlen(k_tags[k]);
            if (n - i >= tl && !memcmp(p + i, k_tags[k], tl)) {
                *at = i;
                return k;
            }
        }
    }
    return N_TAGS;
}

/* Length of the longest suffix of p[0..n) that is a proper prefix of a tag. */
static size_t partial_tag(const char *p, size_t n) {
    for (size_t k = n < 13 ? n : 13; k > 0; k--)
        for (int t = 0; t < N_TAGS; t++)
            if (k < strlen(k_tags[t]) && !memcmp(p + n - k, k_tags[t], k)) return k;
    return 0;
}

static void consume(rk_think_split *s, size_t n) {
    memmove(s->pending.s, s->pending.s + n, s->pending.len - n + 1);
    s->pending.len -= n;
}

void rk_harmony_feed(rk_think_split *s, const char *text, size_t n, int final, rk_strbuf *reasoning,
                     rk_strbuf *content) {
    rk_strbuf_putn(&s->pending, text, n);
    if (!s->pending.s) return;
    for (;;) {
        const char *p = s->pending.s;
        size_t len = s->pending.len, at = 0;
        int tag = next_tag(p, len, &at);
        if (s->state == RK_THINK_START || s->state == RK_THINK_OPENED) {
            /* a header: role, channel name, constraint, up to <|message|> */
            if (tag == N_TAGS) {
                if (final) { /* no message body: all answer */
                    if (len) rk_strbuf_putn(content, p, len);
                    consume(s, len);
                }
                return;
            }
            if (s->state == RK_THINK_OPENED) /* the channel's name ends here */
                s->analysis = at >= 8 && !memcmp(p, "analysis", 8) && (at == 8 || p[8] == ' ');
            if (tag == T_CHANNEL || tag == T_CONSTRAIN) {
                /* after <|constrain|>: its type, header still */
                s->state = tag == T_CHANNEL ? RK_THINK_OPENED : RK_THINK_START;
                consume(s, at + strlen(k_tags[tag]));
                continue;
            }
            if (tag == T_MESSAGE) {
                s->state = RK_THINK_IN;
                consume(s, at + strlen(k_tags[tag]));
                continue;
            }
            consume(s, at + strlen(k_tags[tag])); /* <|start|>, a stray close */
            continue;
        }
        if (s->state == RK_THINK_IN) { /* a message body */
            size_t end = tag == N_TAGS ? len : at;
            if (tag == N_TAGS && !final) end -= partial_tag(p, len);
            if (end) rk_strbuf_putn(s->analysis ? reasoning : content, p, end);
            if (tag == N_TAGS) {
                consume(s, final ? len : end);
                return;
            }
            consume(s, end + strlen(k_tags[tag]));
            s->state = tag == T_RETURN || tag == T_CALL ? RK_THINK_ANSWER
                       : tag == T_CHANNEL               ? RK_THINK_OPENED
                                                        : RK_THINK_START;
            continue;
        }
        /* after <|return|> or <|call|>: nothing more is the answer's */
        consume(s, len);
        return;
    }
}

void rk_harmony_system(rk_strbuf *b, int effort) {
    static const char *const names[] = {"medium", "low", "medium", "high"};
    rk_strbuf_puts(b, "<|start|>system<|message|>You are ChatGPT, a large language model trained "
                      "by OpenAI.\nKnowledge cutoff: 2024-06\n\nReasoning: ");
    rk_strbuf_puts(b, names[effort >= 0 && effort <= 3 ? effort : 0]);
    rk_strbuf_puts(b, "\n\n# Valid channels: analysis, commentary, final. Channel must be "
                      "included for every message.<|end|>");
}
