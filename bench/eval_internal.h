/* bench/eval_internal.h — what the files of `ragkv eval` share (see eval.h
 * for the evaluation itself):
 *
 *   eval.c         options, the prompt file, one request run with its hooks,
 *                  the held-out set, rk_eval_main
 *   eval_ref.c     the reference runs, the configurations' runs along them
 *                  and the metrics
 *   eval_task.c    --task: the records, answers scored, --calibrate
 *   eval_report.c  the tables, the JSON objects and the SVG plot
 *
 * Private to bench/. One `eval` lives for one run and is used by one thread. */
#ifndef RK_EVAL_INTERNAL_H
#define RK_EVAL_INTERNAL_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "config/settings.h"
#include "pipeline/pipeline.h"
#include "pipeline/split.h"

#define MAX_CONFIGS  32
#define MAX_TYPES    16   /* record types --task breaks results down by */
#define SPLIT_CHUNKS 4096 /* any number of chunks a prompt file line may hold */

typedef enum family {
    FAM_PLAIN,
    FAM_NONE,
    FAM_FIRST_K,
    FAM_DEVIATION,
    FAM_QUERY,
    N_FAMILIES
} family;

typedef struct eval_config {
    char name[40];
    family fam;
    int k;        /* first_k */
    double ratio; /* deviation, query */
} eval_config;

typedef struct eval_opts {
    const char *model; /* NULL = the embedded model */
    const char *prompts;
    const char *make_set;
    const char *plot;
    const char *task, *calibrate;
    char model_arg[1024], prompts_arg[4096], make_set_arg[4096], plot_arg[4096]; /* "" = none */
    char task_arg[4096], calibrate_arg[4096], chunk_sep[64];
    int chunk_tokens; /* LongBench contexts: cut into pieces of this many tokens (0 = off) */
    double max_loss;  /* --calibrate: accuracy points a configuration may lose against plain */
    int configs_given;
    char context_arg[16]; /* what the cached chunks are computed after */
    rk_chunk_context context;
    int set_size;
    long long seed;
    rk_config cfg;
    char ref_dtype[8]; /* KV type of the reference ("" = cfg.kv_dtype) */
    eval_config configs[MAX_CONFIGS];
    int n_configs;
    int n_tokens;
    int json;
} eval_opts;

typedef struct prompt_set {
    rk_split *p; /* (n) */
    int n, max_chunks;
} prompt_set;

/* What the hooks see: the tokens to force (NULL = free running) and where
 * to keep each step's log-softmax. */
typedef struct run_ctx {
    const int32_t *force;
    int n_steps, n_vocab;
    double *logp; /* (n_steps, n_vocab), NULL = not kept */
} run_ctx;

typedef struct run_out {
    int32_t *tokens; /* (n_steps) */
    int n_out, recomputed, prompt_tokens, chunk_tokens, n_chunks;
    int *chunk_lens; /* (n_chunks) */
    double total_ms;
} run_out;

/* One configuration on one prompt. */
typedef struct prompt_result {
    run_out forced, greedy;
    double *kl; /* (n_steps) */
    int *top1;  /* (n_steps) 1 = the config's argmax is the reference token */
    int *rank;  /* (n_steps) 1-based rank of the reference token */
    int agree;  /* greedy positions equal to the reference */
    int prefix; /* greedy tokens equal to the reference before the first difference */
} prompt_result;

typedef struct config_result {
    prompt_result *pr; /* (n_prompts) */
    double first_top1, mean_top1, mean_kl, first_kl, max_kl, mean_rank, greedy_agree, mean_prefix,
        recomputed_share, ms;
    long recomputed, prompt_tokens;
} config_result;

/* A --task record: its pieces, accepted answers and type. */
typedef struct task_rec {
    rk_split p;
    char **answers; /* (n_answers) */
    int n_answers;
    int type; /* index into eval.type_names, -1 = none */
} task_rec;

/* One configuration over the --task records. */
typedef struct task_result {
    char **pred; /* (n_tasks) the answer as generated, cut at a newline */
    int *em;     /* (n_tasks) */
    double *f1;  /* (n_tasks) */
    double acc, f1_mean, type_acc[MAX_TYPES], type_f1[MAX_TYPES], share, ms;
    long recomputed, prompt_tokens;
} task_result;

typedef struct eval {
    eval_opts o;
    prompt_set ps;
    task_rec *tasks; /* (n_tasks) --task */
    int n_tasks, n_types;
    char type_names[MAX_TYPES][32];
    int type_count[MAX_TYPES];
    task_result *tres; /* (n_configs) --task */
    int bad_input;     /* --task: the records file was refused (exit 2) */
    char model_desc[96];
    int n_vocab;
    double *ref_logp;  /* (n_prompts, N, n_vocab) */
    run_out *ref;      /* (n_prompts) */
    double ref_ms;     /* mean total_ms of the reference runs */
    config_result *cr; /* (n_configs) */
} eval;

/* The names of the families, as --configs spells them. */
extern const char *const rk_eval_family_names[N_FAMILIES];

/* eval.c: one JSON line of a prompt file into pieces (line: its 1-based
 * number, for messages); each JSON object of a file; room for one more
 * element; a run's options and the run itself; the service of a run. */
rk_status rk_eval_parse_line(json_t *o, const char *path, int line, rk_split *out);
rk_status rk_eval_each_json_line(const char *path,
                                 rk_status (*each)(json_t *o, const char *path, int line,
                                                   void *ctx),
                                 void *ctx);
rk_status rk_eval_grow_for(void **arr, int *cap, int n, size_t size);
void rk_eval_run_out_free(run_out *o);
void rk_eval_config_options(const eval_config *c, int n_tokens, rk_chunk_context context,
                            rk_req_options *opt);
rk_status rk_eval_run_prompt(rk_service *svc, const rk_split *p, const rk_req_options *opt,
                             run_ctx *ctx, run_out *out);
rk_status rk_eval_open_service(const eval *e, int ref, rk_service **svc);

/* eval_ref.c: the reference runs (e->ref, e->ref_logp), then configuration
 * ci along them (e->cr[ci]). */
rk_status rk_eval_run_reference(eval *e);
rk_status rk_eval_run_config(eval *e, int ci);

/* eval_task.c: the whole --task evaluation; a record freed. */
rk_status rk_eval_run_task(eval *e);
void rk_eval_task_rec_free(task_rec *t);

/* eval_report.c: the table (stdout) and the JSON object (NULL when out of
 * memory; the caller owns it) of each mode, and the SVG plot at path. */
void rk_eval_print_table(const eval *e);
json_t *rk_eval_json(const eval *e);
void rk_eval_print_task_table(const eval *e);
json_t *rk_eval_task_json(const eval *e);
rk_status rk_eval_write_svg(const eval *e, const char *path);

#endif
