/* bench/bench_batching.c — what continuous batching buys a short request:
 * its latency (submit to done, max_tokens 1) when it arrives while another
 * request generates, divided by its latency alone. Both run in-process
 * through the engine thread (rk_scheduler), as `ragkv serve` runs them.
 *
 *   alone:     the short request with nothing else running;
 *   contended: a long request (--long-tokens, end of generation ignored) is
 *              submitted, and once it streamed its first token the short one
 *              is submitted; then the long one runs to its end.
 *
 * Each is repeated --reps times after one warm-up (so the short request's
 * chunk and system prompt are cache hits in both); the medians are printed,
 * with their ratio, as one line of text and one of JSON.
 *
 *   bench_batching [--model F.gguf] [--threads N] [--long-tokens N] [--reps N]
 *                  (default: the embedded model, 2 threads, 128 tokens, 5 reps) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/setup.h"
#include "pipeline/scheduler.h"

static const char *LONG_PROMPT =
    "You are a helpful assistant who answers from the documents given.##Once upon a time a "
    "little girl named Lily lived near a big forest with her dog Max.##Tell a long story about "
    "Lily and Max.";
static const char *SHORT_PROMPT = "You answer in one word.##The sky over the town was blue "
                                  "all day.##What colour was the sky?";

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Prepare and queue a greedy request; returns its status. */
static rk_status submit(rk_scheduler *e, rk_job *j, const char *prompt, int max_tokens) {
    rk_status st = rk_job_init(j);
    if (st) return st;
    rk_service *svc = rk_scheduler_service(e);
    rk_req_options_default(&j->req.opt);
    j->req.opt.max_tokens = max_tokens;
    j->req.opt.sampling.temperature = 0;
    j->req.opt.stop_at_eog = 0;
    j->notify_tokens = 1;
    rk_split sp;
    if ((st = rk_split_prompt(prompt, strlen(prompt), NULL, svc->cfg.max_chunks, &sp))) return st;
    st = rk_request_prepare(svc, &sp, &j->req);
    rk_split_free(&sp);
    return st ? st : rk_scheduler_submit(e, j);
}

/* Wait for more than `seen` tokens or the end; returns the job's status
 * once it is done, RK_OK while it runs. Bounded: 10 minutes. */
static rk_status wait_for(rk_job *j, int seen, int until_done) {
    int n = seen, done = 0;
    double deadline = rk_time_now() + 600;
    do {
        if (rk_job_wait(j, n, deadline, &n, &done))
            return rk_errorf(RK_ERR_INTERNAL, "no progress in 10 minutes");
    } while (until_done ? !done : (!done && n <= seen));
    return done ? j->status : RK_OK;
}

/* Latency of one short request, ms; with a long one generating when `contended`. */
static rk_status one_run(rk_scheduler *e, int contended, int long_tokens, double *out_ms) {
    rk_job lj, sj;
    rk_status st = RK_OK;
    int have_long = 0, have_short = 0;
    if (contended) {
        have_long = 1;
        if ((st = submit(e, &lj, LONG_PROMPT, long_tokens)) || (st = wait_for(&lj, 0, 0)))
            goto done;
    }
    double t0 = rk_time_now();
    have_short = 1;
    if ((st = submit(e, &sj, SHORT_PROMPT, 1)) || (st = wait_for(&sj, 0, 1))) goto done;
    *out_ms = (rk_time_now() - t0) * 1e3;
    if (contended) {
        pthread_mutex_lock(&lj.mu);
        int ended = lj.done;
        pthread_mutex_unlock(&lj.mu);
        if (ended) fprintf(stderr, "note: the long request ended before the short one\n");
        st = wait_for(&lj, 0, 1);
    }
done:
    if (st) fprintf(stderr, "bench_batching: %s\n", rk_error_message());
    if (have_long) rk_job_destroy(&lj);
    if (have_short) rk_job_destroy(&sj);
    return st;
}

typedef struct opts {
    int long_tokens, reps;
} opts;

static const rk_setting k_settings[] = {
    {"long_tokens", "long-tokens", RK_SET_INT, offsetof(opts, long_tokens), 0, 2, 1 << 20, 0, 0,
     "N  tokens the long request generates (default: 128)"},
    {"reps", "reps", RK_SET_INT, offsetof(opts, reps), 0, 1, 100, 0, 0,
     "N  measured repetitions of each case (default: 5)"},
};

int main(int argc, char **argv) {
    static const char *usage =
        "usage: bench_batching [--model F.gguf] [--threads N] [--long-tokens N] [--reps N]\n"
        "A short request's latency alone and while a long generation runs, through the engine\n"
        "thread. Defaults: the embedded model, 2 threads.\n";
    rk_bench_model m;
    rk_bench_model_defaults(&m);
    opts o = {.long_tokens = 128, .reps = 5};
    rk_settings own = {k_settings, sizeof k_settings / sizeof k_settings[0], &o};
    int exit_code;
    if (rk_bench_parse("bench_batching", usage, &m, RK_BENCH_MODEL_FILE, &own, argc, argv,
                       &exit_code))
        return exit_code;
    const char *model = m.model[0] ? m.model : NULL;
    int threads = m.threads, long_tokens = o.long_tokens, reps = o.reps;
    rk_scheduler_params p = {.model_path = model, .max_queue = 16, .max_batch = 8};
    rk_config_defaults(&p.cfg);
    p.cfg.n_threads = threads;
    p.cfg.kv_memory_mb = 512;
    rk_scheduler *e;
    if (rk_scheduler_start(&p, &e)) return 1;
    char why[320];
    while (rk_scheduler_get_state(e, why, sizeof why) == RK_SCHEDULER_LOADING) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (rk_scheduler_get_state(e, why, sizeof why) != RK_SCHEDULER_READY) {
        fprintf(stderr, "bench_batching: %s\n", why);
        rk_scheduler_free(e);
        return 1;
    }
    double *alone = malloc((size_t)reps * sizeof *alone);
    double *contended = malloc((size_t)reps * sizeof *contended), warm;
    int rc = !alone || !contended || one_run(e, 0, long_tokens, &warm);
    for (int r = 0; r < reps && !rc; r++)
        rc = one_run(e, 0, long_tokens, &alone[r]) || one_run(e, 1, long_tokens, &contended[r]);
    if (!rc) {
        double a = median(alone, reps), c = median(contended, reps);
        printf("short request (max_tokens 1): alone %.2f ms, while a %d-token generation runs "
               "%.2f ms: %.2fx  (medians of %d, model %s, %d threads)\n",
               a, long_tokens, c, c / a, reps, model ? model : "embedded", threads);
        printf("{\"alone_ms\": %.3f, \"contended_ms\": %.3f, \"ratio\": %.3f, \"long_tokens\": %d, "
               "\"reps\": %d}\n",
               a, c, c / a, long_tokens, reps);
    }
    free(alone);
    free(contended);
    rk_scheduler_free(e);
    return rc ? 1 : 0;
}
