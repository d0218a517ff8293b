/* engine/grammar_regex.c — a JSON Schema's regular expressions (pattern)
 * translated into grammar text that matches the JSON-escaped form of the
 * strings they match (see rk_gram_pattern in engine/grammar_internal.h).
 *
 * The subset: literals, escapes, ASCII classes (\d \w \s and their
 * negations, [...] and [^...]), '.', groups (and non-capturing groups),
 * alternation, the quantifiers * + ? {m,n} (lazy forms match the same
 * strings), and anchors at the start and the end only.
 *
 * The grammar may allow fewer strings than the pattern (never more): a class
 * holds its ASCII members exactly and the non-ASCII characters as three
 * parts (line separators, other Unicode white space, the rest), so that
 * negation is exact, and allows of them only the rest (_unws) unless it
 * holds all three; control characters but tab, newline and carriage return,
 * and U+0000 (which JSON output never carries), are never allowed. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/grammar_internal.h"

typedef struct rx {
    const char *p;
    const char *start;
    rk_strbuf *o;
    char err[200];
    int top_alts;
} rx;

static void rx_fail(rx *r, const char *msg) {
    if (!r->err[0]) snprintf(r->err, sizeof r->err, "%s at offset %d", msg, (int)(r->p - r->start));
}

#define RX_FAIL(...)                                                                               \
    do {                                                                                           \
        rx_fail(__VA_ARGS__);                                                                      \
        return;                                                                                    \
    } while (0)

/* The grammar literal of one character as it is written inside a JSON string. */
static void json_char_lit(rk_strbuf *o, uint32_t cp, const char *utf8, int len) {
    char tmp[8];
    switch (cp) {
    case '"': rk_grammar_literal(o, "\\\"", 2); return;
    case '\\': rk_grammar_literal(o, "\\\\", 2); return;
    case '\n': rk_grammar_literal(o, "\\n", 2); return;
    case '\t': rk_grammar_literal(o, "\\t", 2); return;
    case '\r': rk_grammar_literal(o, "\\r", 2); return;
    case '\b': rk_grammar_literal(o, "\\b", 2); return;
    case '\f': rk_grammar_literal(o, "\\f", 2); return;
    default: break;
    }
    if (cp == 0) { /* never in the output: this character matches nothing */
        rk_strbuf_puts(o, "[]");
        return;
    }
    if (cp < 0x20) {
        snprintf(tmp, sizeof tmp, "\\u%04X", (unsigned)cp);
        rk_grammar_literal(o, tmp, 6);
        return;
    }
    rk_grammar_literal(o, utf8, (size_t)len);
}

/* The non-ASCII parts of a class: U+2028 and U+2029 (which '.' leaves out),
 * the other characters that are white space to ECMA-262 or to Unicode
 * (U+0085 U+00A0 U+1680 U+2000-U+200A U+202F U+205F U+3000 U+FEFF), and
 * every other non-ASCII character. */
enum { NA_LS = 1, NA_WS = 2, NA_OTHER = 4, NA_ALL = 7 };

/* A class: its ASCII members and its non-ASCII parts. */
typedef struct rx_set {
    uint64_t ascii[2];
    int na;
} rx_set;

static void set_not(rx_set *c) {
    c->ascii[0] = ~c->ascii[0], c->ascii[1] = ~c->ascii[1];
    c->na ^= NA_ALL;
}

/* A class as the JSON-escaped alternatives it allows; "[]" (nothing) when
 * it allows nothing. Controls other than \t \n \r are left out, and so is
 * non-ASCII white space unless every non-ASCII character is in (strings
 * made are a subset, still matching). */
static void rx_emit_class(rk_strbuf *o, const rx_set *cls_set) {
    const uint64_t *s = cls_set->ascii;
    int has = 0;
    rk_strbuf_puts(o, "( ");
    rk_strbuf cls = {0};
    for (int c = 0x20; c < 0x80; c++)
        if ((s[c >> 6] >> (c & 63) & 1) && c != '"' && c != '\\')
            rk_strbuf_printf(&cls, "\\x%02X", c);
    if (cls.len) {
        rk_strbuf_puts(o, "[");
        rk_strbuf_puts(o, cls.s);
        rk_strbuf_puts(o, "] ");
        has = 1;
    }
    free(cls.s);
    static const int specials[] = {'"', '\\', '\n', '\t', '\r'};
    for (size_t i = 0; i < sizeof specials / sizeof *specials; i++) {
        int c = specials[i];
        if (!(s[c >> 6] >> (c & 63) & 1)) continue;
        if (has) rk_strbuf_puts(o, "| ");
        json_char_lit(o, (uint32_t)c, NULL, 0);
        rk_strbuf_puts(o, " ");
        has = 1;
    }
    if (cls_set->na == NA_ALL)
        rk_strbuf_printf(o, "%s_utf8mb ", has ? "| " : ""), has = 1;
    else if (cls_set->na & NA_OTHER)
        rk_strbuf_printf(o, "%s_unws ", has ? "| " : ""), has = 1;
    if (!has) rk_strbuf_puts(o, "[] ");
    rk_strbuf_puts(o, ") ");
}

static void set_add(uint64_t set[2], int lo, int hi) {
    for (int c = lo; c <= hi; c++) set[c >> 6] |= 1ull << (c & 63);
}

/* A class escape (\d \w \s, upper case negated) into *out; 1 when it was
 * one. \d and \w are ASCII only; \s is ASCII and Unicode white space. */
static int class_escape(char e, rx_set *out) {
    rx_set t = {{0, 0}, 0};
    switch (e | 0x20) {
    case 'd': set_add(t.ascii, '0', '9'); break;
    case 'w':
        set_add(t.ascii, '0', '9'), set_add(t.ascii, 'a', 'z'), set_add(t.ascii, 'A', 'Z'),
            set_add(t.ascii, '_', '_');
        break;
    case 's': set_add(t.ascii, ' ', ' '), set_add(t.ascii, '\t', '\r'), t.na = NA_LS | NA_WS; break;
    default: return 0;
    }
    if (e >= 'A' && e <= 'Z') set_not(&t);
    *out = t;
    return 1;
}

/* A single-character escape: its code, or -1. */
static int char_escape(char e) {
    switch (e) {
    case 'n': return '\n';
    case 't': return '\t';
    case 'r': return '\r';
    case 'f': return '\f';
    case 'v': return '\v';
    case '0': return 0;
    default: return ispunct((unsigned char)e) ? e : -1;
    }
}

static void rx_alt(rx *r, int depth);

static void rx_class(rx *r) {
    rx_set set = {{0, 0}, 0};
    int neg = 0;
    r->p++;
    if (*r->p == '^') neg = 1, r->p++;
    int first = 1;
    while (*r->p && (*r->p != ']' || first)) {
        first = 0;
        int lo;
        if (*r->p == '\\') {
            rx_set t;
            if (class_escape(r->p[1], &t)) {
                set.ascii[0] |= t.ascii[0], set.ascii[1] |= t.ascii[1];
                set.na |= t.na;
                r->p += 2;
                continue;
            }
            lo = char_escape(r->p[1]);
            if (lo < 0) RX_FAIL(r, "unsupported escape in a class");
            r->p += 2;
        } else {
            lo = (unsigned char)*r->p++;
        }
        int hi = lo;
        if (*r->p == '-' && r->p[1] && r->p[1] != ']') {
            r->p++;
            if (*r->p == '\\') {
                hi = char_escape(r->p[1]);
                if (hi < 0) RX_FAIL(r, "unsupported escape in a class range");
                r->p += 2;
            } else {
                hi = (unsigned char)*r->p++;
            }
        }
        if (lo > 0x7F || hi > 0x7F) RX_FAIL(r, "only ASCII characters are supported in a class");
        if (hi < lo) RX_FAIL(r, "reversed class range");
        set_add(set.ascii, lo, hi);
    }
    if (*r->p != ']') RX_FAIL(r, "unterminated class");
    r->p++;
    if (neg) set_not(&set);
    rx_emit_class(r->o, &set);
}

static void rx_atom(rx *r) {
    char c = *r->p;
    if (c == '(') {
        r->p++;
        if (r->p[0] == '?') {
            if (r->p[1] != ':') RX_FAIL(r, "lookaround and named groups are not supported");
            r->p += 2;
        }
        rx_alt(r, 1);
        if (*r->p != ')') RX_FAIL(r, "missing ')'");
        r->p++;
    } else if (c == '[') {
        rx_class(r);
    } else if (c == '.') {
        /* Anything but the line terminators \n \r U+2028 U+2029. */
        rx_set set = {{0, 0}, NA_LS};
        set_add(set.ascii, '\n', '\n'), set_add(set.ascii, '\r', '\r');
        set_not(&set);
        r->p++;
        rx_emit_class(r->o, &set);
    } else if (c == '\\') {
        rx_set set;
        char e = r->p[1];
        if (class_escape(e, &set)) {
            r->p += 2;
            rx_emit_class(r->o, &set);
            return;
        }
        if (e == 'u' && rk_gram_hexval(r->p[2]) >= 0 && rk_gram_hexval(r->p[3]) >= 0 &&
            rk_gram_hexval(r->p[4]) >= 0 && rk_gram_hexval(r->p[5]) >= 0) {
            uint32_t cp = (uint32_t)(rk_gram_hexval(r->p[2]) << 12 | rk_gram_hexval(r->p[3]) << 8 |
                                     rk_gram_hexval(r->p[4]) << 4 | rk_gram_hexval(r->p[5]));
            char u[4];
            int n = 0;
            if (cp >= 0xD800 && cp <= 0xDFFF) RX_FAIL(r, "surrogate escapes are not supported");
            if (cp < 0x80)
                u[n++] = (char)cp;
            else if (cp < 0x800)
                u[n++] = (char)(0xC0 | cp >> 6), u[n++] = (char)(0x80 | (cp & 0x3F));
            else
                u[n++] = (char)(0xE0 | cp >> 12), u[n++] = (char)(0x80 | (cp >> 6 & 0x3F)),
                u[n++] = (char)(0x80 | (cp & 0x3F));
            r->p += 6;
            rk_strbuf_puts(r->o, "( ");
            json_char_lit(r->o, cp, u, n);
            rk_strbuf_puts(r->o, " ) ");
            return;
        }
        int ch = e ? char_escape(e) : -1;
        if (ch < 0 || (e >= '1' && e <= '9'))
            RX_FAIL(r, "unsupported escape (backreferences, \\b, \\p are not supported)");
        r->p += 2;
        char u = (char)ch;
        rk_strbuf_puts(r->o, "( ");
        json_char_lit(r->o, (uint32_t)ch, &u, 1);
        rk_strbuf_puts(r->o, " ) ");
    } else if (c == '*' || c == '+' || c == '?' || c == '{') {
        rx_fail(r, "nothing to repeat");
    } else if (c == '^' || c == '$') {
        rx_fail(r, "anchors are supported only at the start and the end of the pattern");
    } else {
        uint32_t cp;
        int n = rk_utf8_decode((const unsigned char *)r->p, strlen(r->p), &cp);
        if (n <= 0) RX_FAIL(r, "invalid UTF-8");
        rk_strbuf_puts(r->o, "( ");
        json_char_lit(r->o, cp, r->p, n);
        rk_strbuf_puts(r->o, " ) ");
        r->p += n;
    }
}

static void rx_seq(rx *r) {
    while (*r->p && *r->p != '|' && *r->p != ')' && !r->err[0]) {
        rk_strbuf_puts(r->o, "( ");
        rx_atom(r);
        rk_strbuf_puts(r->o, ") ");
        char q = *r->p;
        if (q == '*' || q == '+' || q == '?') {
            rk_strbuf_putn(r->o, &q, 1);
            rk_strbuf_puts(r->o, " ");
            r->p++;
        } else if (q == '{') {
            const char *e;
            long lo, hi;
            int rc = rk_gram_repeat(r->p, &lo, &hi, &e);
            if (rc == -1) RX_FAIL(r, "'{' needs a count");
            if (rc < 0) RX_FAIL(r, "bad repetition {m,n}");
            if (hi < 0)
                rk_strbuf_printf(r->o, "{%ld,} ", lo);
            else
                rk_strbuf_printf(r->o, "{%ld,%ld} ", lo, hi);
            r->p = e;
        } else {
            continue;
        }
        if (*r->p == '?')
            r->p++; /* lazy: the same strings match */
        else if (*r->p == '+')
            RX_FAIL(r, "possessive quantifiers are not supported");
        if (*r->p == '*' || *r->p == '+' || *r->p == '?' || *r->p == '{')
            RX_FAIL(r, "nested quantifier");
    }
}

static void rx_alt(rx *r, int depth) {
    rk_strbuf_puts(r->o, "( ");
    for (;;) {
        rx_seq(r);
        if (*r->p != '|' || r->err[0]) break;
        if (!depth) r->top_alts++;
        rk_strbuf_puts(r->o, "| ");
        r->p++;
    }
    rk_strbuf_puts(r->o, ") ");
}

/* A string matching pattern (ECMA-262 search semantics: unanchored unless
 * ^ and $ say so), as a grammar expression appended to b. */
rk_status rk_gram_pattern(const char *pat, rk_strbuf *b, char *err, size_t err_size) {
    size_t len = strlen(pat);
    int a0 = len && pat[0] == '^';
    int a1 = 0;
    if (len > (size_t)a0 && pat[len - 1] == '$') {
        size_t k = 0; /* backslashes before the $ */
        while (k + 1 < len && pat[len - 2 - k] == '\\') k++;
        a1 = k % 2 == 0;
    }
    char *body = malloc(len + 1);
    if (!body) return RK_ERR_NOMEM;
    memcpy(body, pat + a0, len - (size_t)a0 - (size_t)a1);
    body[len - (size_t)a0 - (size_t)a1] = 0;
    rx r = {.p = body, .start = body, .o = b};
    rk_strbuf_puts(b, "\"\\\"\" ");
    if (!a0) rk_strbuf_puts(b, "_chr* ");
    rx_alt(&r, 0);
    if (!r.err[0] && *r.p) rx_fail(&r, "unbalanced ')'");
    if (!r.err[0] && r.top_alts && (a0 || a1))
        rx_fail(&r, "anchors around a top-level '|' are ambiguous: write ^(a|b)$");
    if (!a1) rk_strbuf_puts(b, "_chr* ");
    rk_strbuf_puts(b, "\"\\\"\"");
    free(body);
    if (r.err[0]) {
        snprintf(err, err_size, "%s", r.err);
        return RK_ERR_UNSUPPORTED;
    }
    return RK_OK;
}
