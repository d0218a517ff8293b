/* chunkcache/arena.c — see arena.h. The free list of each pool is a LIFO
 * stack of ids: the most recently freed block is reused first (it is the most
 * likely to still be in cache). Pools start as contiguous id ranges; a retag
 * swaps blocks between pools, so each block carries its pool. */
#include "chunkcache/arena.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct rk_arena {
    rk_backend *be;
    rk_arena_params p;
    rk_kv_cache kv;
    int n_blocks;
    int first[RK_POOL_COUNT];  /* first id of each pool's range */
    int32_t *free_ids;         /* (n_blocks) pool i's stack at free_ids[first[i] ..] */
    int n_free[RK_POOL_COUNT]; /* stack depth per pool */
    int32_t *refs;             /* (n_blocks) reference counts */
    uint8_t *tag;              /* (n_blocks) pool of each block (rk_arena_retag moves them) */
    void *poison_block;        /* one block of one layer filled with NaN (poison mode) */
};

static const char *pool_names[RK_POOL_COUNT] = {"live", "prefix", "chunk"};

const char *rk_pool_name(rk_pool_tag pool) {
    return (unsigned)pool < RK_POOL_COUNT ? pool_names[pool] : "?";
}

static size_t layer_block_bytes(const rk_arena_params *p) {
    return (size_t)p->block_size *
           rk_dtype_row_bytes(p->dtype, (size_t)p->n_kv_heads * (size_t)p->head_dim);
}

size_t rk_arena_block_bytes(const rk_arena_params *p) {
    return 2 * (size_t)p->n_layers * layer_block_bytes(p);
}

rk_status rk_arena_params_from_budget(rk_arena_params *p, size_t budget_bytes,
                                      const float share[RK_POOL_COUNT]) {
    size_t per_block = rk_arena_block_bytes(p);
    if (per_block == 0) return rk_errorf(RK_ERR_INVALID, "arena: zero-sized block");
    float total = 0;
    for (int i = 0; i < RK_POOL_COUNT; i++) {
        if (share[i] < 0) return rk_errorf(RK_ERR_INVALID, "arena: negative pool share");
        total += share[i];
    }
    if (total > 1.0001f)
        return rk_errorf(RK_ERR_INVALID, "arena: pool shares add up to %.3f > 1", total);
    for (int i = 0; i < RK_POOL_COUNT; i++) {
        double n = (double)budget_bytes * share[i] / (double)per_block;
        p->pool_blocks[i] = n > (double)(INT32_MAX / 4) ? INT32_MAX / 4 : (int)n;
    }
    if (p->pool_blocks[RK_POOL_LIVE] < 1)
        return rk_errorf(RK_ERR_INVALID,
                         "arena: a budget of %zu bytes leaves no live block (%zu bytes each)",
                         budget_bytes, per_block);
    return RK_OK;
}

static rk_status validate_params(const rk_arena_params *p) {
    int bs = p->block_size;
    if (bs < 8 || bs > 64 || (bs & (bs - 1)))
        return rk_errorf(RK_ERR_INVALID, "arena: block size %d is not a power of two in [8, 64]",
                         bs);
    if (p->n_layers < 1 || p->n_kv_heads < 1 || p->head_dim < 1)
        return rk_errorf(RK_ERR_INVALID, "arena: bad KV shape (%d layers, %d heads, dim %d)",
                         p->n_layers, p->n_kv_heads, p->head_dim);
    if (!rk_kv_dtype_ok(p->dtype, p->head_dim))
        return rk_errorf(RK_ERR_INVALID, "arena: KV type %s cannot hold heads %d wide",
                         rk_dtype_name(p->dtype), p->head_dim);
    long total = 0;
    for (int i = 0; i < RK_POOL_COUNT; i++) {
        if (p->pool_blocks[i] < 0)
            return rk_errorf(RK_ERR_INVALID, "arena: pool %s has %d blocks", pool_names[i],
                             p->pool_blocks[i]);
        total += p->pool_blocks[i];
    }
    if (p->pool_blocks[RK_POOL_LIVE] < 1)
        return rk_errorf(RK_ERR_INVALID, "arena: the live pool needs at least one block");
    if (total > INT32_MAX / 64)
        return rk_errorf(RK_ERR_INVALID, "arena: %ld blocks is too many", total);
    return RK_OK;
}

void rk_arena_free(rk_arena *a) {
    if (!a) return;
    for (int l = 0; l < a->kv.n_layers; l++) {
        if (a->kv.k && a->kv.k[l]) a->be->ops->free(a->be, a->kv.k[l]);
        if (a->kv.v && a->kv.v[l]) a->be->ops->free(a->be, a->kv.v[l]);
    }
    free(a->kv.k);
    free(a->kv.v);
    free(a->free_ids);
    free(a->refs);
    free(a->tag);
    free(a->poison_block);
    free(a);
}

/* NaN in every element of n_bytes of type t (Q8_0: every block's scale). */
static void fill_nan(void *dst, size_t n_bytes, rk_dtype t) {
    if (t == RK_DTYPE_Q8_0) {
        unsigned char *b = dst;
        for (size_t i = 0; i + 34 <= n_bytes; i += 34) {
            b[i] = 0x00; /* f16 0x7E00, little endian */
            b[i + 1] = 0x7E;
            memset(b + i + 2, 1, 32);
        }
        return;
    }
    size_t n_elems = n_bytes / rk_dtype_size(t);
    if (t == RK_DTYPE_F32) {
        float *f = dst;
        for (size_t i = 0; i < n_elems; i++) f[i] = NAN;
    } else {
        uint16_t h = t == RK_DTYPE_F16 ? 0x7E00 : 0x7FC0;
        uint16_t *u = dst;
        for (size_t i = 0; i < n_elems; i++) u[i] = h;
    }
}

rk_status rk_arena_create(rk_backend *be, const rk_arena_params *p, rk_arena **out) {
    *out = NULL;
    rk_status st = validate_params(p);
    if (st) return st;
    rk_arena *a = calloc(1, sizeof *a);
    if (!a) return rk_errorf(RK_ERR_NOMEM, "arena: out of memory");
    a->be = be;
    a->p = *p;
    int n = 0;
    for (int i = 0; i < RK_POOL_COUNT; i++) {
        a->first[i] = n;
        n += p->pool_blocks[i];
    }
    a->n_blocks = n;
    a->kv = (rk_kv_cache){.n_layers = 0,
                          .n_blocks = n,
                          .block_size = p->block_size,
                          .n_kv_heads = p->n_kv_heads,
                          .head_dim = p->head_dim,
                          .dtype = p->dtype};
    a->kv.k = calloc((size_t)p->n_layers, sizeof(void *));
    a->kv.v = calloc((size_t)p->n_layers, sizeof(void *));
    a->free_ids = malloc((size_t)n * sizeof(int32_t));
    a->refs = calloc((size_t)n, sizeof(int32_t));
    a->tag = malloc((size_t)(n ? n : 1));
    if (!a->kv.k || !a->kv.v || !a->free_ids || !a->refs || !a->tag) {
        rk_arena_free(a);
        return rk_errorf(RK_ERR_NOMEM, "arena: out of memory for %d block records", n);
    }
    size_t layer_bytes = (size_t)n * layer_block_bytes(p);
    for (int l = 0; l < p->n_layers; l++) {
        a->kv.n_layers = l + 1; /* so a failure below frees what was taken */
        if ((st = be->ops->alloc(be, layer_bytes, &a->kv.k[l])) ||
            (st = be->ops->alloc(be, layer_bytes, &a->kv.v[l]))) {
            rk_arena_free(a);
            return rk_errorf(st, "arena: cannot allocate %zu bytes of KV for layer %d (%d blocks)",
                             layer_bytes, l, n);
        }
    }
    if (p->poison) {
        a->poison_block = malloc(layer_block_bytes(p));
        if (!a->poison_block) {
            rk_arena_free(a);
            return rk_errorf(RK_ERR_NOMEM, "arena: out of memory");
        }
        fill_nan(a->poison_block, layer_block_bytes(p), p->dtype);
    }
    /* Stacks: the lowest id on top, so fresh pools hand out ids in order. */
    for (int i = 0; i < RK_POOL_COUNT; i++) {
        int cnt = p->pool_blocks[i];
        for (int j = 0; j < cnt; j++) {
            a->free_ids[a->first[i] + j] = a->first[i] + cnt - 1 - j;
            a->tag[a->first[i] + j] = (uint8_t)i;
        }
        a->n_free[i] = cnt;
    }
    *out = a;
    return RK_OK;
}

const rk_kv_cache *rk_arena_kv(const rk_arena *a) { return &a->kv; }

int rk_arena_block_size(const rk_arena *a) { return a->p.block_size; }

rk_status rk_arena_alloc(rk_arena *a, rk_pool_tag pool, int n, int32_t *out_ids) {
    if ((unsigned)pool >= RK_POOL_COUNT || n < 0)
        return rk_errorf(RK_ERR_INVALID, "arena: bad allocation request (pool %d, %d blocks)",
                         (int)pool, n);
    if (n > a->n_free[pool])
        return rk_errorf(RK_ERR_EXHAUSTED, "arena: pool %s has %d free blocks, %d asked",
                         pool_names[pool], a->n_free[pool], n);
    int32_t *stack = a->free_ids + a->first[pool];
    for (int i = 0; i < n; i++) {
        int32_t id = stack[--a->n_free[pool]];
        a->refs[id] = 1;
        out_ids[i] = id;
    }
    return RK_OK;
}

rk_status rk_arena_ref(rk_arena *a, const int32_t *ids, int n) {
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= a->n_blocks || a->refs[ids[i]] <= 0)
            return rk_errorf(RK_ERR_INTERNAL, "arena: reference to free or invalid block %d",
                             ids[i]);
    for (int i = 0; i < n; i++) a->refs[ids[i]]++;
    return RK_OK;
}

static void poison(rk_arena *a, int32_t id) {
    size_t bytes = layer_block_bytes(&a->p);
    for (int l = 0; l < a->kv.n_layers; l++) {
        a->be->ops->upload(a->be, (char *)a->kv.k[l] + (size_t)id * bytes, a->poison_block, bytes);
        a->be->ops->upload(a->be, (char *)a->kv.v[l] + (size_t)id * bytes, a->poison_block, bytes);
    }
}

rk_status rk_arena_release(rk_arena *a, const int32_t *ids, int n) {
    rk_status st = RK_OK;
    for (int i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= a->n_blocks || a->refs[id] <= 0) {
            st = rk_errorf(RK_ERR_INTERNAL, "arena: double free or invalid block %d", id);
            continue;
        }
        if (--a->refs[id] > 0) continue;
        int pool = rk_arena_block_pool(a, id);
        if (a->poison_block) poison(a, id);
        a->free_ids[a->first[pool] + a->n_free[pool]++] = id;
    }
    return st;
}

int rk_arena_pool_total(const rk_arena *a, rk_pool_tag pool) {
    return (unsigned)pool < RK_POOL_COUNT ? a->p.pool_blocks[pool] : 0;
}

int rk_arena_pool_free(const rk_arena *a, rk_pool_tag pool) {
    return (unsigned)pool < RK_POOL_COUNT ? a->n_free[pool] : 0;
}

int rk_arena_block_pool(const rk_arena *a, int32_t id) {
    return id < 0 || id >= a->n_blocks ? -1 : a->tag[id];
}

rk_status rk_arena_retag(rk_arena *a, const int32_t *ids, int n, rk_pool_tag pool) {
    if ((unsigned)pool >= RK_POOL_COUNT || n < 0)
        return rk_errorf(RK_ERR_INVALID, "arena: bad retag request (pool %d, %d blocks)", (int)pool,
                         n);
    int moves = 0;
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= a->n_blocks || a->refs[ids[i]] <= 0)
            return rk_errorf(RK_ERR_INTERNAL, "arena: retag of free or invalid block %d", ids[i]);
        moves += a->tag[ids[i]] != pool;
    }
    if (moves > a->n_free[pool])
        return rk_errorf(RK_ERR_EXHAUSTED, "arena: pool %s has %d free blocks, %d to move in",
                         pool_names[pool], a->n_free[pool], moves);
    /* Swap: a free block of pool takes each moved block's place in its old
     * pool, so every pool keeps its size and its free list its capacity. */
    for (int i = 0; i < n; i++) {
        int32_t id = ids[i];
        int from = a->tag[id];
        if (from == (int)pool) continue;
        int32_t spare = a->free_ids[a->first[pool] + --a->n_free[pool]];
        a->tag[spare] = (uint8_t)from;
        a->free_ids[a->first[from] + a->n_free[from]++] = spare;
        a->tag[id] = (uint8_t)pool;
    }
    return RK_OK;
}

int rk_arena_refcount(const rk_arena *a, int32_t id) {
    return id < 0 || id >= a->n_blocks ? -1 : a->refs[id];
}

/* ---------------------------------------------------------------- sequences */

static rk_status seq_grow(rk_seq *s, int need) {
    if (need <= s->cap) return RK_OK;
    int cap = s->cap ? s->cap : 8;
    while (cap < need) cap *= 2;
    int32_t *b = realloc(s->blocks, (size_t)cap * sizeof *b);
    if (!b) return rk_errorf(RK_ERR_NOMEM, "sequence: out of memory for %d blocks", cap);
    s->blocks = b;
    s->cap = cap;
    return RK_OK;
}

rk_status rk_seq_reserve(rk_seq *s, rk_arena *a, rk_pool_tag pool, int n_new, int32_t *out_slots) {
    int bs = a->p.block_size;
    if (n_new < 0) return rk_errorf(RK_ERR_INVALID, "sequence: negative token count");
    int need_blocks = (s->n_tokens + n_new + bs - 1) / bs;
    int extra = need_blocks - s->n_blocks;
    if (extra > 0) {
        rk_status st = seq_grow(s, need_blocks);
        if (st) return st;
        if ((st = rk_arena_alloc(a, pool, extra, s->blocks + s->n_blocks))) return st;
        s->n_blocks = need_blocks;
    }
    if (out_slots)
        for (int i = 0; i < n_new; i++) {
            int t = s->n_tokens + i;
            out_slots[i] = s->blocks[t / bs] * bs + t % bs;
        }
    return RK_OK;
}

rk_status rk_seq_share(rk_seq *s, rk_arena *a, const int32_t *ids, int n_blocks) {
    int bs = a->p.block_size;
    if (n_blocks < 0 || s->n_tokens != s->n_blocks * bs)
        return rk_errorf(RK_ERR_INVALID, "sequence: shared blocks must start on a block boundary");
    if (n_blocks == 0) return RK_OK;
    rk_status st = seq_grow(s, s->n_blocks + n_blocks);
    if (st || (st = rk_arena_ref(a, ids, n_blocks))) return st;
    memcpy(s->blocks + s->n_blocks, ids, (size_t)n_blocks * sizeof *ids);
    s->n_blocks += n_blocks;
    s->n_tokens += n_blocks * bs;
    return RK_OK;
}

void rk_seq_release(rk_seq *s, rk_arena *a) {
    if (s->n_blocks) rk_arena_release(a, s->blocks, s->n_blocks);
    free(s->blocks);
    memset(s, 0, sizeof *s);
}
