/* engine/grammar.c — a request's grammar state: its pushdown stacks
 * interned into a lazily built automaton, stepped by bytes and tokens, and
 * the token masks found by walking the vocabulary's byte trie (see
 * engine/grammar.h; the rules come from grammar_parse.c, the trie from
 * grammar_vocab.c). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/grammar_internal.h"

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
#define RK_GRAMMAR_MAX_FRAMES 1048576
#define RK_GRAMMAR_MASK_SLOTS 256
/* The most positions one state's expansion may visit (its stacks included). */
#define RK_GRAMMAR_MAX_VISITS 65536
#define RK_STR_(x)            #x
#define RK_STR(x)             RK_STR_(x)

/* A position visited while expanding: element pos over frame parent, in the
 * round gen (entries of older rounds count as empty). */
typedef struct visit {
    int32_t pos, parent;
    uint32_t gen;
} visit;

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
    visit *visits; /* open addressing: what this round's expansion has seen */
    int n_visits, cap_visits;
    uint32_t gen;
    int64_t n_steps; /* transitions computed by expanding (step_slow) */
    int start;       /* the state at the start of the grammar */
    int cur;
    int finished;
    int error;         /* an allocation or a bound failed while expanding */
    const char *bound; /* which bound, or NULL (out of memory) */
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
        rk_gram_grow((void **)&s->frames, &s->cap_frames, s->n_frames + 1, sizeof *s->frames) < 0)
        return -1;
    int32_t id = s->n_frames++;
    s->frames[id] = (frame){pos, parent};
    s->fhash[k] = id;
    if (s->n_frames * 2 > s->fhash_cap && rehash_frames(s, s->fhash_cap * 2) < 0) return -1;
    return id;
}

static void fail_bound(rk_grammar_state *s, const char *bound) {
    s->error = 1;
    s->bound = bound;
}

/* Start a round of expansion (one state's): nothing visited yet. */
static void visits_clear(rk_grammar_state *s) {
    s->n_scratch = 0;
    s->n_visits = 0;
    s->error = 0;
    s->bound = NULL;
    if (++s->gen == 0) { /* wrapped: old stamps could be taken for new */
        for (int i = 0; i < s->cap_visits; i++) s->visits[i].gen = 0;
        s->gen = 1;
    }
}

static uint32_t visit_slot(const visit *t, int cap, uint32_t gen, int32_t pos, int32_t parent) {
    uint32_t k = mix(mix(2166136261u, (uint32_t)pos), (uint32_t)parent) & (uint32_t)(cap - 1);
    while (t[k].gen == gen && (t[k].pos != pos || t[k].parent != parent))
        k = (k + 1) & (uint32_t)(cap - 1);
    return k;
}

/* Mark (pos, parent) visited in this round: 1 when it was not yet, 0 when
 * it was, -1 when a bound or an allocation failed (s->error set). */
static int visit_once(rk_grammar_state *s, int32_t pos, int32_t parent) {
    if (s->n_visits * 2 >= s->cap_visits) {
        if (s->n_visits >= RK_GRAMMAR_MAX_VISITS) {
            fail_bound(s, "one state's expansion visits more than " RK_STR(
                              RK_GRAMMAR_MAX_VISITS) " grammar positions");
            return -1;
        }
        int cap = s->cap_visits ? s->cap_visits * 2 : 1024;
        visit *t = calloc((size_t)cap, sizeof *t);
        if (!t) {
            s->error = 1;
            return -1;
        }
        for (int i = 0; i < s->cap_visits; i++)
            if (s->visits[i].gen == s->gen)
                t[visit_slot(t, cap, s->gen, s->visits[i].pos, s->visits[i].parent)] = s->visits[i];
        free(s->visits);
        s->visits = t;
        s->cap_visits = cap;
    }
    uint32_t k = visit_slot(s->visits, s->cap_visits, s->gen, pos, parent);
    if (s->visits[k].gen == s->gen) return 0;
    s->visits[k] = (visit){pos, parent, s->gen};
    s->n_visits++;
    return 1;
}

static void push_leaf(rk_grammar_state *s, int32_t pos, int32_t parent) {
    if (s->n_scratch >= RK_GRAMMAR_MAX_WIDTH) {
        fail_bound(s, "a state holds more than " RK_STR(
                          RK_GRAMMAR_MAX_WIDTH) " alternatives at once (a rule with that many "
                                                "alternatives that start "
                                                "alike: factor their common prefixes)");
        return;
    }
    if (rk_gram_grow((void **)&s->scratch, &s->cap_scratch, s->n_scratch + 1, sizeof *s->scratch) <
        0) {
        s->error = 1;
        return;
    }
    s->scratch[s->n_scratch++] = (leaf){pos, parent};
}

/* Expand the stack (pos over parent) into leaves: follow rule references
 * down to their byte classes and the ends of sequences up to their callers.
 * A reference that ends its sequence returns straight to the caller's
 * caller, so right recursion (x*) keeps stacks from growing. A position
 * already visited in this round is not expanded again (its leaves are in),
 * so a round costs at most one visit per distinct position. */
static void expand(rk_grammar_state *s, int32_t pos, int32_t parent, int *accept) {
    const rk_grammar *g = s->g;
    for (;;) {
        if (s->error) return;
        int v = visit_once(s, pos, parent);
        if (v <= 0) return;
        rk_gram_elem e = g->elems[pos];
        if (e.type == RK_GRAM_END) {
            if (parent < 0) {
                *accept = 1;
                return;
            }
            pos = s->frames[parent].pos;
            parent = s->frames[parent].parent;
            continue;
        }
        if (e.type == RK_GRAM_SET) {
            push_leaf(s, pos, parent);
            return;
        }
        int32_t ret = parent;
        if (g->elems[pos + 1].type != RK_GRAM_END) {
            ret = intern_frame(s, pos + 1, parent);
            if (ret < 0) {
                if (s->n_frames >= RK_GRAMMAR_MAX_FRAMES)
                    fail_bound(s, "the stacks hold more than " RK_STR(
                                      RK_GRAMMAR_MAX_FRAMES) " return frames (nesting too deep)");
                else
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
    /* No leaves (a grammar that may only end here) leaves scratch NULL:
     * qsort, memcmp and memcpy are not called with it. */
    int sorted = 1; /* often already: leaves that each step past one byte keep their order */
    for (int i = 1; i < s->n_scratch && sorted; i++)
        sorted = leaf_cmp(&s->scratch[i - 1], &s->scratch[i]) < 0;
    if (!sorted) qsort(s->scratch, (size_t)s->n_scratch, sizeof *s->scratch, leaf_cmp);
    uint32_t h = mix(2166136261u, (uint32_t)accept);
    for (int i = 0; i < s->n_scratch; i++)
        h = mix(mix(h, (uint32_t)s->scratch[i].pos), (uint32_t)s->scratch[i].parent);
    uint32_t k = h & (uint32_t)(s->shash_cap - 1);
    for (; s->shash[k] >= 0; k = (k + 1) & (uint32_t)(s->shash_cap - 1)) {
        const dstate *d = &s->st[s->shash[k]];
        if (d->hash == h && d->accept == accept && d->n_leaf == s->n_scratch &&
            (!s->n_scratch ||
             !memcmp(s->leafs + d->leaf_off, s->scratch, (size_t)s->n_scratch * sizeof(leaf))))
            return s->shash[k];
    }
    if (s->n_st >= RK_GRAMMAR_MAX_STATES) {
        fail_bound(s, "the automaton has more than " RK_STR(RK_GRAMMAR_MAX_STATES) " states");
        return T_ERROR;
    }
    if (rk_gram_grow((void **)&s->st, &s->cap_st, s->n_st + 1, sizeof *s->st) < 0 ||
        rk_gram_grow((void **)&s->leafs, &s->cap_leafs, s->n_leafs + s->n_scratch,
                     sizeof *s->leafs) < 0)
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
    if (s->n_scratch)
        memcpy(s->leafs + s->n_leafs, s->scratch, (size_t)s->n_scratch * sizeof(leaf));
    s->n_leafs += s->n_scratch;
    s->shash[k] = id;
    if (s->n_st * 2 > s->shash_cap && rehash_states(s, s->shash_cap * 2) < 0) return T_ERROR;
    return id;
}

/* The byte classes of state sid's leaves, each once (by content: every
 * class written in a grammar is a class of its own), into sets (at most
 * max); their count, or -1 when there are more than max. */
static int leaf_sets(const rk_grammar_state *s, int32_t sid, int32_t *sets, int max) {
    int n_sets = 0;
    const dstate *d = &s->st[sid];
    const rk_grammar *g = s->g;
    for (int32_t i = 0; i < d->n_leaf; i++) {
        int32_t set = g->elems[s->leafs[d->leaf_off + i].pos].v;
        int k = 0;
        while (k < n_sets && sets[k] != set &&
               memcmp(g->sets[sets[k]], g->sets[set], sizeof g->sets[0]))
            k++;
        if (k < n_sets) continue;
        if (n_sets == max) return -1;
        sets[n_sets++] = set;
    }
    return n_sets;
}

/* Every byte that the same leaves of state sid accept as byte c leads to
 * the same state: give row (sid's) that state for each of them at once, so
 * that a wide state is expanded once per group of bytes its classes tell
 * apart, not once per byte (26 times for [a-z]). Only where the state's
 * leaves use at most 64 classes (one bit each); otherwise bytes are stepped
 * one by one. */
static void fill_alike(const rk_grammar_state *s, int32_t sid, unsigned c, int32_t *row) {
    int32_t sets[64];
    int n_sets = leaf_sets(s, sid, sets, 64);
    if (n_sets < 0) return;
    uint64_t key[256] = {0};
    for (int k = 0; k < n_sets; k++) {
        const uint64_t *set = s->g->sets[sets[k]];
        for (unsigned b = 0; b < 256; b++)
            if (set[b >> 6] >> (b & 63) & 1) key[b] |= 1ull << k;
    }
    for (unsigned b = 0; b < 256; b++)
        if (row[b] == T_UNKNOWN && key[b] == key[c]) row[b] = row[c];
}

/* The state after byte c from state sid (computed once, then looked up). */
static int32_t step_slow(rk_grammar_state *s, int32_t sid, unsigned c) {
    if (s->st[sid].row < 0) {
        if (rk_gram_grow((void **)&s->rows, &s->cap_rows, (s->n_rows + 1) * 256, sizeof *s->rows) <
            0)
            return T_ERROR;
        int32_t *r = s->rows + (size_t)s->n_rows * 256;
        for (int i = 0; i < 256; i++) r[i] = T_UNKNOWN;
        s->st[sid].row = s->n_rows++;
    }
    const rk_grammar *g = s->g;
    visits_clear(s);
    s->n_steps++;
    int accept = 0;
    int32_t off = s->st[sid].leaf_off, n = s->st[sid].n_leaf;
    for (int32_t i = 0; i < n; i++) {
        leaf l = s->leafs[off + i];
        const uint64_t *set = g->sets[g->elems[l.pos].v];
        if (set[c >> 6] >> (c & 63) & 1) expand(s, l.pos + 1, l.parent, &accept);
    }
    int32_t t = intern_state(s, accept);
    if (t == T_ERROR) return t;
    int32_t *row = s->rows + (size_t)s->st[sid].row * 256;
    row[c] = t;
    fill_alike(s, sid, c, row);
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
    free(s->visits);
    free(s);
}

/* The error for a failed step: the bound that was hit (RK_ERR_LIMIT) or
 * out of memory. */
static rk_status state_error(const rk_grammar_state *s) {
    if (s->bound) return rk_errorf(RK_ERR_LIMIT, "grammar: %s", s->bound);
    return rk_errorf(RK_ERR_NOMEM, "grammar: out of memory");
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
    visits_clear(s);
    for (int a = g->alt_off[g->root]; a < g->alt_off[g->root + 1]; a++)
        if (!g->alt_dead[a]) expand(s, g->alt_start[a], -1, &accept);
    s->cur = s->start = intern_state(s, accept);
    if (s->cur < 0) {
        rk_status st = state_error(s);
        rk_grammar_state_free(s);
        return st;
    }
    *out = s;
    return RK_OK;
}

void rk_grammar_state_reset(rk_grammar_state *s) {
    s->cur = s->start;
    s->finished = 0;
}

static int32_t state_minb(rk_grammar_state *s, int32_t sid);

/* Walk the vocabulary trie from the current state in preorder, skipping
 * the subtree of every node whose byte the state refuses, and set in m
 * (zeroed first) every token the state allows that leaves at most budget
 * bytes to finish the output, then the end-of-generation tokens where the
 * output may end. *max_after gets the most bytes any token set as text
 * leaves, *count the tokens set. T_ERROR when the automaton outgrew its
 * bound, else 0. */
static int mask_walk(rk_grammar_state *s, int budget, uint64_t *m, int32_t *max_after, int *count) {
    const rk_grammar_vocab *v = s->v;
    memset(m, 0, ((size_t)v->n_vocab + 63) / 64 * sizeof *m);
    int32_t *walk = s->walk;
    walk[0] = s->cur;
    const uint8_t *byte = v->byte;
    const uint16_t *depth = v->depth;
    int32_t most = 0;
    int n = 0;
    for (int32_t i = 1; i < v->n_nodes;) {
        int32_t t = step(s, walk[depth[i] - 1], byte[i]);
        if (t < 0) {
            if (t == T_ERROR) return T_ERROR;
            i = v->skip[i];
            continue;
        }
        walk[depth[i]] = t;
        if (v->tok[i] >= 0) {
            int32_t mb = state_minb(s, t);
            if (mb <= budget) {
                if (mb > most) most = mb;
                for (int32_t k = v->tok[i]; k >= 0; k = v->tok_next[k]) {
                    m[k >> 6] |= 1ull << (k & 63);
                    n++;
                }
            }
        }
        i++;
    }
    if (s->st[s->cur].accept)
        for (int i = 0; i < v->n_eog; i++) m[v->eog[i] >> 6] |= 1ull << (v->eog[i] & 63), n++;
    *max_after = most;
    *count = n;
    return 0;
}

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
    int32_t max_after;
    int n_allowed;
    if (mask_walk(s, INT32_MAX, m, &max_after, &n_allowed) == T_ERROR) return state_error(s);
    d = &s->st[s->cur]; /* the walk may have moved the state array */
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
        if (cur == T_ERROR) return state_error(s);
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
    int32_t max_after;
    if (mask_walk(s, budget, m, &max_after, n_allowed) == T_ERROR) return state_error(s);
    *mask = m;
    return RK_OK;
}

int rk_grammar_state_can_end(const rk_grammar_state *s) { return s->st[s->cur].accept; }

int rk_grammar_state_must_end(const rk_grammar_state *s) {
    return s->finished || s->st[s->cur].n_leaf == 0;
}

int rk_grammar_state_n_states(const rk_grammar_state *s) { return s->n_st; }

int64_t rk_grammar_state_n_steps(const rk_grammar_state *s) { return s->n_steps; }
