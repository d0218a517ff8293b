/* pipeline/cachectl.c — listing, finding, deleting and flushing cached
 * chunks across the arena, the radix tree and the store, for a viewer (see
 * the cache control section of pipeline.h). The HTTP routes turn these into
 * JSON; the owner filter lives here, below them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/persist.h"

void rk_chunk_listing_free(rk_chunk_listing *l) {
    if (!l) return;
    free(l->v);
    memset(l, 0, sizeof *l);
}

static int may_see(const rk_cache_viewer *who, const rk_chunk_entry *en) {
    return who->all || en->owner == who->owner;
}

static uint64_t kv_block_bytes(const rk_service *svc) {
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    return 2ull * (uint64_t)kv->n_layers * (uint64_t)kv->block_size *
           rk_dtype_row_bytes(kv->dtype, (size_t)kv->n_kv_heads * (size_t)kv->head_dim);
}

static void arena_info(const rk_service *svc, const rk_chunk_entry *en, rk_chunk_info *out) {
    memset(out, 0, sizeof *out);
    rk_chunk_key_hex(en->key, out->key);
    out->tier = "arena";
    out->tokens = en->n_tokens;
    out->bytes = (uint64_t)en->n_blocks * kv_block_bytes(svc);
    out->hits = en->hits;
    out->created = en->created;
    out->owner = en->owner;
    snprintf(out->source, sizeof out->source, "%s", en->source);
    out->refs = en->refs;
    out->base_pos = en->base_pos;
}

static void disk_info(const rk_store_entry *r, rk_chunk_info *out) {
    memset(out, 0, sizeof *out);
    snprintf(out->key, sizeof out->key, "%s", r->key);
    out->tier = "disk";
    out->tokens = r->n_tokens;
    out->bytes = r->n_bytes;
    out->hits = r->hits;
    out->created = r->created;
    out->last_access = r->last_access;
    out->on_disk = 1;
    snprintf(out->policy, sizeof out->policy, "%s", r->policy);
    snprintf(out->doc_id, sizeof out->doc_id, "%s", r->doc_id);
}

typedef struct collect_ctx {
    const rk_cache_viewer *who;
    const rk_chunk_entry **v;
    int n, cap, oom;
} collect_ctx;

static int collect(void *ctx, const rk_chunk_entry *en) {
    collect_ctx *c = ctx;
    if (!may_see(c->who, en)) return 0;
    if (c->n == c->cap) {
        int cap = c->cap ? c->cap * 2 : 256;
        const rk_chunk_entry **v = realloc(c->v, (size_t)cap * sizeof *v);
        if (!v) {
            c->oom = 1;
            return 1;
        }
        c->v = v;
        c->cap = cap;
    }
    c->v[c->n++] = en;
    return 0;
}

/* Most hits first; a stable bottom-up merge sort keeps recency order among
 * ties. RK_ERR_NOMEM when its scratch cannot be had. */
static rk_status sort_by_hits(const rk_chunk_entry **v, int n) {
    const rk_chunk_entry **tmp = malloc((size_t)(n ? n : 1) * sizeof *tmp);
    if (!tmp) return rk_errorf(RK_ERR_NOMEM, "out of memory");
    for (int w = 1; w < n; w *= 2)
        for (int lo = 0; lo < n; lo += 2 * w) {
            int mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            int i = lo, j = mid, k = lo;
            while (i < mid && j < hi) tmp[k++] = v[j]->hits > v[i]->hits ? v[j++] : v[i++];
            while (i < mid) tmp[k++] = v[i++];
            while (j < hi) tmp[k++] = v[j++];
            memcpy(v + lo, tmp + lo, (size_t)(hi - lo) * sizeof *v);
        }
    free(tmp);
    return RK_OK;
}

static rk_status list_disk(rk_service *svc, int by_hits, int offset, int limit,
                           rk_chunk_listing *out) {
    rk_store_entry *rows = NULL;
    int n = 0;
    rk_store_counters sc;
    rk_persist_drain_writes(svc); /* the rows of every chunk computed so far */
    rk_status st = rk_store_stats(svc->store, &sc);
    if (!st)
        st = rk_store_list(svc->store, by_hits ? RK_STORE_SORT_HITS : RK_STORE_SORT_RECENT, limit,
                           offset, &rows, &n);
    if (st) return st;
    out->v = calloc((size_t)(n ? n : 1), sizeof *out->v);
    if (!out->v) {
        free(rows);
        return rk_errorf(RK_ERR_NOMEM, "out of memory");
    }
    for (int i = 0; i < n; i++) disk_info(&rows[i], &out->v[i]);
    out->n = n;
    out->total = sc.rows;
    free(rows);
    return RK_OK;
}

rk_status rk_service_chunk_list(rk_service *svc, const rk_cache_viewer *who, int disk, int by_hits,
                                int offset, int limit, rk_chunk_listing *out) {
    memset(out, 0, sizeof *out);
    if (offset < 0 || limit < 0) return rk_errorf(RK_ERR_INVALID, "offset and limit must be >= 0");
    if (disk) {
        if (!svc->store) return rk_errorf(RK_ERR_INVALID, "no store is configured");
        if (!who->all)
            return rk_errorf(
                RK_ERR_INVALID,
                "the disk tier keeps no owners: only a viewer of every chunk lists it");
        return list_disk(svc, by_hits, offset, limit, out);
    }
    collect_ctx c = {.who = who};
    rk_chunk_index_foreach(svc->chunks, collect, &c);
    rk_status st = c.oom ? rk_errorf(RK_ERR_NOMEM, "out of memory") : RK_OK;
    if (!st && by_hits) st = sort_by_hits(c.v, c.n);
    int first = offset < c.n ? offset : c.n;
    int m = c.n - first < limit ? c.n - first : limit;
    if (!st && !(out->v = calloc((size_t)(m ? m : 1), sizeof *out->v)))
        st = rk_errorf(RK_ERR_NOMEM, "out of memory");
    if (!st) {
        for (int i = 0; i < m; i++) arena_info(svc, c.v[first + i], &out->v[i]);
        out->n = m;
        out->total = (uint64_t)c.n;
    }
    free(c.v);
    return st;
}

rk_status rk_service_redis_list(rk_service *svc, const rk_cache_viewer *who, int offset, int limit,
                                rk_chunk_listing *out) {
    memset(out, 0, sizeof *out);
    if (offset < 0 || limit < 0) return rk_errorf(RK_ERR_INVALID, "offset and limit must be >= 0");
    if (!svc->redis) return rk_errorf(RK_ERR_INVALID, "no shared tier is configured");
    if (!who->all)
        return rk_errorf(RK_ERR_INVALID,
                         "the redis tier keeps no owners: only a viewer of every chunk lists it");
    rk_redis_entry *v = NULL;
    int n = 0;
    rk_status st = rk_redis_list(svc->redis, offset + limit, &v, &n);
    if (st) return st;
    int m = n > offset ? n - offset : 0;
    if (!(out->v = calloc((size_t)(m ? m : 1), sizeof *out->v))) {
        free(v);
        return rk_errorf(RK_ERR_NOMEM, "out of memory");
    }
    for (int i = 0; i < m; i++) {
        const rk_redis_entry *e = &v[offset + i];
        rk_chunk_info *c = &out->v[i];
        snprintf(c->key, sizeof c->key, "%s", e->key);
        c->tier = "redis";
        c->tokens = e->n_tokens;
        c->bytes = e->n_bytes;
        c->created = e->created;
    }
    out->n = m;
    out->total = (uint64_t)n;
    free(v);
    return RK_OK;
}

rk_status rk_service_chunk_get(rk_service *svc, const rk_cache_viewer *who, rk_chunk_key key,
                               rk_chunk_info *out) {
    memset(out, 0, sizeof *out);
    char hex[33];
    rk_chunk_key_hex(key, hex);
    rk_chunk_entry *en = rk_chunk_index_find(svc->chunks, key);
    if (en && !may_see(who, en)) en = NULL;
    int on_disk = 0;
    rk_persist_drain_writes(svc);
    /* A row alone says nothing of its owner: only a viewer of everything,
     * or the owner of the arena entry with the same key, learns of it. */
    if (svc->store && (en || who->all)) rk_store_contains(svc->store, hex, &on_disk);
    if (en) {
        arena_info(svc, en, out);
        out->on_disk = on_disk;
        return RK_OK;
    }
    rk_store_entry row;
    if (on_disk && rk_store_lookup(svc->store, hex, &row) == RK_OK) {
        disk_info(&row, out);
        return RK_OK;
    }
    return rk_errorf(RK_ERR_NOT_FOUND, "no cached chunk has the key %s", hex);
}

rk_status rk_service_chunk_delete(rk_service *svc, const rk_cache_viewer *who, rk_chunk_key key,
                                  int *in_arena, int *on_disk, char *disk_why, size_t why_cap) {
    *in_arena = *on_disk = 0;
    if (why_cap) disk_why[0] = '\0';
    int row = 0;
    char hex[33];
    rk_chunk_key_hex(key, hex);
    rk_chunk_entry *en = rk_chunk_index_find(svc->chunks, key);
    if (!who->all && (!en || !may_see(who, en)))
        return rk_errorf(RK_ERR_NOT_FOUND, "no cached chunk has the key %s", hex);
    rk_status st = rk_chunk_index_remove(svc->chunks, key);
    if (st == RK_ERR_BUSY)
        return rk_errorf(st, "the chunk %s is in use by a request in flight; try again", hex);
    if (st && st != RK_ERR_NOT_FOUND) return st;
    *in_arena = st == RK_OK;
    if (svc->store) {
        rk_persist_drain_writes(svc); /* a write under way would bring it back */
        rk_store_removal rm;
        rk_status ds = rk_store_delete(svc->store, hex, &rm);
        if (ds && ds != RK_ERR_NOT_FOUND) return ds;
        row = ds == RK_OK;
        *on_disk = row && !rm.files_left;
        if (rm.files_left && why_cap) snprintf(disk_why, why_cap, "%s", rm.why);
    }
    if (!*in_arena && !row)
        return rk_errorf(RK_ERR_NOT_FOUND, "no cached chunk has the key %s", hex);
    return RK_OK;
}

rk_status rk_service_flush(rk_service *svc, int chunks, int prefix, int disk,
                           rk_flush_counts *out) {
    memset(out, 0, sizeof *out);
    if (disk && !svc->store) return rk_errorf(RK_ERR_INVALID, "no store is configured");
    if (chunks) out->chunks = rk_chunk_index_flush(svc->chunks);
    if (prefix && svc->prefix) {
        rk_radix_stats a, b;
        rk_radix_get_stats(svc->prefix, &a);
        rk_radix_flush(svc->prefix);
        rk_radix_get_stats(svc->prefix, &b);
        out->prefix_nodes = b.evictions - a.evictions;
        out->prefix_tokens = b.tokens_evicted - a.tokens_evicted;
    }
    if (disk) rk_persist_drain_writes(svc); /* a write under way would bring its chunk back */
    if (!disk) return RK_OK;
    rk_store_removal rm;
    rk_status st = rk_store_flush(svc->store, &rm);
    out->disk_rows = rm.rows;
    out->disk_files_left = rm.files_left;
    snprintf(out->disk_why, sizeof out->disk_why, "%s", rm.why);
    return st;
}

rk_status rk_service_redis_flush(rk_service *svc, uint64_t *out_keys) {
    *out_keys = 0;
    if (!svc->redis) return rk_errorf(RK_ERR_INVALID, "no shared tier is configured");
    return rk_redis_flush(svc->redis, out_keys);
}
