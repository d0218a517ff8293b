/* engine/grammar_cache.c — compiled grammars by content (see
 * engine/grammar.h): a small table of the most recently used, keyed by the
 * XXH3-128 of what they were compiled from (the grammar text or the
 * schema's compact JSON, seeded by its kind), shared by reference. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "engine/grammar_internal.h"

typedef struct cache_entry {
    XXH128_hash_t key;
    rk_grammar *g; /* NULL: empty */
    uint64_t used; /* the cache's clock at the last hit */
} cache_entry;

struct rk_grammar_cache {
    pthread_mutex_t lock;
    cache_entry *e; /* (cap) */
    int cap;
    uint64_t clock;
    int64_t hits, misses;
};

rk_status rk_grammar_cache_create(int capacity, rk_grammar_cache **out) {
    *out = NULL;
    rk_grammar_cache *c = calloc(1, sizeof *c);
    if (c) c->e = calloc((size_t)(capacity > 0 ? capacity : 1), sizeof *c->e);
    if (!c || !c->e) {
        free(c);
        return rk_errorf(RK_ERR_NOMEM, "grammar cache: out of memory");
    }
    c->cap = capacity > 0 ? capacity : 1;
    pthread_mutex_init(&c->lock, NULL);
    *out = c;
    return RK_OK;
}

void rk_grammar_cache_free(rk_grammar_cache *c) {
    if (!c) return;
    for (int i = 0; i < c->cap; i++) rk_grammar_free(c->e[i].g);
    free(c->e);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

void rk_grammar_cache_counts(rk_grammar_cache *c, int64_t *hits, int64_t *misses) {
    pthread_mutex_lock(&c->lock);
    *hits = c->hits;
    *misses = c->misses;
    pthread_mutex_unlock(&c->lock);
}

/* The key of text compiled as kind (the kind seeds the hash). */
static XXH128_hash_t key_of(char kind, const char *text, size_t n) {
    return XXH3_128bits_withSeed(text, n, (XXH64_hash_t)(unsigned char)kind);
}

/* The grammar under key, with a reference for the caller, or NULL. */
static rk_grammar *lookup(rk_grammar_cache *c, XXH128_hash_t key) {
    rk_grammar *g = NULL;
    pthread_mutex_lock(&c->lock);
    for (int i = 0; i < c->cap && !g; i++)
        if (c->e[i].g && XXH128_isEqual(c->e[i].key, key)) {
            c->e[i].used = ++c->clock;
            g = rk_grammar_ref(c->e[i].g);
        }
    if (g)
        c->hits++;
    else
        c->misses++;
    pthread_mutex_unlock(&c->lock);
    return g;
}

/* Keep g under key (the cache takes a reference of its own), in place of
 * the least recently used entry; a key already there (compiled by two
 * requests at once) is left as it is. */
static void insert(rk_grammar_cache *c, XXH128_hash_t key, rk_grammar *g) {
    rk_grammar *old = NULL;
    pthread_mutex_lock(&c->lock);
    int victim = 0, dup = 0;
    for (int i = 0; i < c->cap; i++) {
        if (c->e[i].g && XXH128_isEqual(c->e[i].key, key)) dup = 1;
        if (!c->e[i].g || (c->e[victim].g && c->e[i].used < c->e[victim].used)) victim = i;
    }
    if (!dup) {
        old = c->e[victim].g;
        c->e[victim] = (cache_entry){key, rk_grammar_ref(g), ++c->clock};
    }
    pthread_mutex_unlock(&c->lock);
    rk_grammar_free(old);
}

rk_status rk_grammar_cache_parse(rk_grammar_cache *c, const char *text, rk_grammar **out) {
    if (!c) return rk_grammar_parse(text, out);
    XXH128_hash_t key = key_of('g', text, strlen(text));
    if ((*out = lookup(c, key))) return RK_OK;
    rk_status st = rk_grammar_parse(text, out);
    if (st == RK_OK) insert(c, key, *out);
    return st;
}

rk_status rk_grammar_cache_schema(rk_grammar_cache *c, const json_t *schema, rk_grammar **out) {
    if (!c || !schema) return rk_grammar_from_schema(schema, out);
    /* Compact JSON in the order given: property order is part of the grammar. */
    char *text = json_dumps(schema, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!text) return rk_grammar_from_schema(schema, out);
    XXH128_hash_t key = key_of('s', text, strlen(text));
    free(text);
    if ((*out = lookup(c, key))) return RK_OK;
    rk_status st = rk_grammar_from_schema(schema, out);
    if (st == RK_OK) insert(c, key, *out);
    return st;
}

rk_status rk_grammar_cache_json_object(rk_grammar_cache *c, rk_grammar **out) {
    if (!c) return rk_grammar_json_object(out);
    XXH128_hash_t key = key_of('o', "", 0);
    if ((*out = lookup(c, key))) return RK_OK;
    rk_status st = rk_grammar_json_object(out);
    if (st == RK_OK) insert(c, key, *out);
    return st;
}
