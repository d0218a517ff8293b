/* gateway/routes_common.c — what the route handlers share, below them and
 * below the router (server.c), so that the router calls the handlers and
 * no handler calls back into the router: the service once the model is
 * ready (with the served model's name and chat template, worked out once),
 * the check of a request's `model`, the 503 while the model loads or the
 * server stops, and random ids. Each runs on the request's own thread. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/tokenizer.h"
#include "gateway/http.h"

/* ---------------------------------------------------------------- ids */

static uint64_t splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t rk_gw_random(server *S) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t x = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^
                 (atomic_fetch_add(&S->counter, 1) * 0x2545f4914f6cdd1dull) ^
                 ((uint64_t)getpid() << 48);
    return splitmix(&x);
}

/* ---------------------------------------------------------------- model facts */

/* The service when ready, with the served name and chat template computed. */
rk_service *rk_gw_ready_service(server *S) {
    if (rk_scheduler_get_state(S->engine, NULL, 0) != RK_SCHEDULER_READY) return NULL;
    rk_service *svc = rk_scheduler_service(S->engine);
    if (!svc) return NULL;
    pthread_mutex_lock(&S->info_mu);
    if (!S->have_info) {
        const rk_hparams *hp = rk_model_hparams(svc->model);
        if (S->o.served_model_name[0]) {
            snprintf(S->model_name, sizeof S->model_name, "%.*s",
                     (int)strcspn(S->o.served_model_name, ","), S->o.served_model_name);
        } else if (hp->name[0]) {
            snprintf(S->model_name, sizeof S->model_name, "%s", hp->name);
        } else if (S->o.model[0]) {
            const char *b = strrchr(S->o.model, '/');
            snprintf(S->model_name, sizeof S->model_name, "%.255s", b ? b + 1 : S->o.model);
        } else {
            snprintf(S->model_name, sizeof S->model_name, "ragkv-embedded");
        }
        const char *jinja = NULL;
        const rk_gguf *g = rk_model_gguf(svc->model);
        if (g && rk_gguf_get_str(g, "tokenizer.chat_template", &jinja, NULL)) jinja = NULL;
        const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
        S->tmpl = S->forced_tmpl >= 0
                      ? (rk_chat_template)S->forced_tmpl
                      : rk_chat_template_detect(jinja, hp->arch_name,
                                                rk_tokenizer_find(tok, "<|start_header_id|>") >= 0,
                                                rk_tokenizer_find(tok, "<|turn>") >= 0);
        S->thinks =
            S->o.reasoning > 0 ||
            (S->o.reasoning < 0 && S->tmpl == RK_CHAT_CHATML &&
             rk_tokenizer_find(tok, "<think>") >= 0 && rk_tokenizer_find(tok, "</think>") >= 0) ||
            (S->o.reasoning != 0 && S->tmpl == RK_CHAT_HARMONY) ||
            (S->o.reasoning < 0 && S->tmpl == RK_CHAT_GEMMA4 &&
             rk_tokenizer_find(tok, "<|channel>") >= 0 &&
             rk_tokenizer_find(tok, "<channel|>") >= 0);
        S->have_info = 1;
    }
    pthread_mutex_unlock(&S->info_mu);
    return svc;
}

/* Is name one of the comma-separated names in list? */
static int in_list(const char *list, const char *name) {
    size_t n = strlen(name);
    for (const char *p = list; *p;) {
        size_t l = strcspn(p, ",");
        if (l == n && !strncmp(p, name, n)) return 1;
        p += l + (p[l] == ',');
    }
    return 0;
}

int rk_gw_model_matches(server *S, rk_service *svc, const char *name) {
    if (!strcmp(name, S->model_name) || !strcmp(name, rk_model_fingerprint(svc->model)) ||
        in_list(S->o.served_model_name, name))
        return 1;
    if (S->o.model[0]) {
        const char *b = strrchr(S->o.model, '/');
        b = b ? b + 1 : S->o.model;
        size_t n = strlen(b);
        if (!strcmp(name, b) || !strcmp(name, S->o.model)) return 1;
        if (n > 5 && !strcmp(b + n - 5, ".gguf") && strlen(name) == n - 5 &&
            !strncmp(name, b, n - 5))
            return 1;
    }
    return 0;
}

int rk_gw_check_model(server *S, rk_service *svc, const char *name, rk_http_error *err) {
    if (!name || rk_gw_model_matches(S, svc, name)) return 0;
    if (S->o.model_name_strict) {
        rk_http_errorf(err, 404, "model \"%s\" is not served here; this server serves \"%s\"", name,
                       S->model_name);
        err->code = "model_not_found";
        err->param = "model";
        return -1;
    }
    if (!atomic_exchange(&S->name_mismatch_logged, 1))
        RK_LOG_WARN("a request named model \"%.200s\"; answered as \"%s\" (model_name_policy "
                    "any; logged once)",
                    name, S->model_name);
    return 0;
}

json_t *rk_gw_read_json(req_ctx *rc, rk_service **svc) {
    char *body;
    size_t len;
    if (rk_gw_read_body(rc, &body, &len)) return NULL;
    *svc = rk_gw_ready_service(rc->S);
    if (!*svc) {
        free(body);
        rk_gw_send_not_ready(rc);
        return NULL;
    }
    json_error_t je;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    free(body);
    if (!root)
        rk_gw_send_errorf(rc, 400, "the body is not valid JSON: %s (line %d, column %d)", je.text,
                          je.line, je.column);
    else if (!json_is_object(root))
        rk_gw_send_errorf(rc, 400, "the body must be a JSON object");
    if (root && json_is_object(root)) return root;
    json_decref(root);
    return NULL;
}

void rk_gw_send_not_ready(req_ctx *rc) {
    char msg[320];
    rk_scheduler_state st = rk_scheduler_get_state(rc->S->engine, msg, sizeof msg);
    if (atomic_load(&rc->S->stopping) || st == RK_SCHEDULER_STOPPING)
        rk_gw_send_errorf(rc, 503, "the server is shutting down");
    else if (st == RK_SCHEDULER_FAILED)
        rk_gw_send_errorf(rc, 503, "the model failed to load: %s", msg);
    else
        rk_gw_send_errorf(rc, 503, "the model is still loading");
}
