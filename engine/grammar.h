/* engine/grammar.h — constrained sampling: grammars, JSON Schema, token masks.
 *
 * A grammar is compiled once per request from one of three sources: a JSON
 * Schema (the subset of OpenAI's strict mode that docs/api.md lists), the
 * JSON-object rule (any JSON object), or a GBNF-like grammar text. At each
 * decode step a grammar state gives the set of tokens that keep the output a
 * prefix of a sentence of the grammar (a bitset over the vocabulary), the
 * sampler masks the logits with it, and the state advances by the bytes of
 * the sampled token. End-of-generation tokens are in the set only where the
 * grammar may end.
 *
 * Grammars work on bytes. A compiled grammar is a set of rules whose
 * alternatives are sequences of byte classes and rule references; a state is
 * the set of pushdown stacks the bytes so far leave alive. States are
 * interned into a lazily built automaton (one 256-entry transition row per
 * state visited), and the vocabulary is held once per tokenizer as a byte
 * trie walked in preorder, so a state's mask costs one transition look-up per
 * trie node whose prefix the grammar allows, and a state seen before costs
 * nothing (its mask is cached).
 *
 * No maintained C library with a Debian package does this (Debian 12 has
 * none: llguidance, XGrammar and Outlines are Rust, C++ and Python and are
 * not packaged), so ragkv has its own.
 *
 * Thread-safety: rk_grammar and rk_grammar_vocab are immutable once built and
 * may be shared by any number of threads; an rk_grammar_state belongs to one
 * request and is used by one thread at a time.
 * Ownership: every object is created by its *_create / compile function and
 * released by the matching *_free, which accepts NULL. A state keeps pointers
 * to its grammar and vocabulary, which must outlive it. */
#ifndef RK_GRAMMAR_H
#define RK_GRAMMAR_H

#include <jansson.h>
#include <stdint.h>

#include "config/config.h"
#include "engine/tokenizer.h"

/* Bounds on what a grammar may cost, checked where it is compiled (on the
 * HTTP worker) and again by every state, so that no grammar holds the engine
 * thread for long: a bound that is hit fails with RK_ERR_LIMIT and a message
 * naming it. Rules count after repetitions are expanded; a state's width is
 * the stacks it holds (the alternatives alive at one point of the output). */
#define RK_GRAMMAR_MAX_RULES      65536
#define RK_GRAMMAR_MAX_ELEMS      1048576
#define RK_GRAMMAR_MAX_STATES     65536
#define RK_GRAMMAR_MAX_WIDTH      4096
#define RK_GRAMMAR_MAX_COMPILE_MS 1000

typedef struct rk_grammar rk_grammar;             /* compiled rules (immutable) */
typedef struct rk_grammar_vocab rk_grammar_vocab; /* a tokenizer's byte trie (immutable) */
typedef struct rk_grammar_state rk_grammar_state; /* one request's position */

/* Compile a grammar text (GBNF-like, see docs/api.md; the start rule is
 * `root`). Errors (RK_ERR_INVALID) give the line and what is wrong; a
 * grammar over a bound (rules, elements, RK_GRAMMAR_MAX_COMPILE_MS of
 * compiling, counted in the calling thread's CPU time) gives RK_ERR_LIMIT
 * naming it. */
rk_status rk_grammar_parse(const char *text, rk_grammar **out);

/* rk_grammar_parse with a bound of max_ms milliseconds of compiling. */
rk_status rk_grammar_parse_within(const char *text, double max_ms, rk_grammar **out);

/* Appends to o the grammar text's literal for the n bytes of s (printable
 * ASCII as is, the rest \xHH), for grammars written by program. */
void rk_grammar_literal(rk_strbuf *o, const char *s, size_t n);

/* Take one more reference to g (compiled grammars are shared by the
 * requests that ask for the same one); rk_grammar_free drops one. Returns g. */
rk_grammar *rk_grammar_ref(rk_grammar *g);

/* Compile a JSON Schema. A schema outside the supported subset, or an invalid
 * one, gives RK_ERR_INVALID (outside: RK_ERR_UNSUPPORTED) with a message that
 * starts with the JSON path of the part that cannot be enforced, for example
 * "$.properties.age.format: ...". */
rk_status rk_grammar_from_schema(const json_t *schema, rk_grammar **out);

/* One function call a grammar allows: literal text, the arguments (a JSON
 * value matching schema, or any JSON object when schema is NULL), literal
 * text. path names the schema in errors ("$.tools[0].function.parameters"). */
typedef struct rk_grammar_call {
    const char *open;
    const json_t *schema;
    const char *close;
    const char *path;
} rk_grammar_call;

/* The grammar of one of n calls, or, when sep is not NULL, of one or more of
 * them separated by sep (parallel tool calls). Errors as for schemas. */
rk_status rk_grammar_from_calls(const rk_grammar_call *calls, int n, const char *sep,
                                rk_grammar **out);

/* The grammar of any JSON object (response_format {"type":"json_object"}). */
rk_status rk_grammar_json_object(rk_grammar **out);

/* Drop a reference; the last one frees the grammar. */
void rk_grammar_free(rk_grammar *g);

/* A cache of compiled grammars by content (thread-safe): a repeated grammar
 * text, schema or tool set is compiled once while it stays among the
 * capacity most recently used. Failures are not cached. */
typedef struct rk_grammar_cache rk_grammar_cache;
rk_status rk_grammar_cache_create(int capacity, rk_grammar_cache **out);
void rk_grammar_cache_free(rk_grammar_cache *c);

/* rk_grammar_parse, rk_grammar_from_schema and rk_grammar_json_object
 * through cache c (NULL: no cache). *out is a reference the caller frees. */
rk_status rk_grammar_cache_parse(rk_grammar_cache *c, const char *text, rk_grammar **out);
rk_status rk_grammar_cache_schema(rk_grammar_cache *c, const json_t *schema, rk_grammar **out);
rk_status rk_grammar_cache_json_object(rk_grammar_cache *c, rk_grammar **out);

/* Compilations the cache answered, and those it did not (hits, misses). */
void rk_grammar_cache_counts(rk_grammar_cache *c, int64_t *hits, int64_t *misses);

/* The grammar text a schema compiles to (malloc'ed, the caller frees), for
 * tests and diagnostics; NULL with the error set on failure. */
char *rk_grammar_schema_text(const json_t *schema);

/* Build a tokenizer's byte trie: every token's decoded bytes (special tokens
 * and tokens that decode to nothing are never allowed as text; the
 * end-of-generation tokens are allowed where the grammar may end). */
rk_status rk_grammar_vocab_create(const rk_tokenizer *t, rk_grammar_vocab **out);
void rk_grammar_vocab_free(rk_grammar_vocab *v);
int32_t rk_grammar_vocab_n(const rk_grammar_vocab *v);

/* A fresh state at the start of the grammar. A grammar whose first state is
 * over a bound gives RK_ERR_LIMIT naming it. */
rk_status rk_grammar_state_create(const rk_grammar *g, const rk_grammar_vocab *v,
                                  rk_grammar_state **out);

/* Back to the start of the grammar (what it learnt, its states and masks,
 * is kept: they are the same grammar's). */
void rk_grammar_state_reset(rk_grammar_state *s);
void rk_grammar_state_free(rk_grammar_state *s);

/* The tokens allowed next: a bitset of rk_grammar_vocab_n bits (bit i of word
 * i / 64), owned by the state and valid until the next call on it. Fails
 * (RK_ERR_LIMIT, naming the bound) only when the state's automaton outgrows
 * one of the bounds above. */
rk_status rk_grammar_state_mask(rk_grammar_state *s, const uint64_t **mask);

/* Fewest bytes that would finish the output from here (0 where it may end). */
int rk_grammar_state_min_bytes(rk_grammar_state *s);

/* The tokens allowed next that leave the output finishable within budget
 * more bytes (so within budget more tokens, every token being at least one
 * byte): what a request near its max_tokens samples from, so that it closes
 * its JSON instead of being cut. Not cached; a bitset owned by the state,
 * valid until the next call; *n_allowed counts its tokens (0: none can). */
rk_status rk_grammar_state_mask_budget(rk_grammar_state *s, int budget, const uint64_t **mask,
                                       int *n_allowed);

/* Advance by a token. A token the mask does not allow gives RK_ERR_INVALID
 * and leaves the state as it was. An end-of-generation token where the
 * grammar may end marks the state finished. */
rk_status rk_grammar_state_accept(rk_grammar_state *s, int32_t token);

/* Advance by raw bytes (tests and prompts the caller writes itself). */
rk_status rk_grammar_state_accept_bytes(rk_grammar_state *s, const char *bytes, int n);

/* May the output end here (is what was accepted a whole sentence)? */
int rk_grammar_state_can_end(const rk_grammar_state *s);

/* Is no byte allowed any more (the grammar must end here)? */
int rk_grammar_state_must_end(const rk_grammar_state *s);

/* Automaton size, for benchmarks: states interned so far. */
int rk_grammar_state_n_states(const rk_grammar_state *s);

/* Transitions computed so far (each expands a state's stacks by one byte;
 * bytes that the state's classes do not tell apart share one), for
 * benchmarks and tests. */
int64_t rk_grammar_state_n_steps(const rk_grammar_state *s);

#endif
