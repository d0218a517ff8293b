/* bench/runner_inproc.c — the request list through the pipeline in this
 * process, in batches of --concurrency requests. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/bench_internal.h"

#include "pipeline/split.h"

/* ---------------------------------------------------------------- in-process runner */

/* Pool sizes that hold the whole working set: every corpus chunk in the
 * chunk pool, every system prompt in the prefix pool, and a batch of the
 * largest requests (with the oracle's scratch copies when the oracle runs)
 * in the live pool. */
static void size_pools(const bench *b, int bs, int out[RK_POOL_COUNT]) {
    int oracle = 0;
    for (int i = 0; i < b->o.n_modes; i++) oracle |= b->o.modes[i] == MODE_ORACLE;
    const workload *w = &b->w;
    long chunk = 0, prefix = 0, live_req = 0;
    for (int i = 0; i < w->n_chunks; i++) chunk += (w->chunk_tok[i] + bs - 1) / bs;
    for (int i = 0; i < w->n_sys; i++) prefix += (w->sys_tok[i] + 1 + bs - 1) / bs + 1;
    for (int j = 0; j < w->n_req; j++) {
        long toks = w->sys_tok[w->req_sys[j]] + 1 + w->q_tok[j] + b->o.max_tokens, scratch = 0;
        for (int m = 0; m < w->k; m++) {
            int t = w->chunk_tok[w->req_chunks[(size_t)j * w->k + m]];
            toks += t;
            scratch += (t + bs - 1) / bs;
        }
        long need = (toks + bs - 1) / bs + 2 + (oracle ? scratch : 0);
        live_req = need > live_req ? need : live_req;
    }
    /* A pre-warm request: up to PREWARM_GROUP chunks plus a one-token question. */
    long warm = 0, cur = 0;
    for (int i = 0; i < w->n_chunks && b->o.prewarm; i++) {
        cur += w->chunk_tok[i];
        if ((i + 1) % PREWARM_GROUP == 0 || i + 1 == w->n_chunks) {
            long need = (cur + w->sys_tok[0] + 8 + bs - 1) / bs + 2;
            warm = need > warm ? need : warm;
            cur = 0;
        }
    }
    long live = live_req * b->o.concurrency;
    live = (live > warm ? live : warm) + 4;
    out[RK_POOL_LIVE] = (int)live;
    out[RK_POOL_PREFIX] = (int)(prefix * 2 + 4);
    out[RK_POOL_CHUNK] = (int)(chunk + 4);
}

static void fill_from_request(const rk_request *r, req_result *x) {
    x->ok = 1;
    x->prompt = r->prompt_tokens;
    x->reused = r->cached_tokens;
    x->computed = r->computed_tokens;
    x->sys_tokens = r->n_sys;
    x->sys_cached = r->sys_cached;
    x->q_tokens = r->n_question;
    x->n_chunks = r->n_chunks;
    for (int c = 0; c < r->n_chunks; c++) {
        const rk_chunk_report *rep = &r->chunk_reports[c];
        x->chunk_tokens += r->chunk_lens[c];
        if (rep->status == RK_CHUNK_STATUS_HIT) {
            x->hits++;
            x->hit_tokens += rep->tokens;
        } else if (rep->status == RK_CHUNK_STATUS_MISS) {
            x->misses++;
        } else {
            x->offs++;
        }
    }
}

/* Compute every corpus chunk into the chunk cache: requests of up to
 * PREWARM_GROUP chunks that generate nothing. */
static rk_status prewarm_inproc(bench *b, rk_service *svc, mode_result *m) {
    const workload *w = &b->w;
    rk_req_options opt;
    rk_bench_mode_options(&b->o, MODE_RAG, &opt);
    opt.max_tokens = 0;
    opt.prefix_cache = 0;
    double t0 = rk_time_now();
    rk_status st = RK_OK;
    for (int i = 0; i < w->n_chunks && !st; i += PREWARM_GROUP) {
        int n = w->n_chunks - i < PREWARM_GROUP ? w->n_chunks - i : PREWARM_GROUP;
        rk_split pieces;
        st = rk_split_structured(w->sys[0], (const char *const *)w->chunk + i, n, "?",
                                 svc->cfg.max_chunks, &pieces);
        if (st) break;
        rk_request r = {.opt = opt};
        st = rk_request_prepare(svc, &pieces, &r);
        rk_split_free(&pieces);
        if (st) break;
        rk_request *one = &r;
        if (!(st = rk_pipeline_run(svc, &one, 1, NULL))) {
            for (int c = 0; c < r.n_chunks; c++)
                if (r.chunk_reports[c].status == RK_CHUNK_STATUS_MISS) {
                    m->prewarm_chunks++;
                    m->prewarm_tokens += r.chunk_lens[c];
                }
        }
        rk_request_free(&r);
    }
    m->prewarm_s = rk_time_now() - t0;
    m->prewarmed = st == RK_OK;
    return st;
}

rk_status rk_bench_run_inproc(bench *b, int mode) {
    mode_result *m = &b->res[mode];
    const workload *w = &b->w;
    rk_config cfg = b->o.run.cfg;
    if (cfg.max_chunks < w->k) cfg.max_chunks = w->k;
    if (cfg.max_chunks < PREWARM_GROUP) cfg.max_chunks = PREWARM_GROUP;
    int cb = 0;
    for (int i = 0; i < w->n_chunks; i++) cb = w->chunk_tok[i] > cb ? w->chunk_tok[i] : cb;
    if (cfg.max_chunk_tokens < cb) cfg.max_chunk_tokens = cb;
    if (!b->o.kv_mb_given) {
        int pools[RK_POOL_COUNT];
        size_pools(b, cfg.block_size, pools);
        cfg.live_blocks = pools[RK_POOL_LIVE];
        cfg.prefix_blocks = pools[RK_POOL_PREFIX];
        cfg.chunk_blocks = pools[RK_POOL_CHUNK];
    }
    m->hwm_reset = rk_bench_hwm_reset();
    rk_service *svc = NULL;
    rk_status st = rk_service_open(&cfg, b->o.model, &svc);
    if (st) return st;
    const rk_hparams *hp = rk_model_hparams(svc->model);
    b->n_layers = hp->n_layers;
    b->n_kv_heads = hp->n_kv_heads;
    b->head_dim = hp->head_dim;
    snprintf(b->model_desc, sizeof b->model_desc, "%s", hp->name[0] ? hp->name : hp->arch_name);
    rk_arena_params ap = {.n_layers = hp->n_layers,
                          .n_kv_heads = hp->n_kv_heads,
                          .head_dim = hp->head_dim,
                          .block_size = rk_arena_block_size(svc->arena),
                          .dtype = rk_arena_kv(svc->arena)->dtype};
    long total_blocks = 0;
    for (int p = 0; p < RK_POOL_COUNT; p++) {
        m->pool_blocks[p] = rk_arena_pool_total(svc->arena, (rk_pool_tag)p);
        total_blocks += m->pool_blocks[p];
    }
    m->kv_arena_mib = (double)total_blocks * (double)rk_arena_block_bytes(&ap) / (1 << 20);
    if (!b->warned_pools) {
        b->warned_pools = 1;
        int bs = rk_arena_block_size(svc->arena), need[RK_POOL_COUNT];
        size_pools(b, bs, need);
        if (m->pool_blocks[RK_POOL_CHUNK] < need[RK_POOL_CHUNK] - 4)
            rk_bench_add_warning(
                b,
                "the chunk pool holds %d blocks but the corpus needs %d: expect evictions "
                "(raise --kv-memory-mb, or leave it out to size the pools to fit)",
                m->pool_blocks[RK_POOL_CHUNK], need[RK_POOL_CHUNK] - 4);
        if (m->pool_blocks[RK_POOL_LIVE] < need[RK_POOL_LIVE] - 4)
            rk_bench_add_warning(
                b, "the live pool holds %d blocks; a batch may need %d: requests may fail",
                m->pool_blocks[RK_POOL_LIVE], need[RK_POOL_LIVE] - 4);
        long avail = rk_bench_mem_available_kb();
        if (avail > 0 && m->kv_arena_mib * 1024 > 0.9 * (double)avail)
            rk_bench_add_warning(
                b, "the KV arena (%.0f MiB) is close to the available memory (%ld MiB)",
                m->kv_arena_mib, avail / 1024);
    }
    if (mode == MODE_RAG && b->o.prewarm && (st = prewarm_inproc(b, svc, m))) {
        rk_service_close(svc);
        return st;
    }
    rk_chunk_stats s0, s1;
    rk_chunk_index_get_stats(svc->chunks, &s0);

    rk_req_options opt;
    rk_bench_mode_options(&b->o, mode, &opt);
    int C = b->o.concurrency;
    rk_request *reqs = calloc((size_t)C, sizeof *reqs);
    rk_request **ptrs = calloc((size_t)C, sizeof *ptrs);
    int *idx = calloc((size_t)C, sizeof *idx);
    if (!reqs || !ptrs || !idx) {
        free(reqs);
        free(ptrs);
        free(idx);
        rk_service_close(svc);
        return rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
    }
    double t0 = rk_time_now();
    for (int i0 = 0; i0 < m->n_run; i0 += C) {
        int n = m->n_run - i0 < C ? m->n_run - i0 : C, n_prep = 0;
        double tb = rk_time_now();
        for (int i = i0; i < i0 + n; i++) {
            int j = m->run[i];
            double tr = rk_time_now();
            rk_split pieces;
            rk_request *r = &reqs[n_prep];
            memset(r, 0, sizeof *r);
            r->opt = opt;
            st = rk_split_prompt(w->prompt[j], strlen(w->prompt[j]), "##", cfg.max_chunks, &pieces);
            if (!st) {
                st = rk_request_prepare(svc, &pieces, r);
                rk_split_free(&pieces);
            }
            if (st) {
                if (!m->error[0])
                    snprintf(m->error, sizeof m->error, "request %d: %s", j, rk_error_message());
                continue;
            }
            m->req[j].prep_ms = (rk_time_now() - tr) * 1e3;
            idx[n_prep] = j;
            ptrs[n_prep++] = r;
        }
        double prep_ms = (rk_time_now() - tb) * 1e3;
        st = rk_pipeline_run(svc, ptrs, n_prep, NULL);
        if (st && !m->error[0])
            snprintf(m->error, sizeof m->error, "requests %d..%d: %s", m->run[i0],
                     m->run[i0 + n - 1], rk_error_message());
        for (int q = 0; q < n_prep; q++) {
            req_result *x = &m->req[idx[q]];
            if (!st) {
                fill_from_request(ptrs[q], x);
                /* TTFT as the API reports it (the pipeline's, tokenizing apart);
                 * the latency includes tokenizing the whole batch. */
                x->ttft_ms = ptrs[q]->t.ttft_ms;
                x->e2e_ms = prep_ms + ptrs[q]->t.total_ms;
                x->server_total_ms = x->e2e_ms;
            }
            rk_request_free(ptrs[q]);
        }
        rk_bench_maybe_progress(b, mode, i0, i0 + n, t0);
    }
    m->wall_s = rk_time_now() - t0;
    rk_chunk_index_get_stats(svc->chunks, &s1);
    m->have_index = 1;
    m->ix.lookups = s1.lookups - s0.lookups;
    m->ix.hits = s1.hits - s0.hits;
    m->ix.misses = s1.misses - s0.misses;
    m->ix.evictions = s1.evictions - s0.evictions;
    m->ix.computed_tokens = s1.computed_tokens - s0.computed_tokens;
    m->ix.hit_tokens = s1.hit_tokens - s0.hit_tokens;
    m->vmhwm_kb = rk_bench_hwm_read();
    free(reqs);
    free(ptrs);
    free(idx);
    rk_service_close(svc);
    m->ran = 1;
    return RK_OK;
}
