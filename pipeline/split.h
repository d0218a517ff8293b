/* pipeline/split.h — splitting a RAG prompt into its pieces before tokenizing.
 *
 *   "system##chunk 1##chunk 2##question"
 *
 * Piece 0 is the system prompt, the last piece the question, everything
 * between is a chunk. A separator written with a backslash before each of its
 * characters (`\#\#` for `##`) is a literal separator inside a piece. Rules:
 *   - no separator: a plain prompt, all of it the question (no system, no chunks;
 *     it may be empty: generation then starts from BOS alone);
 *   - one separator: system + question, no chunks;
 *   - empty chunks are skipped and counted in n_empty_chunks;
 *   - with a separator, an empty question is an error (RK_ERR_INVALID);
 *   - more than max_chunks non-empty chunks is RK_ERR_LIMIT. */
#ifndef RK_SPLIT_H
#define RK_SPLIT_H

#include <stddef.h>

#include "config/config.h"

#define RK_SEPARATOR_MAX 16

typedef struct rk_text {
    char *s; /* malloc'ed, NUL-terminated */
    size_t len;
} rk_text;

typedef struct rk_split {
    rk_text system;
    rk_text *chunks; /* (n_chunks) */
    int n_chunks;
    rk_text question;
    int n_empty_chunks; /* empty chunks that were skipped */
} rk_split;

/* Check a separator: 1 to RK_SEPARATOR_MAX bytes, no backslash, no NUL. */
rk_status rk_separator_check(const char *sep);

/* Split len bytes of prompt on sep (NULL = "##"). On success *out owns its
 * strings (rk_split_free); on failure nothing is left allocated. */
rk_status rk_split_prompt(const char *prompt, size_t len, const char *sep, int max_chunks,
                          rk_split *out);

/* The structured form: copies system (may be NULL), chunks (empty ones
 * skipped and counted) and question, with the same rules. */
rk_status rk_split_structured(const char *system, const char *const *chunks, int n_chunks,
                              const char *question, int max_chunks, rk_split *out);

void rk_split_free(rk_split *s);

#endif
