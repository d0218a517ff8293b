/* pipeline/chunks.c — stage 3 of a request (driven by pipeline.c): each
 * chunk looked up in the chunk index (a hit takes a reference; a concurrent
 * miss on the same key shares one PENDING entry: single flight), loaded from
 * the disk or Redis tier, or computed: fed straight into its entry's blocks
 * in pass 1 or by the steps' passes (rk_feed_chunks), or, on a backend whose
 * attention cannot read run tables, in a scratch sequence copied into the
 * entry (pass 2, rk_stage_system_chunks); then written through to the
 * tiers. KV planner, engine thread only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunkcache/chunk_index.h"
#include "pipeline/internal.h"
#include "pipeline/persist.h"

/* Write a freshly computed entry through to the disk and Redis tiers; the
 * Redis write releases the chunk's compute lock when sc holds it. A failed
 * write is logged and counted by its tier; serving goes on from the arena. */
static void persist(rk_service *svc, const rk_chunk_entry *e, rk_chunk_context context,
                    scratch *sc) {
    const rk_redis_lock *lk = sc->rlocked ? &sc->rlock : NULL;
    sc->rlocked = 0;
    static const char *const names[] = {"isolated", "system", "anchor"};
    if (rk_persist_write_tiers(svc, e, names[context], NULL, 1, lk))
        RK_LOG_WARN("chunk not persisted: %s", rk_error_message());
}

/* A chunk the disk tier missed: try the Redis tier (which also takes the
 * fleet-wide compute lock on a miss). Reports the source on a load. */
static rk_status load_shared(rk_service *svc, rk_request *r, int k, int *out_loaded) {
    rk_req_state *s = r->state;
    rk_chunk_entry *e = s->entries[k];
    scratch *sc = &s->scratch[k];
    rk_status st = rk_persist_load_redis(svc, e, out_loaded, &sc->rlock, &sc->rlocked);
    if (st || !*out_loaded) return st;
    rk_chunk_index_loaded(svc->chunks, e);
    snprintf(e->source, sizeof e->source, "redis");
    s->kinds[k] = RK_CHUNK_HIT;
    r->chunk_reports[k].status = RK_CHUNK_STATUS_HIT;
    r->chunk_reports[k].source = RK_CHUNK_SOURCE_REDIS;
    return RK_OK;
}

/* The tokens a chunk's cached KV is computed after: none (isolated), the
 * system prompt, or the anchor (*anchor receives the BOS token). Their count. */
static int chunk_context_tokens(const rk_service *svc, const rk_request *r, int32_t *anchor,
                                const int32_t **out) {
    *out = NULL;
    if (r->opt.chunk_context == RK_CONTEXT_SYSTEM) {
        *out = r->sys;
        return r->n_sys;
    }
    if (r->opt.chunk_context != RK_CONTEXT_ANCHOR) return 0;
    *anchor = rk_tokenizer_bos(rk_model_tokenizer(svc->model));
    *out = anchor;
    return 1;
}

void rk_request_chunk_policy(rk_service *svc, const rk_request *r, rk_chunk_policy *p) {
    const rk_hparams *hp = rk_model_hparams(svc->model);
    *p = (rk_chunk_policy){.fingerprint = rk_model_fingerprint(svc->model),
                           .context_system = (int)r->opt.chunk_context,
                           .kv_dtype = rk_arena_kv(svc->arena)->dtype,
                           .rope_theta = hp->rope.theta,
                           .rope_factor = hp->rope.factor,
                           .rope_n_rot = hp->rope.n_rot,
                           .rope_pairing = (int)hp->rope.pairing,
                           .rope_scaling = (int)hp->rope.scaling,
                           .salt = r->opt.salt};
    int32_t anchor;
    const int32_t *ctx;
    int n_ctx = chunk_context_tokens(svc, r, &anchor, &ctx);
    if (p->context_system) p->system_key = rk_tokens_hash(ctx, n_ctx);
}

/* Chunk k computed after its n_ctx context tokens ctx in a scratch sequence
 * of its own, the context's first token at position pos0: the oracle (at
 * the live position) or an anchored miss (at 0). */
static rk_status plan_after_context(rk_service *svc, rk_request *r, int k, const int32_t *ctx,
                                    int n_ctx, int pos0, batch *pass1) {
    scratch *sc = &r->state->scratch[k];
    int bs = rk_arena_block_size(svc->arena), n = n_ctx + r->chunk_lens[k];
    const int32_t *toks = r->chunks[k];
    rk_status st;
    if (n_ctx) {
        if (!(sc->tokens = malloc((size_t)n * sizeof *sc->tokens)))
            return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
        memcpy(sc->tokens, ctx, (size_t)n_ctx * sizeof *sc->tokens);
        memcpy(sc->tokens + n_ctx, r->chunks[k], (size_t)r->chunk_lens[k] * sizeof *sc->tokens);
        toks = sc->tokens;
    }
    sc->used = 1;
    if ((st = rk_seq_reserve(&sc->kv, svc->arena, RK_POOL_LIVE, n, NULL))) return st;
    sc->kv.n_tokens = n;
    sc->src_first = n_ctx;
    return rk_batch_add(pass1, bs, &sc->kv, toks, n, pos0, 0, 0);
}

/* Chunk k of r when the chunk pool cannot take it (after evicting every
 * entry no request holds): an entry of the request's own, outside the index,
 * over live-pool blocks, computed at its base like a miss and reindexed like
 * any entry, then given back with the request (the copy path gives its
 * blocks back once copied). RK_ERR_EXHAUSTED when the live pool has no room
 * now: the request waits while others run, and alone never fits. */
static rk_status acquire_uncached(rk_service *svc, rk_request *r, int k, int base) {
    rk_req_state *s = r->state;
    int bs = rk_arena_block_size(svc->arena), n = r->chunk_lens[k], nb = (n + bs - 1) / bs;
    rk_chunk_entry *e = calloc(1, sizeof *e);
    int32_t *blocks = malloc((size_t)nb * sizeof *blocks);
    if (!e || !blocks) {
        free(e);
        free(blocks);
        return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    }
    if (rk_arena_alloc(svc->arena, RK_POOL_LIVE, nb, blocks)) {
        free(e);
        free(blocks);
        return rk_errorf(RK_ERR_EXHAUSTED,
                         "neither the chunk pool nor the live pool has room for chunk %d (%d "
                         "blocks)",
                         k, nb);
    }
    *e = (rk_chunk_entry){.tokens = r->chunks[k],
                          .n_tokens = n,
                          .blocks = blocks,
                          .n_blocks = nb,
                          .base_pos = base,
                          .state = RK_CHUNK_PENDING,
                          .refs = 1};
    snprintf(e->source, sizeof e->source, "uncached");
    rk_error_clear();
    s->entries[k] = e;
    s->kinds[k] = RK_CHUNK_MISS;
    s->scratch[k].uncached = 1;
    return RK_OK;
}

/* An isolated chunk computed alone at positions 0..n-1, straight into its
 * entry's blocks (through a borrowed view): in pass 1, or, when the
 * admission defers, by the steps' passes (the request waits for it). */
static rk_status feed_isolated(admission *a, rk_request *r, int k) {
    rk_req_state *s = r->state;
    rk_chunk_entry *e = s->entries[k];
    scratch *sc = &s->scratch[k];
    sc->kv.blocks = e->blocks; /* borrowed: released with the entry, not the scratch */
    sc->kv.n_blocks = e->n_blocks;
    sc->kv.n_tokens = e->n_tokens;
    sc->borrowed = 1;
    if (e->state != RK_CHUNK_PENDING) return RK_OK;
    /* A request with nothing to generate leaves when admitted: its chunks
     * are computed now, so that it still caches them (or, loading, are
     * cached by their load). */
    if ((a->defer || e->loading) && !s->done) {
        sc->stepped = 1;
        s->chunk_wait = s->prefilling = 1;
        return RK_OK;
    }
    int all = -1;
    return rk_feed_chunk(a->b, rk_arena_block_size(a->svc->arena), a->feed, e, &sc->kv, NULL, &all);
}

/* A `system`- or `anchor`-context chunk fed like an isolated one (as
 * feed_isolated: in pass 1, or by the steps, the request waiting for it),
 * straight into its entry's blocks after its n_ctx context tokens: the
 * request's system pages (computed first: in pass 1, needs_system_first, or
 * stepped, by the steps before the chunk, rk_feed_chunks) or
 * its anchor block (the anchor token, added to pass 1 here once). The
 * sequence fed is the run table [context, entry blocks], so every holder of
 * the entry can carry the computation on: each has the same context tokens
 * at the same positions. */
static rk_status feed_in_context(admission *a, rk_request *r, int k, int n_ctx) {
    rk_service *svc = a->svc;
    rk_req_state *s = r->state;
    scratch *sc = &s->scratch[k];
    rk_chunk_entry *e = s->entries[k];
    int bs = rk_arena_block_size(svc->arena);
    rk_status st;
    if (e->state != RK_CHUNK_PENDING) return RK_OK;
    int anchor = r->opt.chunk_context == RK_CONTEXT_ANCHOR;
    if (anchor && s->anchor.n_blocks == 0) {
        int32_t bos = rk_tokenizer_bos(rk_model_tokenizer(svc->model));
        if ((st = rk_seq_reserve(&s->anchor, svc->arena, RK_POOL_LIVE, 1, NULL))) return st;
        s->anchor.n_tokens = 1;
        if ((st = rk_batch_add(a->b, bs, &s->anchor, &bos, 1, 0, 0, 0))) return st;
    }
    if ((st = rk_runs_add(&sc->ctx_runs, bs, anchor ? s->anchor.blocks : s->kv.blocks, n_ctx, 0)) ||
        (st = rk_runs_add(&sc->ctx_runs, bs, e->blocks, e->n_tokens, 0)))
        return st;
    if ((a->defer || e->loading) && !s->done) {
        sc->stepped = 1;
        s->chunk_wait = s->prefilling = 1;
        return RK_OK;
    }
    int all = -1;
    return rk_feed_chunk(a->b, bs, a->feed, e, &sc->kv, &sc->ctx_runs, &all);
}

/* A miss (or another request's PENDING entry) fed straight into its entry,
 * alone or after its context. */
static rk_status feed_entry(admission *a, rk_request *r, int k, int n_ctx) {
    return n_ctx ? feed_in_context(a, r, k, n_ctx) : feed_isolated(a, r, k);
}

/* Look up every chunk; queue the work each needs for pass 1. */
rk_status rk_plan_chunks(admission *a, rk_request *r) {
    rk_service *svc = a->svc;
    batch *pass1 = a->b;
    rk_req_state *s = r->state;
    rk_chunk_policy policy;
    rk_request_chunk_policy(svc, r, &policy);
    rk_status st;
    int after_system = r->opt.chunk_context == RK_CONTEXT_SYSTEM;
    int32_t anchor;
    const int32_t *ctx;
    int n_ctx = chunk_context_tokens(svc, r, &anchor, &ctx);
    /* A miss is fed into its entry (alone, or after its context through a
     * run table: feed_entry) where the backend attends through runs; on the
     * others a context miss is computed in a scratch sequence and copied. */
    int fed = n_ctx == 0 || rk_attends_runs(svc);
    for (int k = 0; k < r->n_chunks; k++) {
        rk_chunk_report *rep = &r->chunk_reports[k];
        rep->tokens = r->chunk_lens[k];
        rep->live_offset = s->layout.pos[k];
        rep->group = rk_chunk_group(r, k);
        if (rk_chunk_from_prefix(r, k)) { /* in place already, as an earlier request left it */
            rep->status = RK_CHUNK_STATUS_HIT;
            rep->source = RK_CHUNK_SOURCE_PREFIX;
            if (r->opt.chunk_cache)
                rk_chunk_key_hex(rk_chunk_key_compute(&policy, r->chunks[k], r->chunk_lens[k]),
                                 rep->key);
            continue;
        }
        if (!r->opt.chunk_cache) {
            /* The oracle: fresh at the live position, seeing what a cached chunk sees. */
            rep->status = RK_CHUNK_STATUS_OFF;
            rep->source = RK_CHUNK_SOURCE_COMPUTED;
            if ((st = plan_after_context(svc, r, k, ctx, n_ctx, s->layout.pos[k] - n_ctx, pass1)))
                return st;
            continue;
        }
        rk_chunk_key key = rk_chunk_key_compute(&policy, r->chunks[k], r->chunk_lens[k]);
        rk_chunk_key_hex(key, rep->key);
        int base = n_ctx;
        st = rk_chunk_index_acquire(svc->chunks, key, r->chunks[k], r->chunk_lens[k], base,
                                    &s->entries[k], &s->kinds[k]);
        if (st == RK_ERR_EXHAUSTED || st == RK_ERR_LIMIT) /* no room even after eviction */
            st = acquire_uncached(svc, r, k, base);
        if (st) return st;
        rk_chunk_entry *e = s->entries[k];
        if (s->kinds[k] == RK_CHUNK_MISS) e->owner = r->opt.owner; /* reserved for it */
        if (s->kinds[k] == RK_CHUNK_MISS &&
            !s->scratch[k].uncached) { /* the disk tier may have it */
            int loaded = 0, queued = 0;
            /* Read (disk or Redis) off the engine thread when the request
             * can wait for it as for a chunk the steps compute (an isolated
             * one). */
            if (a->defer && !s->done && fed)
                st = rk_persist_load_start(svc, e, &queued);
            else
                st = rk_persist_load(svc, e, &loaded);
            if (st) return st;
            if (queued) {
                rep->status = RK_CHUNK_STATUS_MISS; /* a hit once it is in place */
                rep->source = RK_CHUNK_SOURCE_COMPUTED;
                if ((st = feed_entry(a, r, k, n_ctx))) return st;
                continue;
            }
            if (loaded) {
                rk_chunk_index_loaded(svc->chunks, e);
                s->kinds[k] = RK_CHUNK_HIT;
                rep->status = RK_CHUNK_STATUS_HIT;
                rep->source = RK_CHUNK_SOURCE_DISK;
                continue;
            }
            if ((st = load_shared(svc, r, k, &loaded))) return st;
            if (loaded) continue;
        }
        rep->status = s->scratch[k].uncached        ? RK_CHUNK_STATUS_UNCACHED
                      : s->kinds[k] == RK_CHUNK_HIT ? RK_CHUNK_STATUS_HIT
                                                    : RK_CHUNK_STATUS_MISS;
        rep->source =
            s->kinds[k] == RK_CHUNK_HIT ? RK_CHUNK_SOURCE_ARENA : RK_CHUNK_SOURCE_COMPUTED;
        if (s->kinds[k] == RK_CHUNK_HIT) continue;
        if (s->kinds[k] == RK_CHUNK_SHARED) {
            /* Another request's: computed by it in this pass 1, or left
             * PENDING by an earlier admission, which this one carries on. */
            if (fed && (st = feed_entry(a, r, k, n_ctx))) return st;
            continue;
        }
        if (fed) {
            if ((st = feed_entry(a, r, k, n_ctx))) return st;
        } else if (!after_system) {
            /* After the anchor in a scratch sequence; copied into the entry
             * after pass 1. */
            if ((st = plan_after_context(svc, r, k, ctx, n_ctx, 0, pass1))) return st;
            s->scratch[k].anchored = 1;
        } else {
            s->scratch[k].pass2 = 1; /* needs the system KV: after pass 1 */
        }
    }
    return RK_OK;
}

/* Pass 2 set-up for a `system`-context miss: a scratch sequence sharing the
 * request's whole system blocks, a copy of its partial last block, then the
 * chunk at positions n_sys.. . */
static rk_status plan_system_chunk(rk_service *svc, rk_request *r, int k, batch *pass2,
                                   rk_copy_plan *pre) {
    rk_req_state *s = r->state;
    scratch *sc = &s->scratch[k];
    int bs = rk_arena_block_size(svc->arena), full = r->n_sys / bs;
    rk_status st;
    sc->used = 1;
    if ((st = rk_seq_share(&sc->kv, svc->arena, s->kv.blocks, full))) return st;
    int tail = r->n_sys - full * bs;
    if ((st = rk_seq_reserve(&sc->kv, svc->arena, RK_POOL_LIVE, tail + r->chunk_lens[k], NULL)))
        return st;
    if (tail &&
        (st = rk_copy_plan_add(pre, bs, s->kv.blocks, full * bs, &sc->kv, full * bs, tail, 0)))
        return st;
    sc->kv.n_tokens = r->n_sys + r->chunk_lens[k];
    sc->src_first = r->n_sys;
    return rk_batch_add(pass2, bs, &sc->kv, r->chunks[k], r->chunk_lens[k], r->n_sys, r->n_sys, 0);
}

/* Stage 3 (chunks), second part: on a backend whose attention cannot read
 * run tables, pass 2 computes the `system`-context misses after their
 * system prompt in scratch sequences, and their KV, and that of the
 * anchored misses of pass 1, is copied into their entries. Then every entry
 * whose KV is whole (fed by pass 1 or by the steps) is ready, and written
 * through to the tiers. */
rk_status rk_stage_system_chunks(admission *a) {
    rk_service *svc = a->svc;
    int bs = rk_arena_block_size(svc->arena);
    rk_status st;
    double t = rk_time_now();
    rk_batch_reset(a->b);
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        for (int k = 0; k < r->n_chunks; k++)
            if (r->state->scratch[k].pass2 && r->state->kinds[k] == RK_CHUNK_MISS &&
                (st = plan_system_chunk(svc, r, k, a->b, a->copies)))
                return st;
    }
    if ((st = rk_copy_plan_run(a->copies, svc->be, svc->arena, rk_model_ropes(svc->model))) ||
        (st = rk_batch_run(svc, a->b)))
        return st;
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        rk_req_state *s = r->state;
        for (int k = 0; k < r->n_chunks; k++) {
            scratch *sc = &s->scratch[k];
            if (s->kinds[k] != RK_CHUNK_MISS || !s->entries[k] || !(sc->pass2 || sc->anchored))
                continue;
            rk_seq dst = {.blocks = s->entries[k]->blocks, .n_blocks = s->entries[k]->n_blocks};
            if ((st = rk_copy_plan_add(a->copies, bs, sc->kv.blocks, sc->src_first, &dst, 0,
                                       r->chunk_lens[k], 0)))
                return st;
            s->entries[k]->progress = r->chunk_lens[k]; /* once the copies ran, below */
        }
    }
    if ((st = rk_copy_plan_run(a->copies, svc->be, svc->arena, rk_model_ropes(svc->model))))
        return st;
    /* Every entry whose KV is whole now is ready, whichever request computed
     * it (a chunk computed by the steps' passes may have been carried on by
     * another request than the one that reserved it). */
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        for (int k = 0; k < r->n_chunks; k++) {
            rk_chunk_entry *e = r->state->entries[k];
            if (!e || e->state != RK_CHUNK_PENDING || e->progress < e->n_tokens) continue;
            if (r->state->scratch[k].uncached) {
                e->state = RK_CHUNK_READY; /* the request's own: neither indexed nor written */
                continue;
            }
            rk_chunk_index_ready(svc->chunks, e);
            persist(svc, e, r->opt.chunk_context, &r->state->scratch[k]);
        }
    }
    double dt = rk_time_now() - t;
    for (int i = 0; i < a->n; i++) a->reqs[i]->t.chunk_compute_ms += dt * 1e3;
    return RK_OK;
}

int rk_chunks_computed(const rk_request *r) {
    const rk_req_state *s = r->state;
    for (int k = 0; k < r->n_chunks; k++) {
        const rk_chunk_entry *e = s->entries[k];
        if (s->scratch[k].stepped && e->state == RK_CHUNK_PENDING && e->progress < e->n_tokens)
            return 0;
    }
    return 1;
}

/* Feed r's stepped chunks that are still being computed into b, at most
 * *left tokens, each entry once a pass whoever else needs it. In the
 * `system` context, r's system tail first: its chunks attend to its system
 * pages (a slice that ends the tail may share the pass with chunk slices:
 * every token's KV is written before a layer's attention reads it). */
rk_status rk_feed_chunks(rk_pipeline *p, rk_request *r, int *left) {
    rk_req_state *s = r->state;
    int bs = rk_arena_block_size(p->svc->arena);
    rk_status st;
    if (r->opt.chunk_context == RK_CONTEXT_SYSTEM && s->sys_next < r->n_sys) {
        int n = r->n_sys - s->sys_next < *left ? r->n_sys - s->sys_next : *left;
        if (n <= 0) return RK_OK;
        /* The system pages lead the request's own blocks (its run table
         * comes with the reindex, after the chunks). */
        if ((st = rk_batch_add(&p->b, bs, &s->kv, r->sys + s->sys_next, n, s->sys_next, s->sys_next,
                               0)))
            return st;
        s->fed_sys = n;
        *left -= n;
        if (s->sys_next + n < r->n_sys) return RK_OK;
    }
    for (int k = 0; k<r->n_chunks && * left> 0; k++) {
        scratch *sc = &s->scratch[k];
        if (sc->stepped && (st = rk_feed_chunk(&p->b, bs, &p->feed, s->entries[k], &sc->kv,
                                               sc->ctx_runs.n_runs ? &sc->ctx_runs : NULL, left)))
            return st;
    }
    return RK_OK;
}
