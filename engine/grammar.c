/* engine/grammar.c — grammars compiled to byte-level rules, their pushdown
 * states interned into a lazily built automaton, and token masks found by
 * walking the vocabulary's byte trie (see engine/grammar.h).
 *
 * Layout of this file: a growable text buffer; the grammar text parser and
 * the checks run after it (undefined rules, left recursion, rules that match
 * nothing); the vocabulary trie; the state (frames, interned states,
 * transitions, masks); JSON Schema and its regular expressions, both
 * translated into grammar text. */
#include "engine/grammar.h"

#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ text buffer */

typedef struct sbuf {
    char *p;
    size_t n, cap;
    int oom;
} sbuf;

static void sb_putn(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void sb_puts(sbuf *b, const char *s) { sb_putn(b, s, strlen(s)); }

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    sb_putn(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

/* ------------------------------------------------------------ the rules */

enum { E_END = 0, E_SET = 1, E_REF = 2 };

typedef struct elem {
    int32_t type, v; /* E_SET: index of the byte class; E_REF: rule id */
} elem;

struct rk_grammar {
    int n_rules;
    char **names;       /* (n_rules) */
    int32_t *alt_off;   /* (n_rules + 1) into alt_start */
    int32_t *alt_start; /* (n_alts) first element of each alternative */
    uint8_t *alt_dead;  /* (n_alts) the alternative matches nothing */
    elem *elems;        /* alternatives, each ended by E_END */
    uint64_t (*sets)[4];
    int32_t *minlen; /* (n_elems) fewest bytes that finish the sequence from each element */
    int n_alts, n_elems, n_sets;
    int root;
};

/* The parser's growing grammar. Alternatives are appended whole (their
 * elements contiguous, then E_END) and grouped by rule when it finishes. */
typedef struct builder {
    char **names;
    uint8_t *defined;
    int n_rules, cap_rules;
    int32_t *alt_rule, *alt_start;
    int n_alts, cap_alts;
    elem *elems;
    int n_elems, cap_elems;
    uint64_t (*sets)[4];
    int n_sets, cap_sets;
    int oom;
    const char *p; /* parse position */
    int line;
    char err[256];
} builder;

typedef struct evec {
    elem *p;
    int n, cap;
} evec;

static int grow(void **p, int *cap, int need, size_t size) {
    if (need <= *cap) return 0;
    int c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    void *q = realloc(*p, (size_t)c * size);
    if (!q) return -1;
    *p = q;
    *cap = c;
    return 0;
}

static void ev_push(builder *b, evec *v, int32_t type, int32_t val) {
    if (grow((void **)&v->p, &v->cap, v->n + 1, sizeof *v->p) < 0) {
        b->oom = 1;
        return;
    }
    v->p[v->n++] = (elem){type, val};
}

static void b_fail(builder *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void b_fail(builder *b, const char *fmt, ...) {
    if (b->err[0]) return;
    char tmp[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    snprintf(b->err, sizeof b->err, "grammar line %d: %s", b->line, tmp);
}

/* Fail and leave the (void) parsing function. */
#define B_FAIL(...)                                                                                \
    do {                                                                                           \
        b_fail(__VA_ARGS__);                                                                       \
        return;                                                                                    \
    } while (0)

static int b_failed(const builder *b) { return b->oom || b->err[0]; }

static int new_rule(builder *b, const char *name, size_t len) {
    if (grow((void **)&b->names, &b->cap_rules, b->n_rules + 1, sizeof *b->names) < 0) {
        b->oom = 1;
        return -1;
    }
    uint8_t *d = realloc(b->defined, (size_t)b->cap_rules);
    char *s = malloc(len + 1);
    if (!d || !s) {
        if (d) b->defined = d;
        free(s);
        b->oom = 1;
        return -1;
    }
    b->defined = d;
    memcpy(s, name, len);
    s[len] = 0;
    b->names[b->n_rules] = s;
    b->defined[b->n_rules] = 0;
    return b->n_rules++;
}

static int anon_rule(builder *b) {
    char tmp[24];
    snprintf(tmp, sizeof tmp, "#%d", b->n_rules);
    int r = new_rule(b, tmp, strlen(tmp));
    if (r >= 0) b->defined[r] = 1;
    return r;
}

static int rule_id(builder *b, const char *name, size_t len) {
    for (int i = 0; i < b->n_rules; i++)
        if (strlen(b->names[i]) == len && !memcmp(b->names[i], name, len)) return i;
    return new_rule(b, name, len);
}

static void add_alt(builder *b, int rule, const evec *v) {
    if (b_failed(b)) return;
    if (grow((void **)&b->elems, &b->cap_elems, b->n_elems + v->n + 1, sizeof *b->elems) < 0 ||
        grow((void **)&b->alt_rule, &b->cap_alts, b->n_alts + 1, sizeof *b->alt_rule) < 0) {
        b->oom = 1;
        return;
    }
    /* alt_start shares cap_alts with alt_rule: grow it to the same size. */
    int32_t *s = realloc(b->alt_start, (size_t)b->cap_alts * sizeof *s);
    if (!s) {
        b->oom = 1;
        return;
    }
    b->alt_start = s;
    b->alt_rule[b->n_alts] = rule;
    b->alt_start[b->n_alts] = b->n_elems;
    b->n_alts++;
    if (v->n) memcpy(b->elems + b->n_elems, v->p, (size_t)v->n * sizeof *v->p);
    b->n_elems += v->n;
    b->elems[b->n_elems++] = (elem){E_END, 0};
}

static int new_set(builder *b, const uint64_t set[4]) {
    if (grow((void **)&b->sets, &b->cap_sets, b->n_sets + 1, sizeof *b->sets) < 0) {
        b->oom = 1;
        return 0;
    }
    memcpy(b->sets[b->n_sets], set, sizeof b->sets[0]);
    return b->n_sets++;
}

static int byte_set(builder *b, unsigned lo, unsigned hi) {
    uint64_t s[4] = {0};
    for (unsigned c = lo; c <= hi; c++) s[c >> 6] |= 1ull << (c & 63);
    return new_set(b, s);
}

/* A rule holding one alternative: the elements of v. */
static int wrap_rule(builder *b, const evec *v) {
    int r = anon_rule(b);
    if (r >= 0) add_alt(b, r, v);
    return r;
}

static void skip_space(builder *b) {
    for (;;) {
        char c = *b->p;
        if (c == '\n') b->line++;
        if (c == ' ' || c == '\t' || c == '\r' || c == '\n') {
            b->p++;
        } else if (c == '#') {
            while (*b->p && *b->p != '\n') b->p++;
        } else {
            return;
        }
    }
}

static int is_name_char(char c) { return isalnum((unsigned char)c) || c == '_' || c == '-'; }

/* Does a rule definition (name ::=) start at p? */
static int at_rule_start(const char *p) {
    if (!is_name_char(*p)) return 0;
    while (is_name_char(*p)) p++;
    while (*p == ' ' || *p == '\t') p++;
    return p[0] == ':' && p[1] == ':' && p[2] == '=';
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* One character of a literal or class: an escape or a byte. */
static int parse_char(builder *b) {
    unsigned char c = (unsigned char)*b->p;
    if (!c) {
        b_fail(b, "unexpected end inside a literal or class");
        return -1;
    }
    b->p++;
    if (c != '\\') return c;
    char e = *b->p++;
    switch (e) {
    case 'n': return '\n';
    case 't': return '\t';
    case 'r': return '\r';
    case '0': return 0;
    case '\\':
    case '"':
    case '\'':
    case ']':
    case '[':
    case '-':
    case '^':
    case '/': return (unsigned char)e;
    case 'x': {
        int h = hexval(b->p[0]), l = h >= 0 ? hexval(b->p[1]) : -1;
        if (l < 0) {
            b_fail(b, "\\x needs two hex digits");
            return -1;
        }
        b->p += 2;
        return h * 16 + l;
    }
    default: b_fail(b, "unknown escape \\%c", e ? e : '0'); return -1;
    }
}

static void parse_alternatives(builder *b, int rule);

/* The elements of one primary (a literal, class, group, rule name or '.'). */
static void parse_primary(builder *b, evec *out) {
    char c = *b->p;
    if (c == '"') {
        b->p++;
        while (*b->p && *b->p != '"' && !b_failed(b)) {
            int ch = parse_char(b);
            if (ch >= 0) ev_push(b, out, E_SET, byte_set(b, (unsigned)ch, (unsigned)ch));
        }
        if (*b->p != '"') B_FAIL(b, "unterminated string literal");
        b->p++;
    } else if (c == '[') {
        b->p++;
        int neg = *b->p == '^';
        if (neg) b->p++;
        uint64_t set[4] = {0};
        while (*b->p && *b->p != ']' && !b_failed(b)) {
            int lo = parse_char(b), hi = lo;
            if (*b->p == '-' && b->p[1] != ']') {
                b->p++;
                hi = parse_char(b);
            }
            if (lo < 0 || hi < 0) return;
            if (hi < lo) B_FAIL(b, "class range %#x-%#x is reversed", lo, hi);
            if (neg && hi > 0x7F) B_FAIL(b, "a negated class takes ASCII members only");
            for (int x = lo; x <= hi; x++) set[x >> 6] |= 1ull << (x & 63);
        }
        if (*b->p != ']') B_FAIL(b, "unterminated character class");
        b->p++;
        if (!neg) {
            ev_push(b, out, E_SET, new_set(b, set));
            return;
        }
        /* [^...]: the other ASCII bytes, or any multi-byte UTF-8 character. */
        uint64_t inv[4] = {~set[0], ~set[1], 0, 0};
        int r = anon_rule(b);
        evec a = {0};
        ev_push(b, &a, E_SET, new_set(b, inv));
        add_alt(b, r, &a);
        a.n = 0;
        ev_push(b, &a, E_REF, rule_id(b, "_utf8mb", 7));
        add_alt(b, r, &a);
        free(a.p);
        ev_push(b, out, E_REF, r);
    } else if (c == '.') {
        b->p++;
        ev_push(b, out, E_REF, rule_id(b, "_anychar", 8));
    } else if (c == '(') {
        b->p++;
        int r = anon_rule(b);
        parse_alternatives(b, r);
        skip_space(b);
        if (*b->p != ')') B_FAIL(b, "missing ')'");
        b->p++;
        ev_push(b, out, E_REF, r);
    } else if (is_name_char(c)) {
        const char *s = b->p;
        while (is_name_char(*b->p)) b->p++;
        ev_push(b, out, E_REF, rule_id(b, s, (size_t)(b->p - s)));
    } else {
        b_fail(b, "unexpected '%c'", c);
    }
}

/* x* as a rule R ::= x R | "". */
static int star_rule(builder *b, elem x) {
    int r = anon_rule(b);
    evec a = {0};
    ev_push(b, &a, x.type, x.v);
    ev_push(b, &a, E_REF, r);
    add_alt(b, r, &a);
    a.n = 0;
    add_alt(b, r, &a);
    free(a.p);
    return r;
}

#define RK_GRAMMAR_MAX_REPEAT 10000

/* Append x with its quantifier (already parsed into lo, hi; hi < 0: none). */
static void add_repeat(builder *b, evec *seq, elem x, long lo, long hi) {
    for (long i = 0; i < lo; i++) ev_push(b, seq, x.type, x.v);
    if (hi < 0) {
        ev_push(b, seq, E_REF, star_rule(b, x));
        return;
    }
    /* hi - lo optional copies, nested: O_k ::= x O_(k-1) | "". */
    int prev = -1;
    evec a = {0};
    for (long k = 1; k <= hi - lo && !b_failed(b); k++) {
        int r = anon_rule(b);
        a.n = 0;
        ev_push(b, &a, x.type, x.v);
        if (prev >= 0) ev_push(b, &a, E_REF, prev);
        add_alt(b, r, &a);
        a.n = 0;
        add_alt(b, r, &a);
        prev = r;
    }
    free(a.p);
    if (prev >= 0) ev_push(b, seq, E_REF, prev);
}

static void parse_sequence(builder *b, evec *seq) {
    for (;;) {
        skip_space(b);
        char c = *b->p;
        if (!c || c == '|' || c == ')' || at_rule_start(b->p) || b_failed(b)) return;
        evec prim = {0};
        parse_primary(b, &prim);
        while (*b->p == ' ' || *b->p == '\t') b->p++;
        char q = *b->p;
        if (b_failed(b) || (q != '*' && q != '+' && q != '?' && q != '{')) {
            for (int i = 0; i < prim.n; i++) ev_push(b, seq, prim.p[i].type, prim.p[i].v);
            free(prim.p);
            continue;
        }
        long lo = 0, hi = -1;
        if (q == '*') {
            b->p++;
        } else if (q == '+') {
            lo = 1, b->p++;
        } else if (q == '?') {
            hi = 1, b->p++;
        } else {
            char *e;
            lo = strtol(b->p + 1, &e, 10);
            if (e == b->p + 1) {
                free(prim.p);
                B_FAIL(b, "'{' needs a count");
            }
            hi = lo;
            if (*e == ',') {
                char *f;
                hi = strtol(e + 1, &f, 10);
                if (f == e + 1) hi = -1;
                e = f;
            }
            if (*e != '}' || lo < 0 || (hi >= 0 && hi < lo) || lo > RK_GRAMMAR_MAX_REPEAT ||
                hi > RK_GRAMMAR_MAX_REPEAT) {
                free(prim.p);
                B_FAIL(b, "bad repetition {m,n} (0 <= m <= n <= %d)", RK_GRAMMAR_MAX_REPEAT);
            }
            b->p = e + 1;
        }
        elem x;
        if (prim.n == 1) {
            x = prim.p[0];
        } else {
            x = (elem){E_REF, wrap_rule(b, &prim)};
        }
        free(prim.p);
        add_repeat(b, seq, x, lo, hi);
    }
}

static void parse_alternatives(builder *b, int rule) {
    evec seq = {0};
    for (;;) {
        seq.n = 0;
        parse_sequence(b, &seq);
        add_alt(b, rule, &seq);
        skip_space(b);
        if (*b->p != '|' || b_failed(b)) break;
        b->p++;
    }
    free(seq.p);
}

static void parse_rules(builder *b, const char *text) {
    b->p = text;
    b->line = 1;
    for (;;) {
        skip_space(b);
        if (!*b->p || b_failed(b)) return;
        if (!at_rule_start(b->p)) B_FAIL(b, "expected 'name ::='");
        const char *s = b->p;
        while (is_name_char(*b->p)) b->p++;
        int r = rule_id(b, s, (size_t)(b->p - s));
        if (r < 0) return;
        if (b->defined[r]) B_FAIL(b, "rule '%s' is defined twice", b->names[r]);
        b->defined[r] = 1;
        b->p = strstr(b->p, "::=") + 3;
        parse_alternatives(b, r);
    }
}

/* The rules every grammar has: one valid UTF-8 character of two to four
 * bytes (no overlong forms, surrogates or code points above U+10FFFF), and
 * any character. */
static const char *const k_prelude =
    "_utf8mb ::= [\\xC2-\\xDF] [\\x80-\\xBF] | \"\\xE0\" [\\xA0-\\xBF] [\\x80-\\xBF]"
    " | [\\xE1-\\xEC\\xEE\\xEF] [\\x80-\\xBF] [\\x80-\\xBF] | \"\\xED\" [\\x80-\\x9F] [\\x80-\\xBF]"
    " | \"\\xF0\" [\\x90-\\xBF] [\\x80-\\xBF] [\\x80-\\xBF]"
    " | [\\xF1-\\xF3] [\\x80-\\xBF] [\\x80-\\xBF] [\\x80-\\xBF]"
    " | \"\\xF4\" [\\x80-\\x8F] [\\x80-\\xBF] [\\x80-\\xBF]\n"
    "_anychar ::= [\\x00-\\x7F] | _utf8mb\n";

static void builder_free(builder *b) {
    for (int i = 0; i < b->n_rules; i++) free(b->names[i]);
    free(b->names);
    free(b->defined);
    free(b->alt_rule);
    free(b->alt_start);
    free(b->elems);
    free(b->sets);
}

void rk_grammar_free(rk_grammar *g) {
    if (!g) return;
    for (int i = 0; i < g->n_rules; i++) free(g->names[i]);
    free(g->names);
    free(g->alt_off);
    free(g->alt_start);
    free(g->alt_dead);
    free(g->elems);
    free(g->sets);
    free(g->minlen);
    free(g);
}

/* Is the rule's language empty of non-empty...: nullable[r] says r matches "". */
static int fixpoint_nullable(const rk_grammar *g, uint8_t *nullable) {
    int changed = 1;
    while (changed) {
        changed = 0;
        for (int r = 0; r < g->n_rules; r++) {
            if (nullable[r]) continue;
            for (int a = g->alt_off[r]; a < g->alt_off[r + 1] && !nullable[r]; a++) {
                const elem *e = g->elems + g->alt_start[a];
                while (e->type == E_REF && nullable[e->v]) e++;
                if (e->type == E_END) nullable[r] = 1, changed = 1;
            }
        }
    }
    return 0;
}

/* Left recursion: r reaches itself through the first elements of its
 * alternatives without consuming a byte. Depth-first search, colours 0/1/2. */
static int left_cycle(const rk_grammar *g, const uint8_t *nullable, int r, uint8_t *colour) {
    if (colour[r] == 2) return -1;
    if (colour[r] == 1) return r;
    colour[r] = 1;
    for (int a = g->alt_off[r]; a < g->alt_off[r + 1]; a++) {
        for (const elem *e = g->elems + g->alt_start[a]; e->type == E_REF; e++) {
            int c = left_cycle(g, nullable, e->v, colour);
            if (c >= 0) return c;
            if (!nullable[e->v]) break;
        }
    }
    colour[r] = 2;
    return -1;
}

#define RK_GRAMMAR_MAX_ELEMS (1 << 20)

/* Group the builder's alternatives by rule and check the grammar. */
static rk_status finish(builder *b, rk_grammar **out) {
    if (b->oom) return rk_errorf(RK_ERR_NOMEM, "grammar: out of memory");
    if (b->err[0]) return rk_errorf(RK_ERR_INVALID, "%s", b->err);
    if (b->n_elems > RK_GRAMMAR_MAX_ELEMS)
        return rk_errorf(RK_ERR_LIMIT,
                         "grammar: %d elements is over the bound of %d (repetitions "
                         "are expanded: lower their counts)",
                         b->n_elems, RK_GRAMMAR_MAX_ELEMS);
    for (int r = 0; r < b->n_rules; r++)
        if (!b->defined[r])
            return rk_errorf(RK_ERR_INVALID, "grammar: rule '%s' is used but not defined",
                             b->names[r]);
    rk_grammar *g = calloc(1, sizeof *g);
    if (!g) return rk_errorf(RK_ERR_NOMEM, "grammar: out of memory");
    g->n_rules = b->n_rules;
    g->n_alts = b->n_alts;
    g->n_elems = b->n_elems;
    g->n_sets = b->n_sets;
    g->names = b->names;
    g->elems = b->elems;
    g->sets = b->sets;
    b->names = NULL, b->elems = NULL, b->sets = NULL;
    b->n_rules = 0;
    g->alt_off = calloc((size_t)g->n_rules + 1, sizeof *g->alt_off);
    g->alt_start = malloc(((size_t)g->n_alts + 1) * sizeof *g->alt_start);
    g->alt_dead = calloc((size_t)g->n_alts + 1, 1);
    uint8_t *nullable = calloc((size_t)g->n_rules + 1, 1);
    uint8_t *colour = calloc((size_t)g->n_rules + 1, 1);
    uint8_t *prod = calloc((size_t)g->n_rules + 1, 1);
    rk_status st = RK_OK;
    if (!g->alt_off || !g->alt_start || !g->alt_dead || !nullable || !colour || !prod) {
        st = rk_errorf(RK_ERR_NOMEM, "grammar: out of memory");
        goto done;
    }
    /* Counting sort of the alternatives by rule, keeping their order. */
    for (int a = 0; a < g->n_alts; a++) g->alt_off[b->alt_rule[a] + 1]++;
    for (int r = 0; r < g->n_rules; r++) g->alt_off[r + 1] += g->alt_off[r];
    {
        int32_t *fill = malloc(((size_t)g->n_rules + 1) * sizeof *fill);
        if (!fill) {
            st = rk_errorf(RK_ERR_NOMEM, "grammar: out of memory");
            goto done;
        }
        memcpy(fill, g->alt_off, (size_t)g->n_rules * sizeof *fill);
        for (int a = 0; a < g->n_alts; a++) g->alt_start[fill[b->alt_rule[a]]++] = b->alt_start[a];
        free(fill);
    }
    g->root = -1;
    for (int r = 0; r < g->n_rules; r++)
        if (!strcmp(g->names[r], "root")) g->root = r;
    if (g->root < 0) {
        st = rk_errorf(RK_ERR_INVALID, "grammar: no rule named 'root'");
        goto done;
    }
    fixpoint_nullable(g, nullable);
    for (int r = 0; r < g->n_rules; r++) {
        int c = left_cycle(g, nullable, r, colour);
        if (c >= 0) {
            st = rk_errorf(RK_ERR_INVALID,
                           "grammar: rule '%s' is left-recursive (it can reach itself without "
                           "consuming input)",
                           c >= 0 && g->names[c][0] != '#' ? g->names[c] : g->names[r]);
            goto done;
        }
    }
    /* Productive rules (that match some finite text); alternatives that use
     * an unproductive rule or an empty class are dead and never expanded. */
    for (int changed = 1; changed;) {
        changed = 0;
        for (int r = 0; r < g->n_rules; r++) {
            if (prod[r]) continue;
            for (int a = g->alt_off[r]; a < g->alt_off[r + 1] && !prod[r]; a++) {
                const elem *e = g->elems + g->alt_start[a];
                int ok = 1;
                for (; e->type != E_END && ok; e++) {
                    if (e->type == E_REF)
                        ok = prod[e->v];
                    else {
                        const uint64_t *s = g->sets[e->v];
                        ok = (s[0] | s[1] | s[2] | s[3]) != 0;
                    }
                }
                if (ok) prod[r] = 1, changed = 1;
            }
        }
    }
    if (!prod[g->root]) {
        st = rk_errorf(RK_ERR_INVALID, "grammar: the root rule matches nothing");
        goto done;
    }
    for (int r = 0; r < g->n_rules; r++)
        for (int a = g->alt_off[r]; a < g->alt_off[r + 1]; a++)
            for (const elem *e = g->elems + g->alt_start[a]; e->type != E_END; e++) {
                int ok = e->type == E_REF ? prod[e->v]
                                          : (g->sets[e->v][0] | g->sets[e->v][1] |
                                             g->sets[e->v][2] | g->sets[e->v][3]) != 0;
                if (!ok) g->alt_dead[a] = 1;
            }
    /* Fewest bytes each rule matches (a fixpoint), then from each element to
     * the end of its sequence: what finishing a stack costs at least. */
    g->minlen = malloc((size_t)g->n_elems * sizeof *g->minlen);
    int32_t *rmin = malloc((size_t)g->n_rules * sizeof *rmin);
    if (!g->minlen || !rmin) {
        free(rmin);
        st = rk_errorf(RK_ERR_NOMEM, "grammar: out of memory");
        goto done;
    }
    for (int r = 0; r < g->n_rules; r++) rmin[r] = INT32_MAX;
    for (int changed = 1; changed;) {
        changed = 0;
        for (int r = 0; r < g->n_rules; r++)
            for (int a = g->alt_off[r]; a < g->alt_off[r + 1]; a++) {
                if (g->alt_dead[a]) continue;
                int64_t n = 0;
                for (const elem *e = g->elems + g->alt_start[a]; e->type != E_END; e++)
                    n += e->type == E_SET ? 1 : rmin[e->v];
                if (n < rmin[r]) rmin[r] = (int32_t)n, changed = 1;
            }
    }
    for (int a = 0; a < g->n_alts; a++) {
        int end = g->alt_start[a];
        while (g->elems[end].type != E_END) end++;
        int64_t n = 0;
        g->minlen[end] = 0;
        for (int i = end - 1; i >= g->alt_start[a]; i--) {
            n += g->elems[i].type == E_SET ? 1 : rmin[g->elems[i].v];
            g->minlen[i] = n > INT32_MAX ? INT32_MAX : (int32_t)n;
        }
    }
    free(rmin);
done:
    free(nullable);
    free(colour);
    free(prod);
    if (st != RK_OK) {
        rk_grammar_free(g);
        return st;
    }
    *out = g;
    return RK_OK;
}

rk_status rk_grammar_parse(const char *text, rk_grammar **out) {
    *out = NULL;
    builder b = {0};
    parse_rules(&b, k_prelude);
    if (!b_failed(&b)) {
        b.err[0] = 0;
        parse_rules(&b, text);
    }
    rk_status st = finish(&b, out);
    builder_free(&b);
    return st;
}

/* ------------------------------------------------------------ vocabulary */

struct rk_grammar_vocab {
    int32_t n_vocab;
    int32_t n_nodes;
    uint8_t *byte;     /* (n_nodes) preorder; node 0 is the root */
    uint16_t *depth;   /* (n_nodes) */
    int32_t *skip;     /* (n_nodes) the node after this one's subtree */
    int32_t *tok;      /* (n_nodes) first token ending here, -1 */
    int32_t *tok_next; /* (n_vocab) next token with the same bytes, -1 */
    int32_t *eog;
    int n_eog;
    uint32_t *off; /* (n_vocab + 1) into bytes; 0 length: never text */
    char *bytes;
    int max_depth;
};

static _Thread_local const rk_grammar_vocab *t_sort_vocab;

static int by_bytes(const void *pa, const void *pb) {
    const rk_grammar_vocab *v = t_sort_vocab;
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    uint32_t la = v->off[a + 1] - v->off[a], lb = v->off[b + 1] - v->off[b];
    int c = memcmp(v->bytes + v->off[a], v->bytes + v->off[b], la < lb ? la : lb);
    if (c) return c;
    if (la != lb) return la < lb ? -1 : 1;
    return a < b ? -1 : a > b;
}

void rk_grammar_vocab_free(rk_grammar_vocab *v) {
    if (!v) return;
    free(v->byte);
    free(v->depth);
    free(v->skip);
    free(v->tok);
    free(v->tok_next);
    free(v->eog);
    free(v->off);
    free(v->bytes);
    free(v);
}

int32_t rk_grammar_vocab_n(const rk_grammar_vocab *v) { return v->n_vocab; }

rk_status rk_grammar_vocab_create(const rk_tokenizer *t, rk_grammar_vocab **out) {
    *out = NULL;
    int32_t n = rk_tokenizer_n_vocab(t);
    rk_grammar_vocab *v = calloc(1, sizeof *v);
    int32_t *order = NULL, *path = NULL;
    if (!v) return rk_errorf(RK_ERR_NOMEM, "grammar: out of memory for the vocabulary");
    v->n_vocab = n;
    v->off = malloc(((size_t)n + 1) * sizeof *v->off);
    v->tok_next = malloc((size_t)n * sizeof *v->tok_next);
    v->eog = malloc((size_t)n * sizeof *v->eog);
    order = malloc((size_t)n * sizeof *order);
    size_t total = 0;
    if (!v->off || !v->tok_next || !v->eog || !order) goto nomem;
    for (int32_t id = 0; id < n; id++) {
        int len = rk_tokenizer_token_bytes(t, id, 0, NULL, 0);
        total += len > 0 ? (size_t)len : 0;
    }
    v->bytes = malloc(total + 1);
    if (!v->bytes) goto nomem;
    size_t pos = 0;
    int n_text = 0;
    for (int32_t id = 0; id < n; id++) {
        v->off[id] = (uint32_t)pos;
        v->tok_next[id] = -1;
        if (rk_tokenizer_is_eog(t, id)) {
            v->eog[v->n_eog++] = id;
            continue; /* an end token is never text */
        }
        int len = rk_tokenizer_token_bytes(t, id, 0, v->bytes + pos, (int)(total - pos));
        if (len > 0) {
            pos += (size_t)len;
            order[n_text++] = id;
        }
    }
    v->off[n] = (uint32_t)pos;
    t_sort_vocab = v;
    qsort(order, (size_t)n_text, sizeof *order, by_bytes);
    size_t cap = pos + 1;
    v->byte = malloc(cap);
    v->depth = malloc(cap * sizeof *v->depth);
    v->skip = malloc(cap * sizeof *v->skip);
    v->tok = malloc(cap * sizeof *v->tok);
    int max_len = 1;
    for (int i = 0; i < n_text; i++) {
        int len = (int)(v->off[order[i] + 1] - v->off[order[i]]);
        if (len > max_len) max_len = len;
    }
    if (max_len > 65535) {
        rk_grammar_vocab_free(v);
        free(order);
        return rk_errorf(RK_ERR_UNSUPPORTED, "grammar: a token of %d bytes is too long", max_len);
    }
    path = malloc(((size_t)max_len + 1) * sizeof *path);
    if (!v->byte || !v->depth || !v->skip || !v->tok || !path) goto nomem;
    /* Sorted byte strings give the trie in preorder: each token shares with
     * the one before it a prefix (its path), pops the rest and pushes its own
     * remaining bytes; a popped node's subtree ends where the next node goes. */
    int32_t nn = 1, top = 0; /* path[0..top] are the open nodes, path[0] the root */
    v->byte[0] = 0, v->depth[0] = 0, v->tok[0] = -1;
    path[0] = 0;
    const char *prev = NULL;
    int prev_len = 0;
    for (int i = 0; i < n_text; i++) {
        int32_t id = order[i];
        const char *s = v->bytes + v->off[id];
        int len = (int)(v->off[id + 1] - v->off[id]);
        int c = 0;
        while (prev && c < len && c < prev_len && s[c] == prev[c]) c++;
        while (top > c) v->skip[path[top--]] = nn;
        for (int d = c; d < len; d++) {
            v->byte[nn] = (uint8_t)s[d];
            v->depth[nn] = (uint16_t)(d + 1);
            v->tok[nn] = -1;
            path[++top] = nn++;
        }
        int32_t node = path[top];
        if (v->tok[node] < 0) {
            v->tok[node] = id;
        } else { /* the same bytes as an earlier token: chain it */
            int32_t k = v->tok[node];
            while (v->tok_next[k] >= 0) k = v->tok_next[k];
            v->tok_next[k] = id;
        }
        prev = s, prev_len = len;
    }
    while (top > 0) v->skip[path[top--]] = nn;
    v->skip[0] = nn;
    v->n_nodes = nn;
    v->max_depth = max_len;
    free(order);
    free(path);
    *out = v;
    return RK_OK;
nomem:
    free(order);
    free(path);
    rk_grammar_vocab_free(v);
    return rk_errorf(RK_ERR_NOMEM, "grammar: out of memory for the vocabulary");
}

/* ------------------------------------------------------------ the state */

/* A return frame: continue at element pos, then return to frame parent (-1:
 * the end of the grammar). Frames are interned: equal stacks are equal ids. */
typedef struct frame {
    int32_t pos, parent;
} frame;

/* A stack whose top is a byte class: element pos over frame parent. */
typedef frame leaf;

typedef struct dstate {
    int32_t leaf_off, n_leaf;
    int32_t row;  /* transition row (256 entries) or -1 */
    int32_t mask; /* cached mask slot or -1 */
    int32_t minb; /* fewest bytes that finish it, -1 until asked */
    /* With the mask: the most bytes any allowed token leaves to finish, and
     * how many tokens it allows (-1 until the mask is made). */
    int32_t max_after, n_allowed;
    uint32_t hash;
    uint8_t accept;
} dstate;

#define T_UNKNOWN             (-3)
#define T_ERROR               (-2)
#define T_DEAD                (-1)
#define RK_GRAMMAR_MAX_STATES (1 << 16)
#define RK_GRAMMAR_MAX_FRAMES (1 << 20)
#define RK_GRAMMAR_MASK_SLOTS 256

struct rk_grammar_state {
    const rk_grammar *g;
    const rk_grammar_vocab *v;
    frame *frames;
    int n_frames, cap_frames;
    int32_t *fhash; /* open addressing over frames, -1 empty */
    int fhash_cap;
    leaf *leafs;
    int n_leafs, cap_leafs;
    dstate *st;
    int n_st, cap_st;
    int32_t *shash;
    int shash_cap;
    int32_t *rows;
    int n_rows, cap_rows; /* in rows of 256 */
    uint64_t **masks;
    int n_masks;
    uint64_t *bmask; /* the budget mask (rk_grammar_state_mask_budget) */
    leaf *scratch;
    int n_scratch, cap_scratch;
    int32_t *walk; /* (max_depth + 1) states along the trie path */
    int cur;
    int finished;
    int error; /* an allocation or a bound failed while expanding */
};

static uint32_t mix(uint32_t h, uint32_t x) {
    h ^= x;
    h *= 0x01000193u;
    h ^= h >> 15;
    return h;
}

static int rehash_frames(rk_grammar_state *s, int cap) {
    int32_t *t = malloc((size_t)cap * sizeof *t);
    if (!t) return -1;
    memset(t, 0xff, (size_t)cap * sizeof *t);
    for (int i = 0; i < s->n_frames; i++) {
        uint32_t h =
            mix(mix(2166136261u, (uint32_t)s->frames[i].pos), (uint32_t)s->frames[i].parent);
        uint32_t k = h & (uint32_t)(cap - 1);
        while (t[k] >= 0) k = (k + 1) & (uint32_t)(cap - 1);
        t[k] = i;
    }
    free(s->fhash);
    s->fhash = t;
    s->fhash_cap = cap;
    return 0;
}

static int32_t intern_frame(rk_grammar_state *s, int32_t pos, int32_t parent) {
    uint32_t h = mix(mix(2166136261u, (uint32_t)pos), (uint32_t)parent);
    uint32_t k = h & (uint32_t)(s->fhash_cap - 1);
    for (; s->fhash[k] >= 0; k = (k + 1) & (uint32_t)(s->fhash_cap - 1)) {
        const frame *f = &s->frames[s->fhash[k]];
        if (f->pos == pos && f->parent == parent) return s->fhash[k];
    }
    if (s->n_frames >= RK_GRAMMAR_MAX_FRAMES ||
        grow((void **)&s->frames, &s->cap_frames, s->n_frames + 1, sizeof *s->frames) < 0)
        return -1;
    int32_t id = s->n_frames++;
    s->frames[id] = (frame){pos, parent};
    s->fhash[k] = id;
    if (s->n_frames * 2 > s->fhash_cap && rehash_frames(s, s->fhash_cap * 2) < 0) return -1;
    return id;
}

static void push_leaf(rk_grammar_state *s, int32_t pos, int32_t parent) {
    for (int i = 0; i < s->n_scratch; i++)
        if (s->scratch[i].pos == pos && s->scratch[i].parent == parent) return;
    if (grow((void **)&s->scratch, &s->cap_scratch, s->n_scratch + 1, sizeof *s->scratch) < 0) {
        s->error = 1;
        return;
    }
    s->scratch[s->n_scratch++] = (leaf){pos, parent};
}

/* Expand the stack (pos over parent) into leaves: follow rule references
 * down to their byte classes and the ends of sequences up to their callers.
 * A reference that ends its sequence returns straight to the caller's
 * caller, so right recursion (x*) keeps stacks from growing. */
static void expand(rk_grammar_state *s, int32_t pos, int32_t parent, int *accept) {
    const rk_grammar *g = s->g;
    for (;;) {
        elem e = g->elems[pos];
        if (e.type == E_END) {
            if (parent < 0) {
                *accept = 1;
                return;
            }
            pos = s->frames[parent].pos;
            parent = s->frames[parent].parent;
            continue;
        }
        if (e.type == E_SET) {
            push_leaf(s, pos, parent);
            return;
        }
        int32_t ret = parent;
        if (g->elems[pos + 1].type != E_END) {
            ret = intern_frame(s, pos + 1, parent);
            if (ret < 0) {
                s->error = 1;
                return;
            }
        }
        for (int a = g->alt_off[e.v]; a < g->alt_off[e.v + 1] && !s->error; a++)
            if (!g->alt_dead[a]) expand(s, g->alt_start[a], ret, accept);
        return;
    }
}

static int leaf_cmp(const void *a, const void *b) {
    const leaf *x = a, *y = b;
    if (x->pos != y->pos) return x->pos < y->pos ? -1 : 1;
    return x->parent < y->parent ? -1 : x->parent > y->parent;
}

static int rehash_states(rk_grammar_state *s, int cap) {
    int32_t *t = malloc((size_t)cap * sizeof *t);
    if (!t) return -1;
    memset(t, 0xff, (size_t)cap * sizeof *t);
    for (int i = 0; i < s->n_st; i++) {
        uint32_t k = s->st[i].hash & (uint32_t)(cap - 1);
        while (t[k] >= 0) k = (k + 1) & (uint32_t)(cap - 1);
        t[k] = i;
    }
    free(s->shash);
    s->shash = t;
    s->shash_cap = cap;
    return 0;
}

/* The state id of the scratch leaves with accept, interned; T_DEAD when
 * nothing is alive, T_ERROR when a bound or an allocation failed. */
static int32_t intern_state(rk_grammar_state *s, int accept) {
    if (s->error) return T_ERROR;
    if (!s->n_scratch && !accept) return T_DEAD;
    qsort(s->scratch, (size_t)s->n_scratch, sizeof *s->scratch, leaf_cmp);
    uint32_t h = mix(2166136261u, (uint32_t)accept);
    for (int i = 0; i < s->n_scratch; i++)
        h = mix(mix(h, (uint32_t)s->scratch[i].pos), (uint32_t)s->scratch[i].parent);
    uint32_t k = h & (uint32_t)(s->shash_cap - 1);
    for (; s->shash[k] >= 0; k = (k + 1) & (uint32_t)(s->shash_cap - 1)) {
        const dstate *d = &s->st[s->shash[k]];
        if (d->hash == h && d->accept == accept && d->n_leaf == s->n_scratch &&
            !memcmp(s->leafs + d->leaf_off, s->scratch, (size_t)s->n_scratch * sizeof(leaf)))
            return s->shash[k];
    }
    if (s->n_st >= RK_GRAMMAR_MAX_STATES ||
        grow((void **)&s->st, &s->cap_st, s->n_st + 1, sizeof *s->st) < 0 ||
        grow((void **)&s->leafs, &s->cap_leafs, s->n_leafs + s->n_scratch, sizeof *s->leafs) < 0)
        return T_ERROR;
    int32_t id = s->n_st++;
    dstate *d = &s->st[id];
    d->leaf_off = s->n_leafs;
    d->n_leaf = s->n_scratch;
    d->row = -1;
    d->mask = -1;
    d->minb = -1;
    d->max_after = -1;
    d->n_allowed = -1;
    d->hash = h;
    d->accept = (uint8_t)accept;
    memcpy(s->leafs + s->n_leafs, s->scratch, (size_t)s->n_scratch * sizeof(leaf));
    s->n_leafs += s->n_scratch;
    s->shash[k] = id;
    if (s->n_st * 2 > s->shash_cap && rehash_states(s, s->shash_cap * 2) < 0) return T_ERROR;
    return id;
}

/* The state after byte c from state sid (computed once, then looked up). */
static int32_t step_slow(rk_grammar_state *s, int32_t sid, unsigned c) {
    if (s->st[sid].row < 0) {
        if (grow((void **)&s->rows, &s->cap_rows, (s->n_rows + 1) * 256, sizeof *s->rows) < 0)
            return T_ERROR;
        int32_t *r = s->rows + (size_t)s->n_rows * 256;
        for (int i = 0; i < 256; i++) r[i] = T_UNKNOWN;
        s->st[sid].row = s->n_rows++;
    }
    const rk_grammar *g = s->g;
    s->n_scratch = 0;
    s->error = 0;
    int accept = 0;
    int32_t off = s->st[sid].leaf_off, n = s->st[sid].n_leaf;
    for (int32_t i = 0; i < n; i++) {
        leaf l = s->leafs[off + i];
        const uint64_t *set = g->sets[g->elems[l.pos].v];
        if (set[c >> 6] >> (c & 63) & 1) expand(s, l.pos + 1, l.parent, &accept);
    }
    int32_t t = intern_state(s, accept);
    if (t != T_ERROR) s->rows[(size_t)s->st[sid].row * 256 + c] = t;
    return t;
}

static inline int32_t step(rk_grammar_state *s, int32_t sid, unsigned c) {
    int32_t row = s->st[sid].row;
    if (row >= 0) {
        int32_t t = s->rows[(size_t)row * 256 + c];
        if (t != T_UNKNOWN) return t;
    }
    return step_slow(s, sid, c);
}

void rk_grammar_state_free(rk_grammar_state *s) {
    if (!s) return;
    free(s->frames);
    free(s->fhash);
    free(s->leafs);
    free(s->st);
    free(s->shash);
    free(s->rows);
    for (int i = 0; i < s->n_masks; i++) free(s->masks[i]);
    free(s->masks);
    free(s->bmask);
    free(s->scratch);
    free(s->walk);
    free(s);
}

rk_status rk_grammar_state_create(const rk_grammar *g, const rk_grammar_vocab *v,
                                  rk_grammar_state **out) {
    *out = NULL;
    rk_grammar_state *s = calloc(1, sizeof *s);
    if (!s) return rk_errorf(RK_ERR_NOMEM, "grammar: out of memory");
    s->g = g;
    s->v = v;
    s->masks = calloc(RK_GRAMMAR_MASK_SLOTS, sizeof *s->masks);
    s->walk = malloc(((size_t)v->max_depth + 1) * sizeof *s->walk);
    if (!s->masks || !s->walk || rehash_frames(s, 1024) < 0 || rehash_states(s, 1024) < 0) {
        rk_grammar_state_free(s);
        return rk_errorf(RK_ERR_NOMEM, "grammar: out of memory");
    }
    int accept = 0;
    for (int a = g->alt_off[g->root]; a < g->alt_off[g->root + 1]; a++)
        if (!g->alt_dead[a]) expand(s, g->alt_start[a], -1, &accept);
    s->cur = intern_state(s, accept);
    if (s->cur < 0) {
        rk_grammar_state_free(s);
        return rk_errorf(RK_ERR_NOMEM, "grammar: out of memory");
    }
    *out = s;
    return RK_OK;
}

static int32_t state_minb(rk_grammar_state *s, int32_t sid);

rk_status rk_grammar_state_mask(rk_grammar_state *s, const uint64_t **mask) {
    dstate *d = &s->st[s->cur];
    if (d->mask >= 0) {
        *mask = s->masks[d->mask];
        return RK_OK;
    }
    const rk_grammar_vocab *v = s->v;
    size_t words = ((size_t)v->n_vocab + 63) / 64;
    if (s->n_masks == RK_GRAMMAR_MASK_SLOTS) { /* full: start the cache again */
        for (int i = 0; i < s->n_st; i++) s->st[i].mask = -1;
        for (int i = 0; i < s->n_masks; i++) free(s->masks[i]), s->masks[i] = NULL;
        s->n_masks = 0;
    }
    int slot = s->n_masks;
    if (!s->masks[slot]) s->masks[slot] = malloc(words * sizeof(uint64_t));
    uint64_t *m = s->masks[slot];
    if (!m) return rk_errorf(RK_ERR_NOMEM, "grammar: out of memory for a mask");
    memset(m, 0, words * sizeof *m);
    /* Preorder walk of the trie: a node whose byte the state refuses is
     * skipped with its whole subtree. */
    int32_t *walk = s->walk;
    walk[0] = s->cur;
    const uint8_t *byte = v->byte;
    const uint16_t *depth = v->depth;
    int32_t max_after = 0, n_allowed = 0;
    for (int32_t i = 1; i < v->n_nodes;) {
        int32_t t = step(s, walk[depth[i] - 1], byte[i]);
        if (t < 0) {
            if (t == T_ERROR)
                return rk_errorf(RK_ERR_LIMIT,
                                 "grammar: the automaton outgrew its bound (%d states, %d frames)",
                                 s->n_st, s->n_frames);
            i = v->skip[i];
            continue;
        }
        walk[depth[i]] = t;
        if (v->tok[i] >= 0) {
            int32_t mb = s->st[t].minb >= 0 ? s->st[t].minb : state_minb(s, t);
            if (mb > max_after) max_after = mb;
            for (int32_t k = v->tok[i]; k >= 0; k = v->tok_next[k]) {
                m[k >> 6] |= 1ull << (k & 63);
                n_allowed++;
            }
        }
        i++;
    }
    d = &s->st[s->cur]; /* the walk may have moved the state array */
    if (d->accept)
        for (int i = 0; i < v->n_eog; i++)
            m[v->eog[i] >> 6] |= 1ull << (v->eog[i] & 63), n_allowed++;
    d->max_after = max_after;
    d->n_allowed = n_allowed;
    d->mask = slot;
    s->n_masks++;
    *mask = m;
    return RK_OK;
}

rk_status rk_grammar_state_accept_bytes(rk_grammar_state *s, const char *bytes, int n) {
    int32_t cur = s->cur;
    for (int i = 0; i < n; i++) {
        cur = step(s, cur, (unsigned char)bytes[i]);
        if (cur == T_ERROR)
            return rk_errorf(RK_ERR_LIMIT, "grammar: the automaton outgrew its bound");
        if (cur < 0)
            return rk_errorf(RK_ERR_INVALID, "grammar: byte %d (0x%02x) is not allowed here", i,
                             (unsigned char)bytes[i]);
    }
    s->cur = cur;
    return RK_OK;
}

rk_status rk_grammar_state_accept(rk_grammar_state *s, int32_t token) {
    const rk_grammar_vocab *v = s->v;
    if (token < 0 || token >= v->n_vocab)
        return rk_errorf(RK_ERR_INVALID, "grammar: token %d is outside the vocabulary", token);
    for (int i = 0; i < v->n_eog; i++)
        if (v->eog[i] == token) {
            if (!s->st[s->cur].accept)
                return rk_errorf(RK_ERR_INVALID, "grammar: the output may not end here");
            s->finished = 1;
            return RK_OK;
        }
    int len = (int)(v->off[token + 1] - v->off[token]);
    if (!len) return rk_errorf(RK_ERR_INVALID, "grammar: token %d is never allowed as text", token);
    return rk_grammar_state_accept_bytes(s, v->bytes + v->off[token], len);
}

/* Fewest bytes that finish state sid: over its stacks, the rest of each
 * sequence from the leaf up through its frames. */
static int32_t state_minb(rk_grammar_state *s, int32_t sid) {
    dstate *d = &s->st[sid];
    if (d->minb >= 0) return d->minb;
    int64_t best = d->accept ? 0 : INT32_MAX;
    for (int32_t i = 0; i < d->n_leaf && best > 0; i++) {
        leaf l = s->leafs[d->leaf_off + i];
        int64_t n = s->g->minlen[l.pos];
        for (int32_t f = l.parent; f >= 0 && n < best; f = s->frames[f].parent)
            n += s->g->minlen[s->frames[f].pos];
        if (n < best) best = n;
    }
    d->minb = (int32_t)best;
    return d->minb;
}

int rk_grammar_state_min_bytes(rk_grammar_state *s) { return state_minb(s, s->cur); }

rk_status rk_grammar_state_mask_budget(rk_grammar_state *s, int budget, const uint64_t **mask,
                                       int *n_allowed) {
    /* Where no allowed token leaves more than budget, the cached mask is it. */
    rk_status st = rk_grammar_state_mask(s, mask);
    if (st) return st;
    if (s->st[s->cur].max_after <= budget) {
        *n_allowed = s->st[s->cur].n_allowed;
        return RK_OK;
    }
    const rk_grammar_vocab *v = s->v;
    size_t words = ((size_t)v->n_vocab + 63) / 64;
    if (!s->bmask && !(s->bmask = malloc(words * sizeof *s->bmask)))
        return rk_errorf(RK_ERR_NOMEM, "grammar: out of memory for a mask");
    uint64_t *m = s->bmask;
    memset(m, 0, words * sizeof *m);
    int count = 0;
    int32_t *walk = s->walk;
    walk[0] = s->cur;
    for (int32_t i = 1; i < v->n_nodes;) {
        int32_t t = step(s, walk[v->depth[i] - 1], v->byte[i]);
        if (t < 0) {
            if (t == T_ERROR)
                return rk_errorf(RK_ERR_LIMIT, "grammar: the automaton outgrew its bound");
            i = v->skip[i];
            continue;
        }
        walk[v->depth[i]] = t;
        if (v->tok[i] >= 0 && state_minb(s, t) <= budget)
            for (int32_t k = v->tok[i]; k >= 0; k = v->tok_next[k]) {
                m[k >> 6] |= 1ull << (k & 63);
                count++;
            }
        i++;
    }
    if (s->st[s->cur].accept)
        for (int i = 0; i < v->n_eog; i++) m[v->eog[i] >> 6] |= 1ull << (v->eog[i] & 63), count++;
    *mask = m;
    *n_allowed = count;
    return RK_OK;
}

int rk_grammar_state_can_end(const rk_grammar_state *s) { return s->st[s->cur].accept; }

int rk_grammar_state_must_end(const rk_grammar_state *s) {
    return s->finished || s->st[s->cur].n_leaf == 0;
}

int rk_grammar_state_n_states(const rk_grammar_state *s) { return s->n_st; }

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
    "_never ::= []\n";

#define RK_SCHEMA_REF_DEPTH 8
#define RK_INT_MAX          999999999999999.0 /* 15 digits */

typedef struct memo_entry {
    const json_t *target;
    int depth, rule;
} memo_entry;

typedef struct sgen {
    sbuf out;
    int n;
    char path[512];
    const json_t *root;
    memo_entry *memo;
    int n_memo, cap_memo;
    rk_status st;
    char err[900];
} sgen;

static int sg_fail(sgen *G, rk_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int sg_fail(sgen *G, rk_status st, const char *fmt, ...) {
    if (G->st != RK_OK) return -1;
    char tmp[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    snprintf(G->err, sizeof G->err, "%.511s: %s", G->path, tmp);
    G->st = st;
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

/* A grammar literal of n bytes: printable ASCII as is, the rest \xHH. */
static void gbnf_lit(sbuf *o, const char *s, size_t n) {
    sb_puts(o, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7F && c != '"' && c != '\\')
            sb_putn(o, (const char *)&c, 1);
        else
            sb_printf(o, "\\x%02X", c);
    }
    sb_puts(o, "\"");
}

static int gen(sgen *G, const json_t *s, int rdepth);

/* Finish rule n with body b (consumed). */
static int put_rule(sgen *G, int n, sbuf *b) {
    sb_printf(&G->out, "s%d ::= ", n);
    sb_puts(&G->out, b->p ? b->p : "");
    sb_puts(&G->out, "\n");
    if (b->oom) G->out.oom = 1;
    free(b->p);
    return n;
}

static int all_char(const char *s, char c, int n) {
    for (int i = 0; i < n; i++)
        if (s[i] != c) return 0;
    return 1;
}

/* Decimal strings of length n from a to b (a <= b, same length). */
static void digits_range(sbuf *o, const char *a, const char *b, int n) {
    if (n == 0) return;
    if (a[0] == b[0]) {
        sb_printf(o, "\"%c\" ", a[0]);
        digits_range(o, a + 1, b + 1, n - 1);
        return;
    }
    char nines[24], zeros[24];
    memset(nines, '9', sizeof nines);
    memset(zeros, '0', sizeof zeros);
    int a_zero = all_char(a + 1, '0', n - 1), b_nine = all_char(b + 1, '9', n - 1);
    int first = 1;
    sb_puts(o, "( ");
    if (!a_zero) {
        sb_printf(o, "\"%c\" ( ", a[0]);
        digits_range(o, a + 1, nines, n - 1);
        sb_puts(o, ") ");
        first = 0;
    }
    int lo = a[0] - '0' + (a_zero ? 0 : 1), hi = b[0] - '0' - (b_nine ? 0 : 1);
    if (lo <= hi) {
        if (!first) sb_puts(o, "| ");
        sb_printf(o, "[%d-%d] ", lo, hi);
        if (n > 1) sb_printf(o, "[0-9]{%d} ", n - 1);
        first = 0;
    }
    if (!b_nine) {
        if (!first) sb_puts(o, "| ");
        sb_printf(o, "\"%c\" ( ", b[0]);
        digits_range(o, zeros, b + 1, n - 1);
        sb_puts(o, ") ");
    }
    sb_puts(o, ") ");
}

/* Alternatives (each prefixed by sep after the first) for the decimal
 * integers lo..hi without leading zeros; returns how many were written. */
static int uint_range(sbuf *o, double lo, double hi, const char *suffix, int *count) {
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
        if (*count) sb_puts(o, "| ");
        sb_puts(o, "( ");
        digits_range(o, sa, sbb, n);
        sb_printf(o, ") %s ", suffix);
        (*count)++;
        made++;
    }
    return made;
}

#define FRAC  "( \".\" [0-9]{1,15} )?"
#define ZFRAC "( \".\" \"0\"{1,15} )?"

/* Magnitudes k.f in [lo, hi] (integers; hi_inf: no upper bound). */
static void mag_range(sbuf *o, const char *sign, double lo, double hi, int hi_inf, int *count) {
    sbuf tmp = {0};
    int c = 0;
    if (hi_inf) {
        uint_range(&tmp, lo, RK_INT_MAX, FRAC, &c);
    } else {
        uint_range(&tmp, lo, hi - 1, FRAC, &c);
        uint_range(&tmp, hi, hi, ZFRAC, &c);
    }
    if (c) {
        if (*count) sb_puts(o, "| ");
        sb_puts(o, sign);
        sb_puts(o, "( ");
        sb_puts(o, tmp.p);
        sb_puts(o, ") ");
        (*count)++;
    }
    if (tmp.oom) o->oom = 1;
    free(tmp.p);
}

/* A bound keyword of s: 1 and its value when present (a number). */
static int bound(sgen *G, const json_t *s, const char *key, double *out) {
    const json_t *v = json_object_get(s, key);
    if (!v) return 0;
    if (!json_is_number(v)) {
        size_t l = path_push(G, ".%s", key);
        sg_fail(G, RK_ERR_INVALID, "must be a number");
        path_pop(G, l);
        return -1;
    }
    *out = json_number_value(v);
    return 1;
}

static void gen_numeric(sgen *G, const json_t *s, int integer, sbuf *b) {
    double mn = 0, mx = 0, xmn = 0, xmx = 0;
    int has_mn = bound(G, s, "minimum", &mn), has_mx = bound(G, s, "maximum", &mx);
    int has_xmn = bound(G, s, "exclusiveMinimum", &xmn),
        has_xmx = bound(G, s, "exclusiveMaximum", &xmx);
    if (has_mn < 0 || has_mx < 0 || has_xmn < 0 || has_xmx < 0) return;
    if (!has_mn && !has_mx && !has_xmn && !has_xmx) {
        sb_puts(b, integer ? "_int" : "_num");
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
            size_t l = path_push(G, ".%s", bad);
            sg_fail(G, RK_ERR_UNSUPPORTED,
                    "bounds on a number are enforced only as inclusive integers (minimum, "
                    "maximum); use type integer or whole-number bounds");
            path_pop(G, l);
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
    sb_puts(b, "( ");
    if (integer) {
        if (hi_inf || hi >= 0) uint_range(b, lo_inf ? 0 : lo, hi_inf ? RK_INT_MAX : hi, "", &count);
        if (lo_inf || lo < 0) {
            sbuf tmp = {0};
            int c = 0;
            uint_range(&tmp, hi_inf || hi >= 0 ? 1 : -hi, lo_inf ? RK_INT_MAX : -lo, "", &c);
            if (c) {
                sb_puts(b, count ? "| \"-\" ( " : "\"-\" ( ");
                sb_puts(b, tmp.p);
                sb_puts(b, ") ");
                count++;
            }
            free(tmp.p);
        }
    } else {
        if (hi_inf || hi >= 0) mag_range(b, "", lo_inf || lo < 0 ? 0 : lo, hi, hi_inf, &count);
        if (lo_inf || lo < 0)
            mag_range(b, "\"-\" ", hi_inf || hi >= 0 ? 0 : -hi, -lo, lo_inf, &count);
    }
    sb_puts(b, ")");
    if (!count) sg_fail(G, RK_ERR_INVALID, "no value lies within the bounds");
}

/* -------- regular expressions (pattern), translated into grammar text
 * matching the JSON-escaped form of the strings they match. */

typedef struct rx {
    const char *p;
    const char *start;
    sbuf *o;
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
static void json_char_lit(sbuf *o, uint32_t cp, const char *utf8, int len) {
    char tmp[8];
    switch (cp) {
    case '"': gbnf_lit(o, "\\\"", 2); return;
    case '\\': gbnf_lit(o, "\\\\", 2); return;
    case '\n': gbnf_lit(o, "\\n", 2); return;
    case '\t': gbnf_lit(o, "\\t", 2); return;
    case '\r': gbnf_lit(o, "\\r", 2); return;
    case '\b': gbnf_lit(o, "\\b", 2); return;
    case '\f': gbnf_lit(o, "\\f", 2); return;
    default: break;
    }
    if (cp < 0x20) {
        snprintf(tmp, sizeof tmp, "\\u%04X", (unsigned)cp);
        gbnf_lit(o, tmp, 6);
        return;
    }
    gbnf_lit(o, utf8, (size_t)len);
}

/* An ASCII class (128 bits; neg: its complement, plus every non-ASCII
 * character), as the JSON-escaped alternatives it allows. Controls other
 * than \t \n \r are left out (strings made are a subset, still matching). */
static void rx_emit_class(sbuf *o, const uint64_t set[2], int neg) {
    uint64_t s[2] = {neg ? ~set[0] : set[0], neg ? ~set[1] : set[1]};
    int has = 0;
    sb_puts(o, "( ");
    sbuf cls = {0};
    for (int c = 0x20; c < 0x80; c++)
        if ((s[c >> 6] >> (c & 63) & 1) && c != '"' && c != '\\') sb_printf(&cls, "\\x%02X", c);
    if (cls.n) {
        sb_puts(o, "[");
        sb_puts(o, cls.p);
        sb_puts(o, "] ");
        has = 1;
    }
    free(cls.p);
    static const int specials[] = {'"', '\\', '\n', '\t', '\r'};
    for (size_t i = 0; i < sizeof specials / sizeof *specials; i++) {
        int c = specials[i];
        if (!(s[c >> 6] >> (c & 63) & 1)) continue;
        if (has) sb_puts(o, "| ");
        json_char_lit(o, (uint32_t)c, NULL, 0);
        sb_puts(o, " ");
        has = 1;
    }
    if (neg) sb_printf(o, "%s_utf8mb ", has ? "| " : ""), has = 1;
    if (!has) sb_puts(o, "[] ");
    sb_puts(o, ") ");
}

static void set_add(uint64_t set[2], int lo, int hi) {
    for (int c = lo; c <= hi; c++) set[c >> 6] |= 1ull << (c & 63);
}

/* A class escape (\d \w \s, upper case negated) into set; 1 when it was one. */
static int class_escape(char e, uint64_t set[2], int *neg) {
    uint64_t t[2] = {0};
    switch (e | 0x20) {
    case 'd': set_add(t, '0', '9'); break;
    case 'w':
        set_add(t, '0', '9'), set_add(t, 'a', 'z'), set_add(t, 'A', 'Z'), set_add(t, '_', '_');
        break;
    case 's': set_add(t, ' ', ' '), set_add(t, '\t', '\r'); break;
    default: return 0;
    }
    *neg = (e >= 'A' && e <= 'Z');
    set[0] = t[0], set[1] = t[1];
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
    uint64_t set[2] = {0};
    int neg = 0;
    r->p++;
    if (*r->p == '^') neg = 1, r->p++;
    int first = 1;
    while (*r->p && (*r->p != ']' || first)) {
        first = 0;
        int lo;
        if (*r->p == '\\') {
            uint64_t t[2];
            int tneg;
            if (class_escape(r->p[1], t, &tneg)) {
                if (tneg) t[0] = ~t[0], t[1] = ~t[1];
                set[0] |= t[0], set[1] |= t[1];
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
        set_add(set, lo, hi);
    }
    if (*r->p != ']') RX_FAIL(r, "unterminated class");
    r->p++;
    rx_emit_class(r->o, set, neg);
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
        uint64_t set[2] = {0};
        set_add(set, '\n', '\n');
        r->p++;
        rx_emit_class(r->o, set, 1);
    } else if (c == '\\') {
        uint64_t set[2];
        int neg;
        char e = r->p[1];
        if (class_escape(e, set, &neg)) {
            r->p += 2;
            rx_emit_class(r->o, set, neg);
            return;
        }
        if (e == 'u' && hexval(r->p[2]) >= 0 && hexval(r->p[3]) >= 0 && hexval(r->p[4]) >= 0 &&
            hexval(r->p[5]) >= 0) {
            uint32_t cp = (uint32_t)(hexval(r->p[2]) << 12 | hexval(r->p[3]) << 8 |
                                     hexval(r->p[4]) << 4 | hexval(r->p[5]));
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
            sb_puts(r->o, "( ");
            json_char_lit(r->o, cp, u, n);
            sb_puts(r->o, " ) ");
            return;
        }
        int ch = e ? char_escape(e) : -1;
        if (ch < 0 || (e >= '1' && e <= '9'))
            RX_FAIL(r, "unsupported escape (backreferences, \\b, \\p are not supported)");
        r->p += 2;
        char u = (char)ch;
        sb_puts(r->o, "( ");
        json_char_lit(r->o, (uint32_t)ch, &u, 1);
        sb_puts(r->o, " ) ");
    } else if (c == '*' || c == '+' || c == '?' || c == '{') {
        rx_fail(r, "nothing to repeat");
    } else if (c == '^' || c == '$') {
        rx_fail(r, "anchors are supported only at the start and the end of the pattern");
    } else {
        uint32_t cp;
        int n = rk_utf8_decode((const unsigned char *)r->p, strlen(r->p), &cp);
        if (n <= 0) RX_FAIL(r, "invalid UTF-8");
        sb_puts(r->o, "( ");
        json_char_lit(r->o, cp, r->p, n);
        sb_puts(r->o, " ) ");
        r->p += n;
    }
}

static void rx_seq(rx *r) {
    while (*r->p && *r->p != '|' && *r->p != ')' && !r->err[0]) {
        sb_puts(r->o, "( ");
        rx_atom(r);
        sb_puts(r->o, ") ");
        char q = *r->p;
        if (q == '*' || q == '+' || q == '?') {
            sb_putn(r->o, &q, 1);
            sb_puts(r->o, " ");
            r->p++;
        } else if (q == '{') {
            char *e;
            long lo = strtol(r->p + 1, &e, 10), hi = lo;
            if (e == r->p + 1) RX_FAIL(r, "'{' needs a count");
            if (*e == ',') {
                char *f;
                hi = strtol(e + 1, &f, 10);
                if (f == e + 1) hi = -1;
                e = f;
            }
            if (*e != '}' || lo < 0 || (hi >= 0 && hi < lo) || lo > RK_GRAMMAR_MAX_REPEAT ||
                hi > RK_GRAMMAR_MAX_REPEAT)
                RX_FAIL(r, "bad repetition {m,n}");
            if (hi < 0)
                sb_printf(r->o, "{%ld,} ", lo);
            else
                sb_printf(r->o, "{%ld,%ld} ", lo, hi);
            r->p = e + 1;
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
    sb_puts(r->o, "( ");
    for (;;) {
        rx_seq(r);
        if (*r->p != '|' || r->err[0]) break;
        if (!depth) r->top_alts++;
        sb_puts(r->o, "| ");
        r->p++;
    }
    sb_puts(r->o, ") ");
}

/* A string matching pattern (ECMA-262 search semantics: unanchored unless
 * ^ and $ say so), as a grammar expression appended to b. */
static void gen_pattern(sgen *G, const char *pat, sbuf *b) {
    size_t len = strlen(pat);
    int a0 = len && pat[0] == '^';
    int a1 = 0;
    if (len > (size_t)a0 && pat[len - 1] == '$') {
        size_t k = 0; /* backslashes before the $ */
        while (k + 1 < len && pat[len - 2 - k] == '\\') k++;
        a1 = k % 2 == 0;
    }
    char *body = malloc(len + 1);
    if (!body) {
        sg_fail(G, RK_ERR_NOMEM, "out of memory");
        return;
    }
    memcpy(body, pat + a0, len - (size_t)a0 - (size_t)a1);
    body[len - (size_t)a0 - (size_t)a1] = 0;
    rx r = {.p = body, .start = body, .o = b};
    sb_puts(b, "\"\\\"\" ");
    if (!a0) sb_puts(b, "_chr* ");
    rx_alt(&r, 0);
    if (!r.err[0] && *r.p) rx_fail(&r, "unbalanced ')'");
    if (!r.err[0] && r.top_alts && (a0 || a1))
        rx_fail(&r, "anchors around a top-level '|' are ambiguous: write ^(a|b)$");
    if (!a1) sb_puts(b, "_chr* ");
    sb_puts(b, "\"\\\"\"");
    if (r.err[0]) {
        size_t l = path_push(G, ".pattern");
        sg_fail(G, RK_ERR_UNSUPPORTED, "%s", r.err);
        path_pop(G, l);
    }
    free(body);
}

static int get_count(sgen *G, const json_t *s, const char *key, long *out) {
    const json_t *v = json_object_get(s, key);
    if (!v) return 0;
    if (!json_is_integer(v) || json_integer_value(v) < 0 ||
        json_integer_value(v) > RK_GRAMMAR_MAX_REPEAT) {
        size_t l = path_push(G, ".%s", key);
        sg_fail(G,
                json_is_integer(v) && json_integer_value(v) > 0 ? RK_ERR_UNSUPPORTED
                                                                : RK_ERR_INVALID,
                "must be an integer from 0 to %d", RK_GRAMMAR_MAX_REPEAT);
        path_pop(G, l);
        return -1;
    }
    *out = (long)json_integer_value(v);
    return 1;
}

static void gen_string(sgen *G, const json_t *s, sbuf *b) {
    const json_t *pat = json_object_get(s, "pattern");
    long mn = 0, mx = -1;
    int has_mn = get_count(G, s, "minLength", &mn), has_mx = get_count(G, s, "maxLength", &mx);
    if (has_mn < 0 || has_mx < 0) return;
    if (pat) {
        if (!json_is_string(pat)) {
            size_t l = path_push(G, ".pattern");
            sg_fail(G, RK_ERR_INVALID, "must be a string");
            path_pop(G, l);
            return;
        }
        if (has_mn || has_mx) {
            size_t l = path_push(G, has_mn ? ".minLength" : ".maxLength");
            sg_fail(G, RK_ERR_UNSUPPORTED, "lengths cannot be combined with a pattern");
            path_pop(G, l);
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
        sb_puts(b, "_str");
    else if (mx < 0)
        sb_printf(b, "\"\\\"\" _chr{%ld,} \"\\\"\"", mn);
    else
        sb_printf(b, "\"\\\"\" _chr{%ld,%ld} \"\\\"\"", mn, mx);
}

static void gen_array(sgen *G, const json_t *s, int rdepth, sbuf *b) {
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
        sb_puts(b, "\"[]\"");
    } else if (mn == 0) {
        sb_printf(b, "\"[\" ( %s ( \",\" _ws %s )", it, it);
        if (mx < 0)
            sb_puts(b, "*");
        else
            sb_printf(b, "{0,%ld}", mx - 1);
        sb_puts(b, " )? \"]\"");
    } else {
        sb_printf(b, "\"[\" %s ( \",\" _ws %s )", it, it);
        if (mx < 0)
            sb_printf(b, "{%ld,}", mn - 1);
        else
            sb_printf(b, "{%ld,%ld}", mn - 1, mx - 1);
        sb_puts(b, " \"]\"");
    }
}

static void gen_object(sgen *G, const json_t *s, int rdepth, sbuf *b) {
    const json_t *props = json_object_get(s, "properties");
    const json_t *req = json_object_get(s, "required");
    const json_t *addl = json_object_get(s, "additionalProperties");
    if (addl && !json_is_boolean(addl)) {
        size_t l = path_push(G, ".additionalProperties");
        sg_fail(G, RK_ERR_UNSUPPORTED, "only true or false is supported");
        path_pop(G, l);
        return;
    }
    if (props && !json_is_object(props)) {
        size_t l = path_push(G, ".properties");
        sg_fail(G, RK_ERR_INVALID, "must be an object");
        path_pop(G, l);
        return;
    }
    if (req && !json_is_array(req)) {
        size_t l = path_push(G, ".required");
        sg_fail(G, RK_ERR_INVALID, "must be an array of property names");
        path_pop(G, l);
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
        sb_puts(b, addl && json_is_false(addl) ? "\"{}\"" : "_obj");
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
        sbuf k = {0};
        json_t *ks = json_string(key);
        char *enc = ks ? json_dumps(ks, JSON_ENCODE_ANY) : NULL;
        json_decref(ks);
        if (!enc) {
            sg_fail(G, RK_ERR_NOMEM, "out of memory");
            break;
        }
        gbnf_lit(&k, enc, strlen(enc));
        free(enc);
        sb_printf(&k, " \":\" _ws s%d", v);
        kv[i] = put_rule(G, G->n++, &k);
        i++;
    }
    if (G->st == RK_OK) {
        int after_next = -1, first_next = -1; /* rules for i + 1; -1: the empty rest */
        for (size_t r = np; r-- > 0;) {
            sbuf a = {0}, f = {0};
            char an[32] = "", fn[32] = "";
            if (after_next >= 0) snprintf(an, sizeof an, " s%d", after_next);
            if (first_next >= 0) snprintf(fn, sizeof fn, "s%d", first_next);
            if (req_of[r]) {
                sb_printf(&a, "\",\" _ws s%d%s", kv[r], an);
                sb_printf(&f, "s%d%s", kv[r], an);
            } else {
                sb_printf(&a, "( \",\" _ws s%d )?%s", kv[r], an);
                sb_printf(&f, "s%d%s | %s", kv[r], an, fn);
            }
            after_next = put_rule(G, G->n++, &a);
            first_next = put_rule(G, G->n++, &f);
        }
        sb_printf(b, "\"{\" s%d \"}\"", first_next);
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

static int gen_typed(sgen *G, const json_t *s, const char *type, int rdepth, sbuf *b) {
    if (!strcmp(type, "string"))
        gen_string(G, s, b);
    else if (!strcmp(type, "integer"))
        gen_numeric(G, s, 1, b);
    else if (!strcmp(type, "number"))
        gen_numeric(G, s, 0, b);
    else if (!strcmp(type, "boolean"))
        sb_puts(b, "( \"true\" | \"false\" )");
    else if (!strcmp(type, "null"))
        sb_puts(b, "\"null\"");
    else if (!strcmp(type, "object"))
        gen_object(G, s, rdepth, b);
    else if (!strcmp(type, "array"))
        gen_array(G, s, rdepth, b);
    else {
        size_t l = path_push(G, ".type");
        sg_fail(G, RK_ERR_INVALID, "unknown type '%s'", type);
        path_pop(G, l);
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
        sbuf b = {0};
        sb_puts(&b, "_never");
        rule = put_rule(G, G->n++, &b);
    } else {
        char saved[sizeof G->path];
        memcpy(saved, G->path, sizeof saved);
        snprintf(G->path, sizeof G->path, "%s", tpath);
        rule = gen(G, target, rdepth + 1);
        memcpy(G->path, saved, sizeof saved);
        if (rule < 0) return -1;
    }
    if (grow((void **)&G->memo, &G->cap_memo, G->n_memo + 1, sizeof *G->memo) < 0)
        return sg_fail(G, RK_ERR_NOMEM, "out of memory");
    G->memo[G->n_memo++] = (memo_entry){target, rdepth, rule};
    return rule;
}

/* The rule for schema s; -1 with G's error set. */
static int gen(sgen *G, const json_t *s, int rdepth) {
    if (json_is_true(s)) {
        sbuf b = {0};
        sb_puts(&b, "_val");
        return put_rule(G, G->n++, &b);
    }
    if (!json_is_object(s)) return sg_fail(G, RK_ERR_INVALID, "a schema must be an object");
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)s, key, val) {
        int known = 0;
        for (int i = 0; k_keywords[i] && !known; i++) known = !strcmp(k_keywords[i], key);
        if (!known) {
            size_t l = path_push(G, ".%s", key);
            sg_fail(G, RK_ERR_UNSUPPORTED, "keyword '%s' is not supported", key);
            path_pop(G, l);
            return -1;
        }
    }
    const json_t *ref = json_object_get(s, "$ref");
    if (ref) return gen_ref(G, ref, rdepth);
    sbuf b = {0};
    const json_t *en = json_object_get(s, "enum"), *cn = json_object_get(s, "const");
    const json_t *any = json_object_get(s, "anyOf"), *type = json_object_get(s, "type");
    if (en || cn) {
        if (en && (!json_is_array(en) || !json_array_size(en))) {
            size_t l = path_push(G, ".enum");
            sg_fail(G, RK_ERR_INVALID, "must be a non-empty array");
            path_pop(G, l);
            free(b.p);
            return -1;
        }
        size_t n = en ? json_array_size(en) : 1;
        sb_puts(&b, "( ");
        for (size_t i = 0; i < n; i++) {
            char *enc = json_dumps(en ? json_array_get(en, i) : cn, JSON_ENCODE_ANY | JSON_COMPACT);
            if (!enc) {
                free(b.p);
                return sg_fail(G, RK_ERR_NOMEM, "out of memory");
            }
            if (i) sb_puts(&b, "| ");
            gbnf_lit(&b, enc, strlen(enc));
            sb_puts(&b, " ");
            free(enc);
        }
        sb_puts(&b, ")");
    } else if (any) {
        if (!json_is_array(any) || !json_array_size(any)) {
            size_t l = path_push(G, ".anyOf");
            sg_fail(G, RK_ERR_INVALID, "must be a non-empty array of schemas");
            path_pop(G, l);
            free(b.p);
            return -1;
        }
        sb_puts(&b, "( ");
        for (size_t i = 0; i < json_array_size(any); i++) {
            size_t l = path_push(G, ".anyOf[%zu]", i);
            int r = gen(G, json_array_get(any, i), rdepth);
            path_pop(G, l);
            if (r < 0) {
                free(b.p);
                return -1;
            }
            sb_printf(&b, "%ss%d ", i ? "| " : "", r);
        }
        sb_puts(&b, ")");
    } else if (json_is_string(type)) {
        gen_typed(G, s, json_string_value(type), rdepth, &b);
    } else if (json_is_array(type) && json_array_size(type)) {
        sb_puts(&b, "( ");
        for (size_t i = 0; i < json_array_size(type) && G->st == RK_OK; i++) {
            const json_t *t = json_array_get(type, i);
            if (!json_is_string(t)) {
                size_t l = path_push(G, ".type[%zu]", i);
                sg_fail(G, RK_ERR_INVALID, "must be a type name");
                path_pop(G, l);
                break;
            }
            if (i) sb_puts(&b, "| ");
            sb_puts(&b, "( ");
            gen_typed(G, s, json_string_value(t), rdepth, &b);
            sb_puts(&b, ") ");
        }
        sb_puts(&b, ")");
    } else if (type) {
        size_t l = path_push(G, ".type");
        sg_fail(G, RK_ERR_INVALID, "must be a type name or an array of them");
        path_pop(G, l);
    } else if (json_object_get(s, "properties")) {
        gen_object(G, s, rdepth, &b);
    } else if (json_object_get(s, "items")) {
        gen_array(G, s, rdepth, &b);
    } else {
        sb_puts(&b, "_val");
    }
    if (G->st != RK_OK) {
        free(b.p);
        return -1;
    }
    return put_rule(G, G->n++, &b);
}

static char *schema_text(const json_t *schema, rk_status *st) {
    sgen G = {0};
    G.root = schema;
    snprintf(G.path, sizeof G.path, "$");
    sb_puts(&G.out, k_json_prelude);
    int r = gen(&G, schema, 0);
    free(G.memo);
    if (r >= 0 && !G.out.oom) sb_printf(&G.out, "root ::= s%d\n", r);
    if (r < 0 || G.out.oom) {
        if (G.st == RK_OK)
            *st = rk_errorf(RK_ERR_NOMEM, "grammar: out of memory");
        else
            *st = rk_errorf(G.st, "%s", G.err);
        free(G.out.p);
        return NULL;
    }
    *st = RK_OK;
    return G.out.p;
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
        return rk_errorf(st, "$: the schema compiled to an invalid grammar: %s", msg);
    }
    return RK_OK;
}

rk_status rk_grammar_from_calls(const rk_grammar_call *calls, int n, const char *sep,
                                rk_grammar **out) {
    *out = NULL;
    if (n < 1) return rk_errorf(RK_ERR_INVALID, "grammar: no call to allow");
    sgen G = {0};
    sb_puts(&G.out, k_json_prelude);
    sbuf alts = {0};
    for (int i = 0; i < n && G.st == RK_OK; i++) {
        G.root = calls[i].schema;
        G.n_memo = 0;
        snprintf(G.path, sizeof G.path, "%s", calls[i].path ? calls[i].path : "$");
        int r = calls[i].schema ? gen(&G, calls[i].schema, 0) : -1;
        if (calls[i].schema && r < 0) break;
        sbuf c = {0};
        gbnf_lit(&c, calls[i].open, strlen(calls[i].open));
        if (r >= 0)
            sb_printf(&c, " s%d ", r);
        else
            sb_puts(&c, " _obj ");
        gbnf_lit(&c, calls[i].close, strlen(calls[i].close));
        int cr = put_rule(&G, G.n++, &c);
        sb_printf(&alts, "%ss%d", i ? " | " : "", cr);
    }
    free(G.memo);
    if (G.st != RK_OK) {
        free(alts.p);
        free(G.out.p);
        return rk_errorf(G.st, "%s", G.err);
    }
    sb_puts(&G.out, "_call ::= ");
    sb_puts(&G.out, alts.p ? alts.p : "");
    sb_puts(&G.out, "\nroot ::= _call");
    if (sep) {
        sb_puts(&G.out, " ( ");
        gbnf_lit(&G.out, sep, strlen(sep));
        sb_puts(&G.out, " _call )*");
    }
    sb_puts(&G.out, "\n");
    free(alts.p);
    if (G.out.oom || alts.oom) {
        free(G.out.p);
        return rk_errorf(RK_ERR_NOMEM, "grammar: out of memory");
    }
    rk_status st = rk_grammar_parse(G.out.p, out);
    free(G.out.p);
    return st;
}

rk_status rk_grammar_json_object(rk_grammar **out) {
    sbuf b = {0};
    sb_puts(&b, k_json_prelude);
    sb_puts(&b, "root ::= _obj\n");
    if (b.oom) {
        free(b.p);
        return rk_errorf(RK_ERR_NOMEM, "grammar: out of memory");
    }
    rk_status st = rk_grammar_parse(b.p, out);
    free(b.p);
    return st;
}
