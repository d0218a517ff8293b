/* cli/generate.c — `ragkv generate`, `tokenize` and `detokenize`: prompts
 * answered in-process (no HTTP), and the tokenizer on its own. */
#include <errno.h>
#include <jansson.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli/cli.h"
#include "engine/gguf.h"
#include "gateway/report.h"

/* A float flag in [lo, hi] (see rk_parse_double). */
static int parse_float(const char *s, float lo, float hi, float *out) {
    double v;
    if (rk_parse_double(s, lo, hi, &v)) return -1;
    *out = (float)v;
    return 0;
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

int rk_cli_generate(int argc, char **argv) {
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
        if ((r = rk_cli_common_opt("generate", c, &o)) < 0) return EXIT_USAGE;
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
            opt.mode_plain = r;
            break;
        case O_CTX:
            if ((r = choice(optarg, "isolated", "system")) < 0)
                return usage_error("generate", "--chunk-context is isolated or system, not '%s'",
                                   optarg);
            opt.context_system = r;
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
    opt.prefix_cache = prefix_flag >= 0 ? prefix_flag : !opt.mode_plain;

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

int rk_cli_tokenize(int argc, char **argv) {
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
        int r = rk_cli_common_opt("tokenize", c, &o);
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

int rk_cli_detokenize(int argc, char **argv) {
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
        int r = rk_cli_common_opt("detokenize", c, &o);
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
