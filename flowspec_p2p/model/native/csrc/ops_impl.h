/* The non-matmul operations of a decoder layer (activation quantization, RMSNorm, attention, SiLU, GELU), written once
 * in plain C and included by every ISA's translation unit, which compiles it with its own flags (the compiler
 * vectorizes the 16-lane loops). Every reduction is written as 16 lane-wise partial sums combined by a fixed tree,
 * and the compiler may not reassociate (-ffp-contract=off, no fast-math), so each ISA computes the same bits and a
 * row's result never depends on the rest of the batch.
 *
 * Including file: defines nothing; gets static functions fs_op_* for its fs_isa_impl table. */
#ifndef FS_OPS_IMPL_H
#define FS_OPS_IMPL_H

#include <math.h>

#include "fs_internal.h"

#define FS_LANES 16
#define FS_OP static __attribute__((unused)) /* an ISA may replace some ops with its own */

/* a[0] after a[l] += a[l + w] for w = 8, 4, 2, 1 */
FS_INLINE float fs_reduce16(float *a) {
    for (int w = FS_LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) a[l] = a[l] + a[l + w];
    return a[0];
}

/* sum a_i b_i: lane l accumulates the i = l (mod 16) terms in order, then fs_reduce16 */
FS_INLINE float fs_dot(const float *a, const float *b, int64_t n) {
    float acc[FS_LANES] = {0};
    int64_t i = 0;
    for (; i + FS_LANES <= n; i += FS_LANES)
        for (int l = 0; l < FS_LANES; l++) acc[l] = fmaf(a[i + l], b[i + l], acc[l]);
    for (int l = 0; i + l < n; l++) acc[l] = fmaf(a[i + l], b[i + l], acc[l]);
    return fs_reduce16(acc);
}

/* e^x within 2 ulp for x in [-64, 88] (clamped above), 0 below -64 (so softmax weights never reach the
 * denormal range, where each multiply would take a microcode assist; e^-64 ~ 1.6e-28 of the largest weight):
 * 2^n * p(r), r = x - n ln2, p a degree-7 Taylor polynomial. */
FS_INLINE float fs_exp(float x) {
    if (x < -64.0f) return 0.0f;
    x = x > 88.0f ? 88.0f : x;
    const float nf = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* rne(x / ln2) */
    float r = fmaf(nf, -0.693145751953125f, x);
    r = fmaf(nf, -1.42860682030941723212e-6f, r);
    float p = 1.0f / 5040.0f;
    p = fmaf(p, r, 1.0f / 720.0f);
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    const uint32_t bits = (uint32_t)((int32_t)nf + 127) << 23;
    float s;
    memcpy(&s, &bits, sizeof s);
    return p * s;
}

/* Row r of a = the int16 block quantization of x [a->cols]. */
FS_OP void fs_op_quantize_row(const float *x, int64_t r, fs_act *a) {
    for (int64_t b = 0; b < a->cols / FS_QB; b++) {
        const float *xb = x + b * FS_QB;
        const int64_t bi = b * a->n + r;
        int16_t *v = a->v + bi * FS_QB;
        float m[FS_LANES];
        for (int l = 0; l < FS_LANES; l++) {
            const float u = fabsf(xb[l]), w = fabsf(xb[l + FS_LANES]);
            m[l] = u > w ? u : w;
        }
        for (int w = FS_LANES / 2; w >= 1; w /= 2)
            for (int l = 0; l < w; l++) m[l] = m[l] > m[l + w] ? m[l] : m[l + w];
        const float amax = m[0];
        if (!(amax > 0.0f)) {
            memset(v, 0, FS_QB * sizeof *v);
            a->d[bi] = a->dv[bi] = 0.0f;
            continue;
        }
        const float inv = 32767.0f / amax;
        int32_t q[FS_QB], s = 0;
        for (int k = 0; k < FS_QB; k++) {
            float f = xb[k] * inv;
            f = f > 32767.0f ? 32767.0f : f;
            f = f < -32767.0f ? -32767.0f : f;
            q[k] = (int32_t)((f + 12582912.0f) - 12582912.0f); /* round to nearest even */
        }
        for (int k = 0; k < FS_QB; k++) {
            v[k] = (int16_t)q[k];
            s += q[k];
        }
        a->d[bi] = amax / 32767.0f;
        a->dv[bi] = a->d[bi] * (float)s;
    }
}

FS_OP void fs_op_rmsnorm_row(const float *x, const float *w, int64_t dim, float eps, float *out) {
    const float r = 1.0f / sqrtf(fs_dot(x, x, dim) / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) out[i] = (x[i] * r) * w[i];
}

/* Attention output of new row r, q head h: softmax over the visible slots. Scores: fs_dot * scale; the
 * denominator: the k-th visible slot's weight goes to lane k mod 16 (lanes summed in visible order), then
 * fs_reduce16; the output: per element, fma over the visible slots in slot order, then / denominator. Every
 * step depends only on the visible keys in their order, not on the slots they sit in: a draft-tree node whose
 * ancestors sit at pending slots gets exactly the result it would get decoded alone. sc: scratch [start + n]. */
FS_OP void fs_op_attend1(const fs_attn *at, int64_t r, int h, float *sc) {
    const int hd = at->hd;
    const int64_t total = at->start + at->n, limit = at->mask ? total : at->start + r + 1;
    const int64_t lo = fs_window_lo(at, r);
    const uint8_t *vis = at->mask ? at->mask + r * total : NULL;
    const float *q = at->q + (r * at->q_heads + h) * hd;
    const float *kc = at->kc + (int64_t)(h / at->group) * at->capacity * hd;
    const float *vc = at->vc + (int64_t)(h / at->group) * at->capacity * hd;
    float *out = at->out + (r * at->q_heads + h) * hd;
    float mx = -INFINITY;
    int any = 0;
    for (int64_t s = lo; s < limit; s++) {
        if (vis && !vis[s]) continue;
        const float v = fs_dot(q, kc + s * hd, hd) * at->scale;
        sc[s] = v;
        mx = v > mx ? v : mx;
        any = 1;
    }
    for (int i = 0; i < hd; i++) out[i] = 0.0f;
    if (!any) return;
    float l[FS_LANES] = {0};
    int64_t k = 0; /* visible slots so far */
    for (int64_t s = lo; s < limit; s++) {
        if (vis && !vis[s]) continue;
        const float p = fs_exp(sc[s] - mx);
        const float *v = vc + s * hd;
        l[k % FS_LANES] = l[k % FS_LANES] + p;
        k++;
        for (int i = 0; i < hd; i++) out[i] = fmaf(p, v[i], out[i]);
    }
    const float denom = fs_reduce16(l);
    for (int i = 0; i < hd; i++) out[i] = out[i] / denom;
}

/* every q head of kv head kvh, rows [r0, r1) */
FS_OP void fs_op_attend(const fs_attn *at, int kvh, int64_t r0, int64_t r1, int thread) {
    float *sc = at->scratch + thread * at->thread_stride;
    for (int64_t r = r0; r < r1; r++)
        for (int g = 0; g < at->group; g++) fs_op_attend1(at, r, kvh * at->group + g, sc);
}

FS_OP void fs_op_silu_mul(float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i++) g[i] = (g[i] / (1.0f + fs_exp(-g[i]))) * u[i];
}

/* tanh-GELU (transformers' gelu_pytorch_tanh): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), written as
 * x / (1 + e^-t) with t = 2 sqrt(2/pi) (x + 0.044715 x^3) (the same function: 0.5 (1 + tanh(t/2)) = sigmoid(t)) */
#define FS_GELU_A 0.044715f
#define FS_GELU_2C 1.5957691216057308f /* 2 sqrt(2 / pi) */
FS_OP void fs_op_gelu_mul(float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i], t = FS_GELU_2C * (x + FS_GELU_A * ((x * x) * x));
        g[i] = (x / (1.0f + fs_exp(-t))) * u[i];
    }
}

#endif
