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

#include "pipeline/scheduler.h"
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
        long toks = w->sys_tok[w->req_sys[j]] + 1 + w->q_tok[j] + b->o.max_max, scratch = 0;
        /* Later turns add an answer and a question each; an answer may
         * re-tokenize longer than it was generated (see next_turn). */
        toks += (long)w->n_followups * (2L * b->o.max_max + b->o.question_tokens + 8);
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
    long live = live_req * (b->o.arrival_rate > 0 ? OPEN_MAX_BATCH : b->o.concurrency);
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
            x->prefix_hits += rep->source == RK_CHUNK_SOURCE_PREFIX;
            x->hit_tokens += rep->tokens;
        } else if (rep->status == RK_CHUNK_STATUS_MISS) {
            x->misses++;
        } else {
            x->offs++;
        }
    }
}

/* Wait for a submitted job to be done, up to timeout_s; its status. */
static rk_status job_finish(rk_job *j, double timeout_s) {
    int n = 0, done = 0;
    double deadline = rk_time_now() + timeout_s;
    while (!done)
        if (rk_job_wait(j, n, deadline, &n, &done))
            return rk_errorf(RK_ERR_IO, "bench: a request took longer than %g s", timeout_s);
    if (!j->ran) return rk_errorf(RK_ERR_INTERNAL, "bench: a request was cancelled");
    return j->status ? rk_errorf(j->status, "%s", j->error) : RK_OK;
}

/* Run one prepared request: through the pipeline, or, with an engine thread
 * (e), as its job. */
static rk_status run_one(rk_service *svc, rk_scheduler *e, double timeout_s, rk_request *r) {
    if (!e) return rk_pipeline_run(svc, &r, 1, NULL);
    rk_job j;
    rk_status st = rk_job_init(&j);
    if (st) return st;
    j.req = *r;
    memset(r, 0, sizeof *r);
    if (!(st = rk_scheduler_submit(e, &j))) st = job_finish(&j, timeout_s);
    *r = j.req; /* the request and its report go back to the caller */
    memset(&j.req, 0, sizeof j.req);
    rk_job_destroy(&j);
    return st;
}

/* Compute every corpus chunk into the chunk cache: requests of up to
 * PREWARM_GROUP chunks that generate nothing (e: see run_one). */
static rk_status prewarm_inproc(bench *b, rk_service *svc, rk_scheduler *e, mode_result *m) {
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
        if (!(st = run_one(svc, e, b->o.http_timeout_s, &r))) {
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

/* The service's configuration: the run's, with limits that admit the
 * workload and, without --kv-memory-mb, pools sized to hold it. */
static void service_config(const bench *b, rk_config *out) {
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
    *out = cfg;
}

/* The model and the arena of the service into b and m, and warnings about
 * pools too small for the workload (once). Reads only what is fixed once
 * the service is open. */
static void describe_service(bench *b, mode_result *m, rk_service *svc) {
    const rk_hparams *hp = rk_model_hparams(svc->model);
    b->n_layers = hp->n_layers;
    b->n_kv_heads = hp->n_kv_heads;
    b->head_dim = hp->head_dim;
    snprintf(b->model_desc, sizeof b->model_desc, "%s", hp->name[0] ? hp->name : hp->arch_name);
    rk_arena_params ap = {.n_layers = hp->n_kv_layers ? hp->n_kv_layers : hp->n_layers,
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
}

/* The text of a conversation's next turn (--turns): the turn's prompt, the
 * model's answer and the next question, one per line; the chunks stay
 * chunks and the question piece grows. The answer keeps the workload's
 * alphabet, printable ASCII without '#': anything else becomes a space, so
 * that it holds no separator and no broken UTF-8 (a byte token alone). *out
 * replaces the previous text (freed). */
static rk_status next_turn(rk_service *svc, const rk_request *r, const char *prompt,
                           const char *question, char **out) {
    char *answer;
    size_t len;
    rk_status st = rk_tokenizer_decode(rk_model_tokenizer(svc->model), r->out_tokens,
                                       (size_t)r->n_out, 0, 0, &answer, &len);
    if (st) return st;
    for (size_t i = 0; i < len; i++)
        if (answer[i] < 0x20 || answer[i] > 0x7e || answer[i] == '#') answer[i] = ' ';
    size_t n = strlen(prompt) + len + strlen(question) + 3;
    char *text = malloc(n);
    if (text) snprintf(text, n, "%s%s\n%s", prompt, answer, question);
    free(answer);
    if (!text) return rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
    free(*out);
    *out = text;
    return RK_OK;
}

/* Open loop (--arrival-rate): each request is submitted at its Poisson
 * arrival time to an engine thread (rk_scheduler, as `ragkv serve` runs
 * them), whether earlier ones finished or not; the engine batches what is
 * queued, up to OPEN_MAX_BATCH generations. TTFT and e2e count from the
 * arrival time: tokenizing, the queue wait and the engine's own time. The
 * chunk index is the engine thread's alone, so its counters are not read. */
/* The engine thread of an open-loop mode, once its model is loaded. */
static rk_status start_engine(bench *b, mode_result *m, rk_scheduler **out) {
    rk_scheduler_params p = {
        .model_path = b->o.model, .max_queue = m->n_run + 1, .max_batch = OPEN_MAX_BATCH};
    service_config(b, &p.cfg);
    m->hwm_reset = rk_bench_hwm_reset();
    rk_scheduler *e;
    rk_status st = rk_scheduler_start(&p, &e);
    if (st) return st;
    char why[320];
    while (rk_scheduler_get_state(e, why, sizeof why) == RK_SCHEDULER_LOADING) usleep(10000);
    if (rk_scheduler_get_state(e, why, sizeof why) != RK_SCHEDULER_READY) {
        rk_scheduler_free(e);
        return rk_errorf(RK_ERR_IO, "bench: the engine did not start: %s", why);
    }
    *out = e;
    return RK_OK;
}

/* Prepare request j in jb and queue it, noting when in *sent; jb holds
 * nothing after a failure. */
static rk_status submit_open(rk_scheduler *e, const workload *w, int j, const rk_req_options *opt,
                             rk_job *jb, double *sent) {
    rk_status st = rk_job_init(jb);
    if (st) return st;
    rk_service *svc = rk_scheduler_service(e);
    jb->req.opt = *opt;
    jb->req.opt.max_tokens = w->max_out[j];
    rk_split pieces;
    st = rk_split_prompt(w->prompt[j], strlen(w->prompt[j]), "##", svc->cfg.max_chunks, &pieces);
    if (!st) {
        st = rk_request_prepare(svc, &pieces, &jb->req);
        rk_split_free(&pieces);
    }
    *sent = rk_time_now();
    if (!st) st = rk_scheduler_submit(e, jb);
    if (st) rk_job_destroy(jb);
    return st;
}

static rk_status run_open(bench *b, int mode) {
    mode_result *m = &b->res[mode];
    const workload *w = &b->w;
    rk_scheduler *e;
    rk_status st = start_engine(b, m, &e);
    if (st) return st;
    rk_service *svc = rk_scheduler_service(e);
    describe_service(b, m, svc);
    if (mode == MODE_RAG && b->o.prewarm && (st = prewarm_inproc(b, svc, e, m))) {
        rk_scheduler_free(e);
        return st;
    }
    rk_req_options opt;
    rk_bench_mode_options(&b->o, mode, &opt);
    rk_job *jobs = calloc((size_t)m->n_run, sizeof *jobs);
    double *sent = calloc((size_t)m->n_run, sizeof *sent);
    unsigned char *queued = calloc((size_t)m->n_run, 1);
    if (!jobs || !sent || !queued) {
        free(jobs);
        free(sent);
        free(queued);
        rk_scheduler_free(e);
        return rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
    }
    double t0 = rk_time_now();
    for (int i = 0; i < m->n_run; i++) {
        int j = m->run[i];
        double due = t0 + w->arrival_s[j], now = rk_time_now();
        while (now < due) {
            double wait = due - now < 0.5 ? due - now : 0.5; /* usleep: under a second */
            usleep((useconds_t)(wait * 1e6));
            now = rk_time_now();
        }
        m->req[j].late_ms = (now - due) * 1e3;
        if ((st = submit_open(e, w, j, &opt, &jobs[i], &sent[i]))) {
            if (!m->error[0])
                snprintf(m->error, sizeof m->error, "request %d: %s", j, rk_error_message());
            continue;
        }
        queued[i] = 1;
        rk_bench_maybe_progress(b, mode, i, i + 1, t0);
    }
    for (int i = 0; i < m->n_run; i++) {
        if (!queued[i]) continue;
        int j = m->run[i];
        if ((st = job_finish(&jobs[i], b->o.http_timeout_s))) {
            if (!m->error[0])
                snprintf(m->error, sizeof m->error, "request %d: %s", j, rk_error_message());
            continue;
        }
        const rk_request *r = &jobs[i].req;
        req_result *x = &m->req[j];
        double lead = (sent[i] - (t0 + w->arrival_s[j])) * 1e3; /* arrival to submit */
        fill_from_request(r, x);
        x->ttft_ms = lead + r->t.queue_ms + r->t.ttft_ms;
        x->e2e_ms = lead + r->t.total_ms;
        x->server_total_ms = x->e2e_ms;
        x->n_out = r->n_out;
        x->tpot_ms = x->n_out > 1 ? (x->e2e_ms - x->ttft_ms) / (x->n_out - 1) : NAN;
    }
    m->wall_s = rk_time_now() - t0;
    m->vmhwm_kb = rk_bench_hwm_read();
    /* Stopping the engine completes whatever a timeout left running; only
     * then are the jobs the bench's to free. */
    rk_scheduler_free(e);
    for (int i = 0; i < m->n_run; i++)
        if (queued[i]) rk_job_destroy(&jobs[i]);
    free(jobs);
    free(sent);
    free(queued);
    m->ran = 1;
    return RK_OK;
}

/* A closed-loop run's batch: up to --concurrency requests at a time. */
typedef struct batch_run {
    bench *b;
    mode_result *m;
    rk_service *svc;
    rk_req_options opt;
    rk_request *reqs, **ptrs; /* (C) */
    int *idx;                 /* (C) the slot of each prepared request */
    char **conv;              /* (C) each slot's conversation so far */
} batch_run;

/* Prepare turn `turn` of the n conversations from list position i0 into
 * br->ptrs; returns how many were prepared. */
static int prepare_turn(batch_run *br, int i0, int n, int turn) {
    mode_result *m = br->m;
    const workload *w = &br->b->w;
    int n_prep = 0;
    for (int s = 0; s < n; s++) {
        int j = m->run[i0 + s];
        if (turn > 0 && !br->conv[s]) continue;
        const char *text = turn ? br->conv[s] : w->prompt[j];
        double tr = rk_time_now();
        rk_split pieces;
        rk_request *r = &br->reqs[n_prep];
        memset(r, 0, sizeof *r);
        r->opt = br->opt;
        r->opt.max_tokens = w->max_out[j];
        rk_status st = rk_split_prompt(text, strlen(text), "##", br->svc->cfg.max_chunks, &pieces);
        if (!st) {
            st = rk_request_prepare(br->svc, &pieces, r);
            rk_split_free(&pieces);
        }
        if (st) {
            if (!m->error[0])
                snprintf(m->error, sizeof m->error, "request %d turn %d: %s", j, turn + 1,
                         rk_error_message());
            continue;
        }
        if (turn == 0) m->req[j].prep_ms = (rk_time_now() - tr) * 1e3;
        br->idx[n_prep] = s;
        br->ptrs[n_prep++] = r;
    }
    return n_prep;
}

/* Turn `turn` of the n conversations from list position i0, together; a
 * conversation whose turn failed has no text (conv[s] NULL) and stops. */
static void run_turn(batch_run *br, int i0, int n, int turn) {
    mode_result *m = br->m;
    const workload *w = &br->b->w;
    int turns = br->b->o.turns;
    double tb = rk_time_now();
    int n_prep = prepare_turn(br, i0, n, turn);
    double prep_ms = (rk_time_now() - tb) * 1e3;
    rk_status st = rk_pipeline_run(br->svc, br->ptrs, n_prep, NULL);
    if (st && !m->error[0])
        snprintf(m->error, sizeof m->error, "requests %d..%d turn %d: %s", m->run[i0],
                 m->run[i0 + n - 1], turn + 1, rk_error_message());
    for (int q = 0; q < n_prep; q++) {
        rk_request *r = br->ptrs[q];
        int s = br->idx[q], j = m->run[i0 + s];
        req_result *x = turn ? &m->turn[(size_t)(turn - 1) * w->n_req + j] : &m->req[j];
        if (!st) {
            fill_from_request(r, x);
            /* TTFT as the API reports it (the pipeline's, tokenizing apart);
             * the latency includes tokenizing the whole batch. */
            x->ttft_ms = r->t.ttft_ms;
            x->n_out = r->n_out;
            x->tpot_ms = x->n_out > 1 ? (r->t.total_ms - x->ttft_ms) / (x->n_out - 1) : NAN;
            x->e2e_ms = prep_ms + r->t.total_ms;
            x->server_total_ms = x->e2e_ms;
        }
        rk_status nt = RK_OK;
        if (!st && turn + 1 < turns)
            nt = next_turn(br->svc, r, turn ? br->conv[s] : w->prompt[j],
                           w->followup[(size_t)j * w->n_followups + turn], &br->conv[s]);
        if (st || nt || turn + 1 == turns) {
            if (nt && !m->error[0])
                snprintf(m->error, sizeof m->error, "request %d turn %d: %s", j, turn + 2,
                         rk_error_message());
            free(br->conv[s]);
            br->conv[s] = NULL;
        }
        rk_request_free(r);
    }
}

rk_status rk_bench_run_inproc(bench *b, int mode) {
    mode_result *m = &b->res[mode];
    if (b->o.arrival_rate > 0) return run_open(b, mode);
    rk_config cfg;
    service_config(b, &cfg);
    m->hwm_reset = rk_bench_hwm_reset();
    rk_service *svc = NULL;
    rk_status st = rk_service_open(&cfg, b->o.model, &svc);
    if (st) return st;
    describe_service(b, m, svc);
    if (mode == MODE_RAG && b->o.prewarm && (st = prewarm_inproc(b, svc, NULL, m))) {
        rk_service_close(svc);
        return st;
    }
    rk_chunk_stats s0, s1;
    rk_chunk_index_get_stats(svc->chunks, &s0);

    int C = b->o.concurrency;
    batch_run br = {.b = b, .m = m, .svc = svc};
    rk_bench_mode_options(&b->o, mode, &br.opt);
    br.reqs = calloc((size_t)C, sizeof *br.reqs);
    br.ptrs = calloc((size_t)C, sizeof *br.ptrs);
    br.idx = calloc((size_t)C, sizeof *br.idx);
    br.conv = calloc((size_t)C, sizeof *br.conv);
    if (!br.reqs || !br.ptrs || !br.idx || !br.conv) {
        st = rk_errorf(RK_ERR_NOMEM, "bench: out of memory");
        goto out;
    }
    double t0 = rk_time_now();
    for (int i0 = 0; i0 < m->n_run; i0 += C) {
        int n = m->n_run - i0 < C ? m->n_run - i0 : C;
        for (int turn = 0; turn < b->o.turns; turn++) run_turn(&br, i0, n, turn);
        for (int s = 0; s < n; s++) {
            free(br.conv[s]);
            br.conv[s] = NULL;
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
    m->ran = 1;
out:
    free(br.reqs);
    free(br.ptrs);
    free(br.idx);
    free(br.conv);
    rk_service_close(svc);
    return st;
}
