/* engine/grammar_schema.c — JSON Schema, tool calls and the JSON-object
 * rule translated into grammar text, then compiled (see engine/grammar.h).
 *
 * Each (sub)schema becomes one rule s<n> of grammar text over a prelude of
 * JSON rules; local references ($ref) are memoised per nesting depth and cut
 * off at a fixed depth. Error messages start with the JSON path of the part
 * that cannot be enforced. The text is written to an rk_strbuf
 * (config/config.h), and grammar_regex.c writes patterns into it. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/grammar_internal.h"

/* ------------------------------------------------------------ JSON Schema */

/* Rules every schema grammar has. Strings hold unescaped characters or
 * escapes (\u escapes that jansson accepts: no lone surrogate, no \u0000);
 * integers have at most 15 digits and numbers at most 15 fraction digits and
 * a two-digit exponent, so every number fits a double (jansson refuses
 * numbers that overflow). Whitespace is one optional space after ':' and
 * ','. */
static const char *const k_json_prelude =
    "_ws ::= \" \"?\n"
    "_chr ::= [^\"\\\\\\x00-\\x1F] | \"\\\\\" _esc\n"
    "_esc ::= [\"\\\\/bfnrt] | \"u\" _u4\n"
    "_hx ::= [0-9a-fA-F]\n"
    "_u4 ::= [1-9a-cA-C] _hx _hx _hx | [eEfF] _hx _hx _hx | [dD] [0-7] _hx _hx"
    " | \"0\" ( [1-9a-fA-F] _hx _hx | \"0\" ( [1-9a-fA-F] _hx | \"0\" [1-9a-fA-F] ) )\n"
    "_str ::= \"\\\"\" _chr* \"\\\"\"\n"
    "_int ::= \"-\"? ( \"0\" | [1-9] [0-9]{0,14} )\n"
    "_num ::= _int ( \".\" [0-9]{1,15} )? ( [eE] [-+]? [0-9]{1,2} )?\n"
    "_val ::= _obj | _arr | _str | _num | \"true\" | \"false\" | \"null\"\n"
    "_obj ::= \"{\" ( _str \":\" _ws _val ( \",\" _ws _str \":\" _ws _val )* )? \"}\"\n"
    "_arr ::= \"[\" ( _val ( \",\" _ws _val )* )? \"]\"\n"
    "_never ::= []\n"
    /* Any non-ASCII character but white space (U+0085 U+00A0 U+1680
     * U+2000-U+200A U+2028 U+2029 U+202F U+205F U+3000 U+FEFF): what a
     * pattern's \S, \D, \W, '.' and negated classes allow beyond ASCII. */
    "_unws ::= \"\\xC2\" [\\x80-\\x84\\x86-\\x9F\\xA1-\\xBF] | [\\xC3-\\xDF] [\\x80-\\xBF]"
    " | \"\\xE0\" [\\xA0-\\xBF] [\\x80-\\xBF]"
    " | \"\\xE1\" ( [\\x80-\\x99\\x9B-\\xBF] [\\x80-\\xBF] | \"\\x9A\" [\\x81-\\xBF] )"
    " | \"\\xE2\" ( \"\\x80\" [\\x8B-\\xA7\\xAA-\\xAE\\xB0-\\xBF] | \"\\x81\" "
    "[\\x80-\\x9E\\xA0-\\xBF]"
    " | [\\x82-\\xBF] [\\x80-\\xBF] )"
    " | \"\\xE3\" ( \"\\x80\" [\\x81-\\xBF] | [\\x81-\\xBF] [\\x80-\\xBF] )"
    " | [\\xE4-\\xEC\\xEE] [\\x80-\\xBF] [\\x80-\\xBF] | \"\\xED\" [\\x80-\\x9F] [\\x80-\\xBF]"
    " | \"\\xEF\" ( [\\x80-\\xBA\\xBC-\\xBF] [\\x80-\\xBF] | \"\\xBB\" [\\x80-\\xBE] )"
    " | \"\\xF0\" [\\x90-\\xBF] [\\x80-\\xBF] [\\x80-\\xBF]"
    " | [\\xF1-\\xF3] [\\x80-\\xBF] [\\x80-\\xBF] [\\x80-\\xBF]"
    " | \"\\xF4\" [\\x80-\\x8F] [\\x80-\\xBF] [\\x80-\\xBF]\n";

#define RK_SCHEMA_REF_DEPTH 8
#define RK_INT_MAX          999999999999999.0 /* 15 digits */

typedef struct memo_entry {
    const json_t *target;
    int depth, rule;
} memo_entry;

typedef struct sgen {
    rk_strbuf out;
    int n;
    char path[512];
    const json_t *root;
    memo_entry *memo;
    int n_memo, cap_memo;
    rk_status st;
    char err[900];
} sgen;

/* Set G's error (the first one only): the path, then the message. Returns -1. */
static int sg_vfail(sgen *G, rk_status st, const char *fmt, va_list ap)
    __attribute__((format(printf, 3, 0)));
static int sg_vfail(sgen *G, rk_status st, const char *fmt, va_list ap) {
    if (G->st != RK_OK) return -1;
    char tmp[300];
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    snprintf(G->err, sizeof G->err, "%.511s: %s", G->path, tmp);
    G->st = st;
    return -1;
}

static int sg_fail(sgen *G, rk_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int sg_fail(sgen *G, rk_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    sg_vfail(G, st, fmt, ap);
    va_end(ap);
    return -1;
}

/* Append a path component (".name" or "[i]"); returns the length to restore. */
static size_t path_push(sgen *G, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static size_t path_push(sgen *G, const char *fmt, ...) {
    size_t len = strlen(G->path);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(G->path + len, sizeof G->path - len, fmt, ap);
    va_end(ap);
    return len;
}

static void path_pop(sgen *G, size_t len) { G->path[len] = 0; }

/* Fail as sg_fail, with the path of s's keyword key (".key" appended to the
 * path for the message only). Returns -1. */
static int sg_fail_at(sgen *G, const char *key, rk_status st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int sg_fail_at(sgen *G, const char *key, rk_status st, const char *fmt, ...) {
    size_t l = path_push(G, ".%s", key);
    va_list ap;
    va_start(ap, fmt);
    sg_vfail(G, st, fmt, ap);
    va_end(ap);
    path_pop(G, l);
    return -1;
}

/* A grammar literal of n bytes: printable ASCII as is, the rest \xHH. */
void rk_grammar_literal(rk_strbuf *o, const char *s, size_t n) {
    rk_strbuf_puts(o, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7F && c != '"' && c != '\\')
            rk_strbuf_putn(o, (const char *)&c, 1);
        else
            rk_strbuf_printf(o, "\\x%02X", c);
    }
    rk_strbuf_puts(o, "\"");
}

static int gen(sgen *G, const json_t *s, int rdepth);

/* Finish rule n with body b (consumed). */
static int put_rule(sgen *G, int n, rk_strbuf *b) {
    rk_strbuf_printf(&G->out, "s%d ::= ", n);
    rk_strbuf_puts(&G->out, b->s ? b->s : "");
    rk_strbuf_puts(&G->out, "\n");
    if (b->oom) G->out.oom = 1;
    free(b->s);
    return n;
}

static int all_char(const char *s, char c, int n) {
    for (int i = 0; i < n; i++)
        if (s[i] != c) return 0;
    return 1;
}

/* Decimal strings of length n from a to b (a <= b, same length). */
static void digits_range(rk_strbuf *o, const char *a, const char *b, int n) {
    if (n == 0) return;
    if (a[0] == b[0]) {
        rk_strbuf_printf(o, "\"%c\" ", a[0]);
        digits_range(o, a + 1, b + 1, n - 1);
        return;
    }
    char nines[24], zeros[24];
    memset(nines, '9', sizeof nines);
    memset(zeros, '0', sizeof zeros);
    int a_zero = all_char(a + 1, '0', n - 1), b_nine = all_char(b + 1, '9', n - 1);
    int first = 1;
    rk_strbuf_puts(o, "( ");
    if (!a_zero) {
        rk_strbuf_printf(o, "\"%c\" ( ", a[0]);
        digits_range(o, a + 1, nines, n - 1);
        rk_strbuf_puts(o, ") ");
        first = 0;
    }
    int lo = a[0] - '0' + (a_zero ? 0 : 1), hi = b[0] - '0' - (b_nine ? 0 : 1);
    if (lo <= hi) {
        if (!first) rk_strbuf_puts(o, "| ");
        rk_strbuf_printf(o, "[%d-%d] ", lo, hi);
        if (n > 1) rk_strbuf_printf(o, "[0-9]{%d} ", n - 1);
        first = 0;
    }
    if (!b_nine) {
        if (!first) rk_strbuf_puts(o, "| ");
        rk_strbuf_printf(o, "\"%c\" ( ", b[0]);
        digits_range(o, zeros, b + 1, n - 1);
        rk_strbuf_puts(o, ") ");
    }
    rk_strbuf_puts(o, ") ");
}

/* Alternatives (each prefixed by sep after the first) for the decimal
 * integers lo..hi without leading zeros; returns how many were written. */
static int uint_range(rk_strbuf *o, double lo, double hi, const char *suffix, int *count) {
    if (hi > RK_INT_MAX) hi = RK_INT_MAX;
    if (lo < 0) lo = 0;
    if (lo > hi) return 0;
    int n0 = snprintf(NULL, 0, "%.0f", lo), n1 = snprintf(NULL, 0, "%.0f", hi);
    int made = 0;
    for (int n = n0; n <= n1; n++) {
        double a = n == 1 ? 0 : pow(10, n - 1), b = pow(10, n) - 1;
        if (a < lo) a = lo;
        if (b > hi) b = hi;
        if (a > b) continue;
        char sa[24], sbb[24];
        snprintf(sa, sizeof sa, "%.0f", a);
        snprintf(sbb, sizeof sbb, "%.0f", b);
        if (*count) rk_strbuf_puts(o, "| ");
        rk_strbuf_puts(o, "( ");
        digits_range(o, sa, sbb, n);
        rk_strbuf_printf(o, ") %s ", suffix);
        (*count)++;
        made++;
    }
    return made;
}

#define FRAC  "( \".\" [0-9]{1,15} )?"
#define ZFRAC "( \".\" \"0\"{1,15} )?"

/* Magnitudes k.f in [lo, hi] (integers; hi_inf: no upper bound). */
static void mag_range(rk_strbuf *o, const char *sign, double lo, double hi, int hi_inf,
                      int *count) {
    rk_strbuf tmp = {0};
    int c = 0;
    if (hi_inf) {
        uint_range(&tmp, lo, RK_INT_MAX, FRAC, &c);
    } else {
        uint_range(&tmp, lo, hi - 1, FRAC, &c);
        uint_range(&tmp, hi, hi, ZFRAC, &c);
    }
    if (c) {
        if (*count) rk_strbuf_puts(o, "| ");
        rk_strbuf_puts(o, sign);
        rk_strbuf_puts(o, "( ");
        rk_strbuf_puts(o, tmp.s);
        rk_strbuf_puts(o, ") ");
        (*count)++;
    }
    if (tmp.oom) o->oom = 1;
    free(tmp.s);
}

/* A bound keyword of s: 1 and its value when present (a number). */
static int bound(sgen *G, const json_t *s, const char *key, double *out) {
    const json_t *v = json_object_get(s, key);
    if (!v) return 0;
    if (!json_is_number(v)) {
        sg_fail_at(G, key, RK_ERR_INVALID, "must be a number");
        return -1;
    }
    *out = json_number_value(v);
    return 1;
}

static void gen_numeric(sgen *G, const json_t *s, int integer, rk_strbuf *b) {
    double mn = 0, mx = 0, xmn = 0, xmx = 0;
    int has_mn = bound(G, s, "minimum", &mn), has_mx = bound(G, s, "maximum", &mx);
    int has_xmn = bound(G, s, "exclusiveMinimum", &xmn),
        has_xmx = bound(G, s, "exclusiveMaximum", &xmx);
    if (has_mn < 0 || has_mx < 0 || has_xmn < 0 || has_xmx < 0) return;
    if (!has_mn && !has_mx && !has_xmn && !has_xmx) {
        rk_strbuf_puts(b, integer ? "_int" : "_num");
        return;
    }
    double lo = -INFINITY, hi = INFINITY;
    if (integer) {
        if (has_mn) lo = ceil(mn);
        if (has_xmn && floor(xmn) + 1 > lo) lo = floor(xmn) + 1;
        if (has_mx) hi = floor(mx);
        if (has_xmx && ceil(xmx) - 1 < hi) hi = ceil(xmx) - 1;
    } else {
        const char *bad = has_xmn ? "exclusiveMinimum" : has_xmx ? "exclusiveMaximum" : NULL;
        if (!bad && has_mn && mn != floor(mn)) bad = "minimum";
        if (!bad && has_mx && mx != floor(mx)) bad = "maximum";
        if (bad) {
            sg_fail_at(G, bad, RK_ERR_UNSUPPORTED,
                       "bounds on a number are enforced only as inclusive integers (minimum, "
                       "maximum); use type integer or whole-number bounds");
            return;
        }
        if (has_mn) lo = mn;
        if (has_mx) hi = mx;
    }
    if (lo > hi) {
        sg_fail(G, RK_ERR_INVALID, "no value lies within the bounds [%g, %g]", lo, hi);
        return;
    }
    int lo_inf = lo <= -RK_INT_MAX, hi_inf = hi >= RK_INT_MAX;
    int count = 0;
    rk_strbuf_puts(b, "( ");
    if (integer) {
        if (hi_inf || hi >= 0) uint_range(b, lo_inf ? 0 : lo, hi_inf ? RK_INT_MAX : hi, "", &count);
        if (lo_inf || lo < 0) {
            rk_strbuf tmp = {0};
            int c = 0;
            uint_range(&tmp, hi_inf || hi >= 0 ? 1 : -hi, lo_inf ? RK_INT_MAX : -lo, "", &c);
            if (c) {
                rk_strbuf_puts(b, count ? "| \"-\" ( " : "\"-\" ( ");
                rk_strbuf_puts(b, tmp.s);
                rk_strbuf_puts(b, ") ");
                count++;
            }
            free(tmp.s);
        }
    } else {
        if (hi_inf || hi >= 0) mag_range(b, "", lo_inf || lo < 0 ? 0 : lo, hi, hi_inf, &count);
        if (lo_inf || lo < 0)
            mag_range(b, "\"-\" ", hi_inf || hi >= 0 ? 0 : -hi, -lo, lo_inf, &count);
    }
    rk_strbuf_puts(b, ")");
    if (!count) sg_fail(G, RK_ERR_INVALID, "no value lies within the bounds");
}

/* A string matching pattern, as a grammar expression appended to b (see
 * rk_gram_pattern in grammar_regex.c). */
static void gen_pattern(sgen *G, const char *pat, rk_strbuf *b) {
    char err[200];
    rk_strbuf e = {0};
    rk_strbuf_puts(&e, k_json_prelude);
    rk_strbuf_puts(&e, "root ::= ");
    size_t at = e.len;
    rk_status st = rk_gram_pattern(pat, &e, err, sizeof err);
    if (st == RK_OK && e.oom) st = RK_ERR_NOMEM;
    if (st == RK_ERR_NOMEM) {
        sg_fail(G, RK_ERR_NOMEM, "out of memory");
    } else if (st != RK_OK) {
        sg_fail_at(G, "pattern", st, "%s", err);
    } else {
        /* A pattern no output string matches (an empty class, U+0000) would
         * leave the schema unsatisfiable or this property never written:
         * refused, with the pattern named. */
        rk_grammar *g = NULL;
        rk_status pst = rk_grammar_parse(e.s, &g);
        rk_grammar_free(g);
        if (pst == RK_ERR_NOMEM)
            sg_fail(G, RK_ERR_NOMEM, "out of memory");
        else if (pst != RK_OK && strstr(rk_error_message(), "root rule matches nothing"))
            sg_fail_at(G, "pattern", RK_ERR_INVALID,
                       "no string that JSON output can carry matches it (an empty class, or a "
                       "U+0000 that the output never holds)");
        else if (pst != RK_OK)
            sg_fail_at(G, "pattern", pst, "%s", rk_error_message());
        else
            rk_strbuf_putn(b, e.s + at, e.len - at);
    }
    free(e.s);
}

static int get_count(sgen *G, const json_t *s, const char *key, long *out) {
    const json_t *v = json_object_get(s, key);
    if (!v) return 0;
    if (!json_is_integer(v) || json_integer_value(v) < 0 ||
        json_integer_value(v) > RK_GRAMMAR_MAX_REPEAT) {
        sg_fail_at(G, key,
                   json_is_integer(v) && json_integer_value(v) > 0 ? RK_ERR_UNSUPPORTED
                                                                   : RK_ERR_INVALID,
                   "must be an integer from 0 to %d", RK_GRAMMAR_MAX_REPEAT);
        return -1;
    }
    *out = (long)json_integer_value(v);
    return 1;
}

static void gen_string(sgen *G, const json_t *s, rk_strbuf *b) {
    const json_t *pat = json_object_get(s, "pattern");
    long mn = 0, mx = -1;
    int has_mn = get_count(G, s, "minLength", &mn), has_mx = get_count(G, s, "maxLength", &mx);
    if (has_mn < 0 || has_mx < 0) return;
    if (pat) {
        if (!json_is_string(pat)) {
            sg_fail_at(G, "pattern", RK_ERR_INVALID, "must be a string");
            return;
        }
        if (has_mn || has_mx) {
            sg_fail_at(G, has_mn ? "minLength" : "maxLength", RK_ERR_UNSUPPORTED,
                       "lengths cannot be combined with a pattern");
            return;
        }
        gen_pattern(G, json_string_value(pat), b);
        return;
    }
    if (has_mx && mx < mn) {
        sg_fail(G, RK_ERR_INVALID, "maxLength is below minLength");
        return;
    }
    if (!has_mn && !has_mx)
        rk_strbuf_puts(b, "_str");
    else if (mx < 0)
        rk_strbuf_printf(b, "\"\\\"\" _chr{%ld,} \"\\\"\"", mn);
    else
        rk_strbuf_printf(b, "\"\\\"\" _chr{%ld,%ld} \"\\\"\"", mn, mx);
}

static void gen_array(sgen *G, const json_t *s, int rdepth, rk_strbuf *b) {
    long mn = 0, mx = -1;
    int has_mn = get_count(G, s, "minItems", &mn), has_mx = get_count(G, s, "maxItems", &mx);
    if (has_mn < 0 || has_mx < 0) return;
    if (has_mx && mx < mn) {
        sg_fail(G, RK_ERR_INVALID, "maxItems is below minItems");
        return;
    }
    const json_t *items = json_object_get(s, "items");
    int item;
    if (items) {
        size_t l = path_push(G, ".items");
        item = gen(G, items, rdepth);
        path_pop(G, l);
        if (item < 0) return;
    } else {
        item = -1;
    }
    char it[32];
    if (item >= 0)
        snprintf(it, sizeof it, "s%d", item);
    else
        snprintf(it, sizeof it, "_val");
    if (has_mx && mx == 0) {
        rk_strbuf_puts(b, "\"[]\"");
    } else if (mn == 0) {
        rk_strbuf_printf(b, "\"[\" ( %s ( \",\" _ws %s )", it, it);
        if (mx < 0)
            rk_strbuf_puts(b, "*");
        else
            rk_strbuf_printf(b, "{0,%ld}", mx - 1);
        rk_strbuf_puts(b, " )? \"]\"");
    } else {
        rk_strbuf_printf(b, "\"[\" %s ( \",\" _ws %s )", it, it);
        if (mx < 0)
            rk_strbuf_printf(b, "{%ld,}", mn - 1);
        else
            rk_strbuf_printf(b, "{%ld,%ld}", mn - 1, mx - 1);
        rk_strbuf_puts(b, " \"]\"");
    }
}

static void gen_object(sgen *G, const json_t *s, int rdepth, rk_strbuf *b) {
    const json_t *props = json_object_get(s, "properties");
    const json_t *req = json_object_get(s, "required");
    const json_t *addl = json_object_get(s, "additionalProperties");
    if (addl && !json_is_boolean(addl)) {
        sg_fail_at(G, "additionalProperties", RK_ERR_UNSUPPORTED,
                   "only true or false is supported");
        return;
    }
    if (props && !json_is_object(props)) {
        sg_fail_at(G, "properties", RK_ERR_INVALID, "must be an object");
        return;
    }
    if (req && !json_is_array(req)) {
        sg_fail_at(G, "required", RK_ERR_INVALID, "must be an array of property names");
        return;
    }
    size_t np = props ? json_object_size(props) : 0;
    for (size_t j = 0; req && j < json_array_size(req); j++) {
        const json_t *r = json_array_get(req, j);
        if (!json_is_string(r) || !props || !json_object_get(props, json_string_value(r))) {
            size_t l = path_push(G, ".required[%zu]", j);
            sg_fail(G, json_is_string(r) ? RK_ERR_UNSUPPORTED : RK_ERR_INVALID,
                    json_is_string(r) ? "'%s' is not one of the properties"
                                      : "must be a property name%s",
                    json_is_string(r) ? json_string_value(r) : "");
            path_pop(G, l);
            return;
        }
    }
    if (!np) {
        rk_strbuf_puts(b, addl && json_is_false(addl) ? "\"{}\"" : "_obj");
        return;
    }
    /* Properties in the order given. first_i: none written yet, choosing
     * from i on; after_i: some written, choosing from i on. */
    int *kv = malloc(np * sizeof *kv), *req_of = calloc(np, sizeof *req_of);
    if (!kv || !req_of) {
        free(kv);
        free(req_of);
        sg_fail(G, RK_ERR_NOMEM, "out of memory");
        return;
    }
    const char *key;
    const json_t *val;
    size_t i = 0;
    json_object_foreach((json_t *)props, key, val) {
        for (size_t j = 0; req && j < json_array_size(req); j++)
            if (!strcmp(json_string_value(json_array_get(req, j)), key)) req_of[i] = 1;
        size_t l = path_push(G, ".properties.%s", key);
        int v = gen(G, val, rdepth);
        path_pop(G, l);
        if (v < 0) break;
        rk_strbuf k = {0};
        json_t *ks = json_string(key);
        char *enc = ks ? json_dumps(ks, JSON_ENCODE_ANY) : NULL;
        json_decref(ks);
        if (!enc) {
            sg_fail(G, RK_ERR_NOMEM, "out of memory");
            break;
        }
        rk_grammar_literal(&k, enc, strlen(enc));
        free(enc);
        rk_strbuf_printf(&k, " \":\" _ws s%d", v);
        kv[i] = put_rule(G, G->n++, &k);
        i++;
    }
    if (G->st == RK_OK) {
        int after_next = -1, first_next = -1; /* rules for i + 1; -1: the empty rest */
        for (size_t r = np; r-- > 0;) {
            rk_strbuf a = {0}, f = {0};
            char an[32] = "", fn[32] = "";
            if (after_next >= 0) snprintf(an, sizeof an, " s%d", after_next);
            if (first_next >= 0) snprintf(fn, sizeof fn, "s%d", first_next);
            if (req_of[r]) {
                rk_strbuf_printf(&a, "\",\" _ws s%d%s", kv[r], an);
                rk_strbuf_printf(&f, "s%d%s", kv[r], an);
            } else {
                rk_strbuf_printf(&a, "( \",\" _ws s%d )?%s", kv[r], an);
                rk_strbuf_printf(&f, "s%d%s | %s", kv[r], an, fn);
            }
            after_next = put_rule(G, G->n++, &a);
            first_next = put_rule(G, G->n++, &f);
        }
        rk_strbuf_printf(b, "\"{\" s%d \"}\"", first_next);
    }
    free(kv);
    free(req_of);
}

static const char *const k_keywords[] = {"type",
                                         "properties",
                                         "required",
                                         "additionalProperties",
                                         "items",
                                         "minItems",
                                         "maxItems",
                                         "enum",
                                         "const",
                                         "pattern",
                                         "minLength",
                                         "maxLength",
                                         "minimum",
                                         "maximum",
                                         "exclusiveMinimum",
                                         "exclusiveMaximum",
                                         "anyOf",
                                         "$ref",
                                         "$defs",
                                         "definitions",
                                         "description",
                                         "title",
                                         "$schema",
                                         "$id",
                                         "$comment",
                                         "default",
                                         "examples",
                                         NULL};

static int gen_typed(sgen *G, const json_t *s, const char *type, int rdepth, rk_strbuf *b) {
    if (!strcmp(type, "string"))
        gen_string(G, s, b);
    else if (!strcmp(type, "integer"))
        gen_numeric(G, s, 1, b);
    else if (!strcmp(type, "number"))
        gen_numeric(G, s, 0, b);
    else if (!strcmp(type, "boolean"))
        rk_strbuf_puts(b, "( \"true\" | \"false\" )");
    else if (!strcmp(type, "null"))
        rk_strbuf_puts(b, "\"null\"");
    else if (!strcmp(type, "object"))
        gen_object(G, s, rdepth, b);
    else if (!strcmp(type, "array"))
        gen_array(G, s, rdepth, b);
    else {
        sg_fail_at(G, "type", RK_ERR_INVALID, "unknown type '%s'", type);
    }
    return G->st == RK_OK ? 0 : -1;
}

/* Resolve a local reference ("#", "#/$defs/x", "#/definitions/x") into the
 * rule made for it at this depth. */
static int gen_ref(sgen *G, const json_t *ref, int rdepth) {
    size_t l = path_push(G, ".$ref");
    const char *r = json_is_string(ref) ? json_string_value(ref) : NULL;
    const json_t *target = NULL;
    char tpath[300] = "$";
    if (r && !strcmp(r, "#")) {
        target = G->root;
    } else if (r && (!strncmp(r, "#/$defs/", 8) || !strncmp(r, "#/definitions/", 14))) {
        const char *sec = r[2] == '$' ? "$defs" : "definitions";
        const char *name = r + (r[2] == '$' ? 8 : 14);
        target = json_object_get(json_object_get(G->root, sec), name);
        snprintf(tpath, sizeof tpath, "$.%s.%s", sec, name);
    }
    if (!target) {
        sg_fail(G, r ? RK_ERR_UNSUPPORTED : RK_ERR_INVALID,
                "only local references to \"#\", \"#/$defs/<name>\" or \"#/definitions/<name>\" "
                "that exist are supported");
        path_pop(G, l);
        return -1;
    }
    path_pop(G, l);
    for (int i = 0; i < G->n_memo; i++)
        if (G->memo[i].target == target && G->memo[i].depth == rdepth) return G->memo[i].rule;
    int rule;
    if (rdepth >= RK_SCHEMA_REF_DEPTH) {
        rk_strbuf b = {0};
        rk_strbuf_puts(&b, "_never");
        rule = put_rule(G, G->n++, &b);
    } else {
        char saved[sizeof G->path];
        memcpy(saved, G->path, sizeof saved);
        snprintf(G->path, sizeof G->path, "%s", tpath);
        rule = gen(G, target, rdepth + 1);
        memcpy(G->path, saved, sizeof saved);
        if (rule < 0) return -1;
    }
    if (rk_gram_grow((void **)&G->memo, &G->cap_memo, G->n_memo + 1, sizeof *G->memo) < 0)
        return sg_fail(G, RK_ERR_NOMEM, "out of memory");
    G->memo[G->n_memo++] = (memo_entry){target, rdepth, rule};
    return rule;
}

/* The rule for schema s; -1 with G's error set. */
static int gen(sgen *G, const json_t *s, int rdepth) {
    if (json_is_true(s)) {
        rk_strbuf b = {0};
        rk_strbuf_puts(&b, "_val");
        return put_rule(G, G->n++, &b);
    }
    if (!json_is_object(s)) return sg_fail(G, RK_ERR_INVALID, "a schema must be an object");
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)s, key, val) {
        int known = 0;
        for (int i = 0; k_keywords[i] && !known; i++) known = !strcmp(k_keywords[i], key);
        if (!known) {
            sg_fail_at(G, key, RK_ERR_UNSUPPORTED, "keyword '%s' is not supported", key);
            return -1;
        }
    }
    const json_t *ref = json_object_get(s, "$ref");
    if (ref) return gen_ref(G, ref, rdepth);
    rk_strbuf b = {0};
    const json_t *en = json_object_get(s, "enum"), *cn = json_object_get(s, "const");
    const json_t *any = json_object_get(s, "anyOf"), *type = json_object_get(s, "type");
    if (en || cn) {
        if (en && (!json_is_array(en) || !json_array_size(en))) {
            sg_fail_at(G, "enum", RK_ERR_INVALID, "must be a non-empty array");
            free(b.s);
            return -1;
        }
        size_t n = en ? json_array_size(en) : 1;
        rk_strbuf_puts(&b, "( ");
        for (size_t i = 0; i < n; i++) {
            char *enc = json_dumps(en ? json_array_get(en, i) : cn, JSON_ENCODE_ANY | JSON_COMPACT);
            if (!enc) {
                free(b.s);
                return sg_fail(G, RK_ERR_NOMEM, "out of memory");
            }
            if (i) rk_strbuf_puts(&b, "| ");
            rk_grammar_literal(&b, enc, strlen(enc));
            rk_strbuf_puts(&b, " ");
            free(enc);
        }
        rk_strbuf_puts(&b, ")");
    } else if (any) {
        if (!json_is_array(any) || !json_array_size(any)) {
            sg_fail_at(G, "anyOf", RK_ERR_INVALID, "must be a non-empty array of schemas");
            free(b.s);
            return -1;
        }
        rk_strbuf_puts(&b, "( ");
        for (size_t i = 0; i < json_array_size(any); i++) {
            size_t l = path_push(G, ".anyOf[%zu]", i);
            int r = gen(G, json_array_get(any, i), rdepth);
            path_pop(G, l);
            if (r < 0) {
                free(b.s);
                return -1;
            }
            rk_strbuf_printf(&b, "%ss%d ", i ? "| " : "", r);
        }
        rk_strbuf_puts(&b, ")");
    } else if (json_is_string(type)) {
        gen_typed(G, s, json_string_value(type), rdepth, &b);
    } else if (json_is_array(type) && json_array_size(type)) {
        rk_strbuf_puts(&b, "( ");
        for (size_t i = 0; i < json_array_size(type) && G->st == RK_OK; i++) {
            const json_t *t = json_array_get(type, i);
            if (!json_is_string(t)) {
                size_t l = path_push(G, ".type[%zu]", i);
                sg_fail(G, RK_ERR_INVALID, "must be a type name");
                path_pop(G, l);
                break;
            }
            if (i) rk_strbuf_puts(&b, "| ");
            rk_strbuf_puts(&b, "( ");
            gen_typed(G, s, json_string_value(t), rdepth, &b);
            rk_strbuf_puts(&b, ") ");
        }
        rk_strbuf_puts(&b, ")");
    } else if (type) {
        sg_fail_at(G, "type", RK_ERR_INVALID, "must be a type name or an array of them");
    } else if (json_object_get(s, "properties")) {
        gen_object(G, s, rdepth, &b);
    } else if (json_object_get(s, "items")) {
        gen_array(G, s, rdepth, &b);
    } else {
        rk_strbuf_puts(&b, "_val");
    }
    if (G->st != RK_OK) {
        free(b.s);
        return -1;
    }
    return put_rule(G, G->n++, &b);
}

static char *schema_text(const json_t *schema, rk_status *st) {
    sgen G = {0};
    G.root = schema;
    snprintf(G.path, sizeof G.path, "$");
    rk_strbuf_puts(&G.out, k_json_prelude);
    int r = gen(&G, schema, 0);
    free(G.memo);
    if (r >= 0 && !G.out.oom) rk_strbuf_printf(&G.out, "root ::= s%d\n", r);
    if (r < 0 || G.out.oom) {
        if (G.st == RK_OK)
            *st = rk_errorf(RK_ERR_NOMEM, "grammar: out of memory");
        else
            *st = rk_errorf(G.st, "%s", G.err);
        free(G.out.s);
        return NULL;
    }
    *st = RK_OK;
    return G.out.s;
}

char *rk_grammar_schema_text(const json_t *schema) {
    rk_status st;
    return schema_text(schema, &st);
}

rk_status rk_grammar_from_schema(const json_t *schema, rk_grammar **out) {
    *out = NULL;
    if (!schema) return rk_errorf(RK_ERR_INVALID, "$: the schema is missing");
    rk_status st;
    char *text = schema_text(schema, &st);
    if (!text) return st;
    st = rk_grammar_parse(text, out);
    free(text);
    if (st != RK_OK) {
        char msg[300];
        snprintf(msg, sizeof msg, "%s", rk_error_message());
        if (strstr(msg, "root rule matches nothing"))
            return rk_errorf(RK_ERR_UNSUPPORTED,
                             "$: no value satisfies the schema within %d levels of $ref",
                             RK_SCHEMA_REF_DEPTH);
        if (st == RK_ERR_LIMIT) return rk_errorf(st, "$: the schema is over a bound: %s", msg);
        return rk_errorf(st, "$: the schema compiled to an invalid grammar: %s", msg);
    }
    return RK_OK;
}

rk_status rk_grammar_from_calls(const rk_grammar_call *calls, int n, const char *sep,
                                rk_grammar **out) {
    *out = NULL;
    if (n < 1) return rk_errorf(RK_ERR_INVALID, "grammar: no call to allow");
    sgen G = {0};
    rk_strbuf_puts(&G.out, k_json_prelude);
    rk_strbuf alts = {0};
    for (int i = 0; i < n && G.st == RK_OK; i++) {
        G.root = calls[i].schema;
        G.n_memo = 0;
        snprintf(G.path, sizeof G.path, "%s", calls[i].path ? calls[i].path : "$");
        int r = calls[i].schema ? gen(&G, calls[i].schema, 0) : -1;
        if (calls[i].schema && r < 0) break;
        rk_strbuf c = {0};
        rk_grammar_literal(&c, calls[i].open, strlen(calls[i].open));
        if (r >= 0)
            rk_strbuf_printf(&c, " s%d ", r);
        else
            rk_strbuf_puts(&c, " _obj ");
        rk_grammar_literal(&c, calls[i].close, strlen(calls[i].close));
        int cr = put_rule(&G, G.n++, &c);
        rk_strbuf_printf(&alts, "%ss%d", i ? " | " : "", cr);
    }
    free(G.memo);
    if (G.st != RK_OK) {
        free(alts.s);
        free(G.out.s);
        return rk_errorf(G.st, "%s", G.err);
    }
    rk_strbuf_puts(&G.out, "_call ::= ");
    rk_strbuf_puts(&G.out, alts.s ? alts.s : "");
    rk_strbuf_puts(&G.out, "\nroot ::= _call");
    if (sep) {
        rk_strbuf_puts(&G.out, " ( ");
        rk_grammar_literal(&G.out, sep, strlen(sep));
        rk_strbuf_puts(&G.out, " _call )*");
    }
    rk_strbuf_puts(&G.out, "\n");
    free(alts.s);
    if (G.out.oom || alts.oom) {
        free(G.out.s);
        return rk_errorf(RK_ERR_NOMEM, "grammar: out of memory");
    }
    rk_status st = rk_grammar_parse(G.out.s, out);
    free(G.out.s);
    return st;
}

rk_status rk_grammar_json_object(rk_grammar **out) {
    rk_strbuf b = {0};
    rk_strbuf_puts(&b, k_json_prelude);
    rk_strbuf_puts(&b, "root ::= _obj\n");
    if (b.oom) {
        free(b.s);
        return rk_errorf(RK_ERR_NOMEM, "grammar: out of memory");
    }
    rk_status st = rk_grammar_parse(b.s, out);
    free(b.s);
    return st;
}
