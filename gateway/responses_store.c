/* gateway/responses_store.c — stored responses (responses.h): a list kept
 * in the order stored, each entry its JSON texts, dropped oldest first when
 * over the count or the bytes, and when expired. One mutex guards it. */
#include <jansson.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "config/config.h"
#include "gateway/responses.h"

typedef struct resp_entry {
    struct resp_entry *prev, *next; /* oldest first */
    char *id;
    int tenant;
    double expires;
    char *response, *input, *conversation; /* JSON texts */
    size_t bytes;
} resp_entry;

struct rk_resp_store {
    pthread_mutex_t mu;
    resp_entry *head, *tail;
    int count, max_count;
    long long bytes, max_bytes;
    double ttl_s;
};

rk_status rk_resp_store_create(int max_count, long long max_bytes, double ttl_s,
                               rk_resp_store **out) {
    rk_resp_store *s = calloc(1, sizeof *s);
    if (!s) return rk_errorf(RK_ERR_NOMEM, "out of memory");
    pthread_mutex_init(&s->mu, NULL);
    s->max_count = max_count;
    s->max_bytes = max_bytes;
    s->ttl_s = ttl_s;
    *out = s;
    return RK_OK;
}

static void entry_free(resp_entry *e) {
    free(e->id);
    free(e->response);
    free(e->input);
    free(e->conversation);
    free(e);
}

static void unlink_entry(rk_resp_store *s, resp_entry *e) {
    if (e->prev)
        e->prev->next = e->next;
    else
        s->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        s->tail = e->prev;
    s->count--;
    s->bytes -= (long long)e->bytes;
    entry_free(e);
}

void rk_resp_store_free(rk_resp_store *s) {
    if (!s) return;
    while (s->head) unlink_entry(s, s->head);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* Drop what expired (entries are in the order stored, so expiry order too). */
static void expire(rk_resp_store *s) {
    double now = rk_time_now();
    while (s->head && s->head->expires <= now) unlink_entry(s, s->head);
}

static resp_entry *find(rk_resp_store *s, int tenant, const char *id) {
    expire(s);
    for (resp_entry *e = s->tail; e; e = e->prev)
        if (e->tenant == tenant && !strcmp(e->id, id)) return e;
    return NULL;
}

rk_status rk_resp_store_put(rk_resp_store *s, int tenant, const char *id, json_t *response,
                            json_t *input, json_t *conversation) {
    resp_entry *e = calloc(1, sizeof *e);
    if (!e) return rk_errorf(RK_ERR_NOMEM, "out of memory");
    e->id = rk_strdup(id);
    e->tenant = tenant;
    e->response = json_dumps(response, JSON_COMPACT);
    e->input = json_dumps(input, JSON_COMPACT);
    e->conversation = json_dumps(conversation, JSON_COMPACT);
    if (!e->id || !e->response || !e->input || !e->conversation) {
        entry_free(e);
        return rk_errorf(RK_ERR_NOMEM, "out of memory");
    }
    e->bytes = strlen(e->id) + strlen(e->response) + strlen(e->input) + strlen(e->conversation) +
               sizeof *e;
    if ((long long)e->bytes > s->max_bytes) {
        size_t b = e->bytes;
        entry_free(e);
        return rk_errorf(RK_ERR_LIMIT, "the response takes %zu bytes; the store holds %lld", b,
                         s->max_bytes);
    }
    pthread_mutex_lock(&s->mu);
    resp_entry *old = find(s, tenant, id);
    if (old) unlink_entry(s, old);
    while (s->head &&
           (s->count + 1 > s->max_count || s->bytes + (long long)e->bytes > s->max_bytes))
        unlink_entry(s, s->head);
    e->expires = rk_time_now() + s->ttl_s;
    e->prev = s->tail;
    if (s->tail)
        s->tail->next = e;
    else
        s->head = e;
    s->tail = e;
    s->count++;
    s->bytes += (long long)e->bytes;
    pthread_mutex_unlock(&s->mu);
    return RK_OK;
}

static json_t *load(const char *text) { return text ? json_loads(text, 0, NULL) : NULL; }

rk_status rk_resp_store_get(rk_resp_store *s, int tenant, const char *id, json_t **response,
                            json_t **input, json_t **conversation) {
    pthread_mutex_lock(&s->mu);
    resp_entry *e = find(s, tenant, id);
    char *r = NULL, *i = NULL, *c = NULL;
    if (e) {
        r = response ? rk_strdup(e->response) : NULL;
        i = input ? rk_strdup(e->input) : NULL;
        c = conversation ? rk_strdup(e->conversation) : NULL;
    }
    pthread_mutex_unlock(&s->mu);
    if (!e) return rk_errorf(RK_ERR_NOT_FOUND, "no response with id '%s'", id);
    rk_status st = RK_OK;
    if (response && !(*response = load(r))) st = RK_ERR_NOMEM;
    if (input && !(*input = load(i))) st = RK_ERR_NOMEM;
    if (conversation && !(*conversation = load(c))) st = RK_ERR_NOMEM;
    free(r);
    free(i);
    free(c);
    if (st) {
        if (response) json_decref(*response), *response = NULL;
        if (input) json_decref(*input), *input = NULL;
        if (conversation) json_decref(*conversation), *conversation = NULL;
        return rk_errorf(st, "out of memory");
    }
    return RK_OK;
}

rk_status rk_resp_store_delete(rk_resp_store *s, int tenant, const char *id) {
    pthread_mutex_lock(&s->mu);
    resp_entry *e = find(s, tenant, id);
    if (e) unlink_entry(s, e);
    pthread_mutex_unlock(&s->mu);
    return e ? RK_OK : rk_errorf(RK_ERR_NOT_FOUND, "no response with id '%s'", id);
}
