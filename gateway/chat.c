/* gateway/chat.c — chat templates: a chat request rendered into the three
 * kinds of pieces the pipeline tokenizes separately.
 *
 *   system piece   the template's system part, the turns before the document
 *                  turn and that turn's opening;
 *   chunks         the document turn's documents, raw text (never templated,
 *                  so a chunk's tokens and its cache key do not depend on the
 *                  conversation);
 *   question       the rest of the document turn, every later turn (answers
 *                  and questions) and the assistant's opening.
 *
 * A user message's documents are its content parts marked "ragkv_chunk":
 * true and, when the request asks for splitting (a "separator" in the body,
 * or the server's --chat-separator), the pieces its text splits into; the
 * `chunks` and `documents` extensions are the first user message's. Without
 * that, a "##" in a message is text (a Markdown heading stays a heading).
 * The document turn is the first user message that carries documents;
 * without one, the first user message, so a chat without documents has the
 * same layout with no chunks (its turns after the system part are all in the
 * question piece, where the next turn finds them). The chunks are the
 * documents of every user message from the document turn on, in message
 * order: a later turn's documents join the document turn's, after them, so
 * they are chunk segments, looked up in and reused from the chunk cache in
 * this turn and every later one, never recomputed as question text. The later turns keep
 * their text in the question piece. Everything before the assistant's
 * opening therefore stays in place from one turn to the next: turn N+1's
 * system piece is turn N's, its chunks are turn N's followed by its own new
 * documents, and its question starts with turn N's question. When turn N+1
 * brings no new documents its layout extends turn N's sequence (prompt and
 * answer) in the radix cache, so only the new turns are computed; when it
 * does, the system piece and every chunk are reused and the turns' text
 * after the chunks is computed again.
 *
 * For ChatML (Qwen2/Qwen3), with system S, chunks C1 C2, question Q, answer
 * A and a follow-up F:
 *
 *   "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n" | C1 | C2 |
 *   "Q<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n<|im_start|>user\nF<|im_end|>\n"
 *   "<|im_start|>assistant\n"
 *
 * A chat whose last message is the assistant's continues that message: its
 * turn is rendered open (no end-of-turn marker) in place of the assistant's
 * opening, and the answer is the continuation.
 *
 * Llama-3 uses <|start_header_id|>role<|end_header_id|>\n\n ... <|eot_id|>;
 * Phi-3 <|role|>\n ... <|end|>\n;
 * Llama-2 puts the system prompt in <<SYS>> inside the first [INST]. Gemma
 * (2 and 3) writes <start_of_turn>user\n ... <end_of_turn>\n and
 * <start_of_turn>model\n for the assistant; it has no system role: the
 * system text and a blank line open the first user turn (as Llama-2's
 * <<SYS>> block does here), and each message's text is trimmed as its
 * template trims it. Gemma 4 (chat_gemma4.c) has a system turn of its own:
 * <|turn>system\n ... <turn|>\n, then <|turn>user|model\n ... <turn|>\n.
 * BOS is added by the tokenizer step, never written here. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/chat.h"

const char *rk_chat_template_name(rk_chat_template t) {
    switch (t) {
    case RK_CHAT_CHATML: return "chatml";
    case RK_CHAT_LLAMA3: return "llama3";
    case RK_CHAT_LLAMA2: return "llama2";
    case RK_CHAT_PHI3: return "phi3";
    case RK_CHAT_GEMMA: return "gemma";
    case RK_CHAT_HARMONY: return "harmony";
    case RK_CHAT_GEMMA4: return "gemma4";
    }
    return "?";
}

rk_chat_template rk_chat_template_detect(const char *jinja, const char *arch, int has_llama3_tokens,
                                         int has_gemma4_tokens) {
    if (jinja) {
        if (strstr(jinja, "<|channel|>") && strstr(jinja, "<|message|>")) return RK_CHAT_HARMONY;
        if (strstr(jinja, "<|turn>")) return RK_CHAT_GEMMA4;
        if (strstr(jinja, "<|im_start|>")) return RK_CHAT_CHATML;
        if (strstr(jinja, "<|start_header_id|>")) return RK_CHAT_LLAMA3;
        if (strstr(jinja, "[INST]")) return RK_CHAT_LLAMA2;
        if (strstr(jinja, "<|assistant|>") && strstr(jinja, "<|end|>")) return RK_CHAT_PHI3;
        if (strstr(jinja, "<start_of_turn>")) return RK_CHAT_GEMMA;
    }
    if (arch && (!strcmp(arch, "qwen2") || !strcmp(arch, "qwen3"))) return RK_CHAT_CHATML;
    if (arch && !strcmp(arch, "phi3")) return RK_CHAT_PHI3;
    /* gemma4 files written with Gemma 3's vocabulary keep Gemma 3's template */
    if (arch && !strcmp(arch, "gemma4") && has_gemma4_tokens) return RK_CHAT_GEMMA4;
    /* gemma4 files computed here carry Gemma 3's vocabulary (Gemma 4's own
     * tokenizer, whose turns are <|turn>role\n...<turn|>, is not read) */
    if (arch && (!strcmp(arch, "gemma2") || !strcmp(arch, "gemma3") || !strcmp(arch, "gemma4")))
        return RK_CHAT_GEMMA;
    if (arch && !strcmp(arch, "gpt-oss")) return RK_CHAT_HARMONY;
    if (has_llama3_tokens) return RK_CHAT_LLAMA3;
    return RK_CHAT_LLAMA2;
}

/* ---------------------------------------------------------------- a growing string */

/* Empty b, keeping its memory for what follows. */
static void sb_clear(rk_strbuf *b) {
    b->len = 0;
    if (b->s) b->s[0] = '\0';
}

/* ---------------------------------------------------------------- templates */

static const char *role_name(rk_chat_role r) {
    return r == RK_ROLE_SYSTEM ? "system" : r == RK_ROLE_USER ? "user" : "assistant";
}

/* ---------------------------------------------------------------- tools */

/* One tool call as the template writes it: Qwen's {"name", "arguments"} in
 * <tool_call> tags, Llama 3's JSON {"name", "parameters"}. */
static void call_text(rk_chat_template t, rk_strbuf *b, const char *name, const json_t *args) {
    char *a = json_dumps(args, JSON_COMPACT);
    json_t *n = json_string(name);
    char *ns = n ? json_dumps(n, JSON_ENCODE_ANY) : NULL;
    json_decref(n);
    if (!a || !ns) {
        b->oom = 1;
    } else if (t == RK_CHAT_CHATML) {
        rk_strbuf_puts(b, "<tool_call>\n{\"name\": ");
        rk_strbuf_puts(b, ns);
        rk_strbuf_puts(b, ", \"arguments\": ");
        rk_strbuf_puts(b, a);
        rk_strbuf_puts(b, "}\n</tool_call>");
    } else {
        rk_strbuf_puts(b, "{\"name\": ");
        rk_strbuf_puts(b, ns);
        rk_strbuf_puts(b, ", \"parameters\": ");
        rk_strbuf_puts(b, a);
        rk_strbuf_puts(b, "}");
    }
    free(a);
    free(ns);
}

/* The calls of an assistant message (JSON text of [{"name", "arguments"}]). */
static void calls_text(rk_chat_template t, rk_strbuf *b, const char *calls) {
    json_t *list = json_loads(calls, 0, NULL);
    if (!list) {
        b->oom = 1;
        return;
    }
    for (size_t k = 0; k < json_array_size(list); k++) {
        json_t *c = json_array_get(list, k);
        if (k) rk_strbuf_puts(b, "\n");
        call_text(t, b, json_string_value(json_object_get(c, "name")),
                  json_object_get(c, "arguments"));
    }
    json_decref(list);
}

/* The tool definitions as the template's system text describes them. */
static void tools_block(rk_chat_template t, const rk_api_request *req, rk_strbuf *b) {
    if (t == RK_CHAT_CHATML)
        rk_strbuf_puts(b,
                       "# Tools\n\nYou may call one or more functions to assist with the user "
                       "query.\n\nYou are provided with function signatures within <tools></tools> "
                       "XML tags:\n<tools>");
    else
        rk_strbuf_puts(b, "You have access to the following functions. To call a function, respond "
                          "with JSON for a function call in the format {\"name\": function name, "
                          "\"parameters\": dictionary of argument name and its value}. Do not use "
                          "variables.\n");
    for (int i = 0; i < req->n_tools; i++) {
        const rk_api_tool *tool = &req->tools[i];
        json_t *f = json_pack("{s:s}", "name", tool->name);
        if (f && tool->description)
            json_object_set_new(f, "description", json_string(tool->description));
        if (f && tool->parameters) json_object_set(f, "parameters", tool->parameters);
        json_t *o = f ? json_pack("{s:s, s:o}", "type", "function", "function", f) : NULL;
        char *d = o ? json_dumps(o, JSON_COMPACT) : NULL;
        json_decref(o);
        if (!d) {
            b->oom = 1;
            return;
        }
        rk_strbuf_puts(b, "\n");
        rk_strbuf_puts(b, d);
        free(d);
    }
    if (t == RK_CHAT_CHATML)
        rk_strbuf_puts(
            b, "\n</tools>\n\nFor each function call, return a json object with function name "
               "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
               "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>");
}

/* The messages with the tool definitions in the system message (one made
 * first when there is none), as the templates do: a view *out over req's
 * messages (the caller frees it and *sys_text; req is not changed, so a
 * request may be rendered again). */
static rk_status with_tools(rk_chat_template t, const rk_api_request *req, rk_chat_msg **out,
                            int *n_out, char **sys_text, rk_http_error *err) {
    rk_strbuf c = {0};
    int has_sys = req->msgs[0].role == RK_ROLE_SYSTEM;
    if (has_sys && *req->msgs[0].content) {
        /* harmony: the developer message, its instructions before its tools */
        if (t == RK_CHAT_HARMONY) rk_strbuf_puts(&c, "# Instructions\n\n");
        rk_strbuf_puts(&c, req->msgs[0].content);
        rk_strbuf_puts(&c, "\n\n");
    }
    if (t == RK_CHAT_HARMONY)
        rk_harmony_functions(&c, req);
    else
        tools_block(t, req, &c);
    int n = req->n_msgs + !has_sys;
    rk_chat_msg *m = malloc((size_t)n * sizeof *m);
    if (c.oom || !m) {
        free(c.s);
        free(m);
        return rk_http_errorf(err, 500, "out of memory");
    }
    memcpy(m + !has_sys, req->msgs, (size_t)req->n_msgs * sizeof *m);
    m[0] = (rk_chat_msg){.role = RK_ROLE_SYSTEM, .content = c.s, .verbatim = 1};
    *out = m;
    *n_out = n;
    *sys_text = c.s;
    return RK_OK;
}

/* tool_choice required or named: the answer is constrained to calls. */
static rk_status tools_grammar(rk_chat_template t, rk_api_request *req, rk_http_error *err) {
    if (t == RK_CHAT_GEMMA4) {         /* its own call syntax (chat_gemma4.c) */
        rk_grammar_free(req->grammar); /* a render before this one made it */
        req->grammar = NULL;
        req->opt.grammar = NULL;
        char *text = rk_gemma4_calls_grammar(req);
        if (!text) return rk_http_errorf(err, 500, "out of memory");
        rk_status st = rk_grammar_parse(text, &req->grammar);
        free(text);
        if (st)
            return rk_http_errorf(err, st == RK_ERR_NOMEM ? 500 : 400,
                                  "the tools' calls cannot be enforced: %s", rk_error_message());
        req->opt.grammar = req->grammar;
        return RK_OK;
    }
    if (t != RK_CHAT_CHATML && req->parallel_given && req->parallel_tool_calls)
        return rk_http_errorf(err, 400,
                              "'parallel_tool_calls' true is not supported with the %s template "
                              "(one call per answer); send false or leave it out",
                              rk_chat_template_name(t));
    rk_grammar_free(req->grammar); /* a render before this one made it (nothing else can) */
    req->grammar = NULL;
    req->opt.grammar = NULL;
    int n = req->tool_choice == RK_TOOLS_NAMED ? 1 : req->n_tools;
    rk_grammar_call *calls = calloc((size_t)n, sizeof *calls);
    char(*open)[160] = calloc((size_t)n, sizeof *open);
    char(*path)[64] = calloc((size_t)n, sizeof *path);
    if (!calls || !open || !path) {
        free(calls), free(open), free(path);
        return rk_http_errorf(err, 500, "out of memory");
    }
    for (int i = 0; i < n; i++) {
        int k = req->tool_choice == RK_TOOLS_NAMED ? req->tool_named : i;
        snprintf(open[i], sizeof open[i],
                 t == RK_CHAT_CHATML ? "<tool_call>\n{\"name\": \"%s\", \"arguments\": "
                                     : "{\"name\": \"%s\", \"parameters\": ",
                 req->tools[k].name);
        snprintf(path[i], sizeof path[i], "$.tools[%d].function.parameters", k);
        calls[i] = (rk_grammar_call){open[i], req->tools[k].parameters,
                                     t == RK_CHAT_CHATML ? "}\n</tool_call>" : "}", path[i]};
    }
    rk_status st = rk_grammar_from_calls(
        calls, n, t == RK_CHAT_CHATML && req->parallel_tool_calls ? "\n" : NULL, &req->grammar);
    free(calls), free(open), free(path);
    if (st)
        return rk_http_errorf(err, st == RK_ERR_NOMEM ? 500 : 400,
                              "a tool's parameters cannot be enforced: %s", rk_error_message());
    req->opt.grammar = req->grammar;
    return RK_OK;
}

/* A call of name with args (a JSON object) naming one of the tools,
 * appended to calls in the response shape; 0 when it is not a call. */
static int add_call(const rk_api_request *req, const char *name, const json_t *args, const char *id,
                    int index, json_t *calls) {
    int known = 0;
    for (int i = 0; name && i < req->n_tools; i++) known |= !strcmp(req->tools[i].name, name);
    int ok = known && json_is_object(args);
    if (ok) {
        char *a = json_dumps(args, JSON_COMPACT);
        char cid[96];
        snprintf(cid, sizeof cid, "call_%s_%d", id, index);
        json_t *call = a ? json_pack("{s:s, s:s, s:{s:s, s:s}}", "id", cid, "type", "function",
                                     "function", "name", name, "arguments", a)
                         : NULL;
        free(a);
        ok = call && !json_array_append_new(calls, call);
    }
    return ok;
}

/* A call the model wrote: {"name", "arguments" or "parameters"} naming one
 * of the tools; appended to calls in the response shape. */
static int take_call(const rk_api_request *req, const char *s, size_t n, const char *id, int index,
                     json_t *calls) {
    json_t *c = json_loadb(s, n, 0, NULL);
    json_t *args = json_object_get(c, "arguments");
    if (!args) args = json_object_get(c, "parameters");
    int ok = add_call(req, json_string_value(json_object_get(c, "name")), args, id, index, calls);
    json_decref(c);
    return ok;
}

/* Harmony: the messages addressed to a function and closed by <|call|>,
 * their bodies the arguments; *first where the first call's message begins. */
static void harmony_calls(const rk_api_request *req, const char *text, const char *id,
                          json_t *calls, const char **first) {
    size_t pos = 0, n = 0, at = 0;
    const char *args;
    char name[65];
    while (rk_harmony_find_call(text, &pos, name, &args, &n, &at)) {
        json_t *a = json_loadb(args, n, 0, NULL);
        if (add_call(req, name, a, id, (int)json_array_size(calls), calls) && !*first)
            *first = text + at;
        json_decref(a);
    }
}

/* Gemma 4: its <|tool_call>call:NAME{...}<tool_call|> calls. */
static void gemma4_calls(const rk_api_request *req, const char *text, const char *id, json_t *calls,
                         const char **first) {
    size_t pos = 0, at = 0;
    json_t *args;
    char name[65];
    while (rk_gemma4_find_call(text, &pos, name, &args, &at)) {
        if (add_call(req, name, args, id, (int)json_array_size(calls), calls) && !*first)
            *first = text + at;
        json_decref(args);
    }
}

json_t *rk_chat_tool_calls(rk_chat_template t, const rk_api_request *req, const char *text,
                           const char *id, char **content) {
    *content = NULL;
    json_t *calls = json_array();
    if (!calls) return NULL;
    const char *first = NULL;
    if (t == RK_CHAT_HARMONY) {
        harmony_calls(req, text, id, calls, &first);
    } else if (t == RK_CHAT_GEMMA4) {
        gemma4_calls(req, text, id, calls, &first);
    } else if (t == RK_CHAT_CHATML) {
        for (const char *p = strstr(text, "<tool_call>"); p; p = strstr(p, "<tool_call>")) {
            const char *body = p + strlen("<tool_call>");
            const char *end = strstr(body, "</tool_call>");
            size_t n = end ? (size_t)(end - body) : strlen(body);
            if (take_call(req, body, n, id, (int)json_array_size(calls), calls) && !first)
                first = p;
            p = end ? end : body + n;
        }
    } else {
        const char *p = text + strspn(text, " \t\r\n");
        if (*p == '{' && take_call(req, p, strlen(p), id, 0, calls)) first = p;
    }
    if (!json_array_size(calls)) {
        json_decref(calls);
        return NULL;
    }
    size_t n = (size_t)(first - text);
    if (t == RK_CHAT_HARMONY) { /* the content of the messages before the call */
        rk_strbuf before = {0}, reasoning = {0}, answer = {0};
        rk_strbuf_putn(&before, text, n);
        if (before.s) rk_think_split_text_as(1, before.s, &reasoning, &answer);
        int oom = before.oom || reasoning.oom || answer.oom;
        free(before.s);
        free(reasoning.s);
        *content = oom ? NULL : answer.s ? rk_strbuf_take(&answer) : rk_strdup("");
        if (!*content) json_decref(calls), calls = NULL;
        return calls;
    }
    while (n && strchr(" \t\r\n", text[n - 1])) n--;
    *content = malloc(n + 1);
    if (!*content) {
        json_decref(calls);
        return NULL;
    }
    memcpy(*content, text, n);
    (*content)[n] = 0;
    return calls;
}

/* A user message as the pieces see it: its documents (chunks) and the text
 * after them. Its documents are its ragkv_chunk content parts, then, when
 * the request splits chat messages (a separator in the body or the
 * server's), the pieces its text splits into, the text after the last
 * separator being its question. The `chunks` and `documents` extensions
 * belong to the first user message (take_chunks puts them first). */
typedef struct user_msg {
    rk_split split;    /* the split content (zeroed when not split) */
    json_t *passages;  /* a tool result's JSON array of passages, or NULL */
    const char **docs; /* (n_docs) malloc'ed array; the strings are the message's, split's or
                        * passages' */
    int n_docs;
    int n_empty; /* empty documents skipped */
    const char *question;
} user_msg;

/* Room for n documents in u->docs, and m's own (its ragkv_chunk parts and
 * `documents`) first, the empty ones counted. Nonzero when out of memory. */
static int take_docs(const rk_chat_msg *m, int n, user_msg *u) {
    u->docs = calloc((size_t)(n ? n : 1), sizeof *u->docs);
    if (!u->docs) return 1;
    for (int k = 0; k < m->n_docs; k++) {
        if (*m->docs[k])
            u->docs[u->n_docs++] = m->docs[k];
        else
            u->n_empty++;
    }
    return 0;
}

static rk_status split_user(const rk_api_request *req, int i, user_msg *u, rk_http_error *err) {
    const rk_chat_msg *m = &req->msgs[i];
    const char *content = m->content;
    u->question = content;
    if (req->split_chat && *content) {
        size_t ls = strlen(req->separator), lc = strlen(content);
        char *text = malloc(ls + lc + 1);
        if (!text) return rk_http_errorf(err, 500, "out of memory");
        memcpy(text, req->separator, ls);
        memcpy(text + ls, content, lc + 1);
        /* The chunks are counted against max_chunks together, by
         * rk_split_structured in take_chunks. */
        rk_status st = rk_split_prompt(text, ls + lc, req->separator, INT_MAX, &u->split);
        free(text);
        if (st)
            return rk_http_errorf(err, rk_http_status_of(st), "bad messages[%d]: %s", i,
                                  rk_error_message());
        u->question = u->split.question.s;
        u->n_empty = u->split.n_empty_chunks;
    }
    if (take_docs(m, m->n_docs + u->split.n_chunks, u))
        return rk_http_errorf(err, 500, "out of memory");
    for (int k = 0; k < u->split.n_chunks; k++) u->docs[u->n_docs++] = u->split.chunks[k].s;
    return RK_OK;
}

/* A tool message as the layout sees it: its documents (ragkv_chunk parts,
 * its `documents`) and, with chunking.tool_results, its content as
 * passages: a JSON array of them (strings, or objects with a string "text"
 * or "content"), else its text split on the separator (no separator: one
 * passage). u->question is what stays text (all of it without passages). */
static rk_status split_tool(const rk_api_request *req, int i, user_msg *u, rk_http_error *err) {
    const rk_chat_msg *m = &req->msgs[i];
    u->question = m->content;
    json_t *a = NULL;
    if (req->chunk_tool_results && *m->content) {
        a = json_loads(m->content, JSON_DECODE_ANY, NULL);
        if (a && !json_is_array(a)) json_decref(a), a = NULL;
        for (size_t k = 0; a && k < json_array_size(a); k++) {
            json_t *p = json_array_get(a, k), *t = p;
            if (json_is_object(p))
                t = json_object_get(p, "text") ? json_object_get(p, "text")
                                               : json_object_get(p, "content");
            if (!json_is_string(t)) json_decref(a), a = NULL; /* not passages: text */
        }
        if (!a) {
            rk_status st =
                rk_split_prompt(m->content, strlen(m->content), req->separator, INT_MAX, &u->split);
            if (st)
                return rk_http_errorf(err, rk_http_status_of(st), "bad messages[%d]: %s", i,
                                      rk_error_message());
            /* Every piece is a passage: the text after the last separator too. */
        }
        u->question = "";
    }
    u->passages = a;
    int n_split = u->split.n_chunks + (u->split.question.s && *u->split.question.s) +
                  (u->split.system.s && *u->split.system.s);
    if (take_docs(m, m->n_docs + n_split + (a ? (int)json_array_size(a) : 0), u))
        return rk_http_errorf(err, 500, "out of memory");
    for (size_t k = 0; a && k < json_array_size(a); k++) {
        json_t *p = json_array_get(a, k), *t = p;
        if (json_is_object(p))
            t = json_object_get(p, "text") ? json_object_get(p, "text")
                                           : json_object_get(p, "content");
        if (*json_string_value(t))
            u->docs[u->n_docs++] = json_string_value(t);
        else
            u->n_empty++;
    }
    if (u->split.system.s && *u->split.system.s) u->docs[u->n_docs++] = u->split.system.s;
    for (int k = 0; k < u->split.n_chunks; k++) u->docs[u->n_docs++] = u->split.chunks[k].s;
    if (u->split.question.s && *u->split.question.s) u->docs[u->n_docs++] = u->split.question.s;
    u->n_empty += u->split.n_empty_chunks;
    return RK_OK;
}

/* The opening of a user turn; for Llama-2, the <<SYS>> block (sys_block:
 * joined system messages, may be empty) goes inside it. */
static void user_open(rk_chat_template t, rk_strbuf *b, const rk_strbuf *sys_block) {
    if (t == RK_CHAT_GEMMA) {
        rk_strbuf_puts(b, "<start_of_turn>user\n");
        if (sys_block->len) {
            rk_strbuf_puts(b, sys_block->s);
            rk_strbuf_puts(b, "\n\n");
        }
    } else if (t == RK_CHAT_CHATML) {
        rk_strbuf_puts(b, "<|im_start|>user\n");
    } else if (t == RK_CHAT_LLAMA3) {
        rk_strbuf_puts(b, "<|start_header_id|>user<|end_header_id|>\n\n");
    } else if (t == RK_CHAT_PHI3) {
        rk_strbuf_puts(b, "<|user|>\n");
    } else if (t == RK_CHAT_HARMONY) {
        rk_strbuf_puts(b, "<|start|>user<|message|>");
    } else if (t == RK_CHAT_GEMMA4) {
        rk_strbuf_puts(b, "<|turn>user\n");
    } else {
        rk_strbuf_puts(b, "[INST] ");
        if (sys_block->len) {
            rk_strbuf_puts(b, "<<SYS>>\n");
            rk_strbuf_puts(b, sys_block->s);
            rk_strbuf_puts(b, "\n<</SYS>>\n\n");
        }
    }
}

static void user_close(rk_chat_template t, rk_strbuf *b) {
    rk_strbuf_puts(b, t == RK_CHAT_CHATML    ? "<|im_end|>\n"
                      : t == RK_CHAT_LLAMA3  ? "<|eot_id|>"
                      : t == RK_CHAT_PHI3    ? "<|end|>\n"
                      : t == RK_CHAT_GEMMA   ? "<end_of_turn>\n"
                      : t == RK_CHAT_HARMONY ? "<|end|>"
                      : t == RK_CHAT_GEMMA4  ? "<turn|>\n"
                                             : " [/INST]");
}

/* Harmony: the function whose result tool message i is (malloc'ed, NULL
 * when none): the call of an earlier assistant message with its
 * tool_call_id, else the first call of the latest assistant message when
 * it made calls, as the template names it. */
static char *tool_name(const rk_api_request *req, int i) {
    const char *id = req->msgs[i].tool_call_id;
    char *name = NULL;
    int latest = 1; /* no answer without calls in between yet */
    for (int j = i - 1; j >= 0; j--) {
        const rk_chat_msg *m = &req->msgs[j];
        if (m->role != RK_ROLE_ASSISTANT) continue;
        json_t *list = m->tool_calls ? json_loads(m->tool_calls, 0, NULL) : NULL;
        for (size_t k = 0; id && k < json_array_size(list); k++) {
            json_t *c = json_array_get(list, k);
            const char *cid = json_string_value(json_object_get(c, "id"));
            if (cid && !strcmp(cid, id)) {
                free(name);
                name = rk_strdup(json_string_value(json_object_get(c, "name")));
                json_decref(list);
                return name;
            }
        }
        if (latest && list && !name)
            name = rk_strdup(json_string_value(json_object_get(json_array_get(list, 0), "name")));
        latest = 0;
        json_decref(list);
        if (!id) break;
    }
    return name;
}

/* A tool result's turn: Qwen's user turn of <tool_response>, Llama 3's
 * ipython, harmony's message from functions.NAME, Gemma 4's
 * <|tool_response> in the model's turn (message i's). */
static void tool_open(rk_chat_template t, const rk_api_request *req, int i, rk_strbuf *b) {
    if (t == RK_CHAT_HARMONY || t == RK_CHAT_GEMMA4) {
        /* found: rk_chat_render checked */
        char *name = t == RK_CHAT_HARMONY ? tool_name(req, i) : rk_gemma4_tool_name(req, i);
        if (!name) b->oom = 1;
        if (t == RK_CHAT_HARMONY) rk_harmony_tool_open(b, name ? name : "");
        if (t == RK_CHAT_GEMMA4) rk_gemma4_tool_open(b, name ? name : "");
        free(name);
        return;
    }
    rk_strbuf_puts(b, t == RK_CHAT_CHATML ? "<|im_start|>user\n<tool_response>\n"
                                          : "<|start_header_id|>ipython<|end_header_id|>\n\n");
}

/* A tool result's text (after its documents, n_docs of them): harmony's is
 * a JSON string, as the template's tojson writes it (none after documents
 * when it is empty). */
static void tool_text(rk_chat_template t, rk_strbuf *b, const char *text, int n_docs) {
    if (t != RK_CHAT_HARMONY)
        rk_strbuf_puts(b, text); /* Gemma 4's too: its value's marks are no escapes */
    else if (*text || !n_docs)
        rk_harmony_tool_text(b, text);
}

static void tool_close(rk_chat_template t, const rk_api_request *req, int i, rk_strbuf *b) {
    if (t == RK_CHAT_GEMMA4) {
        rk_gemma4_tool_close(b, req, i);
        return;
    }
    rk_strbuf_puts(b, t == RK_CHAT_CHATML    ? "\n</tool_response><|im_end|>\n"
                      : t == RK_CHAT_HARMONY ? "<|end|>"
                                             : "<|eot_id|>");
}

/* Harmony: an assistant message's calls, each its own message (the
 * template writes one call per message), after its text on the analysis
 * channel unless a later answer without calls follows (as the template
 * drops it then). */
static void harmony_calls_turn(const rk_api_request *req, rk_strbuf *b, const rk_chat_msg *m) {
    int later_answer = 0;
    for (int j = (int)(m - req->msgs) + 1; j < req->n_msgs; j++)
        later_answer |= req->msgs[j].role == RK_ROLE_ASSISTANT && !req->msgs[j].tool_calls;
    if (*m->content && !later_answer) {
        rk_strbuf_puts(b, "<|start|>assistant<|channel|>analysis<|message|>");
        rk_strbuf_puts(b, m->content);
        rk_strbuf_puts(b, "<|end|>");
    }
    json_t *list = json_loads(m->tool_calls, 0, NULL);
    if (!list) b->oom = 1;
    for (size_t k = 0; k < json_array_size(list); k++) {
        json_t *c = json_array_get(list, k);
        rk_harmony_call(b, json_string_value(json_object_get(c, "name")),
                        json_object_get(c, "arguments"));
    }
    json_decref(list);
}

/* s without its leading (lead) and trailing whitespace, as Jinja's trim. */
static void put_trimmed(rk_strbuf *b, const char *s, int lead) {
    size_t n = strlen(s);
    while (lead && n && strchr(" \t\n\r\f\v", *s)) s++, n--;
    while (n && strchr(" \t\n\r\f\v", s[n - 1])) n--;
    rk_strbuf_putn(b, s, n);
}

/* A complete system or assistant turn (Llama-2: assistant only; its system
 * messages join the <<SYS>> block of the next user turn). open: the
 * assistant's turn the answer continues (a prefill), without its end. */
static void other_turn(rk_chat_template t, const rk_api_request *req, rk_strbuf *b,
                       const rk_chat_msg *m, int open) {
    if (m->role == RK_ROLE_TOOL) {
        tool_open(t, req, (int)(m - req->msgs), b);
        tool_text(t, b, m->content, 0);
        tool_close(t, req, (int)(m - req->msgs), b);
        return;
    }
    if (m->tool_calls && t == RK_CHAT_HARMONY) {
        harmony_calls_turn(req, b, m);
        return;
    }
    if (t == RK_CHAT_GEMMA4) {
        rk_gemma4_turn(b, req, m, open);
        return;
    }
    if (t == RK_CHAT_HARMONY && m->verbatim) { /* the developer message with tools */
        rk_strbuf_puts(b, "<|start|>developer<|message|>");
        rk_strbuf_puts(b, m->content);
        rk_strbuf_puts(b, "<|end|>");
        return;
    }
    if (m->tool_calls && t != RK_CHAT_LLAMA2) {
        rk_strbuf_puts(b, t == RK_CHAT_CHATML
                              ? "<|im_start|>assistant\n"
                              : "<|start_header_id|>assistant<|end_header_id|>\n\n");
        if (*m->content) {
            rk_strbuf_puts(b, m->content);
            rk_strbuf_puts(b, "\n");
        }
        calls_text(t, b, m->tool_calls);
        rk_strbuf_puts(b, t == RK_CHAT_CHATML ? "<|im_end|>\n" : "<|eot_id|>");
        return;
    }
    if (t == RK_CHAT_HARMONY) { /* system: the developer's instructions; earlier answers: final */
        int sys = m->role == RK_ROLE_SYSTEM;
        rk_strbuf_puts(b, sys ? "<|start|>developer<|message|># Instructions\n\n"
                              : "<|start|>assistant<|channel|>final<|message|>");
        rk_strbuf_puts(b, m->content);
        if (sys) rk_strbuf_puts(b, "\n\n"); /* as the template ends its instructions */
        if (!open) rk_strbuf_puts(b, "<|end|>");
        return;
    }
    if (t == RK_CHAT_GEMMA) { /* system messages wait for the next user turn */
        rk_strbuf_puts(b, "<start_of_turn>model\n");
        if (open) { /* continued as it stands, but for the template's leading trim */
            rk_strbuf_puts(b, m->content + strspn(m->content, " \t\n\r\f\v"));
        } else {
            put_trimmed(b, m->content, 1);
            rk_strbuf_puts(b, "<end_of_turn>\n");
        }
    } else if (t == RK_CHAT_CHATML) {
        /* An earlier answer's thinking is dropped, as Qwen3's template does. */
        const char *content = m->content, *think_end = strstr(content, "</think>");
        if (m->role == RK_ROLE_ASSISTANT && think_end && !open)
            for (content = think_end + 8; *content == '\n'; content++) continue;
        rk_strbuf_puts(b, "<|im_start|>");
        rk_strbuf_puts(b, role_name(m->role));
        rk_strbuf_puts(b, "\n");
        rk_strbuf_puts(b, content);
        if (!open) rk_strbuf_puts(b, "<|im_end|>\n");
    } else if (t == RK_CHAT_LLAMA3) {
        rk_strbuf_puts(b, "<|start_header_id|>");
        rk_strbuf_puts(b, role_name(m->role));
        rk_strbuf_puts(b, "<|end_header_id|>\n\n");
        rk_strbuf_puts(b, m->content);
        if (!open) rk_strbuf_puts(b, "<|eot_id|>");
    } else if (t == RK_CHAT_PHI3) {
        rk_strbuf_puts(b, "<|");
        rk_strbuf_puts(b, role_name(m->role));
        rk_strbuf_puts(b, "|>\n");
        rk_strbuf_puts(b, m->content);
        if (!open) rk_strbuf_puts(b, "<|end|>\n");
    } else {
        /* An answer this service returns starts with the space its first
         * token decodes to (a SentencePiece word start): that space is the
         * template's, so the answer tokenizes as it was generated. */
        if (m->content[0] != ' ') rk_strbuf_puts(b, " ");
        rk_strbuf_puts(b, m->content);
        if (!open) rk_strbuf_puts(b, " </s><s>");
    }
}

/* Llama-2: a system message joins the <<SYS>> block of a user turn. */
static void add_system(rk_strbuf *sys_block, const rk_chat_msg *m) {
    if (sys_block->len) rk_strbuf_puts(sys_block, "\n\n");
    rk_strbuf_puts(sys_block, m->content);
}

/* Render messages [from, to) into b as complete turns, the user ones as
 * text. Llama-2 system messages wait in *sys_block for the next user turn
 * (system messages the caller already put there are skipped when
 * skip_system is set). */
static void render_turns(rk_chat_template t, const rk_api_request *req, const user_msg *users,
                         int from, int to, int skip_system, rk_strbuf *b, rk_strbuf *sys_block) {
    for (int i = from; i < to; i++) {
        const rk_chat_msg *m = &req->msgs[i];
        if (m->role == RK_ROLE_USER) {
            user_open(t, b, sys_block);
            sb_clear(sys_block);
            if (t == RK_CHAT_GEMMA || t == RK_CHAT_GEMMA4)
                put_trimmed(b, users[i].question, 1);
            else
                rk_strbuf_puts(b, users[i].question); /* its documents are chunks */
            user_close(t, b);
        } else if ((t == RK_CHAT_LLAMA2 || t == RK_CHAT_GEMMA) && m->role == RK_ROLE_SYSTEM) {
            if (!skip_system) add_system(sys_block, m);
        } else {
            other_turn(t, req, b, m, 0);
        }
    }
}

static const char *assistant_open(rk_chat_template t) {
    return t == RK_CHAT_CHATML    ? "<|im_start|>assistant\n"
           : t == RK_CHAT_LLAMA3  ? "<|start_header_id|>assistant<|end_header_id|>\n\n"
           : t == RK_CHAT_PHI3    ? "<|assistant|>\n"
           : t == RK_CHAT_GEMMA   ? "<start_of_turn>model\n"
           : t == RK_CHAT_HARMONY ? "<|start|>assistant"
           : t == RK_CHAT_GEMMA4  ? "<|turn>model\n"
                                  : "";
}

/* Whether message i is a document turn, a chunk group where it stands: a
 * user or tool message with documents, or the first user message when the
 * `chunks`/`documents` extension (its documents) has one. */
static int is_group(const rk_api_request *req, const user_msg *users, int i, int first_user) {
    if (i == first_user && req->chat_chunks_given)
        for (int k = 0; k < req->n_chat_chunks; k++)
            if (*req->chat_chunks[k]) return 1;
    return users[i].n_docs > 0;
}

/* The layout as segments: texts[0], group 0, texts[1], ..., texts[n]
 * (group g: message gmsg[g]'s documents, the extension's first for the
 * first user message), with the ids the extension gave, into *out. */
static rk_status layout_split(rk_api_request *req, const user_msg *users, const int *gmsg, int n,
                              int first_user, rk_strbuf *texts, int max_chunks, rk_split *out,
                              char ***out_ids, rk_http_error *err) {
    int given = req->chat_chunks_given ? req->n_chat_chunks : 0, n_in = given, empty = 0;
    for (int g = 0; g < n; g++) n_in += users[gmsg[g]].n_docs;
    const char **list = calloc((size_t)(n_in ? n_in : 1), sizeof *list);
    char **ids = calloc((size_t)(n_in ? n_in : 1), sizeof *ids);
    rk_segment *segs = calloc((size_t)(2 * n + 1), sizeof *segs);
    rk_status st = RK_OK;
    int kept = 0, any_id = 0;
    *out_ids = NULL;
    if (!list || !ids || !segs) st = rk_http_errorf(err, 500, "out of memory");
    for (int g = 0; g < n && !st; g++) {
        const user_msg *u = &users[gmsg[g]];
        segs[2 * g] = (rk_segment){.text = texts[g].s ? texts[g].s : ""};
        segs[2 * g + 1] = (rk_segment){.chunks = list + kept};
        int from = gmsg[g] == first_user ? 0 : given;
        for (int i = from; i < given + u->n_docs && !st; i++) {
            const char *c = i < given ? req->chat_chunks[i] : u->docs[i - given];
            const char *id = i < given ? req->chat_chunk_ids[i] : NULL;
            if (!*c) {
                empty++;
                continue;
            }
            if (id && !(ids[kept] = strdup(id))) st = rk_http_errorf(err, 500, "out of memory");
            any_id |= id != NULL;
            list[kept++] = c;
            segs[2 * g + 1].n_chunks++;
        }
    }
    segs[2 * n] = (rk_segment){.text = texts[n].s ? texts[n].s : ""};
    if (!st && (st = rk_split_segments(segs, 2 * n + 1, max_chunks, out)))
        rk_http_errorf(err, rk_http_status_of(st), "bad chat request: %s", rk_error_message());
    free(list);
    free(segs);
    if (!st) out->n_empty_chunks += empty;
    if (st || !any_id) {
        for (int i = 0; ids && i < kept; i++) free(ids[i]);
        free(ids);
        return st;
    }
    *out_ids = ids;
    return RK_OK;
}

/* The texts around the chunk groups of messages gmsg[0 .. n) into
 * texts[0 .. n]: the turns before the first group and its message's
 * opening (Llama-2 and Gemma: every system message before it in the first
 * user turn), then after each group the rest of its message, the turns up
 * to the next group's message and that one's opening, and after the last
 * the later turns and the assistant's opening (or the open turn it
 * continues, last: the messages before it). */
static void render_texts(rk_chat_template t, const rk_api_request *req, const user_msg *users,
                         const int *gmsg, int n, int last, rk_strbuf *texts, rk_strbuf *block) {
    for (int i = 0; (t == RK_CHAT_LLAMA2 || t == RK_CHAT_GEMMA) && i < gmsg[0]; i++)
        if (req->msgs[i].role == RK_ROLE_SYSTEM) add_system(block, &req->msgs[i]);
    if (t == RK_CHAT_HARMONY)
        rk_harmony_system(&texts[0], req->reasoning_effort, req->n_tools > 0, req->today);
    if (t == RK_CHAT_GEMMA4) rk_gemma4_system(&texts[0], req);
    render_turns(t, req, users, 0, gmsg[0], 1, &texts[0], block);
    for (int g = 0; g < n; g++) {
        int m = gmsg[g];
        const user_msg *u = &users[m];
        rk_strbuf *b = &texts[g], *after = &texts[g + 1];
        if (g > 0) render_turns(t, req, users, gmsg[g - 1] + 1, m, 0, b, block);
        if (req->msgs[m].role == RK_ROLE_TOOL) {
            tool_open(t, req, m, b);
            tool_text(t, after, u->question, u->n_docs);
            tool_close(t, req, m, after);
            continue;
        }
        user_open(t, b, block);
        sb_clear(block);
        if (t == RK_CHAT_GEMMA || t == RK_CHAT_GEMMA4)
            put_trimmed(after, u->question, 1);
        else
            rk_strbuf_puts(after, u->question);
        user_close(t, after);
    }
    render_turns(t, req, users, gmsg[n - 1] + 1, last, 0, &texts[n], block);
    if (last < req->n_msgs) {
        other_turn(t, req, &texts[n], &req->msgs[last], 1);
    } else if (t != RK_CHAT_GEMMA4 || req->msgs[last - 1].role != RK_ROLE_TOOL) {
        /* (Gemma 4's results are in the model's turn, which goes on) */
        rk_strbuf_puts(&texts[n], assistant_open(t));
        /* Qwen3's template with enable_thinking false: an empty thinking block. */
        if (req->no_thinking && t == RK_CHAT_CHATML)
            rk_strbuf_puts(&texts[n], "<think>\n\n</think>\n\n");
    }
}

rk_status rk_chat_render(rk_chat_template t, rk_api_request *req, int max_chunks,
                         rk_http_error *err) {
    int tool_turns = 0;
    for (int i = 0; i < req->n_msgs; i++)
        tool_turns |= req->msgs[i].role == RK_ROLE_TOOL || req->msgs[i].tool_calls;
    if ((t == RK_CHAT_LLAMA2 || t == RK_CHAT_PHI3 || t == RK_CHAT_GEMMA) &&
        (req->n_tools || tool_turns))
        return rk_http_errorf(err, 400,
                              "tools are not supported with the %s chat template (it has no "
                              "tool-call format)",
                              rk_chat_template_name(t));
    if (req->reasoning_effort && t != RK_CHAT_HARMONY)
        return rk_http_errorf(err, 400,
                              "'reasoning_effort' is not supported with the %s chat template "
                              "(the harmony template of gpt-oss takes it)",
                              rk_chat_template_name(t));
    if (t == RK_CHAT_HARMONY && req->tool_choice >= RK_TOOLS_REQUIRED)
        return rk_http_errorf(err, 400,
                              "'tool_choice' \"required\" or a named function is not supported "
                              "with the harmony chat template (the call would have to be "
                              "constrained after the model's analysis message); use \"auto\"");
    for (int i = 0; (t == RK_CHAT_HARMONY || t == RK_CHAT_GEMMA4) && i < req->n_msgs; i++) {
        if (req->msgs[i].role != RK_ROLE_TOOL) continue;
        char *name = t == RK_CHAT_HARMONY ? tool_name(req, i) : rk_gemma4_tool_name(req, i);
        if (!name)
            return rk_http_errorf(err, 400,
                                  t == RK_CHAT_HARMONY
                                      ? "messages[%d]: a tool message needs an earlier assistant "
                                        "message with 'tool_calls' (harmony names the function "
                                        "that answers)"
                                      : "messages[%d]: a tool message needs the 'tool_call_id' "
                                        "of a call of the assistant message before it (gemma4 "
                                        "writes each result after its call)",
                                  i);
        free(name);
    }
    rk_status tst = RK_OK;
    if (req->tool_choice >= RK_TOOLS_REQUIRED && (tst = tools_grammar(t, req, err))) return tst;
    /* With tools, render a view of the messages whose system message
     * describes them; req's own messages are put back at the end. */
    rk_chat_msg *own_msgs = req->msgs, *view = NULL;
    int own_n = req->n_msgs;
    char *sys_text = NULL;
    if (req->n_tools && t != RK_CHAT_GEMMA4) { /* Gemma 4's system turn has them */
        int n_view = 0;
        if ((tst = with_tools(t, req, &view, &n_view, &sys_text, err))) return tst;
        req->msgs = view;
        req->n_msgs = n_view;
    }
    int n = req->n_msgs, empty = 0;
    /* A last message of the assistant's is continued: rendered open, after
     * every other turn, in place of the assistant's opening. */
    int prefill = n > 0 && req->msgs[n - 1].role == RK_ROLE_ASSISTANT;
    int last = prefill ? n - 1 : n;
    user_msg *users = calloc((size_t)(n > 0 ? n : 1), sizeof *users);
    rk_strbuf block = {0}, *texts = NULL;
    int *gmsg = NULL;
    rk_status st = users ? RK_OK : rk_http_errorf(err, 500, "out of memory");
    for (int i = 0; i < n && !st; i++) {
        rk_chat_role role = req->msgs[i].role;
        if (role == RK_ROLE_USER)
            st = split_user(req, i, &users[i], err);
        else if (role == RK_ROLE_TOOL)
            st = split_tool(req, i, &users[i], err);
        empty += users[i].n_empty;
    }
    if (st) goto done;
    int first_user = -1, n_groups = 0;
    for (int i = 0; i < n && first_user < 0; i++)
        if (req->msgs[i].role == RK_ROLE_USER) first_user = i;
    if (first_user < 0 || (n > 0 && req->msgs[n - 1].role == RK_ROLE_SYSTEM)) {
        st = rk_http_errorf(err, 400,
                            "the last message must be the user's (or the assistant's, "
                            "continued), after a user message");
        goto done;
    }
    /* Each document turn is a chunk group where it stands; without one,
     * the first user message is a group of none (its layout extends into
     * the next turn's: see the top of this file). */
    gmsg = malloc((size_t)n * sizeof *gmsg);
    texts = calloc((size_t)n + 1, sizeof *texts);
    if (!gmsg || !texts) {
        st = rk_http_errorf(err, 500, "out of memory");
        goto done;
    }
    for (int i = 0; i < last; i++)
        if (is_group(req, users, i, first_user)) gmsg[n_groups++] = i;
    if (n_groups == 0) gmsg[n_groups++] = first_user;
    render_texts(t, req, users, gmsg, n_groups, last, texts, &block);
    int oom = block.oom;
    for (int g = 0; g <= n_groups; g++) oom |= texts[g].oom;
    if (oom) {
        st = rk_http_errorf(err, 500, "out of memory");
        goto done;
    }
    rk_split out;
    char **ids;
    if ((st = layout_split(req, users, gmsg, n_groups, first_user, texts, max_chunks, &out, &ids,
                           err)))
        goto done;
    out.n_empty_chunks += empty;
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
    for (int i = 0; users && i < n; i++) {
        rk_split_free(&users[i].split);
        json_decref(users[i].passages);
        free(users[i].docs);
    }
    for (int g = 0; texts && g <= n; g++) free(texts[g].s);
    free(texts);
    free(gmsg);
    free(users);
    req->msgs = own_msgs;
    req->n_msgs = own_n;
    free(view);
    free(sys_text);
    free(block.s);
    return st;
}
