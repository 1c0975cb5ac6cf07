/* fs_layers_forward(_groups, _x): a stack of decoder layers on n rows in one call, so Python pays one call per stage
 * forward instead of a dispatch per op; the rows may belong to several requests (groups), each with its own KV cache
 * and mask: the matmuls run over all rows at once, the attention per group.
 *
 * Per layer (h: the normed input, a: its int16 quantization, shared by the matmuls that read it; [..] where the
 * layer's fs_layer_x has it: Qwen3 / Gemma 3 QK-norm, Gemma 3's norms after attention and MLP, sliding windows):
 *   h = rmsnorm(x, attn_norm) (or x)      q, k, v = h @ Wq^T (+bq) ...   [q, k = rmsnorm per head]
 *   rope(q), rope(k) at pos (the layer's tables)                         cache[start + r] = k, v
 *   att = softmax(q k^T * scale, visible slots [the last `window` of them]) v
 *   o = att @ Wo^T, x += o [rmsnorm(o)]   h = rmsnorm(x, mlp_norm)
 *   g, u = h @ Wg^T, h @ Wu^T             d = (act(g) * u) @ Wd^T, x += d [rmsnorm(d)]    act: SiLU or tanh-GELU
 * Everything a row computes depends only on that row, its group's cache and the keys visible to it, in slot order,
 * so a row's result is the same alone or in any batch, with any other requests' rows (batch invariance); the matmuls and the attention run on the
 * pool (panels; (row, head) pairs), the cheap per-row steps on the pool only when there are enough rows. */
#include <math.h>

#include "fs_internal.h"

#define FS_ROWS_PARALLEL 16384 /* elements: below this a per-row step runs on the calling thread */

typedef struct stack {
    const fs_config *c;
    const fs_isa_impl *isa;
    int64_t n, qdim, kvdim;
    float *x, *h, *q, *k, *v, *att, *out, *g, *u;
    fs_act a, b; /* a: h quantized (hidden columns); b: att or silu(g)*u quantized */
    const int32_t *pos;
    const float *cos, *sin;    /* the current layer's rotary tables */
    const fs_layer *L;
    const fs_layer_x *X;       /* its extras (all NULL / 0 for a Llama layer) */
    const fs_arch *arch;
    int layer;                 /* the index of L */
    const fs_group *groups;    /* the requests' row ranges, caches and masks */
    int n_groups;
    const int32_t *row_group;  /* [n]: the group of each row */
    const float *norm; /* the norm of the current step (NULL: none) */
    int quantize;      /* whether the current step quantizes */
} stack;

static void run_rows(stack *s, fs_job_fn fn, int64_t width) {
    if (s->n * width >= FS_ROWS_PARALLEL)
        fs_pool_run(fn, s, s->n);
    else
        for (int64_t r = 0; r < s->n; r++) fn(s, r, 0);
}

static int is_int(const fs_matrix *m) { return !fs_traits_of(m->type)->is_float; }

/* h = rmsnorm(x) and its quantization, row r */
static void norm_row(void *ctx, int64_t r, int thread) {
    stack *s = ctx;
    const int64_t dim = s->c->hidden;
    (void)thread;
    const float *src = s->x + r * dim;
    if (s->norm) {
        s->isa->rmsnorm_row(src, s->norm, dim, s->c->eps, s->h + r * dim);
        src = s->h + r * dim;
    }
    if (s->quantize) s->isa->quantize_row(src, r, &s->a);
}

static void rope(float *x, const float *cos, const float *sin, int hd) {
    const int half = hd / 2;
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + -b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

static void add_bias(float *x, const float *bias, int64_t n) {
    if (bias)
        for (int64_t i = 0; i < n; i++) x[i] = x[i] + bias[i];
}

/* group g's cache of the current layer: [kv_heads][capacity][hd] */
static float *layer_cache(const stack *s, const fs_group *g, float *base) {
    return base + (int64_t)s->layer * s->c->kv_heads * g->capacity * s->c->head_dim;
}

/* biases, rotary embedding and the cache write of row r */
static void qk_row(void *ctx, int64_t r, int thread) {
    stack *s = ctx;
    const int hd = s->c->head_dim;
    const fs_group *g = &s->groups[s->row_group[r]];
    float *kc = layer_cache(s, g, g->k_cache), *vc = layer_cache(s, g, g->v_cache);
    const float *cos = s->cos + (int64_t)s->pos[r] * hd, *sin = s->sin + (int64_t)s->pos[r] * hd;
    float *q = s->q + r * s->qdim, *k = s->k + r * s->kvdim, *v = s->v + r * s->kvdim;
    (void)thread;
    add_bias(q, s->L->q_bias, s->qdim);
    add_bias(k, s->L->k_bias, s->kvdim);
    add_bias(v, s->L->v_bias, s->kvdim);
    for (int h = 0; h < s->c->q_heads; h++) {
        if (s->X->q_norm) s->isa->rmsnorm_row(q + h * hd, s->X->q_norm, hd, s->c->eps, q + h * hd);
        rope(q + h * hd, cos, sin, hd);
    }
    for (int h = 0; h < s->c->kv_heads; h++) {
        if (s->X->k_norm) s->isa->rmsnorm_row(k + h * hd, s->X->k_norm, hd, s->c->eps, k + h * hd);
        rope(k + h * hd, cos, sin, hd);
        const int64_t slot = (h * g->capacity + g->start + r - g->row0) * hd;
        memcpy(kc + slot, k + h * hd, (size_t)hd * sizeof(float));
        memcpy(vc + slot, v + h * hd, (size_t)hd * sizeof(float));
    }
}

typedef struct attn_job {
    const fs_attn *at;
    const fs_isa_impl *isa;
} attn_job;

static void attn_item(void *ctx, int64_t i, int thread) {
    const attn_job *j = ctx;
    const int kv_heads = j->at->q_heads / j->at->group;
    const int64_t r0 = i / kv_heads * FS_ATT_ROWS, r1 = r0 + FS_ATT_ROWS < j->at->n ? r0 + FS_ATT_ROWS : j->at->n;
    j->isa->attend(j->at, (int)(i % kv_heads), r0, r1, thread);
}

static void quantize_att_row(void *ctx, int64_t r, int thread) {
    stack *s = ctx;
    (void)thread;
    s->isa->quantize_row(s->att + r * s->qdim, r, &s->b);
}

static void act_row(void *ctx, int64_t r, int thread) {
    stack *s = ctx;
    const int64_t inter = s->c->intermediate;
    (void)thread;
    if (s->arch->act == FS_ACT_GELU_TANH)
        s->isa->gelu_mul(s->g + r * inter, s->u + r * inter, inter);
    else
        s->isa->silu_mul(s->g + r * inter, s->u + r * inter, inter);
    if (s->quantize) s->isa->quantize_row(s->g + r * inter, r, &s->b);
}

/* out = rmsnorm(out, norm), row r (Gemma's norm of a block's output before the residual add) */
static void post_norm_row(void *ctx, int64_t r, int thread) {
    stack *s = ctx;
    float *o = s->out + r * s->c->hidden;
    (void)thread;
    s->isa->rmsnorm_row(o, s->norm, s->c->hidden, s->c->eps, o);
}

/* x += out, after out's norm where the layer has one */
static void residual(stack *s, const float *norm) {
    if (norm) {
        s->norm = norm;
        run_rows(s, post_norm_row, s->c->hidden);
    }
    const int64_t count = s->n * s->c->hidden;
    for (int64_t i = 0; i < count; i++) s->x[i] = s->x[i] + s->out[i];
}

static fs_mm mm_of(const fs_matrix *w, const fs_act *a, const float *x, int64_t ldx, float *y, int64_t n) {
    return (fs_mm){w->type, w->rows, w->cols, n, w->data, is_int(w) ? a : NULL, x, ldx, y, w->rows};
}

/* each group's rows against its own cache, one pool dispatch per group */
static void attention(stack *s, float *scratch, int64_t ld_scores) {
    const fs_config *c = s->c;
    const int group = c->q_heads / c->kv_heads;
    for (int gi = 0; gi < s->n_groups; gi++) {
        const fs_group *g = &s->groups[gi];
        const fs_attn at = {s->q + g->row0 * s->qdim, layer_cache(s, g, g->k_cache), layer_cache(s, g, g->v_cache),
                            g->mask, s->att + g->row0 * s->qdim, scratch, g->capacity, g->start, g->n, ld_scores,
                            fs_attn_scratch(group, c->head_dim, ld_scores), s->X->window, c->q_heads, group,
                            c->head_dim, s->arch->attn_scale > 0 ? s->arch->attn_scale
                                                                 : 1.0f / sqrtf((float)c->head_dim)};
        attn_job job = {&at, s->isa};
        fs_pool_run(attn_item, &job, (g->n + FS_ATT_ROWS - 1) / FS_ATT_ROWS * c->kv_heads);
    }
}

static void layer(stack *s, float *scores, int64_t ld_scores) {
    const fs_config *c = s->c;
    const fs_layer *L = s->L;
    const int64_t hidden = c->hidden, n = s->n;
    /* attention block */
    s->norm = L->attn_norm;
    s->quantize = is_int(&L->q) || is_int(&L->k) || is_int(&L->v);
    if (s->norm || s->quantize) run_rows(s, norm_row, hidden);
    const float *hin = L->attn_norm ? s->h : s->x;
    const fs_mm qkv[3] = {mm_of(&L->q, &s->a, hin, hidden, s->q, n), mm_of(&L->k, &s->a, hin, hidden, s->k, n),
                          mm_of(&L->v, &s->a, hin, hidden, s->v, n)};
    fs_run_matmuls(qkv, 3);
    run_rows(s, qk_row, s->qdim);
    attention(s, scores, ld_scores);
    s->b.cols = s->qdim;
    if (is_int(&L->o)) run_rows(s, quantize_att_row, s->qdim);
    const fs_mm o = mm_of(&L->o, &s->b, s->att, s->qdim, s->out, n);
    fs_run_matmuls(&o, 1);
    residual(s, s->X->post_attn_norm);
    /* MLP block */
    s->norm = L->mlp_norm;
    s->quantize = is_int(&L->gate) || is_int(&L->up);
    run_rows(s, norm_row, hidden);
    const fs_mm gu[2] = {mm_of(&L->gate, &s->a, s->h, hidden, s->g, n),
                         mm_of(&L->up, &s->a, s->h, hidden, s->u, n)};
    fs_run_matmuls(gu, 2);
    s->quantize = is_int(&L->down);
    s->b.cols = c->intermediate;
    run_rows(s, act_row, c->intermediate);
    const fs_mm down = mm_of(&L->down, &s->b, s->g, c->intermediate, s->out, n);
    fs_run_matmuls(&down, 1);
    residual(s, s->X->post_mlp_norm);
}

static int matrix_ok(const fs_matrix *m, int64_t rows, int64_t cols) {
    return m->data != NULL && m->rows == rows && m->cols == cols && fs_packed_size(m->type, rows, cols) >= 0;
}

static int check(const fs_config *c, const fs_layer *layers, int n_layers) {
    if (c->hidden <= 0 || c->q_heads <= 0 || c->kv_heads <= 0 || c->head_dim <= 0 || c->head_dim % 2 ||
        c->intermediate <= 0 || c->q_heads % c->kv_heads)
        return FS_ESHAPE;
    const int64_t qdim = (int64_t)c->q_heads * c->head_dim, kvdim = (int64_t)c->kv_heads * c->head_dim;
    for (int l = 0; l < n_layers; l++) {
        const fs_layer *L = &layers[l];
        if (!matrix_ok(&L->q, qdim, c->hidden) || !matrix_ok(&L->k, kvdim, c->hidden) ||
            !matrix_ok(&L->v, kvdim, c->hidden) || !matrix_ok(&L->o, c->hidden, qdim) ||
            !matrix_ok(&L->gate, c->intermediate, c->hidden) || !matrix_ok(&L->up, c->intermediate, c->hidden) ||
            !matrix_ok(&L->down, c->hidden, c->intermediate) || L->mlp_norm == NULL)
            return FS_ESHAPE;
    }
    return FS_OK;
}

/* Points the stack's buffers into scratch; FS_ENOMEM when one can't be had. */
static int buffers(stack *s, float **scores, int64_t ld_scores) {
    const fs_config *c = s->c;
    const int64_t n = s->n, inter = c->intermediate, qcols = s->qdim > inter ? s->qdim : inter;
#define F(id, count) ((float *)fs_scratch((id), (size_t)(count) * sizeof(float)))
    s->h = F(FS_S_NORM, n * c->hidden);
    s->q = F(FS_S_Q, n * s->qdim);
    s->k = F(FS_S_K, n * s->kvdim);
    s->v = F(FS_S_V, n * s->kvdim);
    s->att = F(FS_S_ATT, n * s->qdim);
    s->out = F(FS_S_OUT, n * c->hidden);
    s->g = F(FS_S_G, n * inter);
    s->u = F(FS_S_U, n * inter);
    *scores = F(FS_S_SCORES, fs_attn_scratch(c->q_heads / c->kv_heads, c->head_dim, ld_scores) * fs_pool_threads());
#undef F
    if (!s->h || !s->q || !s->k || !s->v || !s->att || !s->out || !s->g || !s->u || !*scores) return FS_ENOMEM;
    if (fs_act_alloc(&s->a, FS_S_ACT, n, c->hidden % FS_QB ? 0 : c->hidden) != FS_OK) return FS_ENOMEM;
    return fs_act_alloc(&s->b, FS_S_ACT2, n, qcols % FS_QB ? 0 : qcols);
}

/* groups cover [0, n) in order, each inside its cache; -> the widest start + n (the scores' row length) or < 0 */
static int64_t check_groups(const fs_group *groups, int n_groups, int64_t n) {
    int64_t row = 0, widest = 0;
    for (int i = 0; i < n_groups; i++) {
        const fs_group *g = &groups[i];
        if (g->row0 != row || g->n < 1 || g->start < 0 || g->start + g->n > g->capacity || !g->k_cache ||
            !g->v_cache)
            return FS_EINVAL;
        row += g->n;
        if (g->start + g->n > widest) widest = g->start + g->n;
    }
    return row == n ? widest : FS_EINVAL;
}

static int check_x(const fs_layer_x *xs, int n_layers, int n_rope, const float *const *cos,
                   const float *const *sin) {
    if (n_rope < 1 || n_rope > 2 || !cos || !sin) return FS_EINVAL;
    for (int i = 0; i < n_rope; i++)
        if (!cos[i] || !sin[i]) return FS_EINVAL;
    for (int l = 0; xs && l < n_layers; l++)
        if (xs[l].window < 0 || xs[l].rope < 0 || xs[l].rope >= n_rope) return FS_EINVAL;
    return FS_OK;
}

int fs_layers_forward_x(const fs_config *cfg, const fs_arch *arch, const fs_layer *layers, const fs_layer_x *xs,
                        int n_layers, float *x, int64_t n, const int32_t *pos, const float *const *rope_cos,
                        const float *const *rope_sin, int n_rope, int64_t max_pos, const fs_group *groups,
                        int n_groups, volatile int *stop) {
    static const fs_layer_x plain = {0};
    static const fs_arch llama = {FS_ACT_SILU, 0.0f};
    if (n < 0 || n_layers < 0 || n_groups < 0 || max_pos <= 0) return FS_EINVAL;
    if (arch && arch->act != FS_ACT_SILU && arch->act != FS_ACT_GELU_TANH) return FS_EINVAL;
    int rc = check(cfg, layers, n_layers);
    if (rc == FS_OK) rc = check_x(xs, n_layers, n_rope, rope_cos, rope_sin);
    if (rc != FS_OK || (n == 0 && n_groups == 0)) return rc;
    const int64_t widest = check_groups(groups, n_groups, n);
    if (widest < 0) return (int)widest;
    fs_lock();
    int32_t *row_group = (int32_t *)fs_scratch(FS_S_GROUPS, (size_t)n * sizeof(int32_t));
    stack s = {.c = cfg, .isa = fs_current_isa(), .n = n, .x = x, .pos = pos, .groups = groups,
               .n_groups = n_groups, .row_group = row_group, .arch = arch ? arch : &llama};
    s.qdim = (int64_t)cfg->q_heads * cfg->head_dim;
    s.kvdim = (int64_t)cfg->kv_heads * cfg->head_dim;
    float *scores;
    const int64_t ld_scores = (widest + 15) / 16 * 16;
    rc = row_group ? buffers(&s, &scores, ld_scores) : FS_ENOMEM;
    if (row_group)
        for (int gi = 0; gi < n_groups; gi++)
            for (int64_t r = groups[gi].row0; r < groups[gi].row0 + groups[gi].n; r++) row_group[r] = gi;
    int done = 0;
    for (; rc == FS_OK && done < n_layers; done++) {
        if (stop && *stop) break;
        s.L = &layers[done];
        s.X = xs ? &xs[done] : &plain;
        s.cos = rope_cos[s.X->rope];
        s.sin = rope_sin[s.X->rope];
        s.layer = done;
        layer(&s, scores, ld_scores);
    }
    fs_unlock();
    return rc == FS_OK ? done : rc;
}

int fs_layers_forward_groups(const fs_config *cfg, const fs_layer *layers, int n_layers, float *x, int64_t n,
                             const int32_t *pos, const float *rope_cos, const float *rope_sin, int64_t max_pos,
                             const fs_group *groups, int n_groups, volatile int *stop) {
    return fs_layers_forward_x(cfg, NULL, layers, NULL, n_layers, x, n, pos, &rope_cos, &rope_sin, 1, max_pos,
                               groups, n_groups, stop);
}

int fs_layers_forward(const fs_config *cfg, const fs_layer *layers, int n_layers, float *x, int64_t n,
                      const int32_t *pos, const float *rope_cos, const float *rope_sin, int64_t max_pos,
                      float *k_cache, float *v_cache, int64_t capacity, int64_t start, const uint8_t *mask,
                      volatile int *stop) {
    if (n < 0 || n_layers < 0 || start < 0 || start + n > capacity || max_pos <= 0) return FS_EINVAL;
    if (n == 0) {
        const int rc = check(cfg, layers, n_layers);
        return rc == FS_OK ? 0 : rc;
    }
    const fs_group one = {k_cache, v_cache, mask, 0, n, capacity, start};
    return fs_layers_forward_groups(cfg, layers, n_layers, x, n, pos, rope_cos, rope_sin, max_pos, &one, 1, stop);
}
