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
 * gives: a tag cut between two pieces waits for the next.
 *
 * Tools, as gpt-oss's chat template writes them: the developer message's
 * "# Tools" section (each function a TypeScript-like type of its JSON
 * Schema parameters), calls in the history as messages to=functions.NAME,
 * results as messages from functions.NAME. A call in an answer is a
 * message whose header names to=functions.NAME and whose body, the
 * arguments, is closed by <|call|>. */
#include <ctype.h>
#include <stdlib.h>
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

void rk_harmony_system(rk_strbuf *b, int effort, int tools, const char *today) {
    static const char *const names[] = {"medium", "low", "medium", "high"};
    rk_strbuf_puts(b, "<|start|>system<|message|>You are ChatGPT, a large language model trained "
                      "by OpenAI.\nKnowledge cutoff: 2024-06\n");
    if (today && *today) rk_strbuf_printf(b, "Current date: %s\n", today);
    rk_strbuf_puts(b, "\nReasoning: ");
    rk_strbuf_puts(b, names[effort >= 0 && effort <= 3 ? effort : 0]);
    rk_strbuf_puts(b, "\n\n# Valid channels: analysis, commentary, final. Channel must be "
                      "included for every message.");
    if (tools)
        rk_strbuf_puts(b, "\nCalls to these tools must go to the commentary channel: 'functions'.");
    rk_strbuf_puts(b, "<|end|>");
}

/* ---------------------------------------------------------------- tools */

/* v as the template's tojson writes it (Python's json.dumps: ", " and ": "
 * between items, UTF-8 kept). */
static void put_json(rk_strbuf *b, const json_t *v) {
    char *s = json_dumps(v, JSON_ENCODE_ANY);
    if (!s) {
        b->oom = 1;
        return;
    }
    rk_strbuf_puts(b, s);
    free(s);
}

/* A default value joined to text: a string as it stands, anything else as JSON. */
static void put_value(rk_strbuf *b, const json_t *v) {
    if (json_is_string(v))
        rk_strbuf_putn(b, json_string_value(v), json_string_length(v));
    else
        put_json(b, v);
}

static int type_is(const json_t *spec, const char *name) {
    const char *t = json_string_value(json_object_get(spec, "type"));
    return t && !strcmp(t, name);
}

static int truthy(const json_t *v) {
    if (!v || json_is_null(v) || json_is_false(v)) return 0;
    if (json_is_string(v)) return json_string_length(v) > 0;
    if (json_is_array(v)) return json_array_size(v) > 0;
    if (json_is_object(v)) return json_object_size(v) > 0;
    if (json_is_integer(v)) return json_integer_value(v) != 0;
    if (json_is_real(v)) return json_real_value(v) != 0;
    return 1;
}

/* Whether name is in the schema's "required" list. */
static int required(const json_t *spec, const char *name) {
    const json_t *req = json_object_get(spec, "required");
    for (size_t i = 0; i < json_array_size(req); i++) {
        const char *r = json_string_value(json_array_get(req, i));
        if (r && !strcmp(r, name)) return 1;
    }
    return 0;
}

/* A JSON Schema as the TypeScript-like type the gpt-oss template writes
 * (its render_typescript_type macro, whitespace included); depth bounds the
 * nesting (deeper: any). */
static void ts_type(rk_strbuf *b, const json_t *spec, int depth) {
    const json_t *type = json_object_get(spec, "type"), *one_of = json_object_get(spec, "oneOf");
    int nullable = truthy(json_object_get(spec, "nullable"));
    if (depth > 32 || !json_is_object(spec)) {
        rk_strbuf_puts(b, "any");
    } else if (type_is(spec, "array")) {
        const json_t *items = json_object_get(spec, "items");
        if (!truthy(items)) {
            rk_strbuf_puts(b, "any[]");
        } else if (type_is(items, "string")) {
            rk_strbuf_puts(b, "string[]");
        } else if (type_is(items, "number") || type_is(items, "integer")) {
            rk_strbuf_puts(b, "number[]");
        } else if (type_is(items, "boolean")) {
            rk_strbuf_puts(b, "boolean[]");
        } else {
            rk_strbuf inner = {0};
            ts_type(&inner, items, depth + 1);
            b->oom |= inner.oom;
            if (!inner.s || inner.len > 50 || !strcmp(inner.s, "object | object")) {
                rk_strbuf_puts(b, "any[]");
            } else {
                rk_strbuf_puts(b, inner.s);
                rk_strbuf_puts(b, "[]");
            }
            free(inner.s);
        }
        if (nullable) rk_strbuf_puts(b, " | null");
    } else if (json_is_array(type) && json_array_size(type)) { /* ["string", "null"] */
        for (size_t i = 0; i < json_array_size(type); i++) {
            if (i) rk_strbuf_puts(b, " | ");
            put_value(b, json_array_get(type, i));
        }
    } else if (truthy(one_of)) {
        int objects = 0;
        for (size_t i = 0; i < json_array_size(one_of); i++)
            objects |= type_is(json_array_get(one_of, i), "object");
        if (objects && json_array_size(one_of) > 1) {
            rk_strbuf_puts(b, "any");
            return;
        }
        for (size_t i = 0; i < json_array_size(one_of); i++) {
            const json_t *v = json_array_get(one_of, i), *d = json_object_get(v, "description");
            ts_type(b, v, depth + 1);
            if (truthy(d)) {
                rk_strbuf_puts(b, "// ");
                put_value(b, d);
            }
            if (json_object_get(v, "default")) {
                rk_strbuf_puts(b, "                    // default: ");
                put_json(b, json_object_get(v, "default"));
            }
            if (i + 1 < json_array_size(one_of)) rk_strbuf_puts(b, " | \n");
        }
    } else if (type_is(spec, "string")) {
        const json_t *e = json_object_get(spec, "enum");
        if (truthy(e)) {
            for (size_t i = 0; i < json_array_size(e); i++) {
                rk_strbuf_puts(b, i ? "\" | \"" : "\"");
                put_value(b, json_array_get(e, i));
            }
            rk_strbuf_puts(b, "\"");
        } else {
            rk_strbuf_puts(b, nullable ? "string | null" : "string");
        }
    } else if (type_is(spec, "number") || type_is(spec, "integer")) {
        rk_strbuf_puts(b, "number");
    } else if (type_is(spec, "boolean")) {
        rk_strbuf_puts(b, "boolean");
    } else if (type_is(spec, "object")) {
        const json_t *props = json_object_get(spec, "properties");
        if (!truthy(props) || !json_is_object(props)) {
            rk_strbuf_puts(b, "object");
            return;
        }
        rk_strbuf_puts(b, "{\n");
        const char *name;
        const json_t *p;
        size_t i = 0, n = json_object_size(props);
        json_object_foreach((json_t *)props, name, p) {
            rk_strbuf_puts(b, name);
            if (!required(spec, name)) rk_strbuf_puts(b, "?");
            /* the template's own line break and indent before the type */
            rk_strbuf_puts(b, ": \n                ");
            ts_type(b, p, depth + 1);
            if (++i < n) rk_strbuf_puts(b, ", ");
        }
        rk_strbuf_puts(b, "}");
    } else {
        rk_strbuf_puts(b, "any");
    }
}

void rk_harmony_functions(rk_strbuf *b, const rk_api_request *req) {
    rk_strbuf_puts(b, "# Tools\n\n## functions\n\nnamespace functions {\n\n");
    for (int i = 0; i < req->n_tools; i++) {
        const rk_api_tool *tool = &req->tools[i];
        const json_t *params = tool->parameters, *props = json_object_get(params, "properties");
        if (tool->description) {
            rk_strbuf_puts(b, "// ");
            rk_strbuf_puts(b, tool->description);
            rk_strbuf_puts(b, "\n");
        }
        rk_strbuf_puts(b, "type ");
        rk_strbuf_puts(b, tool->name);
        rk_strbuf_puts(b, " = ");
        if (!json_is_object(props) || !json_object_size(props)) {
            rk_strbuf_puts(b, "() => any;\n\n");
            continue;
        }
        rk_strbuf_puts(b, "(_: {\n");
        const char *name;
        const json_t *p;
        json_object_foreach((json_t *)props, name, p) {
            const json_t *d = json_object_get(p, "description"),
                         *def = json_object_get(p, "default");
            if (truthy(d)) {
                rk_strbuf_puts(b, "// ");
                put_value(b, d);
                rk_strbuf_puts(b, "\n");
            }
            rk_strbuf_puts(b, name);
            if (!required(params, name)) rk_strbuf_puts(b, "?");
            rk_strbuf_puts(b, ": ");
            ts_type(b, p, 0);
            if (def) {
                int one_of =
                    !truthy(json_object_get(p, "enum")) && truthy(json_object_get(p, "oneOf"));
                rk_strbuf_puts(b, one_of ? "// default: " : ", // default: ");
                if (one_of || truthy(json_object_get(p, "enum")))
                    put_value(b, def);
                else
                    put_json(b, def);
            }
            rk_strbuf_puts(b, ",\n");
        }
        rk_strbuf_puts(b, "}) => any;\n\n");
    }
    rk_strbuf_puts(b, "} // namespace functions");
}

void rk_harmony_call(rk_strbuf *b, const char *name, const json_t *args) {
    rk_strbuf_puts(b, "<|start|>assistant to=functions.");
    rk_strbuf_puts(b, name);
    rk_strbuf_puts(b, "<|channel|>commentary json<|message|>");
    put_json(b, args);
    rk_strbuf_puts(b, "<|call|>");
}

void rk_harmony_tool_open(rk_strbuf *b, const char *name) {
    rk_strbuf_puts(b, "<|start|>functions.");
    rk_strbuf_puts(b, name);
    rk_strbuf_puts(b, " to=assistant<|channel|>commentary<|message|>");
}

void rk_harmony_tool_text(rk_strbuf *b, const char *content) {
    json_t *s = json_string(content);
    if (!s) { /* not UTF-8: as it stands, quoted */
        rk_strbuf_puts(b, "\"");
        rk_strbuf_puts(b, content);
        rk_strbuf_puts(b, "\"");
        return;
    }
    put_json(b, s);
    json_decref(s);
}

static int name_char(char c) { return isalnum((unsigned char)c) || c == '_' || c == '-'; }

int rk_harmony_find_call(const char *text, size_t *pos, char name[65], const char **args,
                         size_t *args_len, size_t *at) {
    size_t p = *pos, len = strlen(text);
    while (p < len) {
        const char *body = strstr(text + p, "<|message|>");
        if (!body) break;
        size_t head = p, head_end = (size_t)(body - text), start = p;
        /* the message begins at the last <|start|> of its header, if any */
        for (const char *s = strstr(text + head, "<|start|>"); s && s < body;
             s = strstr(s + 1, "<|start|>"))
            start = (size_t)(s - text);
        size_t b0 = head_end + strlen("<|message|>"), e = b0;
        int close = N_TAGS;
        while (e < len) {
            size_t at_tag = 0;
            int tag = next_tag(text + e, len - e, &at_tag);
            if (tag == N_TAGS) {
                e = len;
                break;
            }
            e += at_tag;
            if (tag != T_CONSTRAIN && tag != T_MESSAGE) { /* tags that end a body */
                close = tag;
                break;
            }
            e += strlen(k_tags[tag]);
        }
        p = e +
            (close == T_END || close == T_CALL || close == T_RETURN ? strlen(k_tags[close]) : 0);
        if (close != T_CALL) continue;
        /* the header names its recipient: " to=functions.NAME" */
        const char *to = strstr(text + head, "to=functions.");
        if (!to || to > body) continue;
        to += strlen("to=functions.");
        size_t n = 0;
        while (to + n < body && n < 64 && name_char(to[n])) n++;
        if (!n || (to + n < body && name_char(to[n]))) continue; /* none, or too long */
        memcpy(name, to, n);
        name[n] = 0;
        *args = text + b0;
        *args_len = e - b0;
        *at = start;
        *pos = p;
        return 1;
    }
    *pos = len;
    return 0;
}
