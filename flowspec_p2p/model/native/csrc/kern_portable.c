/* The portable matmul: plain C, always built, the reference every SIMD path must equal in structure (the same
 * integer dots and the same float32 sequence per output, fs_internal.h). It decodes each 32-column block of a
 * panel once per tile of FS_TILE activation rows. */
#include <math.h>

#include "fs_internal.h"
#include "ops_impl.h"

static float float_weight(int type, const uint8_t *p) {
    if (type == FS_F16) return fs_half_to_float(fs_rd16(p));
    if (type == FS_BF16) return fs_bf16_to_float(fs_rd16(p));
    float f;
    memcpy(&f, p, sizeof f);
    return f;
}

static void store(float *y, const float *acc, int lanes) {
    for (int l = 0; l < lanes; l++) y[l] = acc[l];
}

static void mm_float(const fs_mm *m, const fs_traits *t, int64_t p0, int64_t p1, int64_t r0, int64_t r1) {
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *pw = m->w + p * m->cols * t->pb;
        const int lanes = (int)(m->rows - p * FS_PANEL < FS_PANEL ? m->rows - p * FS_PANEL : FS_PANEL);
        for (int64_t r = r0; r < r1; r++) {
            const float *x = m->x + r * m->ldx;
            float acc[FS_PANEL] = {0};
            for (int64_t k = 0; k < m->cols; k++)
                for (int l = 0; l < FS_PANEL; l++)
                    acc[l] = fmaf(x[k], float_weight(m->type, pw + k * t->pb + l * t->gguf_bytes), acc[l]);
            store(m->y + r * m->ldy + p * FS_PANEL, acc, lanes);
        }
    }
}

/* acc [lanes] += one decoded block against row `row` of the activations */
static void block_step(const fs_traits *t, const fs_block *blk, const fs_act *a, int64_t b, int64_t row,
                       float *acc) {
    const int64_t bi = b * a->n + row;
    const int16_t *v = a->v + bi * FS_QB;
    const float d = a->d[bi], dv = a->dv[bi];
    for (int l = 0; l < FS_PANEL; l++) {
        int32_t lo = 0, hi = 0;
        for (int k = 0; k < 16; k++) lo += (int32_t)blk->q[l][k] * v[k];
        for (int k = 16; k < 32; k++) hi += (int32_t)blk->q[l][k] * v[k];
        if (t->type == FS_Q6_K) {
            acc[l] = fmaf((float)lo, blk->dw[0][l] * d, acc[l]);
            acc[l] = fmaf((float)hi, blk->dw[1][l] * d, acc[l]);
        } else {
            if (t->asym) acc[l] = fmaf(blk->mw[l], dv, acc[l]);
            acc[l] = fmaf((float)(lo + hi), blk->dw[0][l] * d, acc[l]);
        }
    }
}

static void mm_quant(const fs_mm *m, const fs_traits *t, int64_t p0, int64_t p1, int64_t r0, int64_t r1) {
    fs_block blk;
    float acc[FS_TILE][FS_PANEL];
    const int64_t nb = m->cols / FS_QB, panel_bytes = m->cols / t->qk * t->pb;
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *pw = m->w + p * panel_bytes;
        const int lanes = (int)(m->rows - p * FS_PANEL < FS_PANEL ? m->rows - p * FS_PANEL : FS_PANEL);
        for (int64_t r = r0; r < r1; r += FS_TILE) {
            const int R = (int)(r1 - r < FS_TILE ? r1 - r : FS_TILE);
            memset(acc, 0, sizeof acc);
            for (int64_t b = 0; b < nb; b++) {
                fs_decode_block(m->type, pw, b, &blk);
                for (int i = 0; i < R; i++) block_step(t, &blk, m->a, b, r + i, acc[i]);
            }
            for (int i = 0; i < R; i++) store(m->y + (r + i) * m->ldy + p * FS_PANEL, acc[i], lanes);
        }
    }
}

void fs_mm_portable(const fs_mm *m, int64_t p0, int64_t p1, int64_t r0, int64_t r1) {
    const fs_traits *t = fs_traits_of(m->type);
    if (t->is_float)
        mm_float(m, t, p0, p1, r0, r1);
    else
        mm_quant(m, t, p0, p1, r0, r1);
}

const fs_isa_impl fs_isa_portable = {
    "portable", fs_mm_portable, fs_op_quantize_row, fs_op_rmsnorm_row, fs_op_attend, fs_op_silu_mul, fs_op_gelu_mul,
};
