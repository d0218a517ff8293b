/* gateway/segments.c — the `segments` form of a completion body: the
 * layout written out, texts and chunk groups in the order the model reads
 * them, so documents can stand anywhere, not only between the system
 * prompt and the question:
 *
 *   {"segments": [{"text": "system"}, {"chunks": ["c1", {"id": "d2", "text": "c2"}]},
 *                 {"text": "a turn"}, {"chunks": ["c3"]}, {"text": "question"}]}
 *
 * The text before the first group is the system prompt, the text after the
 * last the question (rk_split_segments). */
#include <stdlib.h>

#include "gateway/json_fields.h"
#include "pipeline/split.h"

/* Longest list accepted before the chunk limit is even looked at. */
#define MAX_SEGMENTS 4096

/* Segment i into seg: a text, or a group whose non-empty chunks (and their
 * ids) are appended to texts/ids from *n on; empties are counted. */
static int one_segment(json_t *v, size_t i, rk_segment *seg, const char **texts, const char **ids,
                       int *n, int *empty, int *any_id, int cap, rk_http_error *err) {
    json_t *t = json_is_object(v) ? json_object_get(v, "text") : NULL;
    json_t *c = json_is_object(v) ? json_object_get(v, "chunks") : NULL;
    if (!json_is_object(v) || (t != NULL) == (c != NULL) || json_object_size(v) != 1)
        return rk_http_errorf(err, 400,
                              "segments[%zu] must be {\"text\": ...} or {\"chunks\": [...]}", i),
               1;
    if (t) {
        if (!json_is_string(t))
            return rk_http_errorf(err, 400, "segments[%zu].text must be a string", i), 1;
        *seg = (rk_segment){.text = json_string_value(t)};
        return 0;
    }
    if (!json_is_array(c))
        return rk_http_errorf(err, 400, "segments[%zu].chunks must be an array", i), 1;
    *seg = (rk_segment){.chunks = texts + *n};
    for (size_t k = 0; k < json_array_size(c); k++) {
        const char *text, *id;
        if (chunk_entry(json_array_get(c, k), (int)k, &text, &id, err)) return 1;
        if (!*text) {
            (*empty)++;
            continue;
        }
        if (*n == cap)
            return rk_http_errorf(err, 422, "the request has more than %d chunks", cap), 1;
        texts[*n] = text;
        ids[*n] = id;
        *any_id |= id != NULL;
        (*n)++;
        seg->n_chunks++;
    }
    return 0;
}

int rk_api_parse_segments(json_t *segs, const rk_parse_limits *lim, rk_api_request *out,
                          rk_http_error *err) {
    if (!json_is_array(segs)) return rk_http_errorf(err, 400, "'segments' must be an array"), 1;
    size_t n_segs = json_array_size(segs);
    if (n_segs == 0) return rk_http_errorf(err, 400, "'segments' is empty"), 1;
    if (n_segs > MAX_SEGMENTS)
        return rk_http_errorf(err, 422, "'segments' has %zu entries; at most %d are allowed",
                              n_segs, MAX_SEGMENTS),
               1;
    int cap = lim->max_chunks, n = 0, empty = 0, any_id = 0, failed = 0;
    rk_segment *list = calloc(n_segs, sizeof *list);
    const char **texts = calloc((size_t)cap + 1, sizeof *texts);
    const char **ids = calloc((size_t)cap + 1, sizeof *ids);
    if (!list || !texts || !ids) {
        rk_http_errorf(err, 500, "out of memory");
        failed = 1;
    }
    for (size_t i = 0; i < n_segs && !failed; i++)
        failed = one_segment(json_array_get(segs, i), i, &list[i], texts, ids, &n, &empty, &any_id,
                             cap, err);
    if (!failed) {
        rk_status st = rk_split_segments(list, (int)n_segs, lim->max_chunks, &out->pieces);
        if (st) {
            rk_http_errorf(err,
                           st == RK_ERR_LIMIT   ? 422
                           : st == RK_ERR_NOMEM ? 500
                                                : 400,
                           "bad segments: %s", rk_error_message());
            failed = 1;
        } else {
            out->have_pieces = 1;
            out->pieces.n_empty_chunks += empty;
        }
    }
    if (!failed && any_id) {
        out->chunk_ids = calloc((size_t)(n ? n : 1), sizeof *out->chunk_ids);
        failed = !out->chunk_ids;
        for (int i = 0; i < n && !failed; i++)
            failed = ids[i] && !(out->chunk_ids[i] = rk_strdup(ids[i]));
        if (failed) rk_http_errorf(err, 500, "out of memory");
    }
    free(list);
    free(texts);
    free(ids);
    return failed;
}
