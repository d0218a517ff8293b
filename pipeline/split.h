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
    /* More than one chunk group (n_groups > 1; 0 or 1: one group, the
     * chunks): group g is chunks [group_end[g - 1], group_end[g]) (from 0
     * for g = 0), and texts[g], for g < n_groups - 1, is the text between
     * group g and group g + 1. The layout is system, group 0, texts[0],
     * group 1, ..., the last group, question. */
    int n_groups;
    int *group_end; /* (n_groups) */
    rk_text *texts; /* (n_groups - 1) */
} rk_split;

/* One segment of a layout (rk_split_segments): text (a string), or a chunk
 * group of n_chunks chunks (text NULL; a group may have none). */
typedef struct rk_segment {
    const char *text;
    const char *const *chunks;
    int n_chunks;
} rk_segment;

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

/* A layout from segments in order: the text before the first group is the
 * system prompt, the text after the last group the question, each text
 * between two groups stays between them (adjacent texts are joined; two
 * adjacent groups have an empty text between them). No group at all: the
 * text is a plain prompt (all question). Empty chunks are skipped and
 * counted; a group left with no chunks still separates the texts around
 * it. With a group, an empty question is RK_ERR_INVALID; more than
 * max_chunks chunks RK_ERR_LIMIT. One group gives what rk_split_structured
 * gives. */
rk_status rk_split_segments(const rk_segment *segs, int n_segs, int max_chunks, rk_split *out);

void rk_split_free(rk_split *s);

#endif
