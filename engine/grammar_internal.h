/* engine/grammar_internal.h — the parts of the grammar engine shared by its
 * source files. Private to engine/: nothing outside the grammar engine
 * includes this header (the API is engine/grammar.h).
 *
 * The files:
 *   grammar_parse.c   grammar text parsed into byte-level rules, and the
 *                     checks run after it (undefined rules, left recursion,
 *                     rules that match nothing, fewest bytes to finish);
 *   grammar_vocab.c   a tokenizer's vocabulary as a byte trie in preorder;
 *   grammar.c         a request's state: pushdown stacks interned into a
 *                     lazily built automaton, stepping by bytes and tokens,
 *                     and token masks found by walking the trie;
 *   grammar_schema.c  JSON Schema (and tool calls) translated into grammar
 *                     text (written to an rk_strbuf, config/config.h);
 *   grammar_regex.c   a schema's regular expressions (pattern) translated
 *                     into grammar text. */
#ifndef RK_GRAMMAR_INTERNAL_H
#define RK_GRAMMAR_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "engine/grammar.h"

/* ------------------------------------------------------------ the rules */

/* The most copies a repetition {m,n} may ask for (grammar text and patterns). */
#define RK_GRAMMAR_MAX_REPEAT 10000

enum { RK_GRAM_END = 0, RK_GRAM_SET = 1, RK_GRAM_REF = 2 };

typedef struct rk_gram_elem {
    int32_t type, v; /* RK_GRAM_SET: index of the byte class; RK_GRAM_REF: rule id */
} rk_gram_elem;

struct rk_grammar {
    int refs; /* references (atomic); the last rk_grammar_free frees it */
    int n_rules;
    char **names;        /* (n_rules) */
    int32_t *alt_off;    /* (n_rules + 1) into alt_start */
    int32_t *alt_start;  /* (n_alts) first element of each alternative */
    uint8_t *alt_dead;   /* (n_alts) the alternative matches nothing */
    rk_gram_elem *elems; /* alternatives, each ended by RK_GRAM_END */
    uint64_t (*sets)[4];
    int32_t *minlen; /* (n_elems) fewest bytes that finish the sequence from each element */
    int n_alts, n_elems, n_sets;
    int root;
};

/* Grow the array *p of *cap items of size bytes to hold need items (doubling
 * from 16). Returns 0, or -1 when out of memory (the array is then unchanged). */
int rk_gram_grow(void **p, int *cap, int need, size_t size);

/* The value of hex digit c, or -1. */
int rk_gram_hexval(char c);

/* The counts of a repetition {m}, {m,} or {m,n} whose '{' is at p: *lo and
 * *hi (-1: no upper bound), and in *end the character after the '}'.
 * Returns 0; -1 when no count follows the '{'; -2 when the counts are
 * malformed or outside 0 <= m <= n <= RK_GRAMMAR_MAX_REPEAT. */
int rk_gram_repeat(const char *p, long *lo, long *hi, const char **end);

/* ------------------------------------------------------------ vocabulary */

struct rk_grammar_vocab {
    int32_t n_vocab;
    int32_t n_nodes;
    uint8_t *byte;     /* (n_nodes) preorder; node 0 is the root */
    uint16_t *depth;   /* (n_nodes) */
    int32_t *skip;     /* (n_nodes) the node after this one's subtree */
    int32_t *tok;      /* (n_nodes) first token ending here, -1 */
    int32_t *tok_next; /* (n_vocab) next token with the same bytes, -1 */
    int32_t *eog;
    int n_eog;
    uint32_t *off; /* (n_vocab + 1) into bytes; 0 length: never text */
    char *bytes;
    int max_depth;
};

/* A string matching pattern (ECMA-262 search semantics: unanchored unless
 * ^ and $ say so), as a grammar expression appended to b: the grammar text of
 * the JSON-escaped form of the strings it matches. Returns RK_OK;
 * RK_ERR_UNSUPPORTED with what the pattern uses that is not supported, and
 * where, in err (no message is set: the caller reports err); RK_ERR_NOMEM. */
rk_status rk_gram_pattern(const char *pat, rk_strbuf *b, char *err, size_t err_size);

#endif
