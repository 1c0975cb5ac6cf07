"""Writes a copy of layers.c with per-phase wall-clock timers (double T[8]) for stack_harness.c."""
import sys

src, dst = sys.argv[1], sys.argv[2]
with open(src) as f:
    s = f.read()
s = s.replace('#include "fs_internal.h"\n', '#include "fs_internal.h"\n#include <time.h>\ndouble T[8];\n'
              'static double nowp(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);'
              ' return t.tv_sec + t.tv_nsec * 1e-9; }\n#define TIC double _t = nowp();\n'
              '#define TOC(i) T[i] += nowp() - _t;\n', 1)
edits = [
    ("    if (s->norm || s->quantize) run_rows(s, norm_row, hidden);",
     "    {TIC if (s->norm || s->quantize) run_rows(s, norm_row, hidden); TOC(0)}"),
    ("    fs_run_matmuls(qkv, 3);\n    run_rows(s, qk_row, s->qdim);\n    attention(s, mask, scores, ld_scores);",
     "    {TIC fs_run_matmuls(qkv, 3); TOC(1)}\n    {TIC run_rows(s, qk_row, s->qdim); TOC(2)}\n"
     "    {TIC attention(s, mask, scores, ld_scores); TOC(3)}"),
    ("    fs_run_matmuls(&o, 1);\n    residual(s);", "    {TIC fs_run_matmuls(&o, 1); residual(s); TOC(4)}"),
    ("    run_rows(s, norm_row, hidden);\n    const fs_mm gu",
     "    {TIC run_rows(s, norm_row, hidden); TOC(0)}\n    const fs_mm gu"),
    ("    fs_run_matmuls(gu, 2);", "    {TIC fs_run_matmuls(gu, 2); TOC(5)}"),
    ("    run_rows(s, silu_row, c->intermediate);", "    {TIC run_rows(s, silu_row, c->intermediate); TOC(6)}"),
    ("    fs_run_matmuls(&down, 1);\n    residual(s);", "    {TIC fs_run_matmuls(&down, 1); residual(s); TOC(7)}"),
]
for old, new in edits:
    assert old in s, old
    s = s.replace(old, new)
with open(dst, "w") as f:
    f.write(s)
