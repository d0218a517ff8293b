/* cli/main.c — the `ragkv` command line: one binary, one subcommand per
 * job. Exit status: 0 success, 1 runtime failure, 2 bad usage. Errors are
 * one line on stderr saying what and where. */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/gguf.h"
#include "engine/mkmodel.h"
#include "bench/bench.h"
#include "pipeline/pipeline.h"
#include "gateway/report.h"
#include "gateway/server.h"

#define EXIT_USAGE 2

static int fail(const char *what) {
    const char *msg = rk_error_message();
    fprintf(stderr, "ragkv: %s%s%s\n", what, *msg ? ": " : "", msg);
    return EXIT_FAILURE;
}

static int usage_error(const char *cmd, const char *fmt, const char *arg) {
    fprintf(stderr, "ragkv %s: ", cmd);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see ragkv %s --help)\n", cmd);
    return EXIT_USAGE;
}

/* A float flag in [lo, hi] (see rk_parse_double). */
static int parse_float(const char *s, float lo, float hi, float *out) {
    double v;
    if (rk_parse_double(s, lo, hi, &v)) return -1;
    *out = (float)v;
    return 0;
}

/* ---------------------------------------------------------------- common options */

/* Options every model-running subcommand takes. */
typedef struct common_opts {
    const char *model;
    rk_config cfg;
} common_opts;

enum {
    OPT_MODEL = 1000,
    OPT_THREADS,
    OPT_BACKEND,
    OPT_KV_MB,
    OPT_LOG,
    OPT_BLOCK,
    OPT_STORE,
    OPT_STORE_MB,
    OPT_KV_DTYPE,
};

#define COMMON_LONG_OPTS                                                                           \
    {"model", required_argument, 0, OPT_MODEL}, {"threads", required_argument, 0, OPT_THREADS},    \
        {"backend", required_argument, 0, OPT_BACKEND},                                            \
        {"kv-memory-mb", required_argument, 0, OPT_KV_MB},                                         \
        {"block-size", required_argument, 0, OPT_BLOCK},                                           \
        {"store", required_argument, 0, OPT_STORE},                                                \
        {"kv-dtype", required_argument, 0, OPT_KV_DTYPE},                                          \
        {"store-budget-mb", required_argument, 0, OPT_STORE_MB},                                   \
        {"log-level", required_argument, 0, OPT_LOG}, {                                            \
        "help", no_argument, 0, 'h'                                                                \
    }

static const char *COMMON_HELP =
    "  --model F.gguf        model file (default: the embedded `tiny` model)\n"
    "  --threads N           compute threads (default: one per core)\n"
    "  --backend cpu|cuda    compute backend (default: cpu)\n"
    "  --kv-memory-mb N      KV cache budget in MiB (default: 1024)\n"
    "  --block-size N        tokens per KV block, power of two 8..64 (default: 16)\n"
    "  --kv-dtype T          KV storage type: f32 (default), f16 or bf16\n"
    "  --store DIR           persistent chunk store (the disk tier); created if missing\n"
    "  --store-budget-mb N   payload MiB kept on disk, least recently used evicted (0 = no limit)\n"
    "  --log-level L         debug|info|warn|error (default: warn)\n";

/* Handle one common option; returns 1 if handled, 0 if not common, -1 on bad value. */
static int common_opt(const char *cmd, int c, common_opts *o) {
    long v;
    switch (c) {
    case OPT_MODEL: o->model = optarg; return 1;
    case OPT_THREADS:
        if (rk_parse_long(optarg, 0, 1024, &v))
            return usage_error(cmd, "bad --threads '%s'", optarg), -1;
        o->cfg.n_threads = (int)v;
        return 1;
    case OPT_BACKEND: snprintf(o->cfg.backend, sizeof o->cfg.backend, "%s", optarg); return 1;
    case OPT_KV_MB:
        if (rk_parse_long(optarg, 1, 1 << 24, &v))
            return usage_error(cmd, "bad --kv-memory-mb '%s'", optarg), -1;
        o->cfg.kv_memory_mb = (int)v;
        return 1;
    case OPT_KV_DTYPE:
        if (strcmp(optarg, "f32") && strcmp(optarg, "f16") && strcmp(optarg, "bf16"))
            return usage_error(cmd, "--kv-dtype is f32, f16 or bf16, not '%s'", optarg), -1;
        snprintf(o->cfg.kv_dtype, sizeof o->cfg.kv_dtype, "%s", optarg);
        return 1;
    case OPT_STORE:
        if (strlen(optarg) >= sizeof o->cfg.store_dir)
            return usage_error(cmd, "--store path too long: '%s'", optarg), -1;
        snprintf(o->cfg.store_dir, sizeof o->cfg.store_dir, "%s", optarg);
        return 1;
    case OPT_STORE_MB:
        if (rk_parse_long(optarg, 0, 1 << 30, &v))
            return usage_error(cmd, "bad --store-budget-mb '%s'", optarg), -1;
        o->cfg.store_budget_mb = (int)v;
        return 1;
    case OPT_BLOCK:
        if (rk_parse_long(optarg, 1, 1 << 20, &v))
            return usage_error(cmd, "bad --block-size '%s'", optarg), -1;
        o->cfg.block_size = (int)v;
        return 1;
    case OPT_LOG: {
        static const char *names[] = {"debug", "info", "warn", "error"};
        for (int i = 0; i < 4; i++)
            if (!strcmp(optarg, names[i])) {
                rk_log_set_level((rk_log_level)i);
                return 1;
            }
        return usage_error(cmd, "bad --log-level '%s'", optarg), -1;
    }
    }
    return 0;
}

static rk_status open_service(common_opts *o, rk_service **out) {
    rk_status st = rk_config_validate(&o->cfg);
    if (st) return st;
    return rk_service_open(&o->cfg, o->model, out);
}

/* ---------------------------------------------------------------- generate */

typedef struct print_ctx {
    const rk_tokenizer *tok;
    int32_t prev;
} print_ctx;

/* Stream each piece as it is generated (the first piece after BOS loses its
 * leading space, as llama2.c prints). */
static void print_token(void *ctx, int req, int32_t token) {
    print_ctx *p = ctx;
    (void)req;
    char *text;
    size_t len;
    int skip = p->prev == rk_tokenizer_bos(p->tok);
    if (rk_tokenizer_decode(p->tok, &token, 1, 0, skip, &text, &len) == RK_OK) {
        fwrite(text, 1, len, stdout);
        fflush(stdout);
        free(text);
    }
    p->prev = token;
}

/* Parse an on/off style choice; returns the index of arg in names or -1. */
static int choice(const char *arg, const char *a, const char *b) {
    return !strcmp(arg, a) ? 0 : !strcmp(arg, b) ? 1 : -1;
}

/* Run one prompt through the pipeline and print it. Returns an exit status. */
static int generate_one(rk_service *svc, const char *prompt, const char *sep,
                        const rk_req_options *opt, int json, int index) {
    rk_split pieces;
    if (rk_split_prompt(prompt, strlen(prompt), sep, svc->cfg.max_chunks, &pieces))
        return fail("bad prompt");
    rk_request r = {.opt = *opt};
    rk_status st = rk_request_prepare(svc, &pieces, &r);
    rk_split_free(&pieces);
    if (st) return fail("bad prompt");
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    print_ctx pc = {.tok = tok,
                    .prev = r.n_question ? r.question[r.n_question - 1] : r.sys[r.n_sys - 1]};
    rk_pipeline_hooks hooks = {.ctx = &pc, .on_token = json ? NULL : print_token};
    rk_request *one = &r;
    if (rk_pipeline_run(svc, &one, 1, &hooks)) {
        if (!json) fputc('\n', stdout);
        rk_request_free(&r);
        return fail("generation failed");
    }
    if (json) {
        char id[32];
        snprintf(id, sizeof id, "cmpl-%d", index);
        const char *name = rk_model_hparams(svc->model)->name;
        json_t *root = rk_report_completion(tok, &r, id, (long)time(NULL), name);
        char *s = root ? json_dumps(root, JSON_COMPACT) : NULL;
        json_decref(root);
        if (!s) {
            rk_request_free(&r);
            rk_error_setf("out of memory");
            return fail("generate");
        }
        puts(s);
        free(s);
    }
    rk_request_free(&r);
    return 0;
}

static int cmd_generate(int argc, char **argv) {
    static const char *help =
        "usage: ragkv generate [--model F.gguf] (--prompt TEXT | --prompts FILE) [options]\n"
        "Answer prompts in-process (no HTTP). A prompt may be `system##chunk##...##question`:\n"
        "each chunk's KV is computed once and reused wherever it appears again.\n"
        "  --prompt TEXT         the prompt (BOS is added when the model asks for it)\n"
        "  --prompts FILE        one prompt per line, run in order in one process\n"
        "  --repeat N            run the prompt(s) N times (default: 1), sharing the caches\n"
        "  -n, --max-tokens N    tokens to generate (default: 128)\n"
        "  --temp T              sampling temperature, 0 = greedy (default: 1.0)\n"
        "  --top-k K             keep the K most likely tokens (default: 0 = off)\n"
        "  --top-p P             nucleus sampling threshold (default: 1.0 = off)\n"
        "  --seed S              sampling seed (default: random)\n"
        "  --ignore-eos          keep generating after an end-of-generation token\n"
        "  --separator S         piece separator (default: ##; \\#\\# is a literal ##)\n"
        "  --chunk-cache on|off  off = the oracle: chunks computed fresh at their position\n"
        "  --mode rag|plain      plain = the pieces as one ordinary sequence, no caches\n"
        "  --chunk-context isolated|system   what a chunk's KV is computed after\n"
        "  --position-mode sequential|parallel   where chunks go in the sequence\n"
        "  --no-prefix-cache     do not reuse the system prompt through the radix cache\n"
        "  --repair-k K          repair: recompute the first K tokens of every chunk with\n"
        "                        full attention over the merged cache (default: 0 = none)\n"
        "  --repair-ratio R      repair: recompute the fraction R (0-1) of chunk tokens whose\n"
        "                        layer-1 K/V deviate most from fresh ones (CacheBlend style)\n"
        "  --logprobs N          top-N log-probabilities per token (0-20, with --json)\n"
        "  --json                one completion object per request, as POST /v1/completions\n";
    common_opts o = {0};
    rk_config_defaults(&o.cfg);
    rk_req_options opt;
    rk_req_options_default(&opt);
    opt.sampling.seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    const char *prompt = NULL, *prompts_file = NULL, *sep = "##";
    long repeat = 1, v;
    int json = 0, prefix_flag = -1, c, r;
    enum {
        O_PROMPT = 1,
        O_PROMPTS,
        O_REPEAT,
        O_TEMP,
        O_TOPK,
        O_TOPP,
        O_SEED,
        O_JSON,
        O_IGNORE_EOS,
        O_SEP,
        O_CC,
        O_MODE,
        O_CTX,
        O_POS,
        O_LOGPROBS,
        O_NOPREFIX,
        O_REPAIR,
        O_REPAIR_RATIO
    };
    struct option longs[] = {COMMON_LONG_OPTS,
                             {"prompt", required_argument, 0, O_PROMPT},
                             {"prompts", required_argument, 0, O_PROMPTS},
                             {"repeat", required_argument, 0, O_REPEAT},
                             {"max-tokens", required_argument, 0, 'n'},
                             {"temp", required_argument, 0, O_TEMP},
                             {"top-k", required_argument, 0, O_TOPK},
                             {"top-p", required_argument, 0, O_TOPP},
                             {"seed", required_argument, 0, O_SEED},
                             {"json", no_argument, 0, O_JSON},
                             {"ignore-eos", no_argument, 0, O_IGNORE_EOS},
                             {"separator", required_argument, 0, O_SEP},
                             {"chunk-cache", required_argument, 0, O_CC},
                             {"mode", required_argument, 0, O_MODE},
                             {"chunk-context", required_argument, 0, O_CTX},
                             {"position-mode", required_argument, 0, O_POS},
                             {"logprobs", required_argument, 0, O_LOGPROBS},
                             {"no-prefix-cache", no_argument, 0, O_NOPREFIX},
                             {"repair-k", required_argument, 0, O_REPAIR},
                             {"repair-ratio", required_argument, 0, O_REPAIR_RATIO},
                             {0, 0, 0, 0}};
    optind = 1;
    while ((c = getopt_long(argc, argv, "n:h", longs, NULL)) != -1) {
        if ((r = common_opt("generate", c, &o)) < 0) return EXIT_USAGE;
        if (r > 0) continue;
        switch (c) {
        case 'h': fputs(help, stdout), fputs(COMMON_HELP, stdout); return 0;
        case O_PROMPT: prompt = optarg; break;
        case O_PROMPTS: prompts_file = optarg; break;
        case O_REPEAT:
            if (rk_parse_long(optarg, 1, 1000000, &repeat))
                return usage_error("generate", "bad --repeat '%s'", optarg);
            break;
        case 'n':
            if (rk_parse_long(optarg, 0, 1 << 20, &v))
                return usage_error("generate", "bad -n '%s'", optarg);
            opt.max_tokens = (int)v;
            break;
        case O_TEMP:
            if (parse_float(optarg, 0, 100, &opt.sampling.temperature))
                return usage_error("generate", "bad --temp '%s'", optarg);
            break;
        case O_TOPK:
            if (rk_parse_long(optarg, 0, 1 << 24, &v))
                return usage_error("generate", "bad --top-k '%s'", optarg);
            opt.sampling.top_k = (int)v;
            break;
        case O_TOPP:
            if (parse_float(optarg, 1e-6f, 1, &opt.sampling.top_p))
                return usage_error("generate", "bad --top-p '%s'", optarg);
            break;
        case O_SEED:
            if (rk_parse_long(optarg, 0, 0x7fffffffffffffffL, &v))
                return usage_error("generate", "bad --seed '%s'", optarg);
            opt.sampling.seed = (uint64_t)v;
            break;
        case O_JSON: json = 1; break;
        case O_IGNORE_EOS: opt.stop_at_eog = 0; break;
        case O_SEP:
            if (rk_separator_check(optarg))
                return usage_error("generate", "bad --separator '%s'", optarg);
            sep = optarg;
            break;
        case O_CC:
            if ((r = choice(optarg, "off", "on")) < 0)
                return usage_error("generate", "--chunk-cache is on or off, not '%s'", optarg);
            opt.chunk_cache = r;
            break;
        case O_MODE:
            if ((r = choice(optarg, "rag", "plain")) < 0)
                return usage_error("generate", "--mode is rag or plain, not '%s'", optarg);
            opt.mode = r ? RK_MODE_PLAIN : RK_MODE_RAG;
            break;
        case O_CTX:
            if ((r = choice(optarg, "isolated", "system")) < 0)
                return usage_error("generate", "--chunk-context is isolated or system, not '%s'",
                                   optarg);
            opt.chunk_context = r ? RK_CONTEXT_SYSTEM : RK_CONTEXT_ISOLATED;
            break;
        case O_POS:
            if ((r = choice(optarg, "sequential", "parallel")) < 0)
                return usage_error("generate",
                                   "--position-mode is sequential or parallel, not '%s'", optarg);
            opt.positions = r ? RK_POSITIONS_PARALLEL : RK_POSITIONS_SEQUENTIAL;
            break;
        case O_LOGPROBS:
            if (rk_parse_long(optarg, 0, 20, &v))
                return usage_error("generate", "bad --logprobs '%s' (0 to 20)", optarg);
            opt.n_logprobs = (int)v;
            break;
        case O_NOPREFIX: prefix_flag = 0; break;
        case O_REPAIR:
            if (rk_parse_long(optarg, 0, 1 << 20, &v))
                return usage_error("generate", "bad --repair-k '%s'", optarg);
            opt.repair_k = (int)v;
            break;
        case O_REPAIR_RATIO:
            if (parse_float(optarg, 0, 1, &opt.repair_ratio))
                return usage_error("generate", "bad --repair-ratio '%s' (0 to 1)", optarg);
            break;
        default: return usage_error("generate", "%s", "unknown option");
        }
    }
    if (optind < argc) return usage_error("generate", "unexpected argument '%s'", argv[optind]);
    if (!prompt == !prompts_file)
        return usage_error("generate", "%s", "give exactly one of --prompt and --prompts");
    /* Plain mode is the no-cache reference unless asked otherwise. */
    opt.prefix_cache = prefix_flag >= 0 ? prefix_flag : opt.mode == RK_MODE_RAG;

    /* The prompts: one, or one per line of the file. */
    char *file_text = NULL, **lines = NULL;
    size_t n_lines = 0;
    if (prompts_file) {
        FILE *f = fopen(prompts_file, "rb");
        if (!f) {
            rk_error_setf("%s: %s", prompts_file, strerror(errno));
            return fail("cannot read the prompts");
        }
        size_t cap = 0, len = 0;
        char buf[65536];
        size_t k;
        while ((k = fread(buf, 1, sizeof buf, f)) > 0) {
            if (len + k + 1 > cap) {
                cap = (len + k + 1) * 2;
                char *nt = realloc(file_text, cap);
                if (!nt) break;
                file_text = nt;
            }
            memcpy(file_text + len, buf, k);
            len += k;
        }
        fclose(f);
        if (!file_text) file_text = calloc(1, 1);
        if (!file_text) return fail("out of memory");
        file_text[len] = '\0';
        for (char *p = file_text; *p;) {
            char *nl = strchr(p, '\n');
            if (nl) *nl = '\0';
            if (*p) {
                char **nlines = realloc(lines, (n_lines + 1) * sizeof *lines);
                if (!nlines) break;
                lines = nlines;
                lines[n_lines++] = p;
            }
            if (!nl) break;
            p = nl + 1;
        }
    }
    rk_service *svc;
    if (open_service(&o, &svc)) {
        free(file_text);
        free(lines);
        return fail("cannot start");
    }
    int rc = 0, index = 0;
    size_t n_prompts = prompts_file ? n_lines : 1;
    for (long rep = 0; rep < repeat && rc == 0; rep++)
        for (size_t i = 0; i < n_prompts && rc == 0; i++) {
            rc = generate_one(svc, prompts_file ? lines[i] : prompt, sep, &opt, json, index++);
            if (!json && rc == 0 && (n_prompts > 1 || repeat > 1 || isatty(STDOUT_FILENO)))
                fputc('\n', stdout);
        }
    free(file_text);
    free(lines);
    rk_service_close(svc);
    return rc;
}

/* ---------------------------------------------------------------- tokenize / detokenize */

static int cmd_tokenize(int argc, char **argv) {
    static const char *help = "usage: ragkv tokenize [--model F.gguf] --text TEXT [--special]\n"
                              "Print the token ids of TEXT as a JSON array (no BOS added).\n"
                              "  --special             recognise special tokens in the text\n";
    common_opts o = {0};
    rk_config_defaults(&o.cfg);
    const char *text = NULL;
    int special = 0;
    struct option longs[] = {COMMON_LONG_OPTS,
                             {"text", required_argument, 0, 't'},
                             {"special", no_argument, 0, 's'},
                             {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longs, NULL)) != -1) {
        int r = common_opt("tokenize", c, &o);
        if (r < 0) return EXIT_USAGE;
        if (r > 0) continue;
        if (c == 'h') return fputs(help, stdout), fputs(COMMON_HELP, stdout), 0;
        if (c == 't')
            text = optarg;
        else if (c == 's')
            special = 1;
        else
            return usage_error("tokenize", "%s", "unknown option");
    }
    if (!text) return usage_error("tokenize", "%s", "--text is required");
    if (optind < argc) return usage_error("tokenize", "unexpected argument '%s'", argv[optind]);
    /* Only the tokenizer is needed: read it from the file without loading weights. */
    rk_tokenizer *tok = NULL;
    rk_service *svc = NULL;
    rk_gguf *g = NULL;
    if (o.model) {
        if (rk_gguf_open(o.model, &g) || rk_tokenizer_from_gguf(g, &tok)) {
            rk_gguf_close(g);
            return fail("cannot read the tokenizer");
        }
    } else if (open_service(&o, &svc)) {
        return fail("cannot start");
    }
    const rk_tokenizer *t = tok ? tok : rk_model_tokenizer(svc->model);
    int32_t *ids = NULL;
    size_t n = 0;
    int rc = 0;
    if (rk_tokenizer_encode(t, text, strlen(text), special, &ids, &n)) {
        rc = fail("cannot tokenize");
    } else {
        fputc('[', stdout);
        for (size_t i = 0; i < n; i++) printf("%s%d", i ? ", " : "", ids[i]);
        fputs("]\n", stdout);
    }
    free(ids);
    rk_tokenizer_free(tok);
    rk_gguf_close(g);
    rk_service_close(svc);
    return rc;
}

static int cmd_detokenize(int argc, char **argv) {
    static const char *help = "usage: ragkv detokenize [--model F.gguf] --ids 1,2,3 [--special]\n"
                              "Print the text of comma-separated token ids.\n"
                              "  --special             render special tokens as their text\n";
    common_opts o = {0};
    rk_config_defaults(&o.cfg);
    const char *ids_arg = NULL;
    int special = 0;
    struct option longs[] = {COMMON_LONG_OPTS,
                             {"ids", required_argument, 0, 'i'},
                             {"special", no_argument, 0, 's'},
                             {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longs, NULL)) != -1) {
        int r = common_opt("detokenize", c, &o);
        if (r < 0) return EXIT_USAGE;
        if (r > 0) continue;
        if (c == 'h') return fputs(help, stdout), fputs(COMMON_HELP, stdout), 0;
        if (c == 'i')
            ids_arg = optarg;
        else if (c == 's')
            special = 1;
        else
            return usage_error("detokenize", "%s", "unknown option");
    }
    if (!ids_arg) return usage_error("detokenize", "%s", "--ids is required");
    size_t cap = strlen(ids_arg) / 2 + 1, n = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    if (!ids) return fail("out of memory");
    for (const char *p = ids_arg; *p;) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX || (*end && *end != ',') || n == cap) {
            free(ids);
            return usage_error("detokenize", "bad --ids '%s' (want e.g. 1,2,3)", ids_arg);
        }
        ids[n++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    rk_tokenizer *tok = NULL;
    rk_service *svc = NULL;
    rk_gguf *g = NULL;
    int rc = 0;
    if (o.model) {
        if (rk_gguf_open(o.model, &g) || rk_tokenizer_from_gguf(g, &tok))
            rc = fail("cannot read the tokenizer");
    } else if (open_service(&o, &svc)) {
        rc = fail("cannot start");
    }
    if (rc == 0) {
        const rk_tokenizer *t = tok ? tok : rk_model_tokenizer(svc->model);
        char *text;
        size_t len;
        for (size_t i = 0; i < n; i++)
            if (ids[i] >= rk_tokenizer_n_vocab(t)) {
                rk_error_setf("token id %d is out of range [0, %d)", ids[i],
                              rk_tokenizer_n_vocab(t));
                rc = fail("cannot detokenize");
                break;
            }
        if (rc == 0 && rk_tokenizer_decode(t, ids, n, special, 0, &text, &len) == RK_OK) {
            fwrite(text, 1, len, stdout);
            fputc('\n', stdout);
            free(text);
        } else if (rc == 0) {
            rc = fail("cannot detokenize");
        }
    }
    free(ids);
    rk_tokenizer_free(tok);
    rk_gguf_close(g);
    rk_service_close(svc);
    return rc;
}

/* ---------------------------------------------------------------- inspect / mkmodel */

static int cmd_inspect(int argc, char **argv) {
    if (argc != 2 || argv[1][0] == '-') {
        int h = argc == 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"));
        fputs("usage: ragkv inspect F.gguf\n"
              "Print the architecture, hyper-parameters, tensors and tokenizer of a GGUF file.\n",
              h ? stdout : stderr);
        return h ? 0 : EXIT_USAGE;
    }
    rk_gguf *g;
    if (rk_gguf_open(argv[1], &g)) return fail("cannot read the model");
    rk_gguf_print_info(g, stdout);
    rk_gguf_close(g);
    return 0;
}

static int cmd_mkmodel(int argc, char **argv) {
    rk_mkmodel_opts opts;
    rk_mkmodel_opts_default(&opts);
    const char *out = NULL;
    struct option longs[] = {
        {"preset", required_argument, 0, 'p'}, {"vocab", required_argument, 0, 'v'},
        {"seed", required_argument, 0, 's'},   {"type", required_argument, 0, 't'},
        {"help", no_argument, 0, 'h'},         {0, 0, 0, 0}};
    int c;
    long v;
    optind = 1;
    while ((c = getopt_long(argc, argv, "o:h", longs, NULL)) != -1) {
        switch (c) {
        case 'h':
            fputs("usage: ragkv mkmodel --preset NAME -o F.gguf [--type f32|f16|bf16] "
                  "[--vocab tokenizer.json] [--seed S]\n"
                  "Write a synthetic GGUF model: random weights, real shapes.\nPresets:\n",
                  stdout);
            size_t n_presets;
            const rk_mkmodel_preset_info *presets = rk_mkmodel_presets(&n_presets);
            for (size_t i = 0; i < n_presets; i++)
                printf("  %-12s %s\n", presets[i].name, presets[i].description);
            return 0;
        case 'p': opts.preset = optarg; break;
        case 'o': out = optarg; break;
        case 'v': opts.vocab_path = optarg; break;
        case 's':
            if (rk_parse_long(optarg, 0, 0x7fffffffffffffffL, &v))
                return usage_error("mkmodel", "bad --seed '%s'", optarg);
            opts.seed = (uint64_t)v;
            break;
        case 't':
            if (rk_mkmodel_parse_wtype(optarg, &opts.wtype))
                return usage_error("mkmodel", "bad --type '%s' (f32, f16 or bf16)", optarg);
            break;
        default: return usage_error("mkmodel", "%s", "unknown option");
        }
    }
    if (!out) return usage_error("mkmodel", "%s", "-o is required");
    if (rk_mkmodel_write(out, &opts)) return fail("cannot write the model");
    return 0;
}

/* ---------------------------------------------------------------- prewarm / cache */

/* One progress line on a terminal: done/total, rate, ETA. */
static void progress(size_t done, size_t total, double t0) {
    double dt = rk_time_now() - t0, rate = dt > 0 ? done / dt : 0;
    double eta = rate > 0 ? (total - done) / rate : 0;
    int width = 30, fill = total ? (int)(width * done / total) : width;
    fprintf(stderr, "\r[%.*s%*s] %zu/%zu chunks  %.1f chunks/s  ETA %d:%02d ", fill,
            "==============================", width - fill, "", done, total, rate, (int)eta / 60,
            (int)eta % 60);
    fflush(stderr);
}

static int cmd_prewarm(int argc, char **argv) {
    static const char *help =
        "usage: ragkv prewarm --input F.jsonl --store DIR [--model F.gguf] [options]\n"
        "Compute the KV of document chunks offline and write it to the store, without the\n"
        "HTTP server. Input lines are {\"id\": \"...\", \"text\": \"...\"}. Chunks already\n"
        "stored are skipped, so an interrupted run can be rerun. Malformed lines are reported\n"
        "with their line number and skipped; the exit status is then 1.\n"
        "  --input F.jsonl       the chunks, one JSON object per line\n"
        "  --batch N             chunks per engine call (default: 64)\n"
        "  --redis URL           also share computed chunks in Redis (--store then optional)\n";
    common_opts o = {0};
    rk_config_defaults(&o.cfg);
    const char *input = NULL;
    long batch = 64;
    struct option longs[] = {COMMON_LONG_OPTS,
                             {"input", required_argument, 0, 'i'},
                             {"batch", required_argument, 0, 'b'},
                             {"redis", required_argument, 0, 'r'},
                             {0, 0, 0, 0}};
    int c, r;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longs, NULL)) != -1) {
        if ((r = common_opt("prewarm", c, &o)) < 0) return EXIT_USAGE;
        if (r > 0) continue;
        if (c == 'h') return fputs(help, stdout), fputs(COMMON_HELP, stdout), 0;
        if (c == 'i')
            input = optarg;
        else if (c == 'r' && strlen(optarg) < sizeof o.cfg.redis_url)
            snprintf(o.cfg.redis_url, sizeof o.cfg.redis_url, "%s", optarg);
        else if (c == 'b') {
            if (rk_parse_long(optarg, 1, 100000, &batch))
                return usage_error("prewarm", "bad --batch '%s'", optarg);
        } else
            return usage_error("prewarm", "%s", "unknown option");
    }
    if (!input) return usage_error("prewarm", "%s", "--input is required");
    if (!o.cfg.store_dir[0] && !o.cfg.redis_url[0])
        return usage_error("prewarm", "%s", "--store or --redis is required");
    if (optind < argc) return usage_error("prewarm", "unexpected argument '%s'", argv[optind]);
    FILE *f = fopen(input, "rb");
    if (!f) {
        rk_error_setf("%s: %s", input, strerror(errno));
        return fail("cannot read the input");
    }
    /* Count the lines first so progress can show a total. */
    size_t total = 0;
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    while ((len = getline(&line, &cap, f)) >= 0)
        if (len > 1 || (len == 1 && line[0] != '\n')) total++;
    rewind(f);
    rk_service *svc;
    if (open_service(&o, &svc)) {
        free(line);
        fclose(f);
        return fail("cannot start");
    }
    rk_prewarm_item *items = calloc((size_t)batch, sizeof *items);
    json_t **docs = calloc((size_t)batch, sizeof *docs);
    size_t line_no = 0, done = 0, n_computed = 0, n_cached = 0, n_failed = 0, n_bad = 0;
    int n = 0, rc = 0, tty = isatty(STDERR_FILENO);
    double t0 = rk_time_now();
    if (!items || !docs) {
        rk_error_setf("out of memory");
        rc = fail("prewarm");
    }
    for (int eof = 0; !eof && rc == 0;) {
        len = getline(&line, &cap, f);
        eof = len < 0;
        if (!eof) {
            line_no++;
            while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = '\0';
            if (len == 0) continue;
            json_error_t jerr;
            json_t *doc = json_loadb(line, (size_t)len, 0, &jerr);
            json_t *text = doc ? json_object_get(doc, "text") : NULL;
            json_t *id = doc ? json_object_get(doc, "id") : NULL;
            if (!doc || !json_is_object(doc) || !json_is_string(text) ||
                (id && !json_is_string(id))) {
                fprintf(stderr, "%sragkv prewarm: %s:%zu: %s\n", tty ? "\n" : "", input, line_no,
                        !doc ? jerr.text : "expected {\"id\": string, \"text\": string}");
                json_decref(doc);
                n_bad++;
                done++;
                continue;
            }
            docs[n] = doc;
            items[n] = (rk_prewarm_item){.text = json_string_value(text),
                                         .len = json_string_length(text),
                                         .doc_id = id ? json_string_value(id) : NULL};
            n++;
        }
        if (n == batch || (eof && n > 0)) {
            if (rk_pipeline_prewarm(svc, items, n, 1)) rc = fail("prewarm failed");
            for (int i = 0; i < n; i++) {
                const char *stt = items[i].status;
                if (!strcmp(stt, "computed"))
                    n_computed++;
                else if (!strcmp(stt, "cached"))
                    n_cached++;
                else {
                    n_failed++;
                    fprintf(stderr, "%sragkv prewarm: chunk %s: %s\n", tty ? "\n" : "",
                            items[i].doc_id ? items[i].doc_id : "(no id)", items[i].error);
                }
                json_decref(docs[i]);
            }
            done += (size_t)n;
            n = 0;
            if (tty) progress(done, total, t0);
        }
    }
    double dt = rk_time_now() - t0;
    if (tty) fputc('\n', stderr);
    rk_store_counters sc = {0};
    rk_store_stats(svc->store, &sc);
    fprintf(
        stderr,
        "ragkv prewarm: %zu chunks in %.1f s (%.1f chunks/s): %zu computed, %zu already cached, "
        "%zu failed, %zu malformed lines; store: %llu rows, %.1f MB\n",
        n_computed + n_cached + n_failed, dt, dt > 0 ? (n_computed + n_cached) / dt : 0.0,
        n_computed, n_cached, n_failed, n_bad, (unsigned long long)sc.rows, sc.bytes / 1e6);
    free(items);
    free(docs);
    free(line);
    fclose(f);
    rk_service_close(svc);
    return rc ? rc : (n_bad || n_failed) ? EXIT_FAILURE : 0;
}

static int cmd_cache(int argc, char **argv) {
    static const char *help =
        "usage: ragkv cache ls|stats|verify|rebuild --store DIR [--sort hits|recent] [--limit N]\n"
        "Read a chunk store offline (ls, stats and verify change nothing).\n"
        "  ls       one line per stored chunk (key, model, tokens, bytes, hits, last access)\n"
        "  stats    rows and bytes, per model\n"
        "  verify   re-check every payload's checksum; exit status 1 if any is bad\n"
        "  rebuild  set chunks.db aside (chunks.db.corrupt-TIME or .old-TIME) and rebuild it\n"
        "           from the payload files; bad payloads go to DIR/quarantine/. Only while\n"
        "           no server has the store open.\n";
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        fputs(help, argc < 2 ? stderr : stdout);
        return argc < 2 ? EXIT_USAGE : 0;
    }
    const char *sub = argv[1], *dir = NULL;
    rk_store_sort sort = RK_STORE_SORT_RECENT;
    long limit = 0;
    struct option longs[] = {{"store", required_argument, 0, 'd'},
                             {"sort", required_argument, 0, 's'},
                             {"limit", required_argument, 0, 'l'},
                             {"help", no_argument, 0, 'h'},
                             {0, 0, 0, 0}};
    int c;
    optind = 2;
    while ((c = getopt_long(argc, argv, "h", longs, NULL)) != -1) {
        if (c == 'h') return fputs(help, stdout), 0;
        if (c == 'd')
            dir = optarg;
        else if (c == 's') {
            if (!strcmp(optarg, "hits"))
                sort = RK_STORE_SORT_HITS;
            else if (!strcmp(optarg, "recent"))
                sort = RK_STORE_SORT_RECENT;
            else
                return usage_error("cache", "--sort is hits or recent, not '%s'", optarg);
        } else if (c == 'l') {
            if (rk_parse_long(optarg, 0, 1 << 30, &limit))
                return usage_error("cache", "bad --limit '%s'", optarg);
        } else
            return usage_error("cache", "%s", "unknown option");
    }
    if (!dir) return usage_error("cache", "%s", "--store is required");
    if (strcmp(sub, "ls") && strcmp(sub, "stats") && strcmp(sub, "verify") &&
        strcmp(sub, "rebuild"))
        return usage_error("cache", "unknown subcommand '%s' (ls, stats, verify, rebuild)", sub);
    if (!strcmp(sub, "rebuild")) {
        rk_store_rebuild_result r;
        if (rk_store_rebuild(dir, &r)) return fail("cache rebuild");
        if (r.set_aside[0])
            printf("old database kept as %s/%s (%s)\n", dir, r.set_aside,
                   r.db_was_corrupt ? "corrupt" : "sound");
        printf("rebuilt %llu rows from the payload files; %llu quarantined, %llu unreadable, "
               "%llu temporary files removed\n",
               (unsigned long long)r.rows_rebuilt, (unsigned long long)r.quarantined,
               (unsigned long long)r.unreadable, (unsigned long long)r.tmp_removed);
        return 0;
    }
    rk_store *st;
    if (rk_store_open_readonly(dir, &st)) return fail("cannot open the store");
    int rc = 0;
    uint64_t bad = 0;
    rk_status s = !strcmp(sub, "ls")      ? rk_store_print_ls(st, stdout, sort, (int)limit)
                  : !strcmp(sub, "stats") ? rk_store_print_stats(st, stdout)
                                          : rk_store_print_verify(st, stdout, &bad);
    if (s)
        rc = fail("cache");
    else if (bad)
        rc = EXIT_FAILURE;
    rk_store_close(st);
    return rc;
}

/* ---------------------------------------------------------------- main */

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *what;
} commands[] = {
    {"serve", rk_serve_main, "run the HTTP service"},
    {"generate", cmd_generate, "generate text in-process"},
    {"tokenize", cmd_tokenize, "print the token ids of a text"},
    {"detokenize", cmd_detokenize, "print the text of token ids"},
    {"mkmodel", cmd_mkmodel, "write a synthetic GGUF model"},
    {"inspect", cmd_inspect, "describe a GGUF file"},
    {"prewarm", cmd_prewarm, "compute chunk KV offline into the store"},
    {"cache", cmd_cache, "inspect or rebuild a chunk store offline (ls, stats, verify, rebuild)"},
    {"bench", rk_bench_main, "run the RAG workload benchmark"},
};

static void print_usage(FILE *f) {
    fputs("usage: ragkv COMMAND [options]   (ragkv COMMAND --help for its options)\n\ncommands:\n",
          f);
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-12s %s\n", commands[i].name, commands[i].what);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        print_usage(stderr);
        return EXIT_USAGE;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        print_usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "--version")) {
        puts("ragkv 0.1.0");
        return 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(argv[1], commands[i].name)) return commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "ragkv: unknown command '%s'\n", argv[1]);
    print_usage(stderr);
    return EXIT_USAGE;
}
