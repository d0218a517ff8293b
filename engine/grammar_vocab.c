/* engine/grammar_vocab.c — a tokenizer's vocabulary as a byte trie (see
 * engine/grammar.h).
 *
 * Every token's decoded bytes, sorted, give the trie in preorder: each node
 * holds its byte, its depth, the node after its subtree (so a walk can skip
 * a subtree the grammar refuses) and the tokens that end there. The
 * end-of-generation tokens are kept apart: they are never text. */
#include <stdlib.h>
#include <string.h>

#include "engine/grammar_internal.h"

static _Thread_local const rk_grammar_vocab *t_sort_vocab;

static int by_bytes(const void *pa, const void *pb) {
    const rk_grammar_vocab *v = t_sort_vocab;
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    uint32_t la = v->off[a + 1] - v->off[a], lb = v->off[b + 1] - v->off[b];
    int c = memcmp(v->bytes + v->off[a], v->bytes + v->off[b], la < lb ? la : lb);
    if (c) return c;
    if (la != lb) return la < lb ? -1 : 1;
    return a < b ? -1 : a > b;
}

void rk_grammar_vocab_free(rk_grammar_vocab *v) {
    if (!v) return;
    free(v->byte);
    free(v->depth);
    free(v->skip);
    free(v->tok);
    free(v->tok_next);
    free(v->eog);
    free(v->off);
    free(v->bytes);
    free(v);
}

int32_t rk_grammar_vocab_n(const rk_grammar_vocab *v) { return v->n_vocab; }

rk_status rk_grammar_vocab_create(const rk_tokenizer *t, rk_grammar_vocab **out) {
    *out = NULL;
    int32_t n = rk_tokenizer_n_vocab(t);
    rk_grammar_vocab *v = calloc(1, sizeof *v);
    int32_t *order = NULL, *path = NULL;
    if (!v) return rk_errorf(RK_ERR_NOMEM, "grammar: out of memory for the vocabulary");
    v->n_vocab = n;
    v->off = malloc(((size_t)n + 1) * sizeof *v->off);
    v->tok_next = malloc((size_t)n * sizeof *v->tok_next);
    v->eog = malloc((size_t)n * sizeof *v->eog);
    order = malloc((size_t)n * sizeof *order);
    size_t total = 0;
    if (!v->off || !v->tok_next || !v->eog || !order) goto nomem;
    for (int32_t id = 0; id < n; id++) {
        int len = rk_tokenizer_token_bytes(t, id, 0, NULL, 0);
        total += len > 0 ? (size_t)len : 0;
    }
    v->bytes = malloc(total + 1);
    if (!v->bytes) goto nomem;
    size_t pos = 0;
    int n_text = 0;
    for (int32_t id = 0; id < n; id++) {
        v->off[id] = (uint32_t)pos;
        v->tok_next[id] = -1;
        if (rk_tokenizer_is_eog(t, id)) {
            v->eog[v->n_eog++] = id;
            continue; /* an end token is never text */
        }
        int len = rk_tokenizer_token_bytes(t, id, 0, v->bytes + pos, (int)(total - pos));
        if (len > 0) {
            pos += (size_t)len;
            order[n_text++] = id;
        }
    }
    v->off[n] = (uint32_t)pos;
    t_sort_vocab = v;
    qsort(order, (size_t)n_text, sizeof *order, by_bytes);
    size_t cap = pos + 1;
    v->byte = malloc(cap);
    v->depth = malloc(cap * sizeof *v->depth);
    v->skip = malloc(cap * sizeof *v->skip);
    v->tok = malloc(cap * sizeof *v->tok);
    int max_len = 1;
    for (int i = 0; i < n_text; i++) {
        int len = (int)(v->off[order[i] + 1] - v->off[order[i]]);
        if (len > max_len) max_len = len;
    }
    if (max_len > 65535) {
        rk_grammar_vocab_free(v);
        free(order);
        return rk_errorf(RK_ERR_UNSUPPORTED, "grammar: a token of %d bytes is too long", max_len);
    }
    path = malloc(((size_t)max_len + 1) * sizeof *path);
    if (!v->byte || !v->depth || !v->skip || !v->tok || !path) goto nomem;
    /* Sorted byte strings give the trie in preorder: each token shares with
     * the one before it a prefix (its path), pops the rest and pushes its own
     * remaining bytes; a popped node's subtree ends where the next node goes. */
    int32_t nn = 1, top = 0; /* path[0..top] are the open nodes, path[0] the root */
    v->byte[0] = 0, v->depth[0] = 0, v->tok[0] = -1;
    path[0] = 0;
    const char *prev = NULL;
    int prev_len = 0;
    for (int i = 0; i < n_text; i++) {
        int32_t id = order[i];
        const char *s = v->bytes + v->off[id];
        int len = (int)(v->off[id + 1] - v->off[id]);
        int c = 0;
        while (prev && c < len && c < prev_len && s[c] == prev[c]) c++;
        while (top > c) v->skip[path[top--]] = nn;
        for (int d = c; d < len; d++) {
            v->byte[nn] = (uint8_t)s[d];
            v->depth[nn] = (uint16_t)(d + 1);
            v->tok[nn] = -1;
            path[++top] = nn++;
        }
        int32_t node = path[top];
        if (v->tok[node] < 0) {
            v->tok[node] = id;
        } else { /* the same bytes as an earlier token: chain it */
            int32_t k = v->tok[node];
            while (v->tok_next[k] >= 0) k = v->tok_next[k];
            v->tok_next[k] = id;
        }
        prev = s, prev_len = len;
    }
    while (top > 0) v->skip[path[top--]] = nn;
    v->skip[0] = nn;
    v->n_nodes = nn;
    v->max_depth = max_len;
    free(order);
    free(path);
    *out = v;
    return RK_OK;
nomem:
    free(order);
    free(path);
    rk_grammar_vocab_free(v);
    return rk_errorf(RK_ERR_NOMEM, "grammar: out of memory for the vocabulary");
}
