/* engine/engine.h — models and the transformer forward pass.
 *
 * A model is loaded from GGUF (the families of arch.h; weights
 * F32, F16, BF16, or Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K kept quantized on the
 * CPU backend), with its tokenizer read from the same file. The forward
 * pass computes a batch of tokens from one or more sequences at explicit
 * positions, writes their K/V into the paged cache through a slot mapping and
 * attends over each sequence's block table: the engine never owns KV memory
 * and has no contiguous-cache path. Sampling lives here too.
 *
 * Errors: every fallible call returns an rk_status with a one-line message
 * (rk_error_message(), thread-local) and frees what it took; nothing aborts.
 * The calls below say which codes they return.
 * Thread-safety: a loaded model is read-only except for the activation
 * buffers rk_model_forward reuses. So the accessors (rk_model_hparams ...
 * rk_model_weight_bytes) and what they return may be used by any number of
 * threads at once while the model lives (the HTTP worker threads of `ragkv
 * serve` tokenize with rk_model_tokenizer's tokenizer, see tokenizer.h);
 * rk_model_forward runs on one thread at a time, the one that owns the
 * model's backend and the KV arena it writes (the engine thread in `ragkv
 * serve`; the backend's own worker threads run inside the call). Loading
 * and freeing are the owner's, with no other call on the model in flight.
 * A sampler is one request's: one thread at a time. rk_log_sum_exp and
 * rk_logprobs_top are pure and may run anywhere.
 * Ownership: the model owns everything its accessors return (valid until
 * rk_model_free); the caller owns the backend (which must outlive the
 * model), the KV cache and every array of an rk_batch, none of which the
 * model keeps after a call returns. */
#ifndef RK_ENGINE_H
#define RK_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "config/config.h"
#include "engine/arch.h"
#include "engine/gguf.h"
#include "engine/tokenizer.h"
#include "kernels/kernels.h"

/* How a sequence's final hidden states (after the output norm) become one
 * embedding: <arch>.pooling_type in GGUF, numbered as the reference engine
 * numbers them. */
typedef enum rk_pooling {
    RK_POOLING_UNSET = -1, /* the file has no pooling_type key */
    RK_POOLING_NONE = 0,   /* per token: no sequence embedding */
    RK_POOLING_MEAN = 1,
    RK_POOLING_CLS = 2,  /* the first token */
    RK_POOLING_LAST = 3, /* the last token */
    RK_POOLING_RANK = 4, /* a reranker: a classification head (cls.output) scores the
                            pooled token (the last for qwen3, the first otherwise) */
} rk_pooling;

typedef struct rk_hparams {
    const rk_arch_desc *desc; /* the family (arch.h) */
    char arch_name[16];
    char name[96]; /* general.name, "" when absent */
    int n_layers;
    int dim; /* embedding width */
    int n_heads;
    int n_kv_heads;
    int head_dim;
    int ffn_dim;
    int n_vocab;
    int n_ctx; /* training context length */
    float rms_eps;
    int tied_embeddings;
    rk_rope_params rope;
    /* Attention (arch.h): q·k scale; sliding window (0: no layer slides) and
     * the period of global layers; soft caps (0: none); the sliding layers'
     * RoPE. */
    float attn_scale;
    int sliding_window, swa_period;
    float attn_softcap, final_softcap;
    rk_rope_params rope_swa;
    rk_dtype wtype;     /* dtype of the attention/FFN matrices (of blk.0.attn_q) */
    rk_pooling pooling; /* <arch>.pooling_type; RK_POOLING_UNSET when absent */
    /* Mixture of experts (desc->moe != RK_MOE_NONE), else 0: experts per
     * layer, experts per token, each expert's FFN width */
    int n_expert, n_expert_used, ffn_exp;
    /* Layers that hold KV (the KV cache's n_layers): n_layers, fewer where
     * the last layers reuse an earlier layer's KV (gemma4,
     * rk_model_kv_layer; 0 in a shape made by hand reads as n_layers); the
     * width of each layer's own token embedding (gemma4's per-layer
     * embeddings, 0: none). */
    int n_kv_layers, n_embd_per_layer;
} rk_hparams;

typedef struct rk_model rk_model; /* opaque */

/* Load a model from a GGUF file for the given backend. The file stays mapped
 * for the model's lifetime (the CPU backend computes from the mapping). The
 * caller owns *out (rk_model_free); on failure *out is NULL, nothing is left
 * allocated or mapped, and the message names the file and the problem:
 * RK_ERR_IO (the file cannot be opened, read or mapped), RK_ERR_FORMAT (not
 * GGUF, truncated, a tensor or metadata key missing or of the wrong shape, a
 * non-finite weight), RK_ERR_UNSUPPORTED (an architecture, tensor type, RoPE
 * scaling or head size ragkv does not compute), RK_ERR_NOMEM (host or
 * backend memory). */
rk_status rk_model_load(const char *path, rk_backend *be, rk_model **out);

/* Same, from a GGUF image in memory that the model takes ownership of (freed
 * with free() when the model is freed, also on failure); name only labels
 * the messages. The same errors but RK_ERR_IO. */
rk_status rk_model_load_owned_buffer(void *buf, size_t len, const char *name, rk_backend *be,
                                     rk_model **out);

/* Free the model, its activation buffers and its tokenizer, and unmap its
 * file; accepts NULL. No other call on m may be in flight. */
void rk_model_free(rk_model *m);

const rk_hparams *rk_model_hparams(const rk_model *m);
const rk_tokenizer *rk_model_tokenizer(const rk_model *m);
/* The RoPE layer l rotates its queries and keys with (0 <= l < n_layers;
 * NULL outside): one table for every layer, except in families whose
 * sliding-window layers use a base of their own (Gemma 3). */
const rk_rope *rk_model_rope(const rk_model *m, int layer);
/* The same for every layer, (n_layers) entries, as rope_shift_copy takes
 * them: the first n_kv_layers are the KV cache's layers (the layers that
 * own KV come first, so KV layer i is model layer i). */
const rk_rope *const *rk_model_ropes(const rk_model *m);
/* The attention of layer l as the forward pass computes it: the model's
 * scale and soft cap, and the layer's sliding window (0: global). */
rk_attn_params rk_model_attn_params(const rk_model *m, int layer);
/* The KV cache layer model layer l writes and attends over: l itself, or for
 * a layer that reuses KV (gemma4's shared layers) the owning layer's; -1
 * outside 0..n_layers-1. */
int rk_model_kv_layer(const rk_model *m, int layer);
const rk_gguf *rk_model_gguf(const rk_model *m);
rk_backend *rk_model_backend(const rk_model *m);
/* 32 lowercase hex digits identifying the weights and hyper-parameters. */
const char *rk_model_fingerprint(const rk_model *m);
/* Bytes of weights read per decoded token (every matrix once; of a
 * mixture-of-experts layer the router and the expert_used_count /
 * expert_count share of its experts), for bandwidth figures. */
size_t rk_model_weight_bytes(const rk_model *m);

/* One forward call. Sequence s of attn owns token rows attn.q_start[s] ..
 * attn.q_start[s+1]-1 of tokens/pos/slots; after its new K/V are written, it
 * attends over the first attn.kv_len[s] entries of its block table (causal in
 * table order). Logits are produced for the rows listed in logit_rows. All
 * arrays are host memory. */
typedef struct rk_batch {
    int n_tokens;
    const int32_t *tokens; /* (n_tokens) */
    const int32_t *pos;    /* (n_tokens) RoPE positions */
    const int32_t *slots;  /* (n_tokens) KV slot each token's K/V is written to */
    rk_attn_batch attn;    /* block_table here is host memory; rope is ignored: segments are
                            * read with each layer's own (rk_model_rope) */
    int n_logits;
    const int32_t *logit_rows; /* (n_logits) rows of tokens to compute logits for */
    int n_layers;              /* run layers [0, n_layers) only (0 = all); no logits then */
    /* When not NULL: the rotated queries of the last layer run, (n_tokens,
     * n_heads * head_dim), downloaded here (host memory the caller owns). */
    float *out_q;
    /* Set: out_logits gets the hidden states of logit_rows after the output
     * norm, (n_logits, dim), instead of logits (embeddings). */
    int hidden;
} rk_batch;

/* Run the transformer over the batch; writes logits (n_logits, n_vocab), or
 * with b->hidden the normed hidden states (n_logits, dim), to host memory
 * out_logits (may be NULL when n_logits is 0), and b->out_q when
 * set. kv is the arena's cache (chunkcache/arena.h), written at b->slots
 * and read through the block tables; its shape must be the model's.
 * Errors: RK_ERR_INVALID for a batch that does not fit the model or the
 * cache (an empty batch, sequences that do not cover its tokens, a token id
 * out of the vocabulary, n_layers out of range or partial with logits, a
 * logit row out of the batch, a slot or table entry the backend's argument
 * checks refuse), RK_ERR_NOMEM when the activation buffers cannot grow,
 * RK_ERR_LIMIT for a batch too large for the attention kernel, RK_ERR_DEVICE
 * from an accelerator. The batch checks run before anything is written; a
 * later failure may leave the batch's KV slots partly written and the
 * logits undefined. The model stays usable either way. Engine thread only
 * (see above). */
rk_status rk_model_forward(rk_model *m, const rk_kv_cache *kv, const rk_batch *b,
                           float *out_logits);

/* ---------------------------------------------------------------- sampling */

#define RK_MAX_LOGIT_BIAS 300 /* logit_bias entries per request (OpenAI's limit) */

/* A bias added to one token's logit before sampling. */
typedef struct rk_logit_bias {
    int32_t token;
    float bias; /* -100..100; -100 bans the token */
} rk_logit_bias;

/* Sampling. The adjustments run first, in this order, on a copy of the
 * logits: logit_bias; the penalties over the tokens accepted so far
 * (rk_sampler_accept: the request's generated tokens, not its prompt);
 * then temperature, top-k and top-p choose (greedy: the largest). */
typedef struct rk_sampler_params {
    float temperature; /* 0 = greedy */
    int top_k;         /* 0 = off */
    float top_p;       /* 1 = off */
    uint64_t seed;
    /* OpenAI's: logit -= count * frequency_penalty + (count > 0) *
     * presence_penalty, count = times the token was accepted; 0 = off. */
    float presence_penalty;
    float frequency_penalty;
    /* llama.cpp's and Hugging Face's: an accepted token's logit is divided
     * by it when positive, multiplied when negative; 1 (or 0) = off. */
    float repetition_penalty;
    int n_logit_bias;
    rk_logit_bias logit_bias[RK_MAX_LOGIT_BIAS];
} rk_sampler_params;

typedef struct rk_sampler {
    rk_sampler_params p;
    uint64_t rng[2];
    int n_vocab;
    float *probs;   /* (n_vocab) scratch */
    int32_t *idx;   /* (n_vocab) scratch */
    float *adj;     /* (n_vocab) the adjusted logits; NULL when nothing adjusts them */
    int32_t *count; /* (n_vocab) times each token was accepted; NULL without penalties */
} rk_sampler;

/* Check p (ranges; logit_bias tokens inside n_vocab) and set s up (s is
 * overwritten; its buffers are s's own until rk_sampler_free). RK_ERR_INVALID
 * names the field; RK_ERR_NOMEM. On failure s holds nothing to free. */
rk_status rk_sampler_init(rk_sampler *s, const rk_sampler_params *p, int n_vocab);
/* Free s's buffers; accepts NULL and a sampler whose init failed. */
void rk_sampler_free(rk_sampler *s);
/* Choose the next token from logits(n_vocab). Reproducible for a given seed
 * and the same tokens accepted. */
int32_t rk_sampler_sample(rk_sampler *s, const float *logits);
/* The same over the tokens whose bit is set in allowed (a bitset of n_vocab
 * bits, word i / 64; NULL: all), the others masked after logit_bias and the
 * penalties and before temperature, top-k and top-p. Returns -1 when allowed
 * holds no token. */
int32_t rk_sampler_sample_masked(rk_sampler *s, const float *logits, const uint64_t *allowed);
/* Record a token of the output (sampled or forced) for the penalties. */
void rk_sampler_accept(rk_sampler *s, int32_t token);

/* log(sum of exp(logits[i])) over logits(n), n >= 1, summed in double after
 * taking out the largest logit. */
float rk_log_sum_exp(const float *logits, int n);

/* The k most likely tokens of logits(n) with their natural-log probabilities
 * (log-softmax of the raw logits: logit - lse, lse = rk_log_sum_exp(logits,
 * n)), most likely first. Returns how many were written. */
int rk_logprobs_top(const float *logits, int n, float lse, int k, int32_t *out_ids,
                    float *out_logprobs);

#endif
