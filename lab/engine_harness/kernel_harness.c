#define _GNU_SOURCE
/* micro-harness: time isa->matmul on one matrix, activations pre-quantized, no pool. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <sys/mman.h>
#include "fs_internal.h"
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv) {
    int type = atoi(argv[1]); int64_t rows = atol(argv[2]), cols = atol(argv[3]); int n = atoi(argv[4]); int iters = atoi(argv[5]);
    const fs_traits *t = fs_traits_of(type);
    int64_t gsz = rows * (cols / t->qk) * t->gguf_bytes;
    uint8_t *raw = malloc(gsz); srand(1); for (int64_t i = 0; i < gsz; i++) raw[i] = rand();
    /* sane fp16 scales: overwrite every block's first 4 bytes with 0x2000 (small positive) */
    for (int64_t b = 0; b < gsz / t->gguf_bytes; b++) { raw[b*t->gguf_bytes] = 0; raw[b*t->gguf_bytes+1] = 0x20; raw[b*t->gguf_bytes+2]=0; raw[b*t->gguf_bytes+3]=0x20; }
    int64_t psz = fs_packed_size(type, rows, cols); uint8_t *pk = aligned_alloc(2 << 20, (psz + (2<<20)) / (2<<20) * (2<<20));
    if (getenv("HUGE")) madvise(pk, (psz + (2<<20)) / (2<<20) * (2<<20), MADV_HUGEPAGE);
    fs_pack(type, rows, cols, raw, pk);
    float *x = malloc(sizeof(float) * n * cols), *y = malloc(sizeof(float) * n * rows);
    for (int64_t i = 0; i < n * cols; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    fs_act a; fs_act_alloc(&a, FS_S_ACT, n, cols);
    if (argc > 6) fs_set_isa(argv[6]);
    const fs_isa_impl *isa = fs_current_isa();
    for (int r = 0; r < n; r++) isa->quantize_row(x + r * cols, r, &a);
    fs_mm m = {type, rows, cols, n, pk, t->is_float ? NULL : &a, x, cols, y, rows};
    for (int i = 0; i < 3; i++) isa->matmul(&m, 0, fs_panels(rows), 0, n);
    double best = 1e9;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = now();
        for (int i = 0; i < iters; i++) isa->matmul(&m, 0, fs_panels(rows), 0, n);
        double dt = (now() - t0) / iters; if (dt < best) best = dt;
    }
    double pbt = (double)fs_panels(rows) * (cols / 32);
    printf("%s type %d %ldx%ld n=%d: %.2f us  %.1f ns/panel-block  %.2f G dpw/s  %.1f GB/s\n", isa->name, type, rows, cols, n,
           best * 1e6, best * 1e9 / pbt, (double)rows * cols * n / 32 / best / 1e9, psz / best / 1e9);
    return 0;
}
