#!/bin/sh
# Builds the experiment harnesses against flowspec_p2p/model/native/csrc into ./out (not part of the package).
#   sh build.sh [extra flags for the AVX-512 kernel, e.g. -include exp.h]
# The stack profile uses a copy of layers.c with per-phase timers (profile_layers.py writes it).
set -eu
cd "$(dirname "$0")"
S=../../flowspec_p2p/model/native/csrc
O=out
mkdir -p $O
C="-O3 -std=c11 -ffp-contract=off -fno-math-errno -D_POSIX_C_SOURCE=200809L -pthread -I$S"
X="-mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq ${*:-}"
python3 profile_layers.py $S/layers.c $O/layers_timed.c
for f in formats api pool kern_portable; do gcc $C -c $S/$f.c -o $O/$f.o; done
gcc $C -c $O/layers_timed.c -o $O/layers.o
gcc $C -mavx2 -mfma -mf16c -c $S/kern_avx2.c -o $O/k2.o
gcc $C $X -c $S/kern_avx512.c -o $O/k5.o
gcc $C $X -mavx512vnni -DFS_VNNI=1 -c $S/kern_avx512.c -o $O/k5v.o
LIB="$O/formats.o $O/api.o $O/pool.o $O/layers.o $O/kern_portable.o $O/k2.o $O/k5.o $O/k5v.o -lm -pthread"
for h in kernel_harness model_harness stack_harness; do gcc $C -o $O/$h $h.c $LIB; done
for m in microbench_dpwssd microbench_broadcast; do gcc -O2 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -o $O/$m $m.c; done
echo "built: $(ls $O | grep -v '\.o$' | tr '\n' ' ')"
