/* gateway/responses.h — POST /v1/responses (OpenAI's Responses API) on the
 * chat path: a Responses body translated into a chat body
 * (responses_input.c), the chat answer turned into a response object or its
 * stream of events (responses.c), and the in-memory store of responses that
 * previous_response_id continues (responses_store.c). */
#ifndef RK_RESPONSES_H
#define RK_RESPONSES_H

#include <jansson.h>

#include "gateway/api.h"

/* ---------------------------------------------------------------- the store */

/* Stored responses, each with its own input items and the whole
 * conversation up to its end, bounded by count and by total bytes (the
 * oldest go first) and expiring ttl_s after they were stored. Each belongs
 * to a tenant (0: none) and is seen by it alone. Lost on restart.
 * Thread-safe. */
typedef struct rk_resp_store rk_resp_store;

rk_status rk_resp_store_create(int max_count, long long max_bytes, double ttl_s,
                               rk_resp_store **out);
void rk_resp_store_free(rk_resp_store *s); /* accepts NULL */

/* Store (or replace) id for tenant: the response object, its input items and
 * the conversation (input and output items of it and every response before
 * it); nothing is taken. RK_ERR_LIMIT when it alone is over max_bytes. */
rk_status rk_resp_store_put(rk_resp_store *s, int tenant, const char *id, json_t *response,
                            json_t *input, json_t *conversation);

/* What id holds for tenant, as new references (any out may be NULL);
 * RK_ERR_NOT_FOUND when it is absent, expired or another tenant's. */
rk_status rk_resp_store_get(rk_resp_store *s, int tenant, const char *id, json_t **response,
                            json_t **input, json_t **conversation);

/* Remove id; RK_ERR_NOT_FOUND as above. */
rk_status rk_resp_store_delete(rk_resp_store *s, int tenant, const char *id);

/* ---------------------------------------------------------------- the request */

/* A Responses body (root) as a chat completions body (a new object), with
 * conversation (the stored items of previous_response_id, or NULL) before
 * this request's input; *input gets this request's input items as items
 * (a new array, ids named after id_base). NULL with err (400 naming the
 * field) when the body asks for what cannot be honoured. */
json_t *rk_resp_chat_body(json_t *root, json_t *conversation, const char *id_base, json_t **input,
                          rk_http_error *err);

#endif
