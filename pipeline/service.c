/* pipeline/service.c — opening a backend, a model and the KV arena together. */
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "engine/mkmodel.h"
#include "pipeline/persist.h"
#include "pipeline/pipeline.h"

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

static rk_status open_arena(rk_service *svc) {
    const rk_hparams *hp = rk_model_hparams(svc->model);
    const rk_config *cfg = &svc->cfg;
    rk_arena_params p = {.n_layers = hp->n_layers,
                         .n_kv_heads = hp->n_kv_heads,
                         .head_dim = hp->head_dim,
                         .block_size = cfg->block_size,
                         .dtype = !strcmp(cfg->kv_dtype, "f16")    ? RK_DTYPE_F16
                                  : !strcmp(cfg->kv_dtype, "bf16") ? RK_DTYPE_BF16
                                                                   : RK_DTYPE_F32,
                         .poison = cfg->kv_poison};
    float share[RK_POOL_COUNT] = {cfg->share_live, cfg->share_prefix, cfg->share_chunk};
    rk_status st = rk_arena_params_from_budget(&p, (size_t)cfg->kv_memory_mb << 20, share);
    if (st) return st;
    int fixed[RK_POOL_COUNT] = {cfg->live_blocks, cfg->prefix_blocks, cfg->chunk_blocks};
    for (int i = 0; i < RK_POOL_COUNT; i++)
        if (fixed[i] > 0) p.pool_blocks[i] = fixed[i];
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

rk_status rk_service_open(const rk_config *cfg, const char *model_path, rk_service **out) {
    *out = NULL;
    rk_status st = rk_config_validate(cfg);
    if (st) return st;
    rk_service *svc = calloc(1, sizeof *svc);
    if (!svc) return rk_errorf(RK_ERR_NOMEM, "service: out of memory");
    svc->cfg = *cfg;
    pthread_mutex_init(&svc->grammar_lock, NULL);
    if (!(st = rk_backend_create(cfg->backend, cfg->n_threads, &svc->be))) {
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
        so.body_check = rk_persist_body_check;
        st = rk_store_open(cfg->store_dir, rk_model_fingerprint(svc->model), &so, &svc->store);
    }
    if (!st && cfg->redis_url[0]) st = open_redis(svc);
    if (st) {
        rk_service_close(svc);
        return st;
    }
    *out = svc;
    return RK_OK;
}

void rk_service_close(rk_service *svc) {
    if (!svc) return;
    rk_redis_close(svc->redis); /* writes what is queued first, bounded by the timeout */
    rk_store_close(svc->store);
    rk_chunk_index_free(svc->chunks);
    rk_radix_free(svc->prefix); /* gives its pages back to the arena first */
    rk_arena_free(svc->arena);
    rk_model_free(svc->model);
    rk_backend_free(svc->be);
    rk_grammar_vocab_free(svc->grammar_vocab);
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
