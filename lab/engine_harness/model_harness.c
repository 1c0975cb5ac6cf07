/* time 30 layers of distinct Q4_1 matrices (model shapes), n rows, kernel only (isa->matmul), + quantize */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <sys/mman.h>
#include "fs_internal.h"
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv) {
    int n = atoi(argv[1]); int huge = argc > 2 && atoi(argv[2]);
    int shapes[7][2] = {{576,576},{192,576},{192,576},{576,576},{1536,576},{1536,576},{576,1536}};
    fs_matrix M[210]; srand(1);
    for (int l = 0; l < 30; l++) for (int j = 0; j < 7; j++) {
        int rows = shapes[j][0], cols = shapes[j][1]; int64_t g = (int64_t)rows * cols / 32 * 20;
        uint8_t *raw = malloc(g); for (int64_t i = 0; i < g; i++) raw[i] = rand();
        for (int64_t b = 0; b < g / 20; b++) { raw[b*20+1] = 0x20; raw[b*20+3] = 0xa0; raw[b*20]=raw[b*20+2]=0; }
        int64_t ps = fs_packed_size(3, rows, cols);
        uint8_t *pk;
        if (huge) { size_t sz = (ps + (2<<20) - 1) / (2<<20) * (2<<20); pk = aligned_alloc(2<<20, sz); madvise(pk, sz, MADV_HUGEPAGE); }
        else pk = malloc(ps);
        fs_pack(3, rows, cols, raw, pk); free(raw);
        M[l*7+j] = (fs_matrix){pk, 3, rows, cols};
    }
    float *x = malloc(4 * 32 * 1536), *y = malloc(4 * 32 * 1536);
    for (int i = 0; i < 32 * 1536; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    fs_act a; fs_act_alloc(&a, FS_S_ACT, n, 1536);
    const fs_isa_impl *isa = fs_current_isa();
    double best = 1e9, bestq = 1e9;
    for (int rep = 0; rep < 10; rep++) {
        double t0 = now(), tq = 0;
        for (int i = 0; i < 210; i++) {
            double t1 = now();
            a.cols = M[i].cols;
            for (int r = 0; r < n; r++) isa->quantize_row(x + r * M[i].cols, r, &a);
            tq += now() - t1;
            fs_mm m = {3, M[i].rows, M[i].cols, n, M[i].data, &a, x, M[i].cols, y, M[i].rows};
            isa->matmul(&m, 0, fs_panels(M[i].rows), 0, n);
        }
        double dt = now() - t0; if (dt < best) best = dt; if (tq < bestq) bestq = tq;
    }
    printf("n=%d huge=%d: 30 layers %.2f ms (quantize %.2f ms), %.1f GB/s\n", n, huge, best * 1e3, bestq * 1e3, 66.4e6 / best / 1e9);
}
