#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#include <stdint.h>
#include <string.h>
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
#define N 2000000L
int16_t act[8192] __attribute__((aligned(64)));
static inline __m512i pair(const int16_t *v){int32_t x; memcpy(&x,v,4); return _mm512_set1_epi32(x);}
int main(){
  for(int i=0;i<8192;i++) act[i]=i*3;
  __m512i acc[16]; for(int i=0;i<16;i++) acc[i]=_mm512_set1_epi32(i);
  __m512i w[4]; for(int i=0;i<4;i++) w[i]=_mm512_set1_epi16(i+1);
  double t=now();
  for(long it=0; it<N; it++){ const int16_t *v = act + (it & 15) * 256;
    _Pragma("GCC unroll 4") for(int c=0;c<4;c++) {
    _Pragma("GCC unroll 8") for(int r=0;r<8;r++) { _Pragma("GCC unroll 4") for(int j=0;j<4;j++) acc[2*r+(c&1)]=_mm512_dpwssd_epi32(acc[2*r+(c&1)], w[j], pair(v + 32*r + 8*c+2*j)); }
    _Pragma("GCC unroll 4") for(int j=0;j<4;j++) __asm__ volatile("" : "+v"(w[j])); }
  }
  double dt=now()-t; __m512i s=acc[0]; for(int i=1;i<16;i++) s=_mm512_add_epi32(s,acc[i]);
  printf("16 chains bcast: %.2f G/s (chk %d)\n", N*128/dt/1e9, _mm512_reduce_add_epi32(s));
  t=now();
  for(long it=0; it<N; it++){ const int16_t *v = act + (it & 15) * 256;
    _Pragma("GCC unroll 4") for(int c=0;c<4;c++) {
    _Pragma("GCC unroll 8") for(int r=0;r<8;r++) { _Pragma("GCC unroll 4") for(int j=0;j<4;j++) { __m512i b; __asm__("vpbroadcastd %1, %0" : "=v"(b) : "m"(*(const int32_t*)(v + 32*r + 8*c+2*j))); acc[2*r+(c&1)]=_mm512_dpwssd_epi32(acc[2*r+(c&1)], w[j], b);} }
    _Pragma("GCC unroll 4") for(int j=0;j<4;j++) __asm__ volatile("" : "+v"(w[j])); }
  }
  dt=now()-t; s=acc[0]; for(int i=1;i<16;i++) s=_mm512_add_epi32(s,acc[i]);
  printf("16 chains asm-bcast: %.2f G/s (chk %d)\n", N*128/dt/1e9, _mm512_reduce_add_epi32(s));
  t=now();
  for(long it=0; it<N; it++){ const int16_t *v = act + (it & 15) * 256;
    _Pragma("GCC unroll 4") for(int c=0;c<4;c++) {
    _Pragma("GCC unroll 8") for(int r=0;r<8;r++) { _Pragma("GCC unroll 4") for(int j=0;j<4;j++) { __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc[2*r+(c&1)]) : "v"(w[j]), "m"(*(const int32_t*)(v + 32*r + 8*c+2*j)));} }
    _Pragma("GCC unroll 4") for(int j=0;j<4;j++) __asm__ volatile("" : "+v"(w[j])); }
  }
  dt=now()-t; s=acc[0]; for(int i=1;i<16;i++) s=_mm512_add_epi32(s,acc[i]);
  printf("16 chains embedded-bcast: %.2f G/s (chk %d)\n", N*128/dt/1e9, _mm512_reduce_add_epi32(s));
}
