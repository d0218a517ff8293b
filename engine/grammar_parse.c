/* engine/grammar_parse.c — grammar text compiled into byte-level rules (see
 * engine/grammar.h and engine/grammar_internal.h).
 *
 * A grammar is a set of rules whose alternatives are sequences of byte
 * classes and rule references; literals, classes, groups and repetitions in
 * the text are desugared into such rules as they are parsed. After parsing,
 * the rules are grouped and checked: undefined rules, left recursion, rules
 * that match nothing (their alternatives are marked dead), and the fewest
 * bytes that finish each sequence. */
#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/grammar_internal.h"

/* The parser's growing grammar. Alternatives are appended whole (their
 * elements contiguous, then RK_GRAM_END) and grouped by rule when it finishes. */
typedef struct builder {
    char **names;
    uint8_t *defined;
    int n_rules, cap_rules;
    int32_t *alt_rule, *alt_start;
    int n_alts, cap_alts;
    rk_gram_elem *elems;
    int n_elems, cap_elems;
    uint64_t (*sets)[4];
    int n_sets, cap_sets;
    int32_t *name_hash; /* open addressing over names, -1 empty */
    int name_hash_cap;
    int oom;
    int over;         /* a bound was hit (err says which) */
    double deadline;  /* thread_cpu_s() past which compiling stops */
    double max_ms;    /* the bound it came from, for the message */
    unsigned n_ticks; /* calls of b_late, so the clock is read now and then */
    const char *p;    /* parse position */
    int line;
    char err[256];
} builder;

typedef struct evec {
    rk_gram_elem *p;
    int n, cap;
} evec;

int rk_gram_grow(void **p, int *cap, int need, size_t size) {
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
    if (rk_gram_grow((void **)&v->p, &v->cap, v->n + 1, sizeof *v->p) < 0) {
        b->oom = 1;
        return;
    }
    v->p[v->n++] = (rk_gram_elem){type, val};
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

/* Seconds of CPU time the calling thread has used. The compile bound is on
 * the compile's own work, so that a loaded machine (the compiling thread
 * waiting for a core) refuses no grammar an idle one accepts. */
static double thread_cpu_s(void) {
    struct timespec t;
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t)) return rk_time_now();
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* Past the compile deadline? Reads the clock one call in 256 (and on the
 * first); a late builder fails with the time bound. */
static int b_late(builder *b) {
    if (b->over) return 1;
    if (b->n_ticks++ % 256) return 0;
    if (thread_cpu_s() <= b->deadline) return 0;
    b->over = 1;
    b->err[0] = 0;
    snprintf(b->err, sizeof b->err,
             "grammar: compiling it took longer than the bound of %g ms of CPU time (make it "
             "smaller)",
             b->max_ms);
    return 1;
}

static uint32_t name_hash(const char *s, size_t len) {
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < len; i++) h = (h ^ (unsigned char)s[i]) * 16777619u;
    return h;
}

/* Put rule id r (named names[r]) in the name table, growing it. -1: no memory. */
static int name_insert(builder *b, int r) {
    if ((r + 1) * 2 > b->name_hash_cap) {
        int cap = b->name_hash_cap ? b->name_hash_cap * 2 : 256;
        int32_t *t = malloc((size_t)cap * sizeof *t);
        if (!t) return -1;
        memset(t, 0xff, (size_t)cap * sizeof *t);
        free(b->name_hash);
        b->name_hash = t;
        b->name_hash_cap = cap;
        for (int i = 0; i < r; i++) {
            uint32_t k = name_hash(b->names[i], strlen(b->names[i])) & (uint32_t)(cap - 1);
            while (t[k] >= 0) k = (k + 1) & (uint32_t)(cap - 1);
            t[k] = i;
        }
    }
    uint32_t k = name_hash(b->names[r], strlen(b->names[r])) & (uint32_t)(b->name_hash_cap - 1);
    while (b->name_hash[k] >= 0) k = (k + 1) & (uint32_t)(b->name_hash_cap - 1);
    b->name_hash[k] = r;
    return 0;
}

static int new_rule(builder *b, const char *name, size_t len) {
    if (b->n_rules >= RK_GRAMMAR_MAX_RULES) {
        if (!b->err[0])
            snprintf(b->err, sizeof b->err,
                     "grammar: more than %d rules (repetitions are expanded into rules: lower "
                     "their counts)",
                     RK_GRAMMAR_MAX_RULES);
        b->over = 1;
        return -1;
    }
    if (rk_gram_grow((void **)&b->names, &b->cap_rules, b->n_rules + 1, sizeof *b->names) < 0) {
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
    if (name_insert(b, b->n_rules) < 0) {
        free(s);
        b->oom = 1;
        return -1;
    }
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
    if (b->name_hash_cap) {
        uint32_t k = name_hash(name, len) & (uint32_t)(b->name_hash_cap - 1);
        for (; b->name_hash[k] >= 0; k = (k + 1) & (uint32_t)(b->name_hash_cap - 1)) {
            const char *n = b->names[b->name_hash[k]];
            if (strlen(n) == len && !memcmp(n, name, len)) return b->name_hash[k];
        }
    }
    return new_rule(b, name, len);
}

static void add_alt(builder *b, int rule, const evec *v) {
    if (b_failed(b) || rule < 0 || b_late(b)) return;
    if (rk_gram_grow((void **)&b->elems, &b->cap_elems, b->n_elems + v->n + 1, sizeof *b->elems) <
            0 ||
        rk_gram_grow((void **)&b->alt_rule, &b->cap_alts, b->n_alts + 1, sizeof *b->alt_rule) < 0) {
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
    b->elems[b->n_elems++] = (rk_gram_elem){RK_GRAM_END, 0};
}

static int new_set(builder *b, const uint64_t set[4]) {
    if (rk_gram_grow((void **)&b->sets, &b->cap_sets, b->n_sets + 1, sizeof *b->sets) < 0) {
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

int rk_gram_hexval(char c) {
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
        int h = rk_gram_hexval(b->p[0]), l = h >= 0 ? rk_gram_hexval(b->p[1]) : -1;
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
            if (ch >= 0) ev_push(b, out, RK_GRAM_SET, byte_set(b, (unsigned)ch, (unsigned)ch));
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
            ev_push(b, out, RK_GRAM_SET, new_set(b, set));
            return;
        }
        /* [^...]: the other ASCII bytes, or any multi-byte UTF-8 character. */
        uint64_t inv[4] = {~set[0], ~set[1], 0, 0};
        int r = anon_rule(b);
        evec a = {0};
        ev_push(b, &a, RK_GRAM_SET, new_set(b, inv));
        add_alt(b, r, &a);
        a.n = 0;
        ev_push(b, &a, RK_GRAM_REF, rule_id(b, "_utf8mb", 7));
        add_alt(b, r, &a);
        free(a.p);
        ev_push(b, out, RK_GRAM_REF, r);
    } else if (c == '.') {
        b->p++;
        ev_push(b, out, RK_GRAM_REF, rule_id(b, "_anychar", 8));
    } else if (c == '(') {
        b->p++;
        int r = anon_rule(b);
        parse_alternatives(b, r);
        skip_space(b);
        if (*b->p != ')') B_FAIL(b, "missing ')'");
        b->p++;
        ev_push(b, out, RK_GRAM_REF, r);
    } else if (is_name_char(c)) {
        const char *s = b->p;
        while (is_name_char(*b->p)) b->p++;
        ev_push(b, out, RK_GRAM_REF, rule_id(b, s, (size_t)(b->p - s)));
    } else {
        b_fail(b, "unexpected '%c'", c);
    }
}

/* x* as a rule R ::= x R | "". */
static int star_rule(builder *b, rk_gram_elem x) {
    int r = anon_rule(b);
    evec a = {0};
    ev_push(b, &a, x.type, x.v);
    ev_push(b, &a, RK_GRAM_REF, r);
    add_alt(b, r, &a);
    a.n = 0;
    add_alt(b, r, &a);
    free(a.p);
    return r;
}

/* Append x with its quantifier (already parsed into lo, hi; hi < 0: none). */
static void add_repeat(builder *b, evec *seq, rk_gram_elem x, long lo, long hi) {
    for (long i = 0; i < lo; i++) ev_push(b, seq, x.type, x.v);
    if (hi < 0) {
        ev_push(b, seq, RK_GRAM_REF, star_rule(b, x));
        return;
    }
    /* hi - lo optional copies, nested: O_k ::= x O_(k-1) | "". */
    int prev = -1;
    evec a = {0};
    for (long k = 1; k <= hi - lo && !b_failed(b); k++) {
        int r = anon_rule(b);
        a.n = 0;
        ev_push(b, &a, x.type, x.v);
        if (prev >= 0) ev_push(b, &a, RK_GRAM_REF, prev);
        add_alt(b, r, &a);
        a.n = 0;
        add_alt(b, r, &a);
        prev = r;
    }
    free(a.p);
    if (prev >= 0) ev_push(b, seq, RK_GRAM_REF, prev);
}

int rk_gram_repeat(const char *p, long *lo, long *hi, const char **end) {
    char *e;
    *lo = strtol(p + 1, &e, 10);
    if (e == p + 1) return -1;
    *hi = *lo;
    if (*e == ',') {
        char *f;
        *hi = strtol(e + 1, &f, 10);
        if (f == e + 1) *hi = -1;
        e = f;
    }
    if (*e != '}' || *lo < 0 || (*hi >= 0 && *hi < *lo) || *lo > RK_GRAMMAR_MAX_REPEAT ||
        *hi > RK_GRAMMAR_MAX_REPEAT)
        return -2;
    *end = e + 1;
    return 0;
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
            const char *e;
            int rc = rk_gram_repeat(b->p, &lo, &hi, &e);
            if (rc < 0) {
                free(prim.p);
                if (rc == -1) B_FAIL(b, "'{' needs a count");
                B_FAIL(b, "bad repetition {m,n} (0 <= m <= n <= %d)", RK_GRAMMAR_MAX_REPEAT);
            }
            b->p = e;
        }
        rk_gram_elem x;
        if (prim.n == 1) {
            x = prim.p[0];
        } else {
            x = (rk_gram_elem){RK_GRAM_REF, wrap_rule(b, &prim)};
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
    free(b->name_hash);
}

rk_grammar *rk_grammar_ref(rk_grammar *g) {
    if (g) __atomic_add_fetch(&g->refs, 1, __ATOMIC_RELAXED);
    return g;
}

void rk_grammar_free(rk_grammar *g) {
    if (!g || __atomic_sub_fetch(&g->refs, 1, __ATOMIC_ACQ_REL) > 0) return;
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

/* Which rules match "" (nullable[r]); -1 when the compile deadline passed. */
static int fixpoint_nullable(builder *b, const rk_grammar *g, uint8_t *nullable) {
    int changed = 1;
    while (changed) {
        if (b_late(b)) return -1;
        changed = 0;
        for (int r = 0; r < g->n_rules; r++) {
            if (nullable[r]) continue;
            for (int a = g->alt_off[r]; a < g->alt_off[r + 1] && !nullable[r]; a++) {
                const rk_gram_elem *e = g->elems + g->alt_start[a];
                while (e->type == RK_GRAM_REF && nullable[e->v]) e++;
                if (e->type == RK_GRAM_END) nullable[r] = 1, changed = 1;
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
        for (const rk_gram_elem *e = g->elems + g->alt_start[a]; e->type == RK_GRAM_REF; e++) {
            int c = left_cycle(g, nullable, e->v, colour);
            if (c >= 0) return c;
            if (!nullable[e->v]) break;
        }
    }
    colour[r] = 2;
    return -1;
}

/* Does the byte class match no byte? */
static int set_empty(const uint64_t set[4]) { return !(set[0] | set[1] | set[2] | set[3]); }

/* Group the builder's alternatives by rule and check the grammar. */
static rk_status finish(builder *b, rk_grammar **out) {
    if (b->oom) return rk_errorf(RK_ERR_NOMEM, "grammar: out of memory");
    if (b->err[0]) return rk_errorf(b->over ? RK_ERR_LIMIT : RK_ERR_INVALID, "%s", b->err);
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
    g->refs = 1;
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
#define LATE_OUT                                                                                   \
    do {                                                                                           \
        if (b_late(b)) {                                                                           \
            st = rk_errorf(RK_ERR_LIMIT, "%s", b->err);                                            \
            goto done;                                                                             \
        }                                                                                          \
    } while (0)
    if (fixpoint_nullable(b, g, nullable) < 0) LATE_OUT;
    for (int r = 0; r < g->n_rules; r++) {
        LATE_OUT;
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
        LATE_OUT;
        changed = 0;
        for (int r = 0; r < g->n_rules; r++) {
            if (prod[r]) continue;
            for (int a = g->alt_off[r]; a < g->alt_off[r + 1] && !prod[r]; a++) {
                const rk_gram_elem *e = g->elems + g->alt_start[a];
                int ok = 1;
                for (; e->type != RK_GRAM_END && ok; e++) {
                    if (e->type == RK_GRAM_REF)
                        ok = prod[e->v];
                    else
                        ok = !set_empty(g->sets[e->v]);
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
            for (const rk_gram_elem *e = g->elems + g->alt_start[a]; e->type != RK_GRAM_END; e++) {
                int ok = e->type == RK_GRAM_REF ? prod[e->v] : !set_empty(g->sets[e->v]);
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
        if (b_late(b)) {
            free(rmin);
            st = rk_errorf(RK_ERR_LIMIT, "%s", b->err);
            goto done;
        }
        changed = 0;
        for (int r = 0; r < g->n_rules; r++)
            for (int a = g->alt_off[r]; a < g->alt_off[r + 1]; a++) {
                if (g->alt_dead[a]) continue;
                int64_t n = 0;
                for (const rk_gram_elem *e = g->elems + g->alt_start[a]; e->type != RK_GRAM_END;
                     e++)
                    n += e->type == RK_GRAM_SET ? 1 : rmin[e->v];
                if (n < rmin[r]) rmin[r] = (int32_t)n, changed = 1;
            }
    }
    for (int a = 0; a < g->n_alts; a++) {
        int end = g->alt_start[a];
        while (g->elems[end].type != RK_GRAM_END) end++;
        int64_t n = 0;
        g->minlen[end] = 0;
        for (int i = end - 1; i >= g->alt_start[a]; i--) {
            n += g->elems[i].type == RK_GRAM_SET ? 1 : rmin[g->elems[i].v];
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

rk_status rk_grammar_parse_within(const char *text, double max_ms, rk_grammar **out) {
    *out = NULL;
    builder b = {0};
    b.deadline = thread_cpu_s() + max_ms / 1e3;
    b.max_ms = max_ms;
    parse_rules(&b, k_prelude);
    if (!b_failed(&b)) {
        b.err[0] = 0;
        parse_rules(&b, text);
    }
    rk_status st = finish(&b, out);
    builder_free(&b);
    return st;
}

rk_status rk_grammar_parse(const char *text, rk_grammar **out) {
    return rk_grammar_parse_within(text, RK_GRAMMAR_MAX_COMPILE_MS, out);
}
