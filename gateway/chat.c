/* gateway/chat.c — chat templates: a chat request rendered into the three
 * kinds of pieces the pipeline tokenizes separately.
 *
 *   system piece   the template's system part, every earlier turn, and the
 *                  opening of the last user turn — text that stays the same
 *                  from one question to the next, so the radix cache reuses it;
 *   chunks         raw document text (never templated, so a chunk's tokens and
 *                  its cache key do not depend on the conversation);
 *   question       the rest of the last user turn and the assistant prefix.
 *
 * For ChatML (Qwen2/Qwen3), with system S, chunks C1 C2 and question Q:
 *
 *   "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n" | C1 | C2 |
 *   "Q<|im_end|>\n<|im_start|>assistant\n"
 *
 * Llama-3 uses <|start_header_id|>role<|end_header_id|>\n\n ... <|eot_id|>;
 * Llama-2 puts the system prompt in <<SYS>> inside the first [INST]. BOS is
 * added by the tokenizer step, never written here. */
#include <stdlib.h>
#include <string.h>

#include "gateway/server.h"

const char *rk_chat_template_name(rk_chat_template t) {
    switch (t) {
    case RK_CHAT_CHATML: return "chatml";
    case RK_CHAT_LLAMA3: return "llama3";
    case RK_CHAT_LLAMA2: return "llama2";
    }
    return "?";
}

rk_chat_template rk_chat_template_detect(const char *jinja, const char *arch,
                                         int has_llama3_tokens) {
    if (jinja) {
        if (strstr(jinja, "<|im_start|>")) return RK_CHAT_CHATML;
        if (strstr(jinja, "<|start_header_id|>")) return RK_CHAT_LLAMA3;
        if (strstr(jinja, "[INST]")) return RK_CHAT_LLAMA2;
    }
    if (arch && (!strcmp(arch, "qwen2") || !strcmp(arch, "qwen3"))) return RK_CHAT_CHATML;
    if (has_llama3_tokens) return RK_CHAT_LLAMA3;
    return RK_CHAT_LLAMA2;
}

/* ---------------------------------------------------------------- a growing string */

typedef struct sbuf {
    char *s;
    size_t len, cap;
    int oom;
} sbuf;

static void sb_add(sbuf *b, const char *s) {
    size_t n = strlen(s);
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        char *p = realloc(b->s, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->s = p;
        b->cap = cap;
    }
    memcpy(b->s + b->len, s, n + 1);
    b->len += n;
}

/* ---------------------------------------------------------------- templates */

static const char *role_name(rk_chat_role r) {
    return r == RK_ROLE_SYSTEM ? "system" : r == RK_ROLE_USER ? "user" : "assistant";
}

/* One complete earlier turn. */
static void turn(rk_chat_template t, sbuf *b, const rk_chat_msg *m) {
    if (t == RK_CHAT_CHATML) {
        sb_add(b, "<|im_start|>");
        sb_add(b, role_name(m->role));
        sb_add(b, "\n");
        sb_add(b, m->content);
        sb_add(b, "<|im_end|>\n");
    } else {
        sb_add(b, "<|start_header_id|>");
        sb_add(b, role_name(m->role));
        sb_add(b, "<|end_header_id|>\n\n");
        sb_add(b, m->content);
        sb_add(b, "<|eot_id|>");
    }
}

/* Llama-2: system messages join into a <<SYS>> block of the first [INST]. */
static void llama2_system(const rk_api_request *req, sbuf *b, int n_before) {
    sbuf sys = {0};
    for (int i = 0; i < n_before; i++) {
        if (req->msgs[i].role != RK_ROLE_SYSTEM) continue;
        if (sys.len) sb_add(&sys, "\n\n");
        sb_add(&sys, req->msgs[i].content);
    }
    if (sys.oom) b->oom = 1;
    int first_user = 1;
    for (int i = 0; i <= n_before; i++) {
        const rk_chat_msg *m = &req->msgs[i];
        if (m->role == RK_ROLE_SYSTEM) continue;
        if (m->role == RK_ROLE_ASSISTANT) {
            sb_add(b, " ");
            sb_add(b, m->content);
            sb_add(b, " </s><s>");
            continue;
        }
        sb_add(b, "[INST] ");
        if (first_user && sys.len) {
            sb_add(b, "<<SYS>>\n");
            sb_add(b, sys.s);
            sb_add(b, "\n<</SYS>>\n\n");
        }
        first_user = 0;
        if (i == n_before) break; /* the last user turn: its content goes after the chunks */
        sb_add(b, m->content);
        sb_add(b, " [/INST]");
    }
    free(sys.s);
}

rk_status rk_chat_render(rk_chat_template t, rk_api_request *req, int max_chunks,
                         rk_http_error *err) {
    if (req->n_msgs < 1 || req->msgs[req->n_msgs - 1].role != RK_ROLE_USER)
        return rk_http_errorf(err, 400, "the last message must be the user's");
    int last = req->n_msgs - 1;
    sbuf sys = {0}, q = {0};
    if (t == RK_CHAT_LLAMA2) {
        llama2_system(req, &sys, last);
    } else {
        for (int i = 0; i < last; i++) turn(t, &sys, &req->msgs[i]);
        sb_add(&sys, t == RK_CHAT_CHATML ? "<|im_start|>user\n"
                                         : "<|start_header_id|>user<|end_header_id|>\n\n");
    }

    /* The last user message: chunks + question. */
    rk_split split = {0};
    rk_status st = RK_OK;
    const char *content = req->msgs[last].content;
    const char *const *chunks = NULL;
    char **ids = NULL;
    int n_chunks = 0;
    if (req->chat_chunks_given) {
        chunks = (const char *const *)req->chat_chunks;
        n_chunks = req->n_chat_chunks;
        sb_add(&q, content);
    } else if (*content) {
        /* Split as a prompt with an empty system piece in front. */
        size_t ls = strlen(req->separator), lc = strlen(content);
        char *text = malloc(ls + lc + 1);
        if (!text) {
            st = rk_http_errorf(err, 500, "out of memory");
            goto done;
        }
        memcpy(text, req->separator, ls);
        memcpy(text + ls, content, lc + 1);
        st = rk_split_prompt(text, ls + lc, req->separator, max_chunks, &split);
        free(text);
        if (st) {
            rk_http_errorf(err, rk_http_status_of(st), "bad last user message: %s",
                           rk_error_message());
            goto done;
        }
        sb_add(&q, split.question.s);
    }
    const char *end = t == RK_CHAT_CHATML   ? "<|im_end|>\n<|im_start|>assistant\n"
                      : t == RK_CHAT_LLAMA3 ? "<|eot_id|><|start_header_id|>assistant<|end_header_"
                                              "id|>\n\n"
                                            : " [/INST]";
    sb_add(&q, end);
    if (sys.oom || q.oom) {
        st = rk_http_errorf(err, 500, "out of memory");
        goto done;
    }

    /* Non-empty chunks in order (empty ones are skipped and counted), with their ids. */
    int n_in = req->chat_chunks_given ? n_chunks : split.n_chunks, kept = 0, empty = 0;
    const char **list = calloc((size_t)(n_in ? n_in : 1), sizeof *list);
    if (!list) {
        st = rk_http_errorf(err, 500, "out of memory");
        goto done;
    }
    for (int i = 0; i < n_in; i++) {
        const char *c = req->chat_chunks_given ? chunks[i] : split.chunks[i].s;
        if (*c)
            list[kept++] = c;
        else
            empty++;
    }
    rk_split out;
    st = rk_split_structured(sys.s, list, kept, q.s, max_chunks, &out);
    if (st) {
        rk_http_errorf(err, rk_http_status_of(st), "bad chat request: %s", rk_error_message());
        free(list);
        goto done;
    }
    out.n_empty_chunks += empty + split.n_empty_chunks;
    if (req->chat_chunks_given && kept > 0) {
        ids = calloc((size_t)kept, sizeof *ids);
        for (int i = 0, k = 0; ids && i < n_chunks; i++) {
            if (!*chunks[i]) continue;
            const char *id = req->chat_chunk_ids[i];
            if (id && !(ids[k] = strdup(id))) {
                for (int j = 0; j < k; j++) free(ids[j]);
                free(ids);
                ids = NULL;
                break;
            }
            k++;
        }
        if (!ids) {
            rk_split_free(&out);
            free(list);
            st = rk_http_errorf(err, 500, "out of memory");
            goto done;
        }
    }
    free(list);
    if (req->have_pieces) {
        if (req->chunk_ids)
            for (int i = 0; i < req->pieces.n_chunks; i++) free(req->chunk_ids[i]);
        rk_split_free(&req->pieces);
    }
    free(req->chunk_ids);
    req->pieces = out;
    req->have_pieces = 1;
    req->chunk_ids = ids;
done:
    rk_split_free(&split);
    free(sys.s);
    free(q.s);
    return st;
}
