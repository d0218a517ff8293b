/* pipeline/embed.c — rk_pipeline_embed and rk_pipeline_rerank (see
 * pipeline.h): sequence embeddings and reranking scores. The inputs go
 * through the model in forward passes of bounded size, each over live-pool
 * blocks taken for that pass alone and released after it: neither leaves
 * anything in the radix tree, the chunk index or the arena. Each sequence's
 * normed final hidden states are pooled and L2-normalised (an embedding), or
 * the pooled state goes through the file's classification head (a score). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "pipeline/internal.h"

/* Tokens per forward pass: bounds activation memory and how long one pass
 * holds the engine thread. An input longer than this runs alone. */
#define EMBED_PASS_TOKENS 2048

rk_pooling rk_service_pooling(const rk_service *svc) {
    static const char *const names[] = {"none", "mean", "cls", "last"};
    for (int i = 0; i < 4; i++)
        if (!strcmp(svc->cfg.pooling, names[i])) return (rk_pooling)i;
    rk_pooling p = rk_model_hparams(svc->model)->pooling;
    return p == RK_POOLING_UNSET ? RK_POOLING_NONE : p;
}

int rk_service_generates(const rk_service *svc) {
    rk_pooling file = rk_model_hparams(svc->model)->pooling;
    return file == RK_POOLING_UNSET || file == RK_POOLING_NONE ||
           rk_service_pooling(svc) == RK_POOLING_NONE;
}

/* A reranker's classification head, widened to f32. */
typedef struct rank_head {
    int n_labels;
    int softmax; /* qwen3: the score is softmax(logits)[0], else logits[0] */
    float *w;    /* (n_labels, dim) */
    float *b;    /* (n_labels) or NULL */
} rank_head;

static void head_free(rank_head *h) {
    free(h->w);
    free(h->b);
}

/* The f32 form of a GGUF tensor type the head may have; -1 when none. */
static int head_dtype(uint32_t t) {
    switch (t) {
    case RK_GGML_F32: return RK_DTYPE_F32;
    case RK_GGML_F16: return RK_DTYPE_F16;
    case RK_GGML_BF16: return RK_DTYPE_BF16;
    case RK_GGML_Q8_0: return RK_DTYPE_Q8_0;
    case RK_GGML_Q4_0: return RK_DTYPE_Q4_0;
    case RK_GGML_Q4_K: return RK_DTYPE_Q4_K;
    case RK_GGML_Q5_K: return RK_DTYPE_Q5_K;
    case RK_GGML_Q6_K: return RK_DTYPE_Q6_K;
    default: return -1;
    }
}

/* Read cls.output.weight (and .bias) from the model file into h (h->w NULL
 * with a message when the model has no usable head). */
static rk_status head_load(const rk_service *svc, rank_head *h) {
    *h = (rank_head){0};
    const rk_hparams *hp = rk_model_hparams(svc->model);
    const rk_gguf *g = rk_model_gguf(svc->model);
    if (rk_service_pooling(svc) != RK_POOLING_RANK)
        return rk_errorf(RK_ERR_INVALID, "rerank: the model's pooling type is not rank");
    const rk_gguf_tensor *w = rk_gguf_find_tensor(g, "cls.output.weight");
    if (!w)
        return rk_errorf(RK_ERR_INVALID, "rerank: the model file has no classification head "
                                         "(cls.output.weight)");
    int dt = head_dtype(w->type);
    if (w->n_dims != 2 || w->ne[0] != hp->dim || w->ne[1] < 1 || w->ne[1] > 64 || dt < 0 ||
        rk_dtype_row_bytes((rk_dtype)dt, (size_t)hp->dim) * (size_t)w->ne[1] != w->n_bytes)
        return rk_errorf(RK_ERR_INVALID,
                         "rerank: cls.output.weight must be (%d, 1..64) of F32, F16, BF16, Q8_0, "
                         "Q4_0, Q4_K, Q5_K or Q6_K",
                         hp->dim);
    h->n_labels = (int)w->ne[1];
    h->softmax = strcmp(hp->arch_name, "qwen3") == 0;
    h->w = malloc((size_t)h->n_labels * hp->dim * sizeof *h->w);
    if (!h->w) return rk_errorf(RK_ERR_NOMEM, "rerank: out of memory");
    size_t row = rk_dtype_row_bytes((rk_dtype)dt, (size_t)hp->dim);
    for (int l = 0; l < h->n_labels; l++)
        rk_dequantize(h->w + (size_t)l * hp->dim, (const char *)w->data + (size_t)l * row,
                      (rk_dtype)dt, (size_t)hp->dim);
    const rk_gguf_tensor *b = rk_gguf_find_tensor(g, "cls.output.bias");
    if (b) {
        if (b->type != RK_GGML_F32 || b->ne[0] != h->n_labels || b->n_dims != 1 ||
            b->n_bytes != (size_t)h->n_labels * sizeof(float)) {
            head_free(h);
            *h = (rank_head){0};
            return rk_errorf(RK_ERR_INVALID, "rerank: cls.output.bias must be (%d) F32",
                             (int)w->ne[1]);
        }
        h->b = malloc((size_t)h->n_labels * sizeof *h->b);
        if (!h->b) {
            head_free(h);
            *h = (rank_head){0};
            return rk_errorf(RK_ERR_NOMEM, "rerank: out of memory");
        }
        memcpy(h->b, b->data, (size_t)h->n_labels * sizeof *h->b);
    }
    return RK_OK;
}

int rk_service_can_rerank(const rk_service *svc) {
    rank_head h;
    rk_status st = head_load(svc, &h);
    head_free(&h);
    return st == RK_OK;
}

/* The score of one pooled hidden state v (dim). */
static float head_score(const rank_head *h, const float *v, int dim) {
    double logit[64], top = -INFINITY;
    for (int l = 0; l < h->n_labels; l++) {
        double acc = h->b ? h->b[l] : 0.0;
        for (int i = 0; i < dim; i++) acc += (double)h->w[(size_t)l * dim + i] * v[i];
        logit[l] = acc;
        top = acc > top ? acc : top;
    }
    if (!h->softmax) return (float)logit[0];
    double sum = 0;
    for (int l = 0; l < h->n_labels; l++) sum += exp(logit[l] - top);
    return (float)(exp(logit[0] - top) / sum);
}

/* One pass's buffers: its sequences' tokens, slots, tables and pooled rows. */
typedef struct embed_pass {
    int n_tok, n_seq, n_rows, max_blocks;
    int32_t *tokens, *pos, *slots; /* (n_tok) */
    int32_t *q_start;              /* (n_seq + 1) */
    int32_t *kv_len;               /* (n_seq) */
    int32_t *rows;                 /* (n_rows) rows whose hidden states are pooled */
    int32_t *table;                /* (n_seq, max_blocks) */
    rk_seq *seqs;                  /* (n_seq) the blocks each sequence took */
    float *hidden;                 /* (n_rows, dim) */
} embed_pass;

static void pass_free(embed_pass *p) {
    free(p->tokens);
    free(p->pos);
    free(p->slots);
    free(p->q_start);
    free(p->kv_len);
    free(p->rows);
    free(p->table);
    free(p->seqs);
    free(p->hidden);
}

/* Run the sequences gathered in p, pool them into out (n_seq, dim), or
 * score them with head into out (n_seq), and release their blocks. */
static rk_status pass_run(rk_service *svc, embed_pass *p, rk_pooling pooling, const rank_head *head,
                          float *out) {
    const rk_hparams *hp = rk_model_hparams(svc->model);
    int dim = hp->dim;
    rk_status st = RK_OK;
    free(p->table);
    free(p->hidden);
    p->table = malloc((size_t)p->n_seq * p->max_blocks * sizeof *p->table);
    p->hidden = malloc((size_t)p->n_rows * dim * sizeof *p->hidden);
    if (!p->table || !p->hidden) st = rk_errorf(RK_ERR_NOMEM, "embeddings: out of memory");
    for (int s = 0; !st && s < p->n_seq; s++)
        for (int k = 0; k < p->max_blocks; k++)
            p->table[s * p->max_blocks + k] = k < p->seqs[s].n_blocks ? p->seqs[s].blocks[k] : -1;
    if (!st) {
        rk_batch b = {.n_tokens = p->n_tok,
                      .tokens = p->tokens,
                      .pos = p->pos,
                      .slots = p->slots,
                      .attn = {.n_seqs = p->n_seq,
                               .q_start = p->q_start,
                               .kv_len = p->kv_len,
                               .block_table = p->table,
                               .max_blocks = p->max_blocks},
                      .n_logits = p->n_rows,
                      .logit_rows = p->rows,
                      .hidden = 1};
        st = rk_model_forward(svc->model, rk_arena_kv(svc->arena), &b, p->hidden);
    }
    int row = 0;
    for (int s = 0; s < p->n_seq; s++) {
        int n = p->q_start[s + 1] - p->q_start[s];
        int n_rows = pooling == RK_POOLING_MEAN ? n : 1;
        float *v = head ? p->hidden + (size_t)row * dim : out + (size_t)s * dim;
        if (!st && head) {
            out[s] = head_score(head, v, dim);
        } else if (!st) {
            double norm = 0;
            for (int i = 0; i < dim; i++) {
                double acc = 0;
                for (int r = 0; r < n_rows; r++) acc += p->hidden[(size_t)(row + r) * dim + i];
                v[i] = (float)(acc / n_rows);
                norm += (double)v[i] * v[i];
            }
            float scale = norm > 0 ? (float)(1.0 / sqrt(norm)) : 0.0f;
            for (int i = 0; i < dim; i++) v[i] *= scale;
        }
        row += n_rows;
        rk_seq_release(&p->seqs[s], svc->arena);
    }
    p->n_tok = p->n_seq = p->n_rows = p->max_blocks = 0;
    return st;
}

/* Pool (or with head, score) each input into out: rows of width dim, or
 * of 1 with head. */
static rk_status run_passes(rk_service *svc, const int32_t *const *inputs, const int *n_tokens,
                            int n_inputs, rk_pooling pooling, const rank_head *head, float *out) {
    size_t width = head ? 1 : (size_t)rk_model_hparams(svc->model)->dim;
    int total = 0, longest = 0;
    for (int i = 0; i < n_inputs; i++) {
        if (n_tokens[i] < 1) return rk_errorf(RK_ERR_INVALID, "embeddings: input %d is empty", i);
        total += n_tokens[i];
        longest = n_tokens[i] > longest ? n_tokens[i] : longest;
    }
    int cap_tok = total < EMBED_PASS_TOKENS ? total : EMBED_PASS_TOKENS;
    cap_tok = longest > cap_tok ? longest : cap_tok;
    int cap_seq = n_inputs > 0 ? n_inputs : 1;
    embed_pass p = {0};
    p.tokens = malloc((size_t)cap_tok * sizeof *p.tokens);
    p.pos = malloc((size_t)cap_tok * sizeof *p.pos);
    p.slots = malloc((size_t)cap_tok * sizeof *p.slots);
    p.rows = malloc((size_t)cap_tok * sizeof *p.rows);
    p.q_start = malloc((size_t)(cap_seq + 1) * sizeof *p.q_start);
    p.kv_len = malloc((size_t)cap_seq * sizeof *p.kv_len);
    p.seqs = calloc((size_t)cap_seq, sizeof *p.seqs);
    rk_status st = RK_OK;
    if (!p.tokens || !p.pos || !p.slots || !p.rows || !p.q_start || !p.kv_len || !p.seqs)
        st = rk_errorf(RK_ERR_NOMEM, "embeddings: out of memory");
    int bs = rk_arena_block_size(svc->arena);
    int first = 0; /* the first input of the pass being gathered */
    for (int i = 0; !st && i < n_inputs;) {
        int n = n_tokens[i];
        if (p.n_seq > 0 && p.n_tok + n > cap_tok) {
            st = pass_run(svc, &p, pooling, head, out + (size_t)first * width);
            first = i;
            continue;
        }
        rk_seq *seq = &p.seqs[p.n_seq];
        *seq = (rk_seq){0};
        st = rk_seq_reserve(seq, svc->arena, RK_POOL_LIVE, n, p.slots + p.n_tok);
        if (st == RK_ERR_EXHAUSTED && p.n_seq > 0) { /* run what fits, then go on */
            rk_error_clear();
            st = pass_run(svc, &p, pooling, head, out + (size_t)first * width);
            first = i;
            continue;
        }
        if (st) break;
        memcpy(p.tokens + p.n_tok, inputs[i], (size_t)n * sizeof *p.tokens);
        for (int j = 0; j < n; j++) p.pos[p.n_tok + j] = j;
        p.q_start[p.n_seq] = p.n_tok;
        p.kv_len[p.n_seq] = n;
        if (pooling == RK_POOLING_MEAN)
            for (int j = 0; j < n; j++) p.rows[p.n_rows++] = p.n_tok + j;
        else
            p.rows[p.n_rows++] = pooling == RK_POOLING_CLS ? p.n_tok : p.n_tok + n - 1;
        p.n_tok += n;
        p.q_start[p.n_seq + 1] = p.n_tok;
        int nb = (n + bs - 1) / bs;
        p.max_blocks = nb > p.max_blocks ? nb : p.max_blocks;
        p.n_seq++;
        i++;
    }
    if (!st && p.n_seq > 0) st = pass_run(svc, &p, pooling, head, out + (size_t)first * width);
    for (int s = 0; s < p.n_seq; s++) rk_seq_release(&p.seqs[s], svc->arena);
    pass_free(&p);
    return st;
}

rk_status rk_pipeline_embed(rk_service *svc, const int32_t *const *inputs, const int *n_tokens,
                            int n_inputs, rk_pooling pooling, float *out) {
    if (pooling != RK_POOLING_MEAN && pooling != RK_POOLING_CLS && pooling != RK_POOLING_LAST)
        return rk_errorf(RK_ERR_INVALID, "embeddings: the model has no pooling (see --pooling)");
    return run_passes(svc, inputs, n_tokens, n_inputs, pooling, NULL, out);
}

rk_status rk_pipeline_rerank(rk_service *svc, const int32_t *const *inputs, const int *n_tokens,
                             int n_inputs, float *out) {
    rank_head h;
    rk_status st = head_load(svc, &h);
    if (st) return st;
    /* The reference engine pools the last token of qwen3 rerankers, the
     * first (CLS) of the others. */
    rk_pooling pooling = strcmp(rk_model_hparams(svc->model)->arch_name, "qwen3") == 0
                             ? RK_POOLING_LAST
                             : RK_POOLING_CLS;
    st = run_passes(svc, inputs, n_tokens, n_inputs, pooling, &h, out);
    head_free(&h);
    return st;
}
