/* gateway/chat_gemma4.c — Gemma 4's chat template (see chat.h).
 *
 * Gemma 4 (its tokenizer.chat_template) writes "<|turn>ROLE\n" + the text
 * trimmed + "<turn|>\n" per message, the assistant as "model", and
 * "<|turn>model\n" as the answer's opening; the first message, when it is a
 * system (or developer) message, and the request to think ("<|think|>\n")
 * go in a system turn at the start. An earlier answer's thinking
 * ("<|channel>thought\n...<channel|>") is dropped, and an assistant message
 * right after another continues its model turn. BOS is the tokenizer
 * step's. */
#include <string.h>

#include "gateway/chat.h"

static const char k_space[] = " \t\n\r\f\v";

/* s[0..n) without its leading (lead) and trailing whitespace, into b. */
static void put_trim(rk_strbuf *b, const char *s, size_t n, int lead) {
    while (lead && n && strchr(k_space, *s)) s++, n--;
    while (n && strchr(k_space, s[n - 1])) n--;
    rk_strbuf_putn(b, s, n);
}

void rk_gemma4_system(rk_strbuf *b, const rk_api_request *req) {
    int sys = req->n_msgs > 0 && req->msgs[0].role == RK_ROLE_SYSTEM;
    if (!sys && !req->thinking) return;
    rk_strbuf_puts(b, "<|turn>system\n");
    if (req->thinking) rk_strbuf_puts(b, "<|think|>\n");
    if (sys) put_trim(b, req->msgs[0].content, strlen(req->msgs[0].content), 1);
    rk_strbuf_puts(b, "<turn|>\n");
}

/* An answer's text without its thinking channels, trimmed, into b: of each
 * part before a "<channel|>" (and the rest after the last), what comes
 * before its "<|channel>", as the template's strip_thinking. */
static void put_answer(rk_strbuf *b, const char *s) {
    rk_strbuf t = {0};
    for (;;) {
        const char *close = strstr(s, "<channel|>");
        size_t n = close ? (size_t)(close - s) : strlen(s);
        const char *open = strstr(s, "<|channel>");
        if (open && (size_t)(open - s) < n) n = (size_t)(open - s);
        rk_strbuf_putn(&t, s, n);
        if (!close) break;
        s = close + strlen("<channel|>");
    }
    if (t.oom) b->oom = 1;
    if (t.s) put_trim(b, t.s, t.len, 1);
    rk_strbuf_free(&t);
}

void rk_gemma4_turn(rk_strbuf *b, const rk_api_request *req, const rk_chat_msg *m, int open) {
    if (m == req->msgs && m->role == RK_ROLE_SYSTEM) return; /* the system turn's */
    int assistant = m->role == RK_ROLE_ASSISTANT;
    if (!assistant || m == req->msgs || m[-1].role != RK_ROLE_ASSISTANT)
        rk_strbuf_puts(b, assistant ? "<|turn>model\n" : "<|turn>system\n");
    if (open) { /* continued as it stands, but for the template's leading trim */
        rk_strbuf_puts(b, m->content + strspn(m->content, k_space));
        return;
    }
    if (assistant)
        put_answer(b, m->content);
    else
        put_trim(b, m->content, strlen(m->content), 1);
    rk_strbuf_puts(b, "<turn|>\n");
}
