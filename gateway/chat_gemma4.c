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
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "gateway/chat.h"

static const char k_space[] = " \t\n\r\f\v";

/* s[0..n) without its leading (lead) and trailing whitespace, into b. */
static void put_trim(rk_strbuf *b, const char *s, size_t n, int lead) {
    while (lead && n && strchr(k_space, *s)) s++, n--;
    while (n && strchr(k_space, s[n - 1])) n--;
    rk_strbuf_putn(b, s, n);
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

/* ---------------------------------------------------------------- tools
 *
 * Gemma 4 writes values in a syntax of its own: a string between <|"|>
 * marks (no escapes), true and false, a number as Python prints it, a
 * mapping {key:value,...} with its keys sorted (case-insensitively, as
 * Jinja's dictsort) and, in a declaration, its keys between marks too, a
 * list [a,b]. A tool's declaration, "<|tool>declaration:NAME{description:
 * ...,parameters:{properties:{...},required:[...],type:<|"|>OBJECT<|"|>}}
 * <tool|>", goes in the system turn; a call is "<|tool_call>call:NAME{key:
 * value,...}<tool_call|>" in the model's turn, and a tool's result
 * "<|tool_response>response:NAME{value:<|"|>TEXT<|"|>}<tool_response|>"
 * follows the calls in the same turn, the model's text after them. */

static const char k_quote[] = "<|\"|>";

/* The value of key in o, NULL when o is not an object or has none. */
static const json_t *get(const json_t *o, const char *key) {
    return json_is_object(o) ? json_object_get(o, key) : NULL;
}

/* Jinja's truth of a value: NULL, null, false, 0, "" and empty containers
 * are false. */
static int truthy(const json_t *v) {
    switch (v ? json_typeof(v) : JSON_NULL) {
    case JSON_OBJECT: return json_object_size(v) > 0;
    case JSON_ARRAY: return json_array_size(v) > 0;
    case JSON_STRING: return json_string_length(v) > 0;
    case JSON_INTEGER: return json_integer_value(v) != 0;
    case JSON_REAL: return json_real_value(v) != 0;
    case JSON_TRUE: return 1;
    default: return 0;
    }
}

/* A real as Python's repr writes it: the shortest digits that read back,
 * fixed with ".0" when whole, else exponent form below 1e-4 and from 1e16. */
static void put_real(rk_strbuf *b, double x) {
    if (x != x || x == 1.0 / 0.0 || x == -1.0 / 0.0) {
        rk_strbuf_puts(b, x != x ? "nan" : x > 0 ? "inf" : "-inf");
        return;
    }
    char s[40];
    for (int p = 1; p <= 17; p++) {
        snprintf(s, sizeof s, "%.*e", p - 1, x);
        if (strtod(s, NULL) == x) break;
    }
    /* s is d.ddde±XX: the digits and the decimal exponent */
    char digits[24];
    int nd = 0, neg = s[0] == '-';
    const char *e = strchr(s, 'e');
    for (const char *p = s + neg; p < e; p++)
        if (*p != '.') digits[nd++] = *p;
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    int exp = atoi(e + 1);
    if (neg) rk_strbuf_puts(b, "-");
    if (exp < -4 || exp >= 16) {
        rk_strbuf_putn(b, digits, 1);
        if (nd > 1) {
            rk_strbuf_puts(b, ".");
            rk_strbuf_putn(b, digits + 1, (size_t)nd - 1);
        }
        rk_strbuf_printf(b, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    } else if (exp < 0) {
        rk_strbuf_puts(b, "0.");
        for (int i = -1; i > exp; i--) rk_strbuf_puts(b, "0");
        rk_strbuf_putn(b, digits, (size_t)nd);
    } else {
        for (int i = 0; i <= exp; i++) rk_strbuf_putn(b, i < nd ? digits + i : "0", 1);
        rk_strbuf_puts(b, ".");
        if (nd > exp + 1)
            rk_strbuf_putn(b, digits + exp + 1, (size_t)(nd - exp - 1));
        else
            rk_strbuf_puts(b, "0");
    }
}

/* A value as Jinja prints it ({{ v }}): a string as it is, a number as
 * Python does, booleans True/False, null None (containers as JSON). */
static void put_plain(rk_strbuf *b, const json_t *v) {
    if (json_is_string(v)) {
        rk_strbuf_putn(b, json_string_value(v), json_string_length(v));
    } else if (json_is_integer(v)) {
        rk_strbuf_printf(b, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
    } else if (json_is_real(v)) {
        put_real(b, json_real_value(v));
    } else if (json_is_boolean(v) || !v || json_is_null(v)) {
        rk_strbuf_puts(b, json_is_true(v) ? "True" : json_is_false(v) ? "False" : "None");
    } else {
        char *s = json_dumps(v, JSON_COMPACT);
        if (!s) b->oom = 1;
        if (s) rk_strbuf_puts(b, s);
        free(s);
    }
}

/* Jinja's upper of a value (a schema's type): a string upper-cased, a list
 * of strings as Python prints it, upper-cased ("['STRING', 'NULL']"). */
static void put_upper(rk_strbuf *b, const json_t *v) {
    rk_strbuf t = {0};
    if (json_is_array(v)) {
        rk_strbuf_puts(&t, "[");
        for (size_t i = 0; i < json_array_size(v); i++) {
            rk_strbuf_puts(&t, i ? ", '" : "'");
            put_plain(&t, json_array_get(v, i));
            rk_strbuf_puts(&t, "'");
        }
        rk_strbuf_puts(&t, "]");
    } else if (v) {
        put_plain(&t, v);
    }
    for (size_t i = 0; i < t.len; i++) t.s[i] = (char)toupper((unsigned char)t.s[i]);
    if (t.oom) b->oom = 1;
    if (t.s) rk_strbuf_putn(b, t.s, t.len);
    rk_strbuf_free(&t);
}

/* Whether the type of schema s, upper-cased, is name. */
static int type_is(const json_t *s, const char *name) {
    const json_t *t = get(s, "type");
    if (!json_is_string(t)) return 0;
    const char *v = json_string_value(t);
    size_t n = strlen(name);
    if (strlen(v) != n) return 0;
    for (size_t i = 0; i < n; i++)
        if (toupper((unsigned char)v[i]) != name[i]) return 0;
    return 1;
}

typedef struct key_at {
    const char *key;
    size_t at; /* the key's place in the object: ties keep it */
} key_at;

static int key_cmp(const void *a, const void *b) {
    const key_at *x = a, *y = b;
    int c = strcasecmp(x->key, y->key);
    return c ? c : x->at < y->at ? -1 : 1;
}

/* The keys of object o in dictsort's order (malloc'ed, *n of them; NULL
 * with *n = 0 when there are none or memory ran out: oom set then). */
static key_at *sorted_keys(const json_t *o, size_t *n, rk_strbuf *b) {
    *n = json_object_size(o);
    if (!*n) return NULL;
    key_at *k = malloc(*n * sizeof *k);
    if (!k) {
        b->oom = 1;
        *n = 0;
        return NULL;
    }
    size_t i = 0;
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)o, key, v) k[i] = (key_at){key, i}, i++;
    qsort(k, *n, sizeof *k, key_cmp);
    return k;
}

/* A value in Gemma 4's syntax (the template's format_argument); keys
 * between marks when escape_keys. */
static void put_argument(rk_strbuf *b, const json_t *v, int escape_keys) {
    if (json_is_string(v)) {
        rk_strbuf_puts(b, k_quote);
        rk_strbuf_putn(b, json_string_value(v), json_string_length(v));
        rk_strbuf_puts(b, k_quote);
    } else if (json_is_boolean(v)) {
        rk_strbuf_puts(b, json_is_true(v) ? "true" : "false");
    } else if (json_is_object(v)) {
        size_t n;
        key_at *k = sorted_keys(v, &n, b);
        rk_strbuf_puts(b, "{");
        for (size_t i = 0; i < n; i++) {
            if (i) rk_strbuf_puts(b, ",");
            if (escape_keys) rk_strbuf_puts(b, k_quote);
            rk_strbuf_puts(b, k[i].key);
            if (escape_keys) rk_strbuf_puts(b, k_quote);
            rk_strbuf_puts(b, ":");
            put_argument(b, json_object_get(v, k[i].key), escape_keys);
        }
        rk_strbuf_puts(b, "}");
        free(k);
    } else if (json_is_array(v)) {
        rk_strbuf_puts(b, "[");
        for (size_t i = 0; i < json_array_size(v); i++) {
            if (i) rk_strbuf_puts(b, ",");
            put_argument(b, json_array_get(v, i), escape_keys);
        }
        rk_strbuf_puts(b, "]");
    } else {
        put_plain(b, v);
    }
}

/* A list of names between marks: required:[<|"|>a<|"|>,...]. */
static void put_names(rk_strbuf *b, const json_t *list) {
    rk_strbuf_puts(b, "required:[");
    for (size_t i = 0; i < json_array_size(list); i++) {
        if (i) rk_strbuf_puts(b, ",");
        rk_strbuf_puts(b, k_quote);
        put_plain(b, json_array_get(list, i));
        rk_strbuf_puts(b, k_quote);
    }
    rk_strbuf_puts(b, "]");
}

/* The comma before a field of a property, but for its first. */
static void field(rk_strbuf *b, int *first) {
    if (!*first) rk_strbuf_puts(b, ",");
    *first = 0;
}

static void put_properties(rk_strbuf *b, const json_t *props, int filter_keys);

/* An array property's items: their fields in key order. */
static void put_items(rk_strbuf *b, const json_t *items) {
    size_t n;
    key_at *k = sorted_keys(items, &n, b);
    int first = 1;
    rk_strbuf_puts(b, "items:{");
    for (size_t i = 0; i < n; i++) {
        const json_t *v = json_object_get(items, k[i].key);
        if (json_is_null(v)) continue;
        field(b, &first);
        if (!strcmp(k[i].key, "properties")) {
            rk_strbuf_puts(b, "properties:{");
            if (json_is_object(v)) put_properties(b, v, 0);
            rk_strbuf_puts(b, "}");
        } else if (!strcmp(k[i].key, "required")) {
            put_names(b, v);
        } else if (!strcmp(k[i].key, "type")) {
            rk_strbuf_puts(b, "type:");
            if (json_is_string(v)) {
                rk_strbuf_puts(b, k_quote);
                put_upper(b, v);
                rk_strbuf_puts(b, k_quote);
            } else {
                rk_strbuf_puts(b, "[");
                for (size_t j = 0; j < json_array_size(v); j++) {
                    rk_strbuf_puts(b, j ? "," : "");
                    rk_strbuf_puts(b, k_quote);
                    put_upper(b, json_array_get(v, j));
                    rk_strbuf_puts(b, k_quote);
                }
                rk_strbuf_puts(b, "]");
            }
        } else {
            rk_strbuf_puts(b, k[i].key);
            rk_strbuf_puts(b, ":");
            put_argument(b, v, 1);
        }
    }
    rk_strbuf_puts(b, "}");
    free(k);
}

/* A schema's properties as the template's format_parameters writes them:
 * each NAME:{description,enum|items,nullable,properties,required,type} in
 * key order; filter_keys skips the schema keywords (an object property
 * without "properties" describes its own keys that way). */
static void put_properties(rk_strbuf *b, const json_t *props, int filter_keys) {
    static const char *const standard[] = {"description", "type", "properties", "required",
                                           "nullable"};
    size_t n;
    key_at *k = sorted_keys(props, &n, b);
    int any = 0;
    for (size_t i = 0; i < n; i++) {
        int skip = 0;
        for (size_t s = 0; filter_keys && s < sizeof standard / sizeof *standard; s++)
            skip |= !strcmp(k[i].key, standard[s]);
        if (skip) continue;
        const json_t *v = json_object_get(props, k[i].key);
        int first = 1;
        if (any++) rk_strbuf_puts(b, ",");
        rk_strbuf_puts(b, k[i].key);
        rk_strbuf_puts(b, ":{");
        if (truthy(get(v, "description"))) {
            rk_strbuf_puts(b, "description:");
            rk_strbuf_puts(b, k_quote);
            put_plain(b, get(v, "description"));
            rk_strbuf_puts(b, k_quote);
            first = 0;
        }
        if (type_is(v, "STRING") && truthy(get(v, "enum"))) {
            field(b, &first);
            rk_strbuf_puts(b, "enum:");
            put_argument(b, get(v, "enum"), 1);
        } else if (type_is(v, "ARRAY") && json_is_object(get(v, "items")) &&
                   truthy(get(v, "items"))) {
            field(b, &first);
            put_items(b, get(v, "items"));
        }
        if (truthy(get(v, "nullable"))) {
            field(b, &first);
            rk_strbuf_puts(b, "nullable:true");
        }
        if (type_is(v, "OBJECT")) {
            const json_t *p = get(v, "properties");
            field(b, &first);
            rk_strbuf_puts(b, "properties:{");
            put_properties(b, json_is_object(p) ? p : v, !json_is_object(p));
            rk_strbuf_puts(b, "}");
            if (truthy(get(v, "required"))) {
                field(b, &first);
                put_names(b, get(v, "required"));
            }
        }
        field(b, &first);
        rk_strbuf_puts(b, "type:");
        rk_strbuf_puts(b, k_quote);
        put_upper(b, get(v, "type"));
        rk_strbuf_puts(b, k_quote);
        rk_strbuf_puts(b, "}");
    }
    free(k);
}

/* One tool's declaration (the template's format_function_declaration). */
static void put_declaration(rk_strbuf *b, const rk_api_tool *tool) {
    rk_strbuf_puts(b, "<|tool>declaration:");
    rk_strbuf_puts(b, tool->name);
    rk_strbuf_puts(b, "{description:");
    rk_strbuf_puts(b, k_quote);
    if (tool->description) rk_strbuf_puts(b, tool->description);
    rk_strbuf_puts(b, k_quote);
    const json_t *params = tool->parameters;
    if (truthy(params)) {
        rk_strbuf_puts(b, ",parameters:{");
        if (truthy(get(params, "properties"))) {
            rk_strbuf_puts(b, "properties:{");
            put_properties(b, get(params, "properties"), 0);
            rk_strbuf_puts(b, "},");
        }
        if (truthy(get(params, "required"))) {
            put_names(b, get(params, "required"));
            rk_strbuf_puts(b, ",");
        }
        if (truthy(get(params, "type"))) { /* the template closes parameters only here */
            rk_strbuf_puts(b, "type:");
            rk_strbuf_puts(b, k_quote);
            put_upper(b, get(params, "type"));
            rk_strbuf_puts(b, k_quote);
            rk_strbuf_puts(b, "}");
        }
    }
    rk_strbuf_puts(b, "}<tool|>");
}

void rk_gemma4_call(rk_strbuf *b, const char *name, const json_t *args) {
    rk_strbuf_puts(b, "<|tool_call>call:");
    rk_strbuf_puts(b, name ? name : "");
    size_t n;
    key_at *k = sorted_keys(args, &n, b);
    rk_strbuf_puts(b, "{");
    for (size_t i = 0; i < n; i++) {
        if (i) rk_strbuf_puts(b, ",");
        rk_strbuf_puts(b, k[i].key);
        rk_strbuf_puts(b, ":");
        put_argument(b, json_object_get(args, k[i].key), 0);
    }
    rk_strbuf_puts(b, "}<tool_call|>");
    free(k);
}

const rk_chat_msg *rk_gemma4_caller(const rk_api_request *req, int i) {
    while (i > 0 && req->msgs[i - 1].role == RK_ROLE_TOOL) i--;
    const rk_chat_msg *m = i > 0 ? &req->msgs[i - 1] : NULL;
    return m && m->role == RK_ROLE_ASSISTANT && m->tool_calls ? m : NULL;
}

char *rk_gemma4_tool_name(const rk_api_request *req, int i) {
    const rk_chat_msg *caller = rk_gemma4_caller(req, i);
    const char *id = req->msgs[i].tool_call_id;
    json_t *list = caller ? json_loads(caller->tool_calls, 0, NULL) : NULL;
    const json_t *call = NULL;
    for (size_t k = 0; id && k < json_array_size(list) && !call; k++) {
        const char *cid = json_string_value(json_object_get(json_array_get(list, k), "id"));
        if (cid && !strcmp(cid, id)) call = json_array_get(list, k);
    }
    if (!id && caller) /* no id: the call in its place (the results in the calls' order) */
        call = json_array_get(list, (size_t)(&req->msgs[i] - caller - 1));
    char *name = call ? rk_strdup(json_string_value(json_object_get(call, "name"))) : NULL;
    json_decref(list);
    return name;
}

void rk_gemma4_tool_open(rk_strbuf *b, const char *name) {
    rk_strbuf_puts(b, "<|tool_response>response:");
    rk_strbuf_puts(b, name);
    rk_strbuf_puts(b, "{value:");
    rk_strbuf_puts(b, k_quote);
}

void rk_gemma4_tool_close(rk_strbuf *b, const rk_api_request *req, int i) {
    rk_strbuf_puts(b, k_quote);
    rk_strbuf_puts(b, "}<tool_response|>");
    /* after the last result: the calling message's text, and its turn's end
     * when it has some (else the turn stays open for the model's words) */
    if (i + 1 < req->n_msgs && req->msgs[i + 1].role == RK_ROLE_TOOL) return;
    const rk_chat_msg *caller = rk_gemma4_caller(req, i);
    size_t at = b->len;
    if (caller) put_answer(b, caller->content);
    if (b->len > at) rk_strbuf_puts(b, "<turn|>\n");
}

/* ---------------------------------------------------------------- calls the model writes */

enum { MAX_DEPTH = 64 };

static json_t *read_value(const char **p, int depth);

/* A key: between marks, or the text up to its ':' (trimmed). */
static char *read_key(const char **p) {
    const char *s = *p + strspn(*p, k_space), *e;
    if (!strncmp(s, k_quote, 5)) {
        s += 5;
        if (!(e = strstr(s, k_quote))) return NULL;
        *p = e + 5;
    } else {
        e = s + strcspn(s, ":,{}[]");
        *p = e;
        while (e > s && strchr(k_space, e[-1])) e--;
        if (e == s) return NULL;
    }
    *p += strspn(*p, k_space);
    if (**p != ':') return NULL;
    (*p)++;
    return strndup(s, (size_t)(e - s));
}

/* A bare scalar up to the next ',', '}' or ']': true, false, null/None, a
 * number, else its text as a string. */
static json_t *read_scalar(const char **p) {
    const char *s = *p, *e = s + strcspn(s, ",}]");
    *p = e;
    while (e > s && strchr(k_space, e[-1])) e--;
    size_t n = (size_t)(e - s);
    if (n == 4 && !strncmp(s, "true", 4)) return json_true();
    if (n == 5 && !strncmp(s, "false", 5)) return json_false();
    if ((n == 4 && !strncmp(s, "null", 4)) || (n == 4 && !strncmp(s, "None", 4)))
        return json_null();
    char *t = strndup(s, n), *end;
    if (!t) return NULL;
    json_t *v = NULL;
    if (n && n < 32 && strspn(t, "-+0123456789") == n) {
        long long x = strtoll(t, &end, 10);
        if (!*end) v = json_integer(x);
    } else if (n && n < 64) {
        double x = strtod(t, &end);
        if (!*end && x == x) v = json_real(x);
    }
    if (!v) v = json_stringn(t, n);
    free(t);
    return v;
}

/* A mapping {key:value,...} or a list [value,...], *p at its bracket. */
static json_t *read_container(const char **p, int depth) {
    int map = **p == '{';
    char close = map ? '}' : ']';
    json_t *c = map ? json_object() : json_array();
    (*p)++;
    *p += strspn(*p, k_space);
    if (**p == close) {
        (*p)++;
        return c;
    }
    while (c) {
        char *key = map ? read_key(p) : NULL;
        json_t *v = (!map || key) ? read_value(p, depth + 1) : NULL;
        int bad = !v || (map ? json_object_set_new(c, key, v) : json_array_append_new(c, v));
        free(key);
        if (bad) break;
        *p += strspn(*p, k_space);
        if (**p == close) {
            (*p)++;
            return c;
        }
        if (**p != ',') break;
        (*p)++;
    }
    json_decref(c);
    return NULL;
}

static json_t *read_value(const char **p, int depth) {
    *p += strspn(*p, k_space);
    if (depth > MAX_DEPTH) return NULL;
    if (!strncmp(*p, k_quote, 5)) {
        const char *s = *p + 5, *e = strstr(s, k_quote);
        if (!e) return NULL;
        *p = e + 5;
        return json_stringn(s, (size_t)(e - s));
    }
    if (**p == '{' || **p == '[') return read_container(p, depth);
    return read_scalar(p);
}

int rk_gemma4_find_call(const char *text, size_t *pos, char name[65], json_t **args, size_t *at) {
    static const char open[] = "<|tool_call>call:", close[] = "<tool_call|>";
    for (const char *s = strstr(text + *pos, open); s; s = strstr(s + 1, open)) {
        const char *n = s + strlen(open), *p = n + strspn(n, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghij"
                                                             "klmnopqrstuvwxyz0123456789_-");
        size_t len = (size_t)(p - n);
        if (!len || len > 64 || *p != '{') continue;
        json_t *a = read_value(&p, 0);
        if (!a || strncmp(p, close, strlen(close))) {
            json_decref(a);
            continue;
        }
        memcpy(name, n, len);
        name[len] = 0;
        *args = a;
        *at = (size_t)(s - text);
        *pos = (size_t)(p - text) + strlen(close);
        return 1;
    }
    return 0;
}

/* ---------------------------------------------------------------- turns */

void rk_gemma4_system(rk_strbuf *b, const rk_api_request *req) {
    int sys = req->n_msgs > 0 && req->msgs[0].role == RK_ROLE_SYSTEM;
    if (!sys && !req->thinking && !req->n_tools) return;
    rk_strbuf_puts(b, "<|turn>system\n");
    if (req->thinking) rk_strbuf_puts(b, "<|think|>\n");
    if (sys) put_trim(b, req->msgs[0].content, strlen(req->msgs[0].content), 1);
    for (int i = 0; i < req->n_tools; i++) put_declaration(b, &req->tools[i]);
    rk_strbuf_puts(b, "<turn|>\n");
}

/* Whether the message before m, tool results aside, is an assistant's. */
static int after_answer(const rk_api_request *req, const rk_chat_msg *m) {
    while (m > req->msgs && m[-1].role == RK_ROLE_TOOL) m--;
    return m > req->msgs && m[-1].role == RK_ROLE_ASSISTANT;
}

void rk_gemma4_turn(rk_strbuf *b, const rk_api_request *req, const rk_chat_msg *m, int open) {
    if (m == req->msgs && m->role == RK_ROLE_SYSTEM) return; /* the system turn's */
    int assistant = m->role == RK_ROLE_ASSISTANT;
    if (!assistant || !after_answer(req, m))
        rk_strbuf_puts(b, assistant ? "<|turn>model\n" : "<|turn>system\n");
    if (assistant && m->tool_calls) {
        int after_user = 1; /* its thinking is kept in the turn of the last question */
        for (const rk_chat_msg *x = m + 1; x < req->msgs + req->n_msgs; x++)
            after_user &= x->role != RK_ROLE_USER;
        if (m->reasoning && after_user) {
            rk_strbuf_puts(b, "<|channel>thought\n");
            rk_strbuf_puts(b, m->reasoning);
            rk_strbuf_puts(b, "\n<channel|>");
        }
        json_t *list = json_loads(m->tool_calls, 0, NULL);
        if (!list) b->oom = 1;
        for (size_t k = 0; k < json_array_size(list); k++) {
            const json_t *c = json_array_get(list, k);
            rk_gemma4_call(b, json_string_value(json_object_get(c, "name")),
                           json_object_get(c, "arguments"));
        }
        json_decref(list);
        /* answered: its text and end follow its results (rk_gemma4_tool_close) */
        if (m + 1 < req->msgs + req->n_msgs && m[1].role == RK_ROLE_TOOL) return;
        put_answer(b, m->content);
        rk_strbuf_puts(b, "<|tool_response>");
        return;
    }
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

/* ---------------------------------------------------------------- calls constrained
 *
 * tool_choice required or named: a grammar of Gemma 4's calls. A tool's
 * parameters shape its mapping: its properties' keys in the template's
 * order, the required ones present, each value of its type (an enum's
 * values, a string between marks without a '<' in it, an integer, a number,
 * true or false, a list of its items, a mapping of its properties); a value
 * of no known type is any value. */

static const char k_values[] =
    "g4str ::= \"<|\\\"|>\" [^<]* \"<|\\\"|>\"\n"
    "g4int ::= \"-\"? [0-9]+\n"
    "g4num ::= g4int (\".\" [0-9]+)? ([eE] [-+]? [0-9]+)?\n"
    "g4bool ::= \"true\" | \"false\"\n"
    "g4key ::= [A-Za-z_] [A-Za-z0-9_]*\n"
    "g4val ::= g4str | g4num | g4bool | g4map | g4list\n"
    "g4map ::= \"{\" (g4key \":\" g4val (\",\" g4key \":\" g4val)*)? \"}\"\n"
    "g4list ::= \"[\" (g4val (\",\" g4val)*)? \"]\"\n";

enum { MAX_SCHEMA_DEPTH = 16 };

/* A new rule "g4rN ::= body" (body consumed); its reference into ref. */
static void new_rule(rk_strbuf *g, int *n, rk_strbuf *body, rk_strbuf *ref) {
    rk_strbuf_printf(g, "g4r%d ::= %s\n", *n, body->s ? body->s : "");
    if (body->oom) g->oom = 1;
    rk_strbuf_free(body);
    rk_strbuf_printf(ref, "g4r%d", (*n)++);
}

static void value_rule(rk_strbuf *g, int *n, const json_t *s, int depth, rk_strbuf *ref);

/* A mapping of schema s's properties, into ref: its pairs in key order,
 * each after a comma but the first, the required ones always there. */
static void mapping_rule(rk_strbuf *g, int *n, const json_t *s, int depth, rk_strbuf *ref) {
    const json_t *props = get(s, "properties"), *req = get(s, "required");
    size_t nk;
    key_at *k = sorted_keys(props, &nk, g);
    rk_strbuf *pair = nk ? calloc(nk, sizeof *pair) : NULL; /* "key:" value */
    int *required = nk ? calloc(nk, sizeof *required) : NULL;
    if (!pair || !required) {
        free(pair);
        free(required);
        free(k);
        rk_strbuf_puts(ref, "g4map");
        return;
    }
    for (size_t i = 0; i < nk; i++) {
        for (size_t j = 0; j < json_array_size(req); j++) {
            const char *r = json_string_value(json_array_get(req, j));
            required[i] |= r && !strcmp(r, k[i].key);
        }
        rk_strbuf body = {0};
        rk_grammar_literal(&body, k[i].key, strlen(k[i].key));
        rk_strbuf_puts(&body, " \":\" ");
        value_rule(g, n, json_object_get(props, k[i].key), depth + 1, &body);
        new_rule(g, n, &body, &pair[i]);
    }
    /* the first pair written is any up to the first required one */
    rk_strbuf body = {0};
    rk_strbuf_puts(&body, "\"{\" (");
    int all_optional = 1;
    for (size_t i = 0; i < nk && all_optional; i++) {
        rk_strbuf_printf(&body, "%s%s", i ? " | " : "", pair[i].s ? pair[i].s : "");
        for (size_t j = i + 1; j < nk; j++)
            rk_strbuf_printf(&body, required[j] ? " \",\" %s" : " (\",\" %s)?",
                             pair[j].s ? pair[j].s : "");
        all_optional = !required[i];
    }
    rk_strbuf_printf(&body, ")%s \"}\"", all_optional ? "?" : "");
    new_rule(g, n, &body, ref);
    for (size_t i = 0; i < nk; i++) {
        if (pair[i].oom) g->oom = 1;
        rk_strbuf_free(&pair[i]);
    }
    free(pair);
    free(required);
    free(k);
}

/* The rule of a value of schema s, into ref. */
static void value_rule(rk_strbuf *g, int *n, const json_t *s, int depth, rk_strbuf *ref) {
    const json_t *en = get(s, "enum");
    if (depth > MAX_SCHEMA_DEPTH) {
        rk_strbuf_puts(ref, "g4val");
    } else if (json_array_size(en)) {
        rk_strbuf body = {0};
        for (size_t i = 0; i < json_array_size(en); i++) {
            rk_strbuf v = {0};
            put_argument(&v, json_array_get(en, i), 0);
            if (i) rk_strbuf_puts(&body, " | ");
            if (v.s) rk_grammar_literal(&body, v.s, v.len);
            if (v.oom) body.oom = 1;
            rk_strbuf_free(&v);
        }
        new_rule(g, n, &body, ref);
    } else if (type_is(s, "STRING")) {
        rk_strbuf_puts(ref, "g4str");
    } else if (type_is(s, "INTEGER")) {
        rk_strbuf_puts(ref, "g4int");
    } else if (type_is(s, "NUMBER")) {
        rk_strbuf_puts(ref, "g4num");
    } else if (type_is(s, "BOOLEAN")) {
        rk_strbuf_puts(ref, "g4bool");
    } else if (type_is(s, "ARRAY")) {
        rk_strbuf item = {0}, body = {0};
        value_rule(g, n, get(s, "items"), depth + 1, &item);
        rk_strbuf_printf(&body, "\"[\" (%s (\",\" %s)*)? \"]\"", item.s ? item.s : "",
                         item.s ? item.s : "");
        if (item.oom) body.oom = 1;
        rk_strbuf_free(&item);
        new_rule(g, n, &body, ref);
    } else if (type_is(s, "OBJECT")) {
        mapping_rule(g, n, s, depth, ref);
    } else {
        rk_strbuf_puts(ref, "g4val");
    }
}

char *rk_gemma4_calls_grammar(const rk_api_request *req) {
    rk_strbuf g = {0}, root = {0};
    int n = 0;
    rk_strbuf_puts(&g, k_values);
    int named = req->tool_choice == RK_TOOLS_NAMED;
    for (int i = 0; i < (named ? 1 : req->n_tools); i++) {
        const rk_api_tool *tool = &req->tools[named ? req->tool_named : i];
        rk_strbuf body = {0}, open = {0};
        rk_strbuf_printf(&open, "<|tool_call>call:%s", tool->name);
        if (open.s) rk_grammar_literal(&body, open.s, open.len);
        if (open.oom) body.oom = 1;
        rk_strbuf_free(&open);
        rk_strbuf_puts(&body, " ");
        if (json_is_object(get(tool->parameters, "properties")))
            mapping_rule(&g, &n, tool->parameters, 0, &body);
        else
            rk_strbuf_puts(&body, "g4map");
        rk_strbuf_puts(&body, " \"<tool_call|>\"");
        if (i) rk_strbuf_puts(&root, " | ");
        new_rule(&g, &n, &body, &root);
    }
    rk_strbuf_printf(&g, "root ::= (%s)%s\n", root.s ? root.s : "",
                     req->parallel_tool_calls ? "+" : "");
    if (root.oom) g.oom = 1;
    rk_strbuf_free(&root);
    return rk_strbuf_take(&g);
}
