/* chunkcache/chunk_index.c — see chunk_index.h. Entries live in a chained
 * hash table keyed by the 128-bit key, and in one LRU list (most recent at
 * the head). Eviction walks the list from the tail and skips referenced and
 * pending entries. */
#include "chunkcache/chunk_index.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>

struct rk_chunk_index {
    rk_arena *arena;
    int max_entries;
    rk_chunk_entry **buckets; /* (n_buckets) */
    size_t n_buckets;
    rk_chunk_entry *lru_head, *lru_tail;
    uint64_t clock;
    rk_chunk_stats st;
};

/* ---------------------------------------------------------------- keys */

void rk_chunk_key_hex(rk_chunk_key k, char out[33]) {
    snprintf(out, 33, "%016llx%016llx", (unsigned long long)k.hi, (unsigned long long)k.lo);
}

rk_status rk_chunk_key_parse(const char *hex, rk_chunk_key *out) {
    uint64_t v[2] = {0, 0};
    for (int i = 0; i < 32; i++) {
        char c = hex[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return rk_errorf(RK_ERR_INVALID, "a chunk key is 32 lowercase hex digits");
        v[i / 16] = v[i / 16] << 4 | (uint64_t)d;
    }
    if (hex[32] != '\0') return rk_errorf(RK_ERR_INVALID, "a chunk key is 32 lowercase hex digits");
    out->hi = v[0];
    out->lo = v[1];
    return RK_OK;
}

rk_chunk_key rk_chunk_key_compute(const rk_chunk_policy *p, const int32_t *tokens, int n_tokens) {
    /* The policy's fields are hashed one by one (never the struct, whose
     * padding is undefined) into a 64-bit seed for the hash of the tokens. */
    unsigned char head[128];
    size_t n = 0, fp_len = strlen(p->fingerprint);
    int32_t ints[5] = {p->context_system, (int32_t)p->kv_dtype, p->rope_n_rot, p->rope_pairing,
                       p->rope_scaling};
    float floats[2] = {p->rope_theta, p->rope_factor};
    uint64_t sys[2] = {p->context_system ? p->system_key.hi : 0,
                       p->context_system ? p->system_key.lo : 0};
    memcpy(head + n, "ragkv-chunk-v1", 14), n += 14;
    memcpy(head + n, ints, sizeof ints), n += sizeof ints;
    memcpy(head + n, floats, sizeof floats), n += sizeof floats;
    memcpy(head + n, sys, sizeof sys), n += sizeof sys;
    if (p->salt.hi || p->salt.lo) { /* unsalted keys stay what they were */
        uint64_t salt[2] = {p->salt.hi, p->salt.lo};
        memcpy(head + n, "salt", 4), n += 4;
        memcpy(head + n, salt, sizeof salt), n += sizeof salt;
    }
    uint64_t seed = XXH3_64bits_withSeed(head, n, XXH3_64bits(p->fingerprint, fp_len));
    XXH128_hash_t h = XXH3_128bits_withSeed(tokens, (size_t)n_tokens * sizeof *tokens, seed);
    return (rk_chunk_key){h.high64, h.low64};
}

rk_chunk_key rk_tokens_hash(const int32_t *tokens, int n_tokens) {
    XXH128_hash_t h = XXH3_128bits(tokens, (size_t)n_tokens * sizeof *tokens);
    return (rk_chunk_key){h.high64, h.low64};
}

static size_t bucket_of(const rk_chunk_index *ix, rk_chunk_key k) {
    return (size_t)(k.lo ^ (k.hi * 0x9E3779B97F4A7C15ull)) & (ix->n_buckets - 1);
}

static int key_eq(rk_chunk_key a, rk_chunk_key b) { return a.hi == b.hi && a.lo == b.lo; }

/* ---------------------------------------------------------------- lists */

static void lru_unlink(rk_chunk_index *ix, rk_chunk_entry *e) {
    if (e->lru_prev)
        e->lru_prev->lru_next = e->lru_next;
    else
        ix->lru_head = e->lru_next;
    if (e->lru_next)
        e->lru_next->lru_prev = e->lru_prev;
    else
        ix->lru_tail = e->lru_prev;
    e->lru_prev = e->lru_next = NULL;
}

static void lru_push_front(rk_chunk_index *ix, rk_chunk_entry *e) {
    e->lru_prev = NULL;
    e->lru_next = ix->lru_head;
    if (ix->lru_head) ix->lru_head->lru_prev = e;
    ix->lru_head = e;
    if (!ix->lru_tail) ix->lru_tail = e;
}

static void touch(rk_chunk_index *ix, rk_chunk_entry *e) {
    e->last_use = ++ix->clock;
    lru_unlink(ix, e);
    lru_push_front(ix, e);
}

/* Unlink from the table and the list, give the blocks back, free. */
static void destroy(rk_chunk_index *ix, rk_chunk_entry *e) {
    rk_chunk_entry **pp = &ix->buckets[bucket_of(ix, e->key)];
    while (*pp && *pp != e) pp = &(*pp)->next_in_bucket;
    if (*pp) *pp = e->next_in_bucket;
    lru_unlink(ix, e);
    rk_arena_release(ix->arena, e->blocks, e->n_blocks);
    ix->st.entries--;
    ix->st.tokens -= (uint64_t)e->n_tokens;
    ix->st.blocks -= (uint64_t)e->n_blocks;
    free(e->tokens);
    free(e->blocks);
    free(e);
}

/* ---------------------------------------------------------------- API */

rk_status rk_chunk_index_create(rk_arena *arena, int max_entries, rk_chunk_index **out) {
    *out = NULL;
    if (max_entries < 1) return rk_errorf(RK_ERR_INVALID, "chunk index: max_entries must be >= 1");
    rk_chunk_index *ix = calloc(1, sizeof *ix);
    if (!ix) return rk_errorf(RK_ERR_NOMEM, "chunk index: out of memory");
    ix->arena = arena;
    ix->max_entries = max_entries;
    ix->n_buckets = 64;
    while (ix->n_buckets < (size_t)max_entries) ix->n_buckets *= 2;
    ix->buckets = calloc(ix->n_buckets, sizeof *ix->buckets);
    if (!ix->buckets) {
        free(ix);
        return rk_errorf(RK_ERR_NOMEM, "chunk index: out of memory");
    }
    *out = ix;
    return RK_OK;
}

void rk_chunk_index_free(rk_chunk_index *ix) {
    if (!ix) return;
    while (ix->lru_head) destroy(ix, ix->lru_head);
    free(ix->buckets);
    free(ix);
}

rk_chunk_entry *rk_chunk_index_find(rk_chunk_index *ix, rk_chunk_key key) {
    for (rk_chunk_entry *e = ix->buckets[bucket_of(ix, key)]; e; e = e->next_in_bucket)
        if (key_eq(e->key, key)) return e->state == RK_CHUNK_READY ? e : NULL;
    return NULL;
}

static rk_chunk_entry *find_any(rk_chunk_index *ix, rk_chunk_key key) {
    for (rk_chunk_entry *e = ix->buckets[bucket_of(ix, key)]; e; e = e->next_in_bucket)
        if (key_eq(e->key, key)) return e;
    return NULL;
}

int rk_chunk_index_evict(rk_chunk_index *ix, int n_blocks) {
    int evicted = 0;
    rk_chunk_entry *e = ix->lru_tail;
    while (e && rk_arena_pool_free(ix->arena, RK_POOL_CHUNK) < n_blocks) {
        rk_chunk_entry *prev = e->lru_prev;
        if (e->refs == 0 && e->state == RK_CHUNK_READY) {
            ix->st.evictions++;
            ix->st.evicted_tokens += (uint64_t)e->n_tokens;
            destroy(ix, e);
            evicted++;
        }
        e = prev;
    }
    return evicted;
}

/* Make room for one more entry under max_entries. */
static int evict_one_entry(rk_chunk_index *ix) {
    for (rk_chunk_entry *e = ix->lru_tail; e; e = e->lru_prev)
        if (e->refs == 0 && e->state == RK_CHUNK_READY) {
            ix->st.evictions++;
            ix->st.evicted_tokens += (uint64_t)e->n_tokens;
            destroy(ix, e);
            return 1;
        }
    return 0;
}

rk_status rk_chunk_index_acquire(rk_chunk_index *ix, rk_chunk_key key, const int32_t *tokens,
                                 int n_tokens, int base_pos, rk_chunk_entry **out_entry,
                                 rk_chunk_lookup *out_kind) {
    *out_entry = NULL;
    if (n_tokens < 1) return rk_errorf(RK_ERR_INVALID, "chunk index: empty chunk");
    ix->st.lookups++;
    rk_chunk_entry *e = find_any(ix, key);
    if (e) {
        if (e->n_tokens != n_tokens ||
            memcmp(e->tokens, tokens, (size_t)n_tokens * sizeof *tokens) != 0 ||
            e->base_pos != base_pos)
            return rk_errorf(RK_ERR_INTERNAL, "chunk index: key collision (tokens differ)");
        e->refs++;
        touch(ix, e);
        if (e->state == RK_CHUNK_READY) {
            e->hits++;
            ix->st.hits++;
            ix->st.hit_tokens += (uint64_t)n_tokens;
            *out_kind = RK_CHUNK_HIT;
        } else {
            ix->st.misses++;
            *out_kind = RK_CHUNK_SHARED;
        }
        *out_entry = e;
        return RK_OK;
    }
    ix->st.misses++;
    int bs = rk_arena_block_size(ix->arena), n_blocks = (n_tokens + bs - 1) / bs;
    if (n_blocks > rk_arena_pool_total(ix->arena, RK_POOL_CHUNK))
        return rk_errorf(RK_ERR_EXHAUSTED,
                         "a chunk of %d tokens needs %d blocks; the chunk pool has %d", n_tokens,
                         n_blocks, rk_arena_pool_total(ix->arena, RK_POOL_CHUNK));
    if ((int)ix->st.entries >= ix->max_entries && !evict_one_entry(ix))
        return rk_errorf(RK_ERR_LIMIT, "chunk index: all %d entries are in use", ix->max_entries);
    e = calloc(1, sizeof *e);
    if (!e) return rk_errorf(RK_ERR_NOMEM, "chunk index: out of memory");
    e->tokens = malloc((size_t)n_tokens * sizeof *e->tokens);
    e->blocks = malloc((size_t)n_blocks * sizeof *e->blocks);
    if (!e->tokens || !e->blocks) {
        free(e->tokens);
        free(e->blocks);
        free(e);
        return rk_errorf(RK_ERR_NOMEM, "chunk index: out of memory");
    }
    if (rk_arena_pool_free(ix->arena, RK_POOL_CHUNK) < n_blocks) rk_chunk_index_evict(ix, n_blocks);
    rk_status st = rk_arena_alloc(ix->arena, RK_POOL_CHUNK, n_blocks, e->blocks);
    if (st) {
        free(e->tokens);
        free(e->blocks);
        free(e);
        return rk_errorf(st,
                         "the chunk pool has no room for %d blocks: the rest is in use by "
                         "requests in flight",
                         n_blocks);
    }
    memcpy(e->tokens, tokens, (size_t)n_tokens * sizeof *tokens);
    e->key = key;
    e->n_tokens = n_tokens;
    e->n_blocks = n_blocks;
    e->base_pos = base_pos;
    e->state = RK_CHUNK_PENDING;
    e->refs = 1;
    e->created = (double)time(NULL);
    snprintf(e->source, sizeof e->source, "computed");
    size_t b = bucket_of(ix, key);
    e->next_in_bucket = ix->buckets[b];
    ix->buckets[b] = e;
    lru_push_front(ix, e);
    e->last_use = ++ix->clock;
    ix->st.computes++;
    ix->st.entries++;
    ix->st.tokens += (uint64_t)n_tokens;
    ix->st.blocks += (uint64_t)n_blocks;
    *out_entry = e;
    *out_kind = RK_CHUNK_MISS;
    return RK_OK;
}

void rk_chunk_index_ready(rk_chunk_index *ix, rk_chunk_entry *e) {
    if (e->state == RK_CHUNK_PENDING) ix->st.computed_tokens += (uint64_t)e->n_tokens;
    e->state = RK_CHUNK_READY;
    e->progress = e->n_tokens;
}

void rk_chunk_index_loaded(rk_chunk_index *ix, rk_chunk_entry *e) {
    if (e->state != RK_CHUNK_PENDING) return;
    e->state = RK_CHUNK_READY;
    e->progress = e->n_tokens;
    snprintf(e->source, sizeof e->source, "disk");
    ix->st.computes--;
    ix->st.disk_loads++;
    ix->st.misses--;
    ix->st.hits++;
    ix->st.hit_tokens += (uint64_t)e->n_tokens;
}

void rk_chunk_index_hold(rk_chunk_entry *e) { e->refs++; }

void rk_chunk_index_release(rk_chunk_index *ix, rk_chunk_entry *e, int failed) {
    if (!e) return;
    if (e->refs > 0) e->refs--;
    if (e->state == RK_CHUNK_PENDING && failed && e->refs == 0) destroy(ix, e);
}

rk_status rk_chunk_index_remove(rk_chunk_index *ix, rk_chunk_key key) {
    rk_chunk_entry *e = find_any(ix, key);
    if (!e) return rk_errorf(RK_ERR_NOT_FOUND, "no chunk with that key");
    if (e->refs > 0 || e->state != RK_CHUNK_READY)
        return rk_errorf(RK_ERR_BUSY, "the chunk is in use by %d requests", e->refs);
    destroy(ix, e);
    return RK_OK;
}

int rk_chunk_index_flush(rk_chunk_index *ix) {
    int n = 0;
    for (rk_chunk_entry *e = ix->lru_tail, *prev; e; e = prev) {
        prev = e->lru_prev;
        if (e->refs == 0 && e->state == RK_CHUNK_READY) {
            destroy(ix, e);
            n++;
        }
    }
    return n;
}

void rk_chunk_index_get_stats(const rk_chunk_index *ix, rk_chunk_stats *out) { *out = ix->st; }

void rk_chunk_index_foreach(rk_chunk_index *ix, int (*fn)(void *ctx, const rk_chunk_entry *e),
                            void *ctx) {
    for (rk_chunk_entry *e = ix->lru_head; e; e = e->lru_next)
        if (e->state == RK_CHUNK_READY && fn(ctx, e)) return;
}
