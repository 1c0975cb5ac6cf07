/* Few-row float32 matmul for CPUs with AVX2 and FMA: y[m, n] = x[m, k] @ w[k, n], m small (1-32 rows: decoding,
 * tree verification, pipeline segments, draft expansions).
 *
 * Memory-bound at these sizes: a good kernel reads each weight once for all rows, so m rows cost about what one
 * row does. w is packed once into column panels of 16, [ceil(n / 16)][k][16] (zero-padded), so each panel is one
 * contiguous stream; up to 6 rows are accumulated at once in 12 ymm registers (2 per row), so one pass over a
 * panel serves 6 rows; more rows take further passes over the panel, which is then in L2.
 *
 * Built and loaded at run time by flowspec_p2p/fewrow.py (cc -O3 -mavx2 -mfma). */
#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#define NR 16         /* panel width: two ymm registers */
#define MR 6          /* rows per pass: 12 accumulators + 2 weights + 1 broadcast of the 16 ymm registers */
#define PREFETCH 256  /* floats ahead (1 KiB: 16 panel rows) */

static inline __attribute__((always_inline)) void panel(int mr, const float *x, size_t k, const float *wp,
                                                        float *y, size_t n, size_t width) {
    __m256 acc[MR][2];
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (size_t i = 0; i < k; i++) {
        __builtin_prefetch(wp + i * NR + PREFETCH);
        const __m256 wa = _mm256_loadu_ps(wp + i * NR), wb = _mm256_loadu_ps(wp + i * NR + 8);
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            const __m256 b = _mm256_broadcast_ss(x + r * k + i);
            acc[r][0] = _mm256_fmadd_ps(b, wa, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(b, wb, acc[r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) {
        if (width == NR) {
            _mm256_storeu_ps(y + r * n, acc[r][0]);
            _mm256_storeu_ps(y + r * n + 8, acc[r][1]);
        } else {  /* the last, partial panel */
            float tmp[NR];
            _mm256_storeu_ps(tmp, acc[r][0]);
            _mm256_storeu_ps(tmp + 8, acc[r][1]);
            memcpy(y + r * n, tmp, width * sizeof(float));
        }
    }
}

#define PANEL(R) static void panel##R(const float *x, size_t k, const float *wp, float *y, size_t n, size_t width) \
    { panel(R, x, k, wp, y, n, width); }
PANEL(1) PANEL(2) PANEL(3) PANEL(4) PANEL(5) PANEL(6)
typedef void (*panel_fn)(const float *, size_t, const float *, float *, size_t, size_t);
static const panel_fn PANELS[MR + 1] = {0, panel1, panel2, panel3, panel4, panel5, panel6};

/* x: [m, k] row-major; wp: w packed as [ceil(n / NR)][k][NR]; y: [m, n] row-major. */
void fewrow_matmul(const float *x, size_t m, size_t k, const float *wp, size_t n, float *y) {
    for (size_t p = 0; p * NR < n; p++) {
        const size_t width = n - p * NR < NR ? n - p * NR : NR;
        for (size_t r = 0; r < m; r += MR) {
            const size_t mr = m - r < MR ? m - r : MR;
            PANELS[mr](x + r * k, k, wp + p * k * NR, y + r * n + p * NR, n, width);
        }
    }
}

int fewrow_panel_width(void) { return NR; }
