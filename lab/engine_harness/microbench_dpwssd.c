#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
#define N 20000000L
#define T(C) { __m512i acc[C]; for(int i=0;i<C;i++) acc[i]=_mm512_set1_epi32(i); __m512i w0=_mm512_set1_epi16(3), w1=_mm512_set1_epi16(5); \
  double t=now(); for(long it=0; it<N; it++){ _Pragma("GCC unroll 24") for(int r=0;r<C;r++){ acc[r]=_mm512_dpwssd_epi32(acc[r], w0, w1);} __asm__ volatile("" : "+v"(w0), "+v"(w1)); } \
  double dt=now()-t; __m512i s=acc[0]; for(int i=1;i<C;i++) s=_mm512_add_epi32(s,acc[i]); printf("dpwssd %d chains: %.2f G/s %d\n", C, N*C/dt/1e9, _mm512_reduce_add_epi32(s)); }
#define U(C) { __m512i acc[C]; for(int i=0;i<C;i++) acc[i]=_mm512_set1_epi32(i); __m512i w0=_mm512_set1_epi16(3), w1=_mm512_set1_epi16(5); \
  double t=now(); for(long it=0; it<N; it++){ _Pragma("GCC unroll 24") for(int r=0;r<C;r++){ acc[r]=_mm512_dpbusd_epi32(acc[r], w0, w1);} __asm__ volatile("" : "+v"(w0), "+v"(w1)); } \
  double dt=now()-t; __m512i s=acc[0]; for(int i=1;i<C;i++) s=_mm512_add_epi32(s,acc[i]); printf("dpbusd %d chains: %.2f G/s %d\n", C, N*C/dt/1e9, _mm512_reduce_add_epi32(s)); }
int main(){ T(8) T(10) T(12) T(16) T(20) T(24) U(12) U(16) }
