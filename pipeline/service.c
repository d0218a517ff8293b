/* pipeline/service.c — opening a backend, a model and the KV arena together. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "engine/gguf.h"
#include "engine/mkmodel.h"
#include "pipeline/persist.h"
#include "pipeline/pipeline.h"

/* Compiled grammars the service keeps by content. */
#define RK_GRAMMAR_CACHE_ENTRIES 64

static rk_status load_embedded(rk_backend *be, rk_model **out) {
    rk_mkmodel_opts opts;
    rk_mkmodel_opts_default(&opts);
    opts.preset = "tiny";
    opts.seed = RK_EMBEDDED_MODEL_SEED;
    void *buf;
    size_t len;
    rk_status st = rk_mkmodel_build_memory(&opts, &buf, &len);
    if (st) return st;
    return rk_model_load_owned_buffer(buf, len, "embedded tiny model", be, out);
}

static rk_dtype kv_dtype_of(const char *name, const char *backend) {
    (void)backend; /* auto: f16 on every backend; its attention kernels read f16 directly */
    return !strcmp(name, "f32")    ? RK_DTYPE_F32
           : !strcmp(name, "bf16") ? RK_DTYPE_BF16
           : !strcmp(name, "q8_0") ? RK_DTYPE_Q8_0
                                   : RK_DTYPE_F16;
}

/* The pool sizes of a budget, with the explicit block counts over the shares. */
static rk_status split_budget(const rk_config *cfg, rk_arena_params *p, uint64_t budget) {
    float share[RK_POOL_COUNT] = {cfg->share_live, cfg->share_prefix, cfg->share_chunk};
    rk_status st = rk_arena_params_from_budget(p, (size_t)budget, share);
    if (st) return st;
    int fixed[RK_POOL_COUNT] = {cfg->live_blocks, cfg->prefix_blocks, cfg->chunk_blocks};
    for (int i = 0; i < RK_POOL_COUNT; i++)
        if (fixed[i] > 0) p->pool_blocks[i] = fixed[i];
    return RK_OK;
}

/* The auto budget (see rk_kv_plan in pipeline.h). */
static rk_status auto_budget(const rk_config *cfg, uint64_t weight_bytes, rk_kv_plan *k) {
    if (cfg->memory_limit_mb > 0) {
        k->memory_bytes = (uint64_t)cfg->memory_limit_mb << 20;
        k->memory_source = "memory_limit_mb";
    } else {
        rk_memory_info mi;
        rk_status st = rk_memory_detect(NULL, NULL, &mi);
        if (st) return st;
        k->memory_bytes = mi.bytes;
        k->memory_source = mi.source;
    }
    k->weight_bytes = weight_bytes;
    double left = k->memory_bytes > weight_bytes ? (double)(k->memory_bytes - weight_bytes) : 0;
    /* The smallest share among the pools sized by share must still hold the
     * context: live always, chunk when it has a share and no block count. */
    double s = cfg->live_blocks > 0 ? 1.0 : cfg->share_live;
    if (cfg->chunk_blocks == 0 && cfg->share_chunk > 0 && cfg->share_chunk < s)
        s = cfg->share_chunk;
    double per_block = (double)k->token_bytes * k->block_size;
    double ctx_blocks = ceil((double)k->context / k->block_size) + 1;
    double floor_b = ctx_blocks * per_block / s + RK_POOL_COUNT * per_block;
    double want = RK_KV_AUTO_SHARE * left, cap = RK_KV_AUTO_CAP * left;
    double most = RK_KV_AUTO_MAX_CONTEXTS * (double)k->context * (double)k->token_bytes;
    double b = want > floor_b ? want : floor_b;
    if (b > most && most > floor_b) b = most;
    if (b > cap) b = cap;
    if (b < 2 * per_block)
        return rk_errorf(RK_ERR_INVALID,
                         "kv_memory_mb auto: %.0f MiB of memory (%s) leave %.0f MiB after the "
                         "weights, too little for the KV cache; set kv_memory_mb",
                         (double)k->memory_bytes / (1 << 20), k->memory_source, left / (1 << 20));
    if (b > (double)((uint64_t)1 << 24) * (1 << 20)) b = (double)((uint64_t)1 << 24) * (1 << 20);
    k->budget_bytes = (uint64_t)b;
    return RK_OK;
}

rk_status rk_kv_plan_make(const rk_config *cfg, const rk_hparams *hp, uint64_t weight_bytes,
                          const char *backend, rk_kv_plan *out) {
    rk_kv_plan *k = out;
    *k = (rk_kv_plan){.dtype = kv_dtype_of(cfg->kv_dtype, backend),
                      .block_size = cfg->block_size,
                      .auto_sized = cfg->kv_memory_mb == 0};
    rk_arena_params p = {.n_layers = hp->n_kv_layers ? hp->n_kv_layers : hp->n_layers,
                         .n_kv_heads = hp->n_kv_heads,
                         .head_dim = hp->head_dim,
                         .block_size = cfg->block_size,
                         .dtype = k->dtype};
    if (k->dtype == RK_DTYPE_Q8_0 && strcmp(backend, "cpu") != 0)
        return rk_errorf(RK_ERR_UNSUPPORTED,
                         "kv_dtype q8_0 is not supported on the %s backend (its kernels read f32, "
                         "f16 and bf16 KV): use f16",
                         backend);
    if (!rk_kv_dtype_ok(k->dtype, hp->head_dim))
        return rk_errorf(RK_ERR_UNSUPPORTED,
                         "kv_dtype %s needs a head size that is a multiple of 32; this model's is "
                         "%d: use f16",
                         cfg->kv_dtype, hp->head_dim);
    k->token_bytes = rk_arena_block_bytes(&p) / (size_t)cfg->block_size;
    k->kv_layers = p.n_layers;
    k->context =
        cfg->max_context > 0 && cfg->max_context < hp->n_ctx ? cfg->max_context : hp->n_ctx;
    if (k->context < 1) k->context = cfg->max_context > 0 ? cfg->max_context : 1;
    rk_status st;
    if (k->auto_sized && strcmp(backend, "cpu") != 0) {
        /* The arena is device memory, which this host-side rule cannot see. */
        k->budget_bytes = (uint64_t)RK_KV_AUTO_DEVICE_MB << 20;
        k->memory_source = "device default";
    } else if (k->auto_sized) {
        if ((st = auto_budget(cfg, weight_bytes, k))) return st;
    } else {
        k->budget_bytes = (uint64_t)cfg->kv_memory_mb << 20;
    }
    if ((st = split_budget(cfg, &p, k->budget_bytes))) return st;
    memcpy(k->pool_blocks, p.pool_blocks, sizeof k->pool_blocks);
    long need = ((long)k->context + k->block_size - 1) / k->block_size;
    k->fits_context = k->pool_blocks[RK_POOL_LIVE] >= need && k->pool_blocks[RK_POOL_CHUNK] >= need;
    return RK_OK;
}

void rk_kv_plan_describe(const rk_kv_plan *k, char *buf, size_t n) {
    char how[256] = "";
    if (k->auto_sized)
        snprintf(how, sizeof how,
                 " (auto: %.0f MiB available from %s, %.0f MiB of weights; a context of %d "
                 "tokens %s)",
                 (double)k->memory_bytes / (1 << 20), k->memory_source,
                 (double)k->weight_bytes / (1 << 20), k->context,
                 k->fits_context ? "fits the live and chunk pools" : "does NOT fit: lower it");
    snprintf(buf, n,
             "KV %s, %.0f MiB%s: live %d tokens, prefix %d tokens, chunk %d tokens (%.1f KiB a "
             "token, %d layers)",
             rk_dtype_name(k->dtype), (double)k->budget_bytes / (1 << 20), how,
             k->pool_blocks[RK_POOL_LIVE] * k->block_size,
             k->pool_blocks[RK_POOL_PREFIX] * k->block_size,
             k->pool_blocks[RK_POOL_CHUNK] * k->block_size, (double)k->token_bytes / 1024,
             k->kv_layers);
}

json_t *rk_kv_plan_json(const rk_kv_plan *k) {
    json_t *pools = json_object();
    for (int i = 0; i < RK_POOL_COUNT && pools; i++)
        json_object_set_new(pools, rk_pool_name((rk_pool_tag)i),
                            json_pack("{s:i, s:I}", "blocks", k->pool_blocks[i], "tokens",
                                      (json_int_t)k->pool_blocks[i] * k->block_size));
    json_t *o = json_pack(
        "{s:s, s:b, s:f, s:I, s:i, s:i, s:i, s:b, s:o*}", "dtype", rk_dtype_name(k->dtype), "auto",
        k->auto_sized, "budget_mb", (double)k->budget_bytes / (1 << 20), "token_bytes",
        (json_int_t)k->token_bytes, "layers", k->kv_layers, "block_size", k->block_size, "context",
        k->context, "fits_context", k->fits_context, "pools", pools);
    if (o && k->auto_sized)
        json_object_update_new(o, json_pack("{s:f, s:s, s:f}", "memory_mb",
                                            (double)k->memory_bytes / (1 << 20), "memory_source",
                                            k->memory_source, "weights_mb",
                                            (double)k->weight_bytes / (1 << 20)));
    return o;
}

/* The weights' memory: the GGUF file (mapped), or for the embedded model
 * what a token reads. */
static uint64_t weights_of(const rk_model *m) {
    const rk_gguf *g = rk_model_gguf(m);
    size_t n = g ? rk_gguf_file_size(g) : 0;
    return n ? n : rk_model_weight_bytes(m);
}

static rk_status open_arena(rk_service *svc) {
    const rk_hparams *hp = rk_model_hparams(svc->model);
    const rk_config *cfg = &svc->cfg;
    rk_status st = rk_kv_plan_make(cfg, hp, weights_of(svc->model), svc->be->name, &svc->kv);
    if (st) return st;
    char line[512];
    rk_kv_plan_describe(&svc->kv, line, sizeof line);
    if (svc->kv.auto_sized && !svc->kv.fits_context)
        RK_LOG_WARN("%s", line);
    else
        RK_LOG_INFO("%s", line);
    rk_arena_params p = {.n_layers = hp->n_kv_layers ? hp->n_kv_layers : hp->n_layers,
                         .n_kv_heads = hp->n_kv_heads,
                         .head_dim = hp->head_dim,
                         .block_size = cfg->block_size,
                         .dtype = svc->kv.dtype,
                         .poison = cfg->kv_poison};
    memcpy(p.pool_blocks, svc->kv.pool_blocks, sizeof p.pool_blocks);
    return rk_arena_create(svc->be, &p, &svc->arena);
}

/* The tree owns one arena reference per page; giving a page up drops it. */
static void release_prefix_pages(void *ctx, const int32_t *pages, int n) {
    rk_arena_release(ctx, pages, n);
}

static rk_status open_prefix_cache(rk_service *svc) {
    if (!svc->cfg.prefix_cache || rk_arena_pool_total(svc->arena, RK_POOL_PREFIX) == 0)
        return RK_OK;
    rk_radix_params p = {.page_size = rk_arena_block_size(svc->arena),
                         .policy = RK_RADIX_LRU,
                         .release_pages = release_prefix_pages,
                         .ctx = svc->arena};
    const char *fp = rk_model_fingerprint(svc->model);
    svc->prefix_ns = XXH3_64bits(fp, strlen(fp));
    return rk_radix_create(&p, &svc->prefix);
}

/* The shared tier, once the model fingerprint is known. An unreachable Redis
 * is not an error (the tier's breaker recovers when it answers); a refused
 * password or database, or a bad URL or prefix, is: the service must not run
 * believing it shares when it cannot. */
static rk_status open_redis(rk_service *svc) {
    const rk_config *cfg = &svc->cfg;
    rk_redis_config rc;
    rk_redis_config_default(&rc);
    rc.url = cfg->redis_url;
    rc.prefix = cfg->redis_prefix;
    rc.timeout_ms = cfg->redis_timeout_ms;
    rc.min_tokens = cfg->redis_min_tokens;
    rc.body_check = rk_persist_body_check;
    uint8_t secret[RK_REDIS_SECRET_MAX];
    size_t secret_len = 0;
    rk_status st =
        rk_redis_secret_load(cfg->redis_secret_file, cfg->redis_secret, secret, &secret_len);
    if (!st) {
        rc.secret = secret_len ? secret : NULL;
        rc.secret_len = secret_len;
        st = rk_redis_open(&rc, rk_model_fingerprint(svc->model), &svc->redis);
    }
    explicit_bzero(secret, sizeof secret);
    return st;
}

rk_status rk_kv_plan_for_model(const rk_config *cfg, const char *model_path, rk_kv_plan *out) {
    rk_backend *be = NULL;
    rk_model *m = NULL;
    rk_status st = rk_config_validate(cfg);
    if (!st) st = rk_backend_create(cfg->backend, cfg->n_threads, &be);
    if (!st) st = model_path ? rk_model_load(model_path, be, &m) : load_embedded(be, &m);
    if (!st) st = rk_kv_plan_make(cfg, rk_model_hparams(m), weights_of(m), be->name, out);
    rk_model_free(m);
    rk_backend_free(be);
    return st;
}

rk_status rk_service_open(const rk_config *cfg, const char *model_path, rk_service **out) {
    *out = NULL;
    rk_status st = rk_config_validate(cfg);
    if (st) return st;
    rk_service *svc = calloc(1, sizeof *svc);
    if (!svc) return rk_errorf(RK_ERR_NOMEM, "service: out of memory");
    svc->cfg = *cfg;
    pthread_mutex_init(&svc->grammar_lock, NULL);
    st = rk_grammar_cache_create(RK_GRAMMAR_CACHE_ENTRIES, &svc->grammar_cache);
    if (!st && !(st = rk_backend_create(cfg->backend, cfg->n_threads, &svc->be))) {
        st = model_path ? rk_model_load(model_path, svc->be, &svc->model)
                        : load_embedded(svc->be, &svc->model);
    }
    if (!st) st = open_arena(svc);
    if (!st) st = open_prefix_cache(svc);
    if (!st) st = rk_chunk_index_create(svc->arena, cfg->chunk_entries, &svc->chunks);
    if (!st && cfg->store_dir[0]) {
        rk_store_options so;
        rk_store_options_default(&so);
        so.disk_budget_bytes = (uint64_t)cfg->store_budget_mb << 20;
        so.verify_on_open = cfg->store_verify;
        so.read_delay_ms = cfg->store_read_delay_ms;
        so.write_delay_ms = cfg->store_write_delay_ms;
        so.body_check = rk_persist_body_check;
        st = rk_store_open(cfg->store_dir, rk_model_fingerprint(svc->model), &so, &svc->store);
    }
    if (!st && cfg->redis_url[0]) st = open_redis(svc);
    if (!st && (svc->store || svc->redis))
        st = rk_loader_create((uint64_t)cfg->load_mb << 20, &svc->loader);
    if (!st && svc->store) /* bounded where writes are queued: rk_persist_write_tiers */
        st = rk_loader_create(UINT64_MAX, &svc->writer);
    if (st) {
        rk_service_close(svc);
        return st;
    }
    *out = svc;
    return RK_OK;
}

void rk_service_close(rk_service *svc) {
    if (!svc) return;
    rk_persist_drain_writes(svc); /* every computed chunk reaches the disk */
    rk_loader_free(svc->writer, rk_persist_drop_load, svc);
    rk_loader_free(svc->loader, rk_persist_drop_load, svc); /* before the entries it holds */
    rk_redis_close(svc->redis); /* writes what is queued first, bounded by the timeout */
    rk_store_close(svc->store);
    rk_chunk_index_free(svc->chunks);
    rk_radix_free(svc->prefix); /* gives its pages back to the arena first */
    rk_arena_free(svc->arena);
    rk_model_free(svc->model);
    rk_backend_free(svc->be);
    rk_grammar_vocab_free(svc->grammar_vocab);
    rk_grammar_cache_free(svc->grammar_cache);
    pthread_mutex_destroy(&svc->grammar_lock);
    free(svc);
}

rk_status rk_service_grammar_vocab(rk_service *svc, const rk_grammar_vocab **out) {
    rk_status st = RK_OK;
    pthread_mutex_lock(&svc->grammar_lock);
    if (!svc->grammar_vocab)
        st = rk_grammar_vocab_create(rk_model_tokenizer(svc->model), &svc->grammar_vocab);
    *out = svc->grammar_vocab;
    pthread_mutex_unlock(&svc->grammar_lock);
    return st;
}

rk_status rk_request_prepare_grammar(rk_service *svc, rk_request *r) {
    if (!r->opt.grammar || r->grammar_state) return RK_OK;
    const rk_grammar_vocab *gv;
    rk_status st = rk_service_grammar_vocab(svc, &gv);
    if (st) return st;
    const rk_hparams *hp = rk_model_hparams(svc->model);
    if (rk_grammar_vocab_n(gv) != hp->n_vocab)
        return rk_errorf(RK_ERR_UNSUPPORTED,
                         "constrained sampling needs the tokenizer's %d ids to be the model's %d",
                         (int)rk_grammar_vocab_n(gv), hp->n_vocab);
    rk_grammar_state *gs;
    if ((st = rk_grammar_state_create(r->opt.grammar, gv, &gs))) return st;
    const uint64_t *mask;
    if ((st = rk_grammar_state_mask(gs, &mask))) {
        rk_grammar_state_free(gs);
        return st;
    }
    r->grammar_state = gs;
    return RK_OK;
}
