/* gateway/chat_docs.c — where a chat's documents come from besides the
 * first user message's `documents`/`chunks` extension (http_json.c): a
 * `documents` field on any user or tool message, and `chunking`, which
 * makes every tool message's content passages. gateway/chat.c lays each
 * message's documents out as a chunk group where the message stands. */
#include <stdlib.h>
#include <string.h>

#include "gateway/json_fields.h"

int rk_api_parse_msg_documents(json_t *m, int i, rk_chat_msg *msg, rk_http_error *err) {
    json_t *docs = json_object_get(m, "documents");
    if (!docs || json_is_null(docs)) return 0;
    if (!json_is_array(docs))
        return rk_http_errorf(err, 400, "messages[%d].documents must be an array", i), 1;
    size_t n = json_array_size(docs);
    if (n > 65536)
        return rk_http_errorf(err, 422, "messages[%d].documents has %zu entries", i, n), 1;
    char **all = realloc(msg->docs, (msg->n_docs + n + 1) * sizeof *all);
    if (!all) return rk_http_errorf(err, 500, "out of memory"), 1;
    msg->docs = all;
    for (size_t k = 0; k < n; k++) {
        json_t *d = json_array_get(docs, k), *t = d;
        if (json_is_object(d)) {
            t = json_object_get(d, "text");
            if (!t) t = json_object_get(d, "content");
        }
        if (!json_is_string(t))
            return rk_http_errorf(err, 400,
                                  "messages[%d].documents[%zu] must be a string or "
                                  "{\"text\": ...}",
                                  i, k),
                   1;
        if (!(msg->docs[msg->n_docs] = rk_strdup(json_string_value(t))))
            return rk_http_errorf(err, 500, "out of memory"), 1;
        msg->n_docs++;
    }
    return 0;
}

int rk_api_parse_chunking(json_t *root, rk_api_request *out, rk_http_error *err) {
    json_t *c = json_object_get(root, "chunking");
    if (!c || json_is_null(c)) return 0;
    if (!json_is_object(c))
        return rk_http_errorf(err, 400,
                              "'chunking' must be an object like "
                              "{\"tool_results\": true}"),
               1;
    const char *key;
    json_t *v;
    json_object_foreach(c, key, v) {
        if (strcmp(key, "tool_results") != 0)
            return rk_http_errorf(err, 400, "'chunking.%s' is not a known field", key), 1;
    }
    return get_bool(c, "tool_results", &out->chunk_tool_results, err);
}
