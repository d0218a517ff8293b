/* pipeline/embed.c — embedding and rerank tasks (rk_embed_task, see
 * pipeline.h): sequence embeddings and reranking scores, computed as prompt
 * work of the engine's steps. Each step's embedding pass (rk_embed_step,
 * called by rk_pipeline_step after the step's own pass) holds slices of the
 * tasks' inputs, in arrival order, within what the step budget left: an
 * input longer than that is fed over several passes, each slice attending
 * to the entries its earlier slices wrote (causal, as chunked prefill), so
 * the result is the one-pass one. An input holds live-pool blocks from its
 * first slice to its last, then releases them: nothing enters the radix
 * tree, the chunk index or the arena. Each input's normed final hidden
 * states are pooled and L2-normalised (an embedding), or the pooled state
 * goes through the file's classification head (a score). */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "pipeline/internal.h"

/* Tokens per embedding pass when the step gives no budget (no stream
 * decodes, or --step-tokens 0): bounds activation memory. */
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

/* ---------------------------------------------------------------- tasks */

struct rk_embed_task {
    const int32_t *const *inputs; /* (n_inputs) the caller's, until done */
    const int *n_tokens;          /* (n_inputs) */
    int n_inputs;
    rk_pooling pooling; /* the rows pooled: mean, cls or last */
    rank_head head;     /* head.w NULL: embeddings */
    float *out;         /* (n_inputs, dim), or (n_inputs) with a head; the caller's */
    int next;           /* the input being fed */
    int fed;            /* its tokens fed so far */
    rk_seq seq;         /* its blocks while it is fed over several passes */
    double *acc;        /* (dim) its pooled rows, summed (mean) or copied (cls, last) */
    atomic_int cancel;
    int done;
    rk_status status;
    char error[320];
};

rk_status rk_embed_task_create(const rk_service *svc, const int32_t *const *inputs,
                               const int *n_tokens, int n_inputs, rk_pooling pooling, float *out,
                               rk_embed_task **out_task) {
    *out_task = NULL;
    const rk_hparams *hp = rk_model_hparams(svc->model);
    rank_head h = {0};
    if (pooling == RK_POOLING_RANK) {
        rk_status st = head_load(svc, &h);
        if (st) return st;
        /* The reference engine pools the last token of qwen3 rerankers, the
         * first (CLS) of the others. */
        pooling = strcmp(hp->arch_name, "qwen3") == 0 ? RK_POOLING_LAST : RK_POOLING_CLS;
    } else if (pooling != RK_POOLING_MEAN && pooling != RK_POOLING_CLS &&
               pooling != RK_POOLING_LAST) {
        return rk_errorf(RK_ERR_INVALID, "embeddings: the model has no pooling (see --pooling)");
    }
    for (int i = 0; i < n_inputs; i++)
        if (n_tokens[i] < 1) {
            head_free(&h);
            return rk_errorf(RK_ERR_INVALID, "embeddings: input %d is empty", i);
        }
    rk_embed_task *t = calloc(1, sizeof *t);
    double *acc = malloc((size_t)hp->dim * sizeof *acc);
    if (!t || !acc) {
        free(t);
        free(acc);
        head_free(&h);
        return rk_errorf(RK_ERR_NOMEM, "embeddings: out of memory");
    }
    *t = (rk_embed_task){.inputs = inputs,
                         .n_tokens = n_tokens,
                         .n_inputs = n_inputs,
                         .pooling = pooling,
                         .head = h,
                         .out = out,
                         .acc = acc,
                         .done = n_inputs == 0};
    *out_task = t;
    return RK_OK;
}

void rk_embed_task_cancel(rk_embed_task *t) { atomic_store(&t->cancel, 1); }

int rk_embed_task_done(const rk_embed_task *t, rk_status *out_status, char *msg, size_t cap) {
    if (!t->done) return 0;
    if (out_status) *out_status = t->status;
    if (msg && cap) snprintf(msg, cap, "%s", t->status ? t->error : "");
    return 1;
}

void rk_embed_task_free(rk_embed_task *t) {
    if (!t) return;
    head_free(&t->head);
    free(t->acc);
    free(t);
}

/* The task ends with st (its blocks released). */
static void task_end(rk_service *svc, rk_embed_task *t, rk_status st, const char *msg) {
    rk_seq_release(&t->seq, svc->arena);
    t->status = st;
    snprintf(t->error, sizeof t->error, "%s", st ? msg : "");
    t->done = 1;
}

/* ---------------------------------------------------------------- one pass */

/* Tokens from..from+n-1 of one task's input, a sequence of the pass. */
typedef struct slice {
    rk_embed_task *t;
    int input, from, n;
    int row, n_rows; /* its pooled rows among the pass's hidden rows */
    rk_seq seq;      /* the input's blocks for the pass */
} slice;

/* One pass's buffers, for at most cap tokens. */
typedef struct embed_pass {
    int n_tok, n_seq, n_rows, max_blocks;
    int32_t *tokens, *pos, *slots; /* (cap) */
    int32_t *rows;                 /* (cap) rows whose hidden states are pooled */
    int32_t *q_start;              /* (cap + 1) */
    int32_t *kv_len;               /* (cap) */
    slice *slices;                 /* (cap) */
    int32_t *table;                /* (n_seq, max_blocks) */
    float *hidden;                 /* (n_rows, dim) */
} embed_pass;

static void pass_free(embed_pass *p) {
    free(p->tokens);
    free(p->pos);
    free(p->slots);
    free(p->rows);
    free(p->q_start);
    free(p->kv_len);
    free(p->slices);
    free(p->table);
    free(p->hidden);
}

static rk_status pass_alloc(embed_pass *p, int cap) {
    *p = (embed_pass){0};
    p->tokens = malloc((size_t)cap * sizeof *p->tokens);
    p->pos = malloc((size_t)cap * sizeof *p->pos);
    p->slots = malloc((size_t)cap * sizeof *p->slots);
    p->rows = malloc((size_t)cap * sizeof *p->rows);
    p->q_start = malloc((size_t)(cap + 1) * sizeof *p->q_start);
    p->kv_len = malloc((size_t)cap * sizeof *p->kv_len);
    p->slices = calloc((size_t)cap, sizeof *p->slices);
    if (p->tokens && p->pos && p->slots && p->rows && p->q_start && p->kv_len && p->slices)
        return RK_OK;
    pass_free(p);
    return rk_errorf(RK_ERR_NOMEM, "embeddings: out of memory");
}

/* Add the next slice of t (at most *left tokens) to the pass: the input's
 * next tokens, their blocks (the ones its earlier slices took, and more),
 * and the rows its pooling reads. RK_ERR_EXHAUSTED when the live pool has
 * no room for them (the task is unchanged). */
static rk_status add_slice(rk_service *svc, embed_pass *p, rk_embed_task *t, int *left) {
    int len = t->n_tokens[t->next], from = t->fed;
    int n = len - from < *left ? len - from : *left;
    slice *s = &p->slices[p->n_seq];
    *s = (slice){.t = t, .input = t->next, .from = from, .n = n, .row = p->n_rows, .seq = t->seq};
    rk_status st = rk_seq_reserve(&s->seq, svc->arena, RK_POOL_LIVE, n, p->slots + p->n_tok);
    t->seq = s->seq; /* blocks it took stay with the input either way */
    if (st) return st;
    t->seq = (rk_seq){0};
    s->seq.n_tokens += n;
    memcpy(p->tokens + p->n_tok, t->inputs[t->next] + from, (size_t)n * sizeof *p->tokens);
    for (int j = 0; j < n; j++) p->pos[p->n_tok + j] = from + j;
    if (t->pooling == RK_POOLING_MEAN)
        for (int j = 0; j < n; j++) p->rows[p->n_rows++] = p->n_tok + j;
    else if (t->pooling == RK_POOLING_CLS && from == 0)
        p->rows[p->n_rows++] = p->n_tok;
    else if (t->pooling == RK_POOLING_LAST && from + n == len)
        p->rows[p->n_rows++] = p->n_tok + n - 1;
    s->n_rows = p->n_rows - s->row;
    p->q_start[p->n_seq] = p->n_tok;
    p->kv_len[p->n_seq] = from + n;
    p->n_tok += n;
    p->q_start[p->n_seq + 1] = p->n_tok;
    p->max_blocks = s->seq.n_blocks > p->max_blocks ? s->seq.n_blocks : p->max_blocks;
    p->n_seq++;
    *left -= n;
    if (from + n == len) {
        t->next++;
        t->fed = 0;
    } else {
        t->fed = from + n;
    }
    return RK_OK;
}

/* The input's pooled state in t->acc is complete: its embedding (unit
 * length) or its score into t->out. */
static void finish_input(rk_embed_task *t, int input, int n_rows, int dim) {
    if (t->head.w) {
        float v[dim];
        for (int i = 0; i < dim; i++) v[i] = (float)t->acc[i];
        t->out[input] = head_score(&t->head, v, dim);
        return;
    }
    float *v = t->out + (size_t)input * dim;
    double norm = 0;
    for (int i = 0; i < dim; i++) {
        v[i] = (float)(t->acc[i] / n_rows);
        norm += (double)v[i] * v[i];
    }
    float scale = norm > 0 ? (float)(1.0 / sqrt(norm)) : 0.0f;
    for (int i = 0; i < dim; i++) v[i] *= scale;
}

/* Run the pass gathered in p, then take each slice's hidden rows into its
 * task: a slice that ends its input completes it and releases its blocks;
 * another gives its blocks back to its task for the next slice. A failed
 * pass ends the tasks in it. */
static void pass_run(rk_service *svc, embed_pass *p) {
    int dim = rk_model_hparams(svc->model)->dim;
    rk_status st = RK_OK;
    p->table = malloc((size_t)p->n_seq * p->max_blocks * sizeof *p->table);
    p->hidden = malloc((size_t)(p->n_rows ? p->n_rows : 1) * dim * sizeof *p->hidden);
    if (!p->table || !p->hidden) st = rk_errorf(RK_ERR_NOMEM, "embeddings: out of memory");
    for (int s = 0; !st && s < p->n_seq; s++)
        for (int k = 0; k < p->max_blocks; k++)
            p->table[s * p->max_blocks + k] =
                k < p->slices[s].seq.n_blocks ? p->slices[s].seq.blocks[k] : -1;
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
    char msg[320];
    snprintf(msg, sizeof msg, "%s", st ? rk_error_message() : "");
    for (int s = 0; s < p->n_seq; s++) {
        slice *sl = &p->slices[s];
        rk_embed_task *t = sl->t;
        if (st || t->done) { /* a failed pass, or an earlier slice of t failed */
            rk_seq_release(&sl->seq, svc->arena);
            if (!t->done) task_end(svc, t, st, msg);
            continue;
        }
        if (sl->from == 0) memset(t->acc, 0, (size_t)dim * sizeof *t->acc);
        const float *h = p->hidden + (size_t)sl->row * dim;
        if (t->pooling == RK_POOLING_MEAN) {
            for (int r = 0; r < sl->n_rows; r++)
                for (int i = 0; i < dim; i++) t->acc[i] += h[(size_t)r * dim + i];
        } else if (sl->n_rows) {
            for (int i = 0; i < dim; i++) t->acc[i] = h[i];
        }
        int len = t->n_tokens[sl->input];
        if (sl->from + sl->n < len) {
            t->seq = sl->seq; /* its next slice goes on from here */
            continue;
        }
        rk_seq_release(&sl->seq, svc->arena);
        finish_input(t, sl->input, t->pooling == RK_POOLING_MEAN ? len : 1, dim);
        if (sl->input == t->n_inputs - 1) task_end(svc, t, RK_OK, ""); /* its last input */
    }
}

void rk_embed_step(rk_service *svc, rk_embed_task *const *tasks, int n_tasks, int budget,
                   int others_running) {
    int left = budget > 0 && budget < EMBED_PASS_TOKENS ? budget : EMBED_PASS_TOKENS;
    embed_pass p;
    rk_status st = pass_alloc(&p, left);
    for (int i = 0; i < n_tasks; i++) {
        rk_embed_task *t = tasks[i];
        if (t->done) continue;
        if (atomic_load(&t->cancel))
            task_end(svc, t, RK_ERR_BUSY, "the request was cancelled");
        else if (st)
            task_end(svc, t, st, "embeddings: out of memory");
    }
    if (st) return;
    int full = 0; /* the live pool has no room for the next slice */
    for (int i = 0; i < n_tasks && left > 0 && !full; i++) {
        rk_embed_task *t = tasks[i];
        while (!t->done && t->next < t->n_inputs && left > 0) {
            rk_status sst = add_slice(svc, &p, t, &left);
            if (sst == RK_ERR_EXHAUSTED) {
                rk_error_clear();
                full = 1;
                break;
            }
            if (sst) {
                task_end(svc, t, sst, rk_error_message()); /* its slices in p are dropped */
                break;
            }
        }
    }
    if (p.n_seq > 0) {
        pass_run(svc, &p);
    } else if (full && !others_running) {
        /* No room even with no generation running: the first waiting task
         * fails (its blocks go back), so the ones after it can go on. */
        for (int i = 0; i < n_tasks; i++)
            if (!tasks[i]->done) {
                rk_embed_task *t = tasks[i];
                char msg[320];
                snprintf(msg, sizeof msg,
                         "embeddings: the live pool has no room for input %d (%d tokens)", t->next,
                         t->n_tokens[t->next]);
                task_end(svc, t, RK_ERR_EXHAUSTED, msg);
                break;
            }
    }
    pass_free(&p);
}
