/* pipeline/pipeline.c — see pipeline.h.
 *
 * A request's stages, numbered as in docs/architecture.md ("The request
 * path"): 1 prepare (request.c), 2 system prompt, 3 chunks, 4 reindex,
 * 5 repair (repair.c), 6 question, 7 decode (step.c), 8 release. Requests
 * admitted together go through stages 2-6 one function per stage (top to
 * bottom under "admission stages"), their forward work in up to three
 * prefill passes:
 *   2 system prompt: the radix match of the request's key (start_request);
 *   3 chunks: lookup (plan_chunks), then
 *     pass 1: every system-prompt tail the prefix cache did not have that
 *             an unstepped `system` chunk, a scoring pass or an unstepped
 *             repair attends to (the others wait for the question pass); every
 *             missing chunk, at its base positions straight into its
 *             entry's chunk-pool blocks: alone (`isolated`), or after its
 *             context through a run table [context, entry] (`system`: the
 *             request's system pages; `anchor`: its anchor block, whose
 *             token is in this pass too; feed_in_context). With
 *             rk_pipeline_join and a step budget these are "stepped"
 *             instead: the steps' passes compute them a slice at a time
 *             (step.c), and the request's stages from pass 2 on run once
 *             they are whole. The oracle's chunks (cache off) go in a
 *             scratch sequence after their context, and so do the context
 *             misses on a backend whose attention cannot read runs;
 *     pass 2: on such a backend, missing chunks of the `system` context, in
 *             a scratch sequence that shares the request's system KV; the
 *             scratch-computed chunks are copied into their entries;
 *   4 reindex (reindex_stage.c): zero-copy (the default, where the backend can): the request's
 *             table is assembled from runs, the cached chunks' own blocks
 *             among them, each attended with its shift live offset - base;
 *             copy: one rope_shift_copy moves every chunk's KV into the
 *             request's live blocks (cached ones rotated by that shift);
 *   5 repair: chunk tokens recomputed over the merged cache (optional,
 *             repair.c): a ratio policy's scoring pass, then the chosen
 *             runs in one pass (with rk_pipeline_join and a step budget the
 *             steps' passes run the deviation pass a slice at a time and
 *             feed the runs, after the system tail);
 *   6 question: the question pass, the rest of each prompt (deferred system
 *             tail, question), with logits for the last token: each
 *             request's first token. With rk_pipeline_join it is part of the
 *             steps' passes (run_pass in step.c).
 * Then they decode (stage 7, step.c) and leave (stage 8, rk_release_request
 * here). This file holds the admission: a request's start, init and
 * release, the chunk lookups and the stages in reading order; sequence.c
 * puts its KV into the radix tree, batch.c runs the passes (internal.h
 * lists the files). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "chunkcache/chunk_index.h"
#include "pipeline/internal.h"
#include "pipeline/persist.h"

/* ---------------------------------------------------------------- stages */

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

/* Set on the first token of every chunk and of the question in a radix key,
 * so the same tokens segmented differently never match (token ids are below
 * 2^24, checked when the key is built). */
#define SEGMENT_MARK (1 << 30)

/* The radix namespace of a request: everything besides the key's tokens that
 * changes the KV of its merged sequence. A plain sequence depends on its
 * tokens alone. */
static uint64_t request_ns(const rk_service *svc, const rk_request *r) {
    int32_t v[8] = {(int32_t)r->opt.mode, (int32_t)rk_arena_kv(svc->arena)->dtype};
    if (r->opt.mode == RK_MODE_RAG) {
        v[2] = r->opt.chunk_cache;
        v[3] = (int32_t)r->opt.chunk_context;
        v[4] = (int32_t)r->opt.positions;
        v[5] = r->opt.repair_k;
        memcpy(&v[6], &r->opt.repair_ratio, sizeof(float));
        v[7] = r->opt.repair_query;
    }
    uint64_t ns = XXH3_64bits_withSeed(v, sizeof v, svc->prefix_ns);
    if (r->opt.salt.hi || r->opt.salt.lo) { /* a salted request's tree of its own */
        uint64_t salt[2] = {r->opt.salt.hi, r->opt.salt.lo};
        ns = XXH3_64bits_withSeed(salt, sizeof salt, ns);
    }
    return ns;
}

/* The radix key of the prompt's layout (room for the generated tokens
 * after it). */
static rk_status build_key(rk_service *svc, rk_request *r) {
    rk_req_state *s = r->state;
    if (rk_model_hparams(svc->model)->n_vocab > SEGMENT_MARK >> 6)
        return rk_errorf(RK_ERR_INTERNAL,
                         "pipeline: a vocabulary of %d tokens leaves no room "
                         "for segment marks in radix keys",
                         rk_model_hparams(svc->model)->n_vocab);
    /* The key follows the layout (a zero-copy table maps the same entries to
     * blocks through its runs). */
    int n_seq = s->q_index + s->n_qtok;
    s->key = malloc((size_t)(n_seq + r->opt.max_tokens + 1) * sizeof *s->key);
    if (!s->key) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    if (r->n_sys) memcpy(s->key, r->sys, (size_t)r->n_sys * sizeof *s->key);
    if (s->n_qtok) memcpy(s->key + s->q_index, s->qtok, (size_t)s->n_qtok * sizeof *s->key);
    if (r->opt.mode != RK_MODE_RAG) return RK_OK;
    for (int k = 0; k < r->n_chunks; k++) {
        memcpy(s->key + s->layout.index[k], r->chunks[k],
               (size_t)r->chunk_lens[k] * sizeof *s->key);
        s->key[s->layout.index[k]] |= SEGMENT_MARK;
    }
    /* Generated tokens resumed as prompt carry no mark, as when inserted. */
    if (s->n_qtok > s->n_gen) s->key[s->q_index] |= SEGMENT_MARK;
    return RK_OK;
}

/* How much of a matched prefix of n tokens a RAG request may take: never part
 * of a chunk (cut back to its start); with repair on, all chunks or none, so
 * the repair policy sees the chunks it would have seen (with the query
 * policy, all chunks only with the whole question after them). */
static int usable_prefix(const rk_request *r, int n) {
    const rk_req_state *s = r->state;
    if (r->opt.mode != RK_MODE_RAG) return n;
    for (int k = 0; k < r->n_chunks; k++)
        if (s->layout.index[k] < n && n < s->layout.index[k] + r->chunk_lens[k])
            n = s->layout.index[k];
    int repair = r->opt.repair_k > 0 || r->opt.repair_ratio > 0;
    if (repair && r->n_chunks && n < s->layout.question_index && n > s->layout.index[0])
        n = s->layout.index[0];
    /* The query policy's choice depends on the question: the whole of it too. */
    if (repair && r->opt.repair_query && r->n_chunks && n > s->layout.index[0] &&
        n < s->layout.question_index + r->n_question)
        n = s->layout.index[0];
    return n;
}

/* Table entries of the prompt: the layout's, or for a zero-copy table the
 * system prompt padded to a block and the question (the chunks are runs of
 * the chunk pool's blocks). */
static int prompt_table_entries(const rk_request *r, int bs) {
    const rk_req_state *s = r->state;
    if (!s->zc) return s->q_index + s->n_qtok;
    return (r->n_sys + bs - 1) / bs * bs + s->n_qtok;
}

/* Match the request's prompt key (all but its last token) in the radix tree,
 * share the whole pages of the usable prefix, take a reference on the page
 * that continues it for less than a page (its rows are copied before pass 1),
 * reserve blocks for the rest of the system (prefix pool for the pages that
 * will be inserted, the partial last one included, live pool after) and for
 * the chunks, question and generated tokens. The question tokens inside the
 * prefix are dropped from those to feed.
 *
 * A zero-copy request whose match reaches its question has every chunk in
 * the prefix: it takes the copy path, with nothing left to copy. Otherwise
 * it takes the system prompt alone from the match. */
static rk_status start_request(rk_service *svc, rk_request *r) {
    rk_req_state *s = r->state;
    int bs = rk_arena_block_size(svc->arena);
    rk_status st;
    /* The key: the whole prompt, or the system prompt alone (whose last token
     * is left for its logits when nothing follows). */
    int whole_seq = r->opt.reuse_sequences;
    int n_key = whole_seq ? s->q_index + s->n_qtok : r->n_sys;
    int leave_one = whole_seq || s->n_qtok == 0;
    int use_prefix = svc->prefix && r->opt.prefix_cache && n_key > 0;
    if (use_prefix) {
        if ((st = build_key(svc, r))) return st;
        s->ns = request_ns(svc, r);
        int32_t *pages = malloc((size_t)(n_key / bs + 1) * sizeof *pages);
        if (!pages) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
        rk_radix_result m;
        st = rk_radix_match(svc->prefix, s->ns, s->key, n_key,
                            RK_RADIX_PARTIAL | (leave_one ? RK_RADIX_LEAVE_ONE : 0), pages, &m);
        s->lock = m.node;
        int use = usable_prefix(r, m.n_matched + m.n_partial);
        if (s->zc && use >= s->q_index)
            s->zc = 0;
        else if (s->zc && use > r->n_sys)
            use = r->n_sys;
        int whole = use / bs;
        int32_t src = use < m.n_matched ? pages[whole] : m.partial_page;
        /* The partial page is not locked: reference it before anything can evict it. */
        if (!st && use % bs && !(st = rk_arena_ref(svc->arena, &src, 1))) {
            s->partial_src = src;
            s->n_partial = use % bs;
        }
        if (!st) st = rk_seq_share(&s->kv, svc->arena, pages, whole);
        free(pages);
        if (st) return st;
        s->reused = use;
        s->sys_first = use < r->n_sys ? use : r->n_sys;
        int n_new = r->n_sys - whole * bs;
        if (use < r->n_sys) {
            st = rk_seq_reserve(&s->kv, svc->arena, RK_POOL_PREFIX, n_new, NULL);
            if (st == RK_ERR_EXHAUSTED) {
                rk_radix_evict(svc->prefix, n_new, NULL);
                st = rk_seq_reserve(&s->kv, svc->arena, RK_POOL_PREFIX, n_new, NULL);
            }
            if (st == RK_OK) {
                s->kv.n_tokens += n_new;
                s->n_insert = r->n_sys;
            } else if (st != RK_ERR_EXHAUSTED) {
                return st;
            } /* else the prefix pool is all locked: compute in live blocks, cache nothing */
        }
    }
    r->sys_cached = s->sys_first;
    r->conv_cached = s->reused - s->sys_first;
    s->n_prompt = prompt_table_entries(r, bs);
    /* Blocks come as decoding needs them; the whole generation must fit
     * the live pool alone, or waiting never helps. */
    long life = (s->n_prompt + (long)r->opt.max_tokens - s->n_gen + bs - 1) / bs - s->kv.n_blocks;
    for (int k = 0; s->zc && k < r->n_chunks; k++)
        life += (rk_private_tokens(r, r->chunk_lens[k], bs) + bs - 1) / bs;
    if (life > rk_arena_pool_total(svc->arena, RK_POOL_LIVE))
        return rk_errorf(RK_ERR_CONTEXT,
                         "the request needs more KV memory than the server has: %ld live "
                         "blocks for its prompt and max_tokens, the live pool has %d",
                         life, rk_arena_pool_total(svc->arena, RK_POOL_LIVE));
    /* The prompt and the first token a decode step feeds. */
    int rest = s->n_prompt + (r->opt.max_tokens > 0) - s->kv.n_tokens;
    if ((st = rk_seq_reserve(&s->kv, svc->arena, RK_POOL_LIVE, rest, NULL))) return st;
    /* A zero-copy table's entries count in the layout's terms: the runs map
     * them to blocks. */
    s->kv.n_tokens = s->zc ? s->q_index + s->n_qtok : s->n_prompt;
    int skip = s->reused - s->q_index;
    if (skip > 0) { /* never all of them: the last prompt token is always computed */
        memmove(s->qtok, s->qtok + skip, (size_t)(s->n_qtok - skip) * sizeof *s->qtok);
        s->n_qtok -= skip;
        s->q_index += skip;
        s->q_pos += skip;
    }
    return RK_OK;
}

/* Whether request r reuses its cached chunks in place. Recomputed tokens
 * must be private: `first_k` repair copies the blocks it writes (copy on
 * write, see build_runs), but the deviation policy recomputes layers 0-1 of
 * every chunk token and the query policy chooses its tokens after the
 * reindex, so their requests copy whole chunks (the copy path), as do
 * the oracle and plain modes and every request on a backend without
 * position-shifted attention. */
/* Whether the backend's attention reads a sequence through a run table
 * (position-shifted attention): the CPU's. */
static int attends_runs(const rk_service *svc) { return strcmp(svc->be->name, "cpu") == 0; }

int rk_zero_copy_for(const rk_service *svc, const rk_request *r, int tell) {
    static _Atomic int told; /* the fallback is logged once */
    if (r->opt.mode != RK_MODE_RAG || !r->opt.chunk_cache || r->n_chunks == 0 ||
        r->opt.repair_ratio > 0 || strcmp(svc->cfg.reindex, "copy") == 0)
        return 0;
    if (!attends_runs(svc)) {
        if (tell && !told++)
            RK_LOG_WARN("zero-copy reindex is not available on the %s backend: chunks are copied",
                        svc->be->name);
        return 0;
    }
    return 1;
}

/* start_request for either reindex path. Zero-copy: the merged sequence's
 * own blocks are the system's (its partial last block a run of its own) and
 * the live ones for the question and generated tokens; the chunks' blocks are
 * the cache entries'. kv.n_tokens then counts table entries of the run table. */
static rk_status start_request_reindexed(rk_service *svc, rk_request *r) {
    r->state->zc = rk_zero_copy_for(svc, r, 1);
    return start_request(svc, r);
}

/* Drop the reference on the partial page a match continued into. */
static void drop_partial(rk_service *svc, rk_req_state *s) {
    if (s->n_partial) rk_arena_release(svc->arena, &s->partial_src, 1);
    s->n_partial = 0;
    s->partial_src = -1;
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

/* Look up every chunk; queue the work each needs for pass 1. */
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
 * stepped, by the steps before the chunk, feed_chunks) or
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

static rk_status plan_chunks(admission *a, rk_request *r) {
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
    int fed = n_ctx == 0 || attends_runs(svc);
    for (int k = 0; k < r->n_chunks; k++) {
        rk_chunk_report *rep = &r->chunk_reports[k];
        rep->tokens = r->chunk_lens[k];
        rep->live_offset = s->layout.pos[k];
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

void rk_release_request(rk_service *svc, rk_request *r, int failed) {
    rk_req_state *s = r->state;
    if (!s) return;
    rk_restore_report(r);
    /* A request still waiting for its chunks has no sequence to keep. */
    if (!failed && !s->chunk_wait) rk_insert_sequence(svc, r);
    for (int k = 0; s->entries && s->scratch && k < r->n_chunks; k++) {
        scratch *sc = &s->scratch[k];
        if (sc->used) rk_seq_release(&sc->kv, svc->arena);
        if (sc->rlocked) (void)rk_redis_unlock(svc->redis, &sc->rlock); /* never computed */
        rk_runs_free(&sc->ctx_runs);
        free(sc->tokens);
        if (s->entries[k] && sc->uncached) {
            rk_drop_uncached_blocks(svc, s->entries[k]);
            free(s->entries[k]->blocks);
            free(s->entries[k]);
        } else if (s->entries[k]) {
            /* A chunk still PENDING stops with its last holder: removed, its
             * progress lost, or carried on by a request that holds it too. */
            rk_chunk_entry *e = s->entries[k];
            rk_chunk_index_release(svc->chunks, e, failed || e->state == RK_CHUNK_PENDING);
        }
    }
    if (s->lock) rk_radix_unlock(svc->prefix, s->lock);
    drop_partial(svc, s);
    rk_seq_release(&s->kv, svc->arena);
    rk_runs_free(&s->runs);
    rk_seq_release(&s->own, svc->arena);
    rk_seq_release(&s->anchor, svc->arena);
    rk_sampler_free(&s->sampler);
    rk_layout_free(&s->layout);
    free(s->entries);
    free(s->kinds);
    free(s->scratch);
    free(s->qtok);
    free(s->key);
    free(s->repair);
    free(s->dev_before);
    free(s->q_mass);
    free(s);
    r->state = NULL;
}

/* A resumed request's prompt goes on with the tokens it generated but the
 * last, which its next decode step feeds. */
static void append_generated(rk_request *r) {
    rk_req_state *s = r->state;
    if (s->n_gen > 0)
        memcpy(s->qtok + s->n_qtok, r->out_tokens, (size_t)s->n_gen * sizeof *s->qtok);
    s->n_qtok += s->n_gen;
}

rk_status rk_init_request(rk_service *svc, rk_request *r) {
    const rk_hparams *hp = rk_model_hparams(svc->model);
    rk_req_state *s = calloc(1, sizeof *s);
    if (!s) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    r->state = s;
    s->partial_src = -1;
    int nc = r->n_chunks ? r->n_chunks : 1;
    s->entries = calloc((size_t)nc, sizeof *s->entries);
    s->kinds = calloc((size_t)nc, sizeof *s->kinds);
    s->scratch = calloc((size_t)nc, sizeof *s->scratch);
    if (!s->entries || !s->kinds || !s->scratch)
        return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    r->finished = 0;
    if (r->resume) { /* preempted: its tokens, timings and clock go on */
        s->t_start = r->t_admitted;
        s->n_gen = r->n_out > 0 ? r->n_out - 1 : 0; /* none when preempted before its first */
    } else {
        s->t_start = r->t_admitted = rk_time_now();
        r->n_out = 0;
        r->preemptions = 0;
        r->finish_reason = RK_FINISH_LENGTH;
        double queue_ms = r->t.queue_ms; /* set by whoever queued it */
        memset(&r->t, 0, sizeof r->t);
        r->t.queue_ms = queue_ms;
    }
    /* Nothing to generate: the prompt is still cached, but no step samples. */
    s->done = r->opt.max_tokens == 0;
    rk_status st = rk_sampler_init(&s->sampler, &r->opt.sampling, hp->n_vocab);
    if (st) return st;
    /* A fresh run starts its grammar again (from the state the HTTP worker
     * made, or the one an earlier run left: what its automaton learnt is
     * kept); a resumed one goes on. */
    if (!r->resume && r->grammar_state) rk_grammar_state_reset(r->grammar_state);
    if (r->opt.grammar && !r->grammar_state) {
        const rk_grammar_vocab *gv;
        if ((st = rk_service_grammar_vocab(svc, &gv))) return st;
        if (rk_grammar_vocab_n(gv) != hp->n_vocab)
            return rk_errorf(RK_ERR_UNSUPPORTED,
                             "constrained sampling needs the tokenizer's %d ids to be the "
                             "model's %d",
                             (int)rk_grammar_vocab_n(gv), hp->n_vocab);
        if ((st = rk_grammar_state_create(r->opt.grammar, gv, &r->grammar_state))) return st;
    }
    if (r->resume) {
        memcpy(s->sampler.rng, r->rng, sizeof r->rng);
        for (int i = 0; i < r->n_out; i++) rk_sampler_accept(&s->sampler, r->out_tokens[i]);
        if ((st = rk_save_report(r))) return st;
    }
    if (r->opt.mode == RK_MODE_PLAIN) {
        /* One ordinary sequence: the chunks and the question follow the system. */
        int n = r->n_question;
        for (int k = 0; k < r->n_chunks; k++) n += r->chunk_lens[k];
        s->qtok = malloc((size_t)(n + s->n_gen + 1) * sizeof *s->qtok);
        if (!s->qtok) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
        int o = 0;
        for (int k = 0; k < r->n_chunks; k++) {
            memcpy(s->qtok + o, r->chunks[k], (size_t)r->chunk_lens[k] * sizeof *s->qtok);
            o += r->chunk_lens[k];
        }
        if (r->n_question)
            memcpy(s->qtok + o, r->question, (size_t)r->n_question * sizeof *s->qtok);
        s->n_qtok = n;
        append_generated(r);
        s->q_index = s->q_pos = r->n_sys;
        for (int k = 0; k < r->n_chunks; k++) {
            r->chunk_reports[k] = (rk_chunk_report){.tokens = r->chunk_lens[k],
                                                    .status = RK_CHUNK_STATUS_OFF,
                                                    .source = RK_CHUNK_SOURCE_COMPUTED};
        }
        return rk_layout_plan(RK_POSITIONS_SEQUENTIAL, r->n_sys, r->chunk_lens, r->n_chunks,
                              &s->layout);
    }
    if (r->opt.chunk_context == RK_CONTEXT_ANCHOR &&
        rk_tokenizer_bos(rk_model_tokenizer(svc->model)) < 0)
        return rk_errorf(RK_ERR_INVALID,
                         "chunk_context anchor needs a model with a BOS token (the anchor)");
    if ((st = rk_layout_plan(r->opt.positions, r->n_sys, r->chunk_lens, r->n_chunks, &s->layout)))
        return st;
    s->qtok = malloc((size_t)(r->n_question + s->n_gen + 1) * sizeof *s->qtok);
    if (!s->qtok) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    if (r->n_question) memcpy(s->qtok, r->question, (size_t)r->n_question * sizeof *s->qtok);
    s->n_qtok = r->n_question;
    append_generated(r);
    s->q_index = s->layout.question_index;
    s->q_pos = s->layout.question_pos;
    return RK_OK;
}

/* ---------------------------------------------------------------- admission stages */

/* Whether something before the question pass attends to r's system KV: a
 * `system`-context chunk computed after it (fed through its run table, or
 * in pass 2), a ratio policy's
 * scoring pass, or a repair run at admission (a stepped `first_k` repair
 * is fed after the system tail in the steps). */
static int needs_system_first(const admission *a, const rk_request *r) {
    if (r->opt.mode != RK_MODE_RAG) return 0;
    for (int k = 0; k < r->n_chunks; k++) {
        const scratch *sc = &r->state->scratch[k];
        /* A stepped one: the steps feed the system tail before it (feed_chunks). */
        if (sc->pass2 ||
            (sc->ctx_runs.n_runs && !sc->stepped && r->opt.chunk_context == RK_CONTEXT_SYSTEM))
            return 1;
    }
    if (r->opt.repair_ratio > 0) return 1;
    return r->opt.repair_k > 0 && !rk_repair_stepped(a, r);
}

/* Stages 2 (system prompt) and 3 (chunks), first part: match each
 * request's key in the radix tree and reserve its blocks, look its chunks
 * up, then pass 1: the system tails the tree did not have (those something
 * before the question pass attends to), the isolated chunk misses (unless
 * the admission defers them to the steps), the anchored misses and the
 * oracle chunks. The new system pages go into the tree. */
rk_status rk_stage_system_and_chunks(admission *a) {
    int bs = rk_arena_block_size(a->svc->arena);
    rk_status st;
    double t = rk_time_now();
    rk_batch_reset(a->b);
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        rk_req_state *s = r->state;
        if ((st = start_request_reindexed(a->svc, r))) return st;
        if (s->n_partial && (st = rk_copy_plan_add(a->copies, bs, &s->partial_src, 0, &s->kv,
                                                   s->reused - s->n_partial, s->n_partial, 0)))
            return st;
    }
    rk_persist_begin_lookups(a->svc);
    for (int i = 0; i < a->n; i++)
        if (a->reqs[i]->opt.mode == RK_MODE_RAG && (st = plan_chunks(a, a->reqs[i]))) return st;
    /* A system tail nothing before the question pass attends to goes into
     * that pass, with the question. */
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        rk_req_state *s = r->state;
        s->sys_next = r->n_sys;
        if (s->sys_first == r->n_sys) continue;
        if (!needs_system_first(a, r)) {
            s->sys_next = s->sys_first;
            continue;
        }
        if ((st = rk_batch_add(a->b, bs, &s->kv, r->sys + s->sys_first, r->n_sys - s->sys_first,
                               s->sys_first, s->sys_first, 0)))
            return st;
    }
    double t_lookup = rk_time_now() - t;
    t = rk_time_now();
    /* The partial pages' rows first: the tails computed in pass 1 attend to them. */
    if ((st = rk_copy_plan_run(a->copies, a->svc->be, a->svc->arena, rk_model_rope(a->svc->model))))
        return st;
    for (int i = 0; i < a->n; i++) drop_partial(a->svc, a->reqs[i]->state);
    if ((st = rk_batch_run(a->svc, a->b))) return st;
    rk_feed_done(a->feed);
    rk_persist_note_prefill(a->svc, a->b->n_tok, rk_time_now() - t);
    for (int i = 0; i < a->n; i++) {
        rk_req_state *s = a->reqs[i]->state;
        if (s->n_insert && s->sys_next == a->reqs[i]->n_sys &&
            (st = rk_insert_system(a->svc, a->reqs[i])))
            return st;
    }
    double t_compute = rk_time_now() - t;
    for (int i = 0; i < a->n; i++) {
        a->reqs[i]->t.lookup_ms = t_lookup * 1e3;
        a->reqs[i]->t.chunk_compute_ms = t_compute * 1e3;
    }
    return RK_OK;
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
    if ((st = rk_copy_plan_run(a->copies, svc->be, svc->arena, rk_model_rope(svc->model))) ||
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
    if ((st = rk_copy_plan_run(a->copies, svc->be, svc->arena, rk_model_rope(svc->model))))
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

/* Stage 6 (question), its set-up: what is left of each request's prompt for
 * the question pass: its deferred system tail, its stepped repair runs
 * (stage 5) and its question (plain: chunks and question; resuming: and its
 * generated tokens but the last). A request whose whole prompt is its
 * computed system prompt feeds the last system token again for its logits.
 * A cancelled request is done. */
void rk_queue_prompt(admission *a) {
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        rk_req_state *s = r->state;
        if (!s->done && r->cancel) {
            r->finish_reason = RK_FINISH_CANCELLED;
            s->done = 1;
        }
        if (s->done) continue;
        s->ptok = s->qtok;
        s->n_ptok = s->n_qtok;
        s->p_idx = s->q_index;
        s->p_pos = s->q_pos;
        s->p_next = 0;
        s->next_pos = s->n_qtok ? s->q_pos + s->n_qtok : r->n_sys;
        if (s->n_qtok == 0 && s->sys_next == r->n_sys && r->n_out == 0) {
            s->ptok = r->sys + r->n_sys - 1;
            s->n_ptok = 1;
            s->p_idx = s->p_pos = r->n_sys - 1;
        }
        s->prefilling =
            s->sys_next < r->n_sys || s->scoring || s->r_next < s->n_rtok || s->n_ptok > 0;
        if (!s->prefilling) s->n_valid = s->kv.n_tokens; /* resumed, nothing to feed */
    }
}
