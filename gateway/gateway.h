/* gateway/ — the top of ragkv: the service object that ties a backend, a
 * model and the KV arena together, the generation loop over batched
 * sequences, and the `ragkv` command line. */
#ifndef RK_GATEWAY_H
#define RK_GATEWAY_H

#include <stdint.h>

#include "chunkcache/arena.h"
#include "config/config.h"
#include "engine/engine.h"

/* Seed of the embedded default model (`tiny`), fixed so every ragkv binary
 * serves the same weights. */
#define RK_EMBEDDED_MODEL_SEED 20261122u

typedef struct rk_service {
    rk_config cfg;
    rk_backend *be;
    rk_model *model;
    rk_arena *arena;
} rk_service;

/* Create the backend, load the model (model_path NULL = build the embedded
 * `tiny` model in memory) and size the arena from cfg. */
rk_status rk_service_open(const rk_config *cfg, const char *model_path, rk_service **out);
void rk_service_close(rk_service *svc);

/* ---------------------------------------------------------------- generation */

typedef struct rk_gen_seq {
    /* in */
    const int32_t *prompt; /* (n_prompt) token ids, BOS included by the caller */
    int n_prompt;
    int max_new; /* tokens to generate at most */
    rk_sampler_params sampling;
    int stop_at_eog; /* stop when the model emits an end-of-generation token */
    /* out */
    int32_t *out_tokens; /* (max_new) caller-provided */
    int n_out;
    const char *finish_reason; /* "stop" (end-of-generation token) or "length" */
    double ttft_s;             /* from the call until this sequence's first token */
} rk_gen_seq;

typedef struct rk_gen_hooks {
    void *ctx;
    /* Called for each sampled token, in order, per sequence. */
    void (*on_token)(void *ctx, int seq, int32_t token);
    /* Called with the logits (n_vocab) each token of a sequence was sampled from. */
    void (*on_logits)(void *ctx, int seq, int step, const float *logits, int n_vocab);
} rk_gen_hooks;

typedef struct rk_gen_stats {
    int prompt_tokens; /* over all sequences */
    int decode_tokens; /* tokens generated after the first of each sequence */
    double prefill_s;  /* the first forward pass (all prompts) */
    double decode_s;   /* every later pass */
} rk_gen_stats;

/* Generate for n_seqs sequences together: one forward pass prefills every
 * prompt, then each pass decodes one token for every unfinished sequence.
 * KV lives in blocks of the live pool and is released before returning, on
 * success and on error. hooks and stats may be NULL. */
rk_status rk_generate(rk_service *svc, rk_gen_seq *seqs, int n_seqs, const rk_gen_hooks *hooks,
                      rk_gen_stats *stats);

#endif
