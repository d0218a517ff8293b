/* bench/eval_task.c — `ragkv eval --task`: answer accuracy. The records
 * (structured, or LongBench's input and context cut into chunks), every
 * configuration's answers scored with LongBench's exact match and token F1
 * (bench/score.c), overall and per record type, and --calibrate, which writes
 * the cheapest configuration within a loss budget of plain. */
#include "bench/eval.h"

#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_internal.h"
#include "bench/eval_internal.h"
#include "bench/score.h"
#include "engine/tokenizer.h"
#include "pipeline/split.h"

/* ---------------------------------------------------------------- --task */

void rk_eval_task_rec_free(task_rec *t) {
    rk_split_free(&t->p);
    for (int i = 0; i < t->n_answers; i++) free(t->answers[i]);
    free(t->answers);
    memset(t, 0, sizeof *t);
}

/* The answers of a record: "answers" (a string or an array of strings) or
 * "answer". */
static rk_status task_answers(json_t *o, const char *path, int line, task_rec *t) {
    json_t *a = json_object_get(o, "answers");
    if (!a) a = json_object_get(o, "answer");
    size_t n = json_is_array(a) ? json_array_size(a) : json_is_string(a) ? 1 : 0;
    if (n == 0)
        return rk_errorf(RK_ERR_INVALID,
                         "%s:%d: want \"answers\" (a string or a non-empty array of strings) or "
                         "\"answer\"",
                         path, line);
    t->answers = calloc(n, sizeof *t->answers);
    if (!t->answers) return rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_is_array(a) ? json_array_get(a, i) : a;
        if (!json_is_string(v))
            return rk_errorf(RK_ERR_INVALID, "%s:%d: answer %zu is not a string", path, line, i);
        if (!(t->answers[i] = strdup(json_string_value(v))))
            return rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
        t->n_answers++;
    }
    return RK_OK;
}

/* A LongBench context cut into chunks: at sep, or every n_tok tokens of tok
 * (each piece decoded back to text). *out: malloc'ed strings. */
static rk_status cut_context(const char *ctx, const char *sep, int n_tok, const rk_tokenizer *tok,
                             char ***out, int *n_out) {
    char **c = NULL;
    int n = 0, cap = 0;
    rk_status st = RK_OK;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    if (!sep && (st = rk_tokenizer_encode(tok, ctx, strlen(ctx), 0, &ids, &n_ids))) return st;
    const char *p = ctx;
    for (size_t at = 0; !st;) {
        char *piece = NULL;
        size_t len;
        if (sep) {
            const char *q = strstr(p, sep);
            len = q ? (size_t)(q - p) : strlen(p);
            piece = strndup(p, len);
            if (!piece) st = rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
            p = q ? q + strlen(sep) : NULL;
        } else {
            if (at >= n_ids) break;
            size_t m = n_ids - at < (size_t)n_tok ? n_ids - at : (size_t)n_tok;
            st = rk_tokenizer_decode(tok, ids + at, m, 0, 0, &piece, &len);
            at += m;
        }
        if (!st && n == cap) {
            cap = cap ? 2 * cap : 16;
            char **nc = realloc(c, (size_t)cap * sizeof *nc);
            if (!nc)
                st = rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
            else
                c = nc;
        }
        if (st) {
            free(piece);
            break;
        }
        c[n++] = piece;
        if (sep && !p) break;
    }
    free(ids);
    if (st) {
        for (int i = 0; i < n; i++) free(c[i]);
        free(c);
        return st;
    }
    *out = c;
    *n_out = n;
    return RK_OK;
}

/* One --task line: the structured form, or LongBench's (input, context cut
 * into chunks, no system prompt). */
static rk_status task_line(eval *e, json_t *o, const char *path, int line, const rk_tokenizer *tok,
                           task_rec *t) {
    memset(t, 0, sizeof *t);
    t->type = -1;
    rk_status st = task_answers(o, path, line, t);
    json_t *in = json_object_get(o, "input"), *ctx = json_object_get(o, "context");
    if (!st && json_is_string(in) && json_is_string(ctx)) {
        if (!e->o.chunk_tokens && !e->o.chunk_sep[0])
            st = rk_errorf(RK_ERR_INVALID,
                           "%s:%d: a LongBench record (input, context) needs --chunk-tokens N or "
                           "--chunk-sep STR to cut its context into chunks",
                           path, line);
        char **c = NULL;
        int n = 0;
        if (!st)
            st = cut_context(json_string_value(ctx), e->o.chunk_sep[0] ? e->o.chunk_sep : NULL,
                             e->o.chunk_tokens, tok, &c, &n);
        if (!st)
            st = rk_split_structured(NULL, (const char *const *)c, n, json_string_value(in),
                                     SPLIT_CHUNKS, &t->p);
        for (int i = 0; i < n; i++) free(c[i]);
        free(c);
    } else if (!st) {
        st = rk_eval_parse_line(o, path, line, &t->p);
    }
    json_t *type = json_object_get(o, "type");
    if (!st && type && !json_is_string(type))
        st = rk_errorf(RK_ERR_INVALID, "%s:%d: \"type\" must be a string", path, line);
    if (!st && type) {
        const char *name = json_string_value(type);
        int k = 0;
        while (k < e->n_types && strcmp(e->type_names[k], name)) k++;
        if (k == MAX_TYPES || strlen(name) >= sizeof e->type_names[0])
            st = rk_errorf(RK_ERR_LIMIT, "%s:%d: at most %d types of up to 31 bytes", path, line,
                           MAX_TYPES);
        else {
            if (k == e->n_types) snprintf(e->type_names[e->n_types++], 32, "%s", name);
            t->type = k;
            e->type_count[k]++;
        }
    }
    if (st) rk_eval_task_rec_free(t);
    return st;
}

typedef struct task_loader {
    eval *e;
    const rk_tokenizer *tok;
    int cap;
} task_loader;

static rk_status add_task(json_t *o, const char *path, int line, void *ctx) {
    task_loader *l = ctx;
    eval *e = l->e;
    rk_status st = rk_eval_grow_for((void **)&e->tasks, &l->cap, e->n_tasks, sizeof *e->tasks);
    if (!st && !(st = task_line(e, o, path, line, l->tok, &e->tasks[e->n_tasks]))) {
        int nc = e->tasks[e->n_tasks].p.n_chunks;
        if (nc > e->ps.max_chunks) e->ps.max_chunks = nc;
        e->n_tasks++;
    }
    return st;
}

static rk_status load_tasks(eval *e, const rk_tokenizer *tok) {
    task_loader l = {e, tok, 0};
    rk_status st = rk_eval_each_json_line(e->o.task, add_task, &l);
    if (!st && e->n_tasks == 0) st = rk_errorf(RK_ERR_INVALID, "%s: no records", e->o.task);
    return st;
}

/* Score one generated answer against a record's answers: the best over them. */
static rk_status score_answer(const task_rec *t, const char *pred, int *em, double *f1) {
    *em = 0;
    *f1 = 0;
    for (int i = 0; i < t->n_answers; i++) {
        int x = rk_score_exact(pred, t->answers[i]);
        double y = rk_score_f1(pred, t->answers[i]);
        if (x < 0 || y < 0) return rk_errorf(RK_ERR_NOMEM, "eval: out of memory scoring");
        *em = x > *em ? x : *em;
        *f1 = y > *f1 ? y : *f1;
    }
    return RK_OK;
}

/* Every record under configuration ci on a fresh service: a first run
 * computes (and caches) its chunks, the second, measured one answers. */
static rk_status run_task_config(eval *e, int ci) {
    const eval_config *c = &e->o.configs[ci];
    task_result *tr = &e->tres[ci];
    int P = e->n_tasks;
    tr->pred = calloc((size_t)P, sizeof *tr->pred);
    tr->em = calloc((size_t)P, sizeof *tr->em);
    tr->f1 = calloc((size_t)P, sizeof *tr->f1);
    if (!tr->pred || !tr->em || !tr->f1) return rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
    rk_service *svc;
    rk_status st = rk_eval_open_service(e, 0, &svc);
    if (st) return st;
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    int V = rk_model_hparams(svc->model)->n_vocab;
    rk_req_options opt;
    rk_eval_config_options(c, e->o.n_tokens, e->o.context, &opt);
    opt.stop_at_eog = 1;
    double ms = 0, em_t[MAX_TYPES] = {0}, f1_t[MAX_TYPES] = {0}, em = 0, f1 = 0;
    for (int j = 0; j < P && !st; j++) {
        const task_rec *t = &e->tasks[j];
        run_ctx ctx = {.n_steps = e->o.n_tokens, .n_vocab = V};
        run_out warm, out;
        if (c->fam != FAM_PLAIN) {
            if ((st = rk_eval_run_prompt(svc, &t->p, &opt, &ctx, &warm))) break;
            rk_eval_run_out_free(&warm);
        }
        if ((st = rk_eval_run_prompt(svc, &t->p, &opt, &ctx, &out))) break;
        size_t len;
        st = rk_tokenizer_decode(tok, out.tokens, (size_t)out.n_out, 0, 1, &tr->pred[j], &len);
        if (!st) {
            char *nl = strchr(tr->pred[j], '\n');
            if (nl) *nl = '\0';
            st = score_answer(t, tr->pred[j], &tr->em[j], &tr->f1[j]);
        }
        if (!st) {
            em += tr->em[j];
            f1 += tr->f1[j];
            if (t->type >= 0) {
                em_t[t->type] += tr->em[j];
                f1_t[t->type] += tr->f1[j];
            }
            ms += out.total_ms;
            tr->recomputed += out.recomputed;
            tr->prompt_tokens += out.prompt_tokens;
        }
        rk_eval_run_out_free(&out);
    }
    rk_service_close(svc);
    tr->acc = em / P;
    tr->f1_mean = f1 / P;
    for (int k = 0; k < e->n_types; k++) {
        tr->type_acc[k] = em_t[k] / e->type_count[k];
        tr->type_f1[k] = f1_t[k] / e->type_count[k];
    }
    tr->ms = ms / P;
    tr->share = tr->prompt_tokens ? (double)tr->recomputed / tr->prompt_tokens : 0;
    return st;
}

/* --calibrate: the cheapest configuration (least recomputed share, then
 * least time) whose exact match, overall and for every type, is within
 * max_loss points of plain's; written with what it was chosen from. */
static rk_status write_calibration(const eval *e, rk_service *svc) {
    const eval_opts *o = &e->o;
    int plain = -1, best = -1;
    for (int ci = 0; ci < o->n_configs; ci++)
        if (o->configs[ci].fam == FAM_PLAIN) plain = ci;
    const task_result *p = &e->tres[plain];
    json_t *cands = json_array();
    for (int ci = 0; ci < o->n_configs; ci++) {
        if (o->configs[ci].fam == FAM_PLAIN) continue;
        const task_result *t = &e->tres[ci];
        double loss = 100 * (p->acc - t->acc);
        int ok = loss <= o->max_loss + 1e-9;
        for (int k = 0; k < e->n_types; k++)
            ok &= 100 * (p->type_acc[k] - t->type_acc[k]) <= o->max_loss + 1e-9;
        json_array_append_new(cands,
                              json_pack("{s:s, s:f, s:f, s:f, s:b}", "name", o->configs[ci].name,
                                        "exact_match", t->acc, "recomputed_share", t->share,
                                        "ms_per_request", t->ms, "within_budget", ok));
        if (ok && (best < 0 || t->share < e->tres[best].share ||
                   (t->share == e->tres[best].share && t->ms < e->tres[best].ms)))
            best = ci;
    }
    if (best < 0) {
        json_decref(cands);
        return rk_errorf(RK_ERR_NOT_FOUND,
                         "--calibrate: no configuration is within %.2f points of plain (%.2f %% "
                         "exact match); nothing written",
                         o->max_loss, 100 * p->acc);
    }
    json_t *root = json_pack(
        "{s:i, s:s, s:s, s:s, s:s, s:i, s:f, s:f, s:{s:s, s:f, s:f, s:f}, s:o}",
        "ragkv_repair_calibration", 1, "policy", o->configs[best].name, "model", e->model_desc,
        "model_fingerprint", rk_model_fingerprint(svc->model), "task", o->task, "records",
        e->n_tasks, "max_loss_points", o->max_loss, "plain_exact_match", p->acc, "chosen", "name",
        o->configs[best].name, "exact_match", e->tres[best].acc, "recomputed_share",
        e->tres[best].share, "ms_per_request", e->tres[best].ms, "candidates", cands);
    if (!root) return rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
    int bad = json_dump_file(root, o->calibrate, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
    json_decref(root);
    if (bad) return rk_errorf(RK_ERR_IO, "%s: cannot write the calibration", o->calibrate);
    fprintf(stderr,
            "ragkv eval: calibration: %s (%.2f %% exact match against plain's %.2f %%, "
            "%.2f %% recomputed) written to %s\n",
            o->configs[best].name, 100 * e->tres[best].acc, 100 * p->acc, 100 * e->tres[best].share,
            o->calibrate);
    return RK_OK;
}

/* The whole --task evaluation; the output as the options ask. */
rk_status rk_eval_run_task(eval *e) {
    rk_service *svc;
    rk_status st = rk_eval_open_service(e, 0, &svc);
    if (st) return st;
    const char *base = e->o.model ? strrchr(e->o.model, '/') : NULL;
    snprintf(e->model_desc, sizeof e->model_desc, "%s",
             !e->o.model ? "ragkv tiny (embedded)"
             : base      ? base + 1
                         : e->o.model);
    if ((st = load_tasks(e, rk_model_tokenizer(svc->model)))) {
        e->bad_input = 1;
    } else {
        e->tres = calloc((size_t)e->o.n_configs, sizeof *e->tres);
        if (!e->tres) st = rk_errorf(RK_ERR_NOMEM, "eval: out of memory");
    }
    for (int ci = 0; ci < e->o.n_configs && !st; ci++) st = run_task_config(e, ci);
    if (!st && e->o.calibrate) st = write_calibration(e, svc);
    rk_service_close(svc);
    return st;
}
