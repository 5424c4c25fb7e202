// What unaligned vector loads cost the direct forward pass's inner loop on this CPU
// (docs/performance.md, "Forty-fifth session"). The loop of `direct/rows.rs` alone: per tap,
// P input vectors loaded at the tap's offset, R weights broadcast, R x P fused multiply-adds
// into R x P register accumulators; 144 taps (16 input channels x 3x3), as ResNet-20's first
// stage. Offsets either as the real layout has them (rows 34 floats apart, so the taps at
// kx = 1, 2 and most rows start off a 64-byte boundary and their 64-byte loads span two cache
// lines) or all 64-byte aligned. Needs AVX-512F:
//
//   gcc -O3 -march=native -o /tmp/split_loads bench/split_loads.c && /tmp/split_loads
//
// Compare the GFLOP/s with the first line of `fl bench --kernels --threads 1` (the peak).
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define TILE(R, P)                                                                       \
  __attribute__((noinline)) static float tile_##R##_##P(const float *x, const float *w,  \
                                                        const long *off, long taps,      \
                                                        long reps) {                     \
    __m512 a[R][P];                                                                      \
    for (int c = 0; c < R; c++)                                                          \
      for (int v = 0; v < P; v++) a[c][v] = _mm512_setzero_ps();                         \
    for (long r = 0; r < reps; r++)                                                      \
      for (long k = 0; k < taps; k++) {                                                  \
        const float *s = x + off[k];                                                     \
        __m512 xv[P];                                                                    \
        _Pragma("GCC unroll 16") for (int v = 0; v < P; v++) xv[v] =                    \
            _mm512_loadu_ps(s + 16 * v);                                                 \
        const float *wk = w + k * 8;                                                     \
        _Pragma("GCC unroll 8") for (int c = 0; c < R; c++) {                           \
          __m512 wc = _mm512_set1_ps(wk[c]);                                             \
          _Pragma("GCC unroll 16") for (int v = 0; v < P; v++) a[c][v] =                \
              _mm512_fmadd_ps(wc, xv[v], a[c][v]);                                       \
        }                                                                                \
      }                                                                                  \
    float sum = 0;                                                                       \
    for (int c = 0; c < R; c++)                                                          \
      for (int v = 0; v < P; v++) sum += _mm512_reduce_add_ps(a[c][v]);                  \
    return sum;                                                                          \
  }
TILE(8, 3)
TILE(6, 4)
TILE(4, 6)
TILE(4, 4)

int main(void) {
  const long taps = 144, reps = 100000, floats = 16 * 48 * 48 + 2048;
  float *x = aligned_alloc(64, floats * 4), *w = aligned_alloc(64, taps * 8 * 4);
  for (long i = 0; i < floats; i++) x[i] = 1e-6f * (i % 1000);
  for (long i = 0; i < taps * 8; i++) w[i] = 1e-6f * i;
  long off[144];
  const char *layouts[2] = {"rows 34 apart (the real layout)", "every load 64-byte aligned"};
  for (int aligned = 0; aligned < 2; aligned++) {
    for (int ci = 0; ci < 16; ci++)
      for (int ky = 0; ky < 3; ky++)
        for (int kx = 0; kx < 3; kx++)
          off[(ci * 3 + ky) * 3 + kx] =
              aligned ? ci * 48 * 48 + ky * 48 : ci * 34 * 34 + ky * 34 + kx;
#define RUN(R, P)                                                                        \
  {                                                                                      \
    double t0 = now();                                                                   \
    float s = tile_##R##_##P(x, w, off, taps, reps);                                     \
    double t = now() - t0;                                                               \
    printf("%-32s R=%d P=%d: %6.1f GFLOP/s (checksum %g)\n", layouts[aligned], R, P,     \
           2.0 * R * P * 16 * taps * reps / t / 1e9, s);                                 \
  }
    RUN(8, 3) RUN(6, 4) RUN(4, 6) RUN(4, 4)
  }
  return 0;
}
