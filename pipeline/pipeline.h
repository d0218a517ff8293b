/* pipeline/pipeline.h — the request pipeline:
 *
 *   split → tokenize → system prompt through the radix cache → chunks through
 *   the chunk index (compute misses once, at base positions) → reindex (copy
 *   and rotate cached KV into the request's live blocks) → question prefill
 *   → decode → release.
 *
 * One call runs a batch of requests together: every stage's forward work for
 * all of them goes into one pass. Runs on the engine thread, which alone owns
 * the model, the arena and the caches. */
#ifndef RK_PIPELINE_H
#define RK_PIPELINE_H

#include <stdint.h>

#include "chunkcache/arena.h"
#include "chunkcache/chunk_index.h"
#include "chunkcache/radix.h"
#include "config/config.h"
#include "engine/engine.h"
#include "store/store.h"
#include "pipeline/split.h"
#include "reindex/reindex.h"

/* Seed of the embedded default model (`tiny`), fixed so every ragkv binary
 * serves the same weights. */
#define RK_EMBEDDED_MODEL_SEED 20261122u

typedef struct rk_service {
    rk_config cfg;
    rk_backend *be;
    rk_model *model;
    rk_arena *arena;
    rk_radix *prefix;       /* system-prompt cache over prefix-pool blocks; NULL when disabled */
    uint64_t prefix_ns;     /* its namespace: derived from the model fingerprint */
    rk_chunk_index *chunks; /* the chunk cache over chunk-pool blocks */
    rk_store *store;        /* the disk tier; NULL without --store */
} rk_service;

/* Create the backend, load the model (model_path NULL = build the embedded
 * `tiny` model in memory) and size the arena from cfg. */
rk_status rk_service_open(const rk_config *cfg, const char *model_path, rk_service **out);
void rk_service_close(rk_service *svc);

typedef struct rk_req_options {
    int mode_plain;     /* 1 = the pieces as one ordinary sequence, no chunk cache */
    int chunk_cache;    /* 0 = the oracle: chunks computed fresh at their live positions */
    int prefix_cache;   /* match and insert the system prompt in the radix tree */
    int context_system; /* chunks computed after the system prompt (not isolated) */
    rk_position_mode positions;
    int max_tokens;
    rk_sampler_params sampling;
    int stop_at_eog;
    int n_logprobs; /* 0..20 top log-probabilities per generated token */
    /* Repair, after reindexing: recompute chunk tokens with full attention
     * over the merged cache (system, earlier chunks, themselves). The
     * recomputed KV goes to live blocks only; the cached entries are untouched.
     * first_k: the first repair_k tokens of every chunk (0 = off).
     * deviation: the repair_ratio of the request's chunk tokens whose layer-1
     * K/V move most when layers 0..1 are recomputed over the merged cache
     * (0 = off; those two layers are then recomputed for every chunk token). */
    int repair_k;
    float repair_ratio;
} rk_req_options;

/* Defaults: rag mode, chunk and prefix caches on, isolated, sequential,
 * 128 tokens, temperature 1, stop at end of generation. */
void rk_req_options_default(rk_req_options *o);

typedef struct rk_chunk_report {
    char key[33]; /* "" when the cache is off */
    int tokens;
    const char *status; /* "hit", "miss" or "off" */
    const char *source; /* "arena", "disk" or "computed" */
    int live_offset;    /* position of its first token in this request */
    double reindex_us;
    int repaired; /* its tokens the repair policy recomputed through every layer */
} rk_chunk_report;

typedef struct rk_req_timings {
    double queue_ms, lookup_ms, chunk_compute_ms, reindex_ms, repair_ms, prefill_ms, ttft_ms,
        decode_ms, total_ms;
} rk_req_timings;

typedef struct rk_req_state rk_req_state; /* private to the pipeline */

typedef struct rk_request {
    rk_req_options opt;
    /* Tokens of the pieces, owned by the request (rk_request_tokenize fills them). */
    int32_t *sys; /* BOS (when the model uses one) + system prompt */
    int n_sys;
    int32_t **chunks; /* (n_chunks) */
    int *chunk_lens;
    int n_chunks;
    int n_empty_chunks; /* skipped by the splitter */
    int32_t *question;
    int n_question;

    /* Results. */
    int32_t *out_tokens; /* (opt.max_tokens) */
    int n_out;
    int32_t *top_ids;    /* (opt.max_tokens, opt.n_logprobs) when n_logprobs > 0 */
    float *top_logprobs; /* same shape */
    float *logprobs;     /* (opt.max_tokens) log-probability of each sampled token */
    const char *finish_reason;
    rk_chunk_report *chunk_reports; /* (n_chunks) */
    int sys_cached;                 /* system tokens reused from the prefix cache */
    int recomputed_tokens;          /* chunk tokens recomputed by the repair policy */
    int prompt_tokens, cached_tokens, computed_tokens;
    rk_req_timings t;

    /* Set from any thread (e.g. when the client disconnects): the request stops
     * at its next decode step with finish_reason "cancelled" and releases all it holds. */
    _Atomic int cancel;

    rk_req_state *state;
} rk_request;

/* Tokenize split pieces into r (system with BOS; special tokens recognised in
 * the system prompt and question, never in chunk text) and allocate the
 * result arrays for r->opt. Enforces the service's limits (chunks, tokens
 * per chunk, context). On failure r holds nothing. */
rk_status rk_request_prepare(rk_service *svc, const rk_split *pieces, rk_request *r);

/* The same from token ids (copied): sys (BOS included) and question; no chunks. */
rk_status rk_request_prepare_tokens(rk_service *svc, const int32_t *sys, int n_sys,
                                    const int32_t *question, int n_question, rk_request *r);

void rk_request_free(rk_request *r);

typedef struct rk_pipeline_hooks {
    void *ctx;
    void (*on_token)(void *ctx, int req, int32_t token);
    void (*on_logits)(void *ctx, int req, int step, const float *logits, int n_vocab);
} rk_pipeline_hooks;

/* Run a batch of prepared requests to completion. Every block reference,
 * chunk reference and radix lock taken is released before returning, on
 * success and on error. hooks may be NULL. */
rk_status rk_pipeline_run(rk_service *svc, rk_request *const *reqs, int n_reqs,
                          const rk_pipeline_hooks *hooks);

/* ---------------------------------------------------------------- pre-warming */

typedef struct rk_prewarm_item {
    /* in */
    const char *text; /* chunk text (UTF-8), len bytes */
    size_t len;
    const char *doc_id; /* may be NULL */
    /* out */
    char key[33];
    int tokens;
    const char *status; /* "cached" (arena or disk), "computed" or "failed" */
    const char *tier;   /* where it is now: "arena" or "disk" */
    char error[160];    /* why it failed */
} rk_prewarm_item;

/* Make sure every chunk's KV (isolated context) is cached without generating
 * anything: chunks found in the arena or the disk tier are "cached", the rest
 * are computed together in forward passes of bounded size. With persist set
 * (and a store), every chunk ends up on disk too. A bad chunk (invalid UTF-8,
 * too long) fails alone. Returns an error only when the engine itself fails. */
rk_status rk_pipeline_prewarm(rk_service *svc, rk_prewarm_item *items, int n_items, int persist);

#endif
