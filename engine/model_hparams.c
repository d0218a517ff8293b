/* engine/model_hparams.c — a model's hyper-parameters read from GGUF
 * metadata and checked: shapes, attention kinds and windows, RoPE (with its
 * scaling and per-frequency factors), experts. The family's description
 * (arch.h) says which keys a file must have. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model_internal.h"

static rk_status get_u32_arch(rk_model *m, const char *suffix, uint32_t def, int required,
                              int *out) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", m->hp.arch_name, suffix);
    uint32_t v;
    rk_status st = rk_gguf_get_u32(m->gguf, key, &v);
    if (st == RK_ERR_NOT_FOUND) {
        if (required) return rk_errorf(RK_ERR_FORMAT, "model: metadata key %s is missing", key);
        v = def;
    } else if (st) {
        return st;
    }
    if (v > (1u << 30)) return rk_errorf(RK_ERR_FORMAT, "model: %s = %u is out of range", key, v);
    *out = (int)v;
    return RK_OK;
}

/* A u32 key that may also be a per-layer array (n_layers entries), as the
 * reference engine reads feed_forward_length and head_count_kv: *out the
 * largest entry, *per_layer (when not NULL) a malloc'ed copy of the array
 * or NULL for a scalar; an array where per_layer is NULL must hold one
 * value. */
static rk_status get_u32_or_arr(rk_model *m, const char *suffix, uint32_t def, int required,
                                int *out, int **per_layer) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", m->hp.arch_name, suffix);
    int64_t i = rk_gguf_find_key(m->gguf, key);
    if (per_layer) *per_layer = NULL;
    if (i < 0 || rk_gguf_kv_type(m->gguf, i) != RK_GGUF_ARRAY)
        return get_u32_arch(m, suffix, def, required, out);
    int32_t *a;
    size_t n;
    rk_status st = rk_gguf_get_arr_i32(m->gguf, key, &a, &n);
    if (st) return st;
    if ((int64_t)n != m->hp.n_layers) {
        free(a);
        return rk_errorf(RK_ERR_FORMAT, "model: %s has %zu entries for %d layers", key, n,
                         m->hp.n_layers);
    }
    int max = 0;
    for (size_t j = 0; j < n; j++) {
        if (a[j] < 1 || a[j] > (1 << 30) || (!per_layer && a[j] != a[0])) {
            free(a);
            return rk_errorf(RK_ERR_UNSUPPORTED, "model: %s[%zu] = %d %s", key, j, a[j],
                             per_layer ? "is out of range"
                                       : "differs from layer 0's (ragkv computes one value for "
                                         "every layer)");
        }
        max = a[j] > max ? a[j] : max;
    }
    *out = max;
    if (per_layer)
        *per_layer = a;
    else
        free(a);
    return RK_OK;
}

/* An optional float key: def when absent, an error when stored with another type. */
static rk_status get_f32_arch(rk_model *m, const char *suffix, float def, float *out) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", m->hp.arch_name, suffix);
    rk_status st = rk_gguf_get_f32(m->gguf, key, out);
    if (st == RK_ERR_NOT_FOUND) *out = def;
    return st == RK_ERR_NOT_FOUND ? RK_OK : st;
}

/* A float hyper-parameter that must be finite and > 0 (NaN fails the compare). */
static rk_status check_positive(const rk_model *m, const char *suffix, float v) {
    if (v > 0 && isfinite(v)) return RK_OK;
    return rk_errorf(RK_ERR_FORMAT, "model: %s.%s = %g is invalid (must be finite and > 0)",
                     m->hp.arch_name, suffix, v);
}

/* The attention's scale, sliding window, soft caps and the sliding layers'
 * RoPE, as the family (arch.h) and the file say; checked. */
static rk_status read_attn(rk_model *m) {
    rk_hparams *hp = &m->hp;
    const rk_arch_desc *d = hp->desc;
    rk_status st;
    hp->attn_scale = d->attn_unscaled ? 1.0f : 1.0f / sqrtf((float)hp->head_dim);
    if (d->scale_dim_layers > 0 && hp->n_layers == d->scale_dim_layers)
        hp->attn_scale = 1.0f / sqrtf((float)(hp->dim / hp->n_heads));
    hp->sliding_window = hp->swa_period = 0;
    /* with the pattern as a per-layer array (rk_gemma4_read_hparams), the window is required */
    if (d->swa_period > 0 &&
        ((st = get_u32_arch(m, "attention.sliding_window", (uint32_t)d->swa_default_window,
                            d->swa_pattern_arr, &hp->sliding_window)) ||
         (!d->swa_pattern_arr && (st = get_u32_arch(m, "attention.sliding_window_pattern",
                                                    (uint32_t)d->swa_period, 0, &hp->swa_period)))))
        return st;
    hp->attn_softcap = hp->final_softcap = 0.0f;
    if (d->attn_softcap > 0 &&
        ((st = get_f32_arch(m, "attn_logit_softcapping", d->attn_softcap, &hp->attn_softcap)) ||
         (st = check_positive(m, "attn_logit_softcapping", hp->attn_softcap))))
        return st;
    if (d->final_softcap_key &&
        ((st = get_f32_arch(m, "final_logit_softcapping", d->final_softcap, &hp->final_softcap)) ||
         (hp->final_softcap != 0.0f &&
          (st = check_positive(m, "final_logit_softcapping", hp->final_softcap)))))
        return st;
    hp->rope_swa = hp->rope;
    if (d->swa_local_rope) {
        hp->rope_swa.theta = 10000.0f;
        hp->rope_swa.scaling = RK_ROPE_SCALING_NONE;
        hp->rope_swa.factor = 1.0f;
    }
    if ((st = get_f32_arch(m, "rope.freq_base_swa", hp->rope_swa.theta, &hp->rope_swa.theta)) ||
        (st = check_positive(m, "rope.freq_base_swa", hp->rope_swa.theta)))
        return st;
    return rk_rope_init(&m->rope_swa, &hp->rope_swa);
}

/* The RoPE parameters (hp's head_dim and context known), checked. */
static rk_status read_rope(rk_model *m) {
    rk_hparams *hp = &m->hp;
    const char *arch = hp->arch_name;
    rk_status st;
    char key[128];
    rk_rope_params *rp = &hp->rope;
    memset(rp, 0, sizeof *rp);
    if ((st = get_u32_arch(m, "rope.dimension_count", (uint32_t)hp->head_dim, 0, &rp->n_rot)))
        return st;
    if (rp->n_rot < 2 || rp->n_rot > hp->head_dim || rp->n_rot % 2)
        return rk_errorf(RK_ERR_FORMAT,
                         "model: %s.rope.dimension_count = %d is invalid (even, 2..head_dim %d)",
                         arch, rp->n_rot, hp->head_dim);
    if ((st = get_f32_arch(m, "rope.freq_base", 10000.0f, &rp->theta)) ||
        (st = check_positive(m, "rope.freq_base", rp->theta)))
        return st;
    rp->pairing = hp->desc->rope_neox ? RK_ROPE_NEOX : RK_ROPE_NORMAL;
    if ((st = get_f32_arch(m, "rope.scaling.factor", 1.0f, &rp->factor))) return st;
    int orig;
    if ((st = get_u32_arch(m, "rope.scaling.original_context_length", (uint32_t)hp->n_ctx, 0,
                           &orig)))
        return st;
    rp->orig_ctx = orig;
    if ((st = get_f32_arch(m, "rope.scaling.yarn_beta_fast", 32.0f, &rp->beta_fast)) ||
        (st = get_f32_arch(m, "rope.scaling.yarn_beta_slow", 1.0f, &rp->beta_slow)) ||
        (st = get_f32_arch(m, "rope.scaling.low_freq_factor", 1.0f, &rp->low_freq_factor)) ||
        (st = get_f32_arch(m, "rope.scaling.high_freq_factor", 4.0f, &rp->high_freq_factor)))
        return st;
    const char *stype = "none";
    snprintf(key, sizeof key, "%s.rope.scaling.type", hp->arch_name);
    rk_gguf_get_str(m->gguf, key, &stype, NULL);
    if (!strcmp(stype, "none"))
        rp->scaling = RK_ROPE_SCALING_NONE;
    else if (!strcmp(stype, "linear"))
        rp->scaling = RK_ROPE_SCALING_LINEAR;
    else if (!strcmp(stype, "yarn"))
        rp->scaling = RK_ROPE_SCALING_YARN;
    else if (!strcmp(stype, "llama3"))
        rp->scaling = RK_ROPE_SCALING_LLAMA3;
    else
        return rk_errorf(RK_ERR_UNSUPPORTED, "model: rope scaling \"%s\" not supported", stype);
    if (rp->scaling != RK_ROPE_SCALING_NONE &&
        (st = check_positive(m, "rope.scaling.factor", rp->factor)))
        return st;
    return rk_rope_init(&m->rope, rp);
}

/* The expert counts of a mixture-of-experts family, checked; ffn_dim
 * (feed_forward_length, optional for these families) defaults to the width
 * of the experts a token uses, as the reference engine takes it. */
static rk_status read_experts(rk_model *m) {
    rk_hparams *hp = &m->hp;
    if (!hp->desc->moe) return RK_OK;
    rk_status st;
    if ((st = get_u32_arch(m, "expert_count", 0, 1, &hp->n_expert)) ||
        (st = get_u32_arch(m, "expert_used_count", 0, 1, &hp->n_expert_used)) ||
        (st = get_u32_arch(m, "expert_feed_forward_length", 0, 1, &hp->ffn_exp)))
        return st;
    if (hp->n_expert < 1 || hp->n_expert > 4096 || hp->n_expert_used < 1 ||
        hp->n_expert_used > hp->n_expert || hp->ffn_exp < 1)
        return rk_errorf(RK_ERR_FORMAT,
                         "model: %s.expert_count %d, expert_used_count %d, "
                         "expert_feed_forward_length %d are inconsistent",
                         hp->arch_name, hp->n_expert, hp->n_expert_used, hp->ffn_exp);
    if (hp->ffn_dim == 0) hp->ffn_dim = hp->ffn_exp * hp->n_expert_used;
    if (hp->desc->act != RK_FFN_SILU && hp->desc->act != RK_FFN_SWIGLU_OAI)
        return rk_errorf(RK_ERR_UNSUPPORTED, "model: %s: experts with a GELU gate", hp->arch_name);
    if (strcmp(m->be->name, "cpu") != 0)
        return rk_errorf(RK_ERR_UNSUPPORTED,
                         "model: %s is a mixture of experts, which the %s backend does not "
                         "compute (cpu only)",
                         hp->arch_name, m->be->name);
    return RK_OK;
}

rk_status rk_model_read_hparams(rk_model *m) {
    rk_hparams *hp = &m->hp;
    const char *arch;
    rk_status st = rk_gguf_get_str(m->gguf, "general.architecture", &arch, NULL);
    if (st) return rk_errorf(RK_ERR_FORMAT, "model: general.architecture is missing");
    if (!(hp->desc = rk_arch_find(arch))) {
        const char *why = rk_arch_refusal(arch);
        if (why)
            return rk_errorf(RK_ERR_UNSUPPORTED, "model: architecture \"%s\" is refused: %s", arch,
                             why);
        char names[128];
        rk_arch_names(names, sizeof names);
        return rk_errorf(RK_ERR_UNSUPPORTED, "model: architecture \"%s\" is not supported (%s)",
                         arch, names);
    }
    snprintf(hp->arch_name, sizeof hp->arch_name, "%s", arch);
    const char *name;
    if (rk_gguf_get_str(m->gguf, "general.name", &name, NULL) == RK_OK)
        snprintf(hp->name, sizeof hp->name, "%s", name);

    if ((st = get_u32_arch(m, "block_count", 0, 1, &hp->n_layers)) ||
        (st = get_u32_arch(m, "embedding_length", 0, 1, &hp->dim)) ||
        (st = get_u32_or_arr(m, "feed_forward_length", 0, !hp->desc->moe, &hp->ffn_dim,
                             &m->ffn_of)) ||
        (st = get_u32_arch(m, "attention.head_count", 0, 1, &hp->n_heads)) ||
        (st = get_u32_or_arr(m, "attention.head_count_kv", (uint32_t)hp->n_heads, 0,
                             &hp->n_kv_heads, NULL)) ||
        (st = get_u32_arch(m, "context_length", 2048, 0, &hp->n_ctx)))
        return st;
    if ((st = read_experts(m))) return st;
    if (hp->n_layers < 1 || hp->dim < 1 || hp->ffn_dim < 1 || hp->n_heads < 1 || hp->n_kv_heads < 1)
        return rk_errorf(RK_ERR_FORMAT,
                         "model: inconsistent shape (%d layers, dim %d, ffn %d, %d heads, %d kv)",
                         hp->n_layers, hp->dim, hp->ffn_dim, hp->n_heads, hp->n_kv_heads);
    if (hp->n_heads % hp->n_kv_heads)
        return rk_errorf(RK_ERR_FORMAT,
                         "model: %s.attention.head_count %d is not a multiple of "
                         "%s.attention.head_count_kv %d",
                         arch, hp->n_heads, arch, hp->n_kv_heads);
    /* A position needs at least one earlier one to attend to: 0 or 1 is a broken file. */
    if (hp->n_ctx < 2)
        return rk_errorf(RK_ERR_FORMAT, "model: %s.context_length = %d is invalid (must be >= 2)",
                         arch, hp->n_ctx);
    char key[128];
    snprintf(key, sizeof key, "%s.attention.key_length", arch);
    if (rk_gguf_find_key(m->gguf, key) < 0 && hp->dim % hp->n_heads)
        return rk_errorf(RK_ERR_FORMAT,
                         "model: %s.embedding_length %d is not a multiple of "
                         "%s.attention.head_count %d (and %s is absent)",
                         arch, hp->dim, arch, hp->n_heads, key);
    if ((st = get_u32_arch(m, "attention.key_length", (uint32_t)(hp->dim / hp->n_heads), 0,
                           &hp->head_dim)))
        return st;
    int vlen;
    if ((st = get_u32_arch(m, "attention.value_length", (uint32_t)hp->head_dim, 0, &vlen)))
        return st;
    if (vlen != hp->head_dim || hp->head_dim < 2 || hp->head_dim > 2 * RK_ROPE_MAX_PAIRS)
        return rk_errorf(RK_ERR_UNSUPPORTED, "model: head_dim %d / value_length %d not supported",
                         hp->head_dim, vlen);
    if ((st = get_f32_arch(m, "attention.layer_norm_rms_epsilon", 1e-5f, &hp->rms_eps)) ||
        (st = check_positive(m, "attention.layer_norm_rms_epsilon", hp->rms_eps)))
        return st;
    char pkey[64];
    snprintf(pkey, sizeof pkey, "%s.pooling_type", arch);
    uint32_t pooling;
    st = rk_gguf_get_u32(m->gguf, pkey, &pooling);
    if (st == RK_ERR_NOT_FOUND) {
        hp->pooling = RK_POOLING_UNSET;
    } else if (st) {
        return st;
    } else if (pooling > RK_POOLING_RANK) {
        return rk_errorf(RK_ERR_FORMAT,
                         "model: %s = %u is not 0 (none), 1 (mean), 2 (cls), 3 (last) or 4 (rank)",
                         pkey, pooling);
    } else {
        hp->pooling = (rk_pooling)pooling;
    }
    hp->n_kv_layers = hp->n_layers;
    if ((st = read_rope(m)) || (st = read_attn(m))) return st;
    const rk_arch_desc *d = hp->desc;
    return d->swa_pattern_arr || d->shared_kv || d->per_layer_embd ? rk_gemma4_read_hparams(m)
                                                                   : RK_OK;
}

/* Whether layer l slides (the reference engine's pattern): with a window,
 * every layer but each swa_period-th (l % period == period - 1), or every
 * layer for a period of 0 (a file's explicit pattern). */
int rk_model_layer_slides(const rk_hparams *hp, int l) {
    if (hp->sliding_window <= 0) return 0;
    if (hp->swa_period == 0) return 1;
    return l % hp->swa_period < hp->swa_period - 1;
}

int rk_model_slides(const rk_model *m, int l) {
    if (m->slides) return m->hp.sliding_window > 0 && m->slides[l];
    return rk_model_layer_slides(&m->hp, l);
}

/* Per-frequency divisors of the RoPE frequencies, where the file has them:
 * llama 3 files in rope_freqs.weight; LongRoPE files (phi3) in
 * rope_factors_short.weight and rope_factors_long.weight, the long ones for
 * a context longer than the original one. ragkv serves up to the file's
 * context_length, so a file whose context exceeds its original one computes
 * with the long factors, as the reference engine does at that context. The
 * rotation is also scaled by rope.scaling.attn_factor where present. */
rk_status rk_model_apply_rope_freqs(rk_model *m) {
    const rk_hparams *hp = &m->hp;
    const char *name = "rope_freqs.weight";
    if (!rk_gguf_find_tensor(m->gguf, name))
        name = hp->n_ctx > hp->rope.orig_ctx ? "rope_factors_long.weight"
                                             : "rope_factors_short.weight";
    float attn_factor;
    rk_status st = get_f32_arch(m, "rope.scaling.attn_factor", 1.0f, &attn_factor);
    if (st || (st = check_positive(m, "rope.scaling.attn_factor", attn_factor))) return st;
    m->rope.mscale *= attn_factor;
    const rk_gguf_tensor *t = rk_gguf_find_tensor(m->gguf, name);
    if (!t) return RK_OK;
    int n = m->rope.n_rot / 2;
    if (t->type != RK_GGML_F32 || t->ne[0] != n || t->ne[1] != 1)
        return rk_errorf(RK_ERR_FORMAT, "model: %s should be F32 {%d}", name, n);
    const float *f = t->data;
    for (int i = 0; i < n; i++) {
        if (!(f[i] > 0)) return rk_errorf(RK_ERR_FORMAT, "model: %s[%d] <= 0", name, i);
        m->rope.freq[i] /= f[i];
    }
    return RK_OK;
}
