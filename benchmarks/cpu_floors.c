/* The arithmetic floors of the AVX2 Adam and q8 steps (benchmarks/bench_cpu_floors.py builds and
 * runs this): what one element costs on one core for the operations no exact kernel of ours can
 * drop, each timed alone on an L1-resident block, so that no memory traffic is in it.
 *
 *   sqrt_div  one IEEE vsqrtps and one vdivps per element: every Adam step's denominator and
 *             quotient, correctly rounded (the bitwise contract rules out rsqrt / rcp estimates)
 *   lookup    a 256-entry fp32 table read per element from byte codes, by scalar loads inserted
 *             into a vector: q8's dequantize (twice an element) and the shape of its quantizer's
 *             bucket reads (twice more)
 *   gather    the same lookup by vpgatherdd, the instruction AVX2 offers for it
 *
 * Usage: cpu_floors THREADS; prints one line per probe: name, threads, ns per element per core
 * (the median over the threads of each one's best of 9 rounds). Each thread runs its own copy.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define N 4096  /* elements a round: 16 KiB of fp32 and 4 KiB of codes, in L1 */
#define REPS 4000
#define ROUNDS 9

typedef struct {
    uint32_t map[256] __attribute__((aligned(64)));
    uint8_t codes[N] __attribute__((aligned(64)));
    float x[N] __attribute__((aligned(64)));
    float out[N] __attribute__((aligned(64)));
} work_t;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

__attribute__((noinline, target("avx2"))) static void sqrt_div(work_t *w)
{
    const __m256 eps = _mm256_set1_ps(1e-8f);
    for (int i = 0; i < N; i += 8) {
        const __m256 v = _mm256_load_ps(w->x + i);
        _mm256_store_ps(w->out + i, _mm256_div_ps(v, _mm256_add_ps(_mm256_sqrt_ps(v), eps)));
    }
}

__attribute__((noinline, target("avx2"))) static void lookup(work_t *w)
{
    for (int i = 0; i < N; i += 8) {
        const uint8_t *k = w->codes + i;
        __m128i lo = _mm_cvtsi32_si128((int)w->map[k[0]]), hi = _mm_cvtsi32_si128((int)w->map[k[4]]);
        lo = _mm_insert_epi32(lo, (int)w->map[k[1]], 1);
        hi = _mm_insert_epi32(hi, (int)w->map[k[5]], 1);
        lo = _mm_insert_epi32(lo, (int)w->map[k[2]], 2);
        hi = _mm_insert_epi32(hi, (int)w->map[k[6]], 2);
        lo = _mm_insert_epi32(lo, (int)w->map[k[3]], 3);
        hi = _mm_insert_epi32(hi, (int)w->map[k[7]], 3);
        _mm256_store_si256((__m256i *)(w->out + i), _mm256_set_m128i(hi, lo));
    }
}

__attribute__((noinline, target("avx2"))) static void gather(work_t *w)
{
    for (int i = 0; i < N; i += 8) {
        const __m256i k = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w->codes + i)));
        _mm256_store_si256((__m256i *)(w->out + i), _mm256_i32gather_epi32((const int *)w->map, k, 4));
    }
}

static double best_ns(void (*fn)(work_t *), work_t *w)
{
    double best = 1e30;
    for (int r = 0; r < ROUNDS; r++) {
        const double t0 = now();
        for (int k = 0; k < REPS; k++) {
            fn(w);
            __asm__ volatile("" ::: "memory");
        }
        const double ns = (now() - t0) / REPS / N * 1e9;
        best = ns < best ? ns : best;
    }
    return best;
}

static int cmp(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    const int threads = argc > 1 ? atoi(argv[1]) : 1;
    if (!__builtin_cpu_supports("avx2")) {
        printf("no AVX2 on this CPU\n");
        return 2;
    }
    static const struct {
        const char *name;
        void (*fn)(work_t *);
    } probes[] = {{"sqrt_div", sqrt_div}, {"lookup", lookup}, {"gather", gather}};
    double *per = calloc((size_t)threads, sizeof(double));
    for (size_t p = 0; p < sizeof probes / sizeof probes[0]; p++) {
#pragma omp parallel num_threads(threads)
        {
            work_t *w = aligned_alloc(64, sizeof(work_t));
            for (int i = 0; i < 256; i++) w->map[i] = 0x3f800000u + (uint32_t)i * 4099u;
            for (int i = 0; i < N; i++) {
                w->codes[i] = (uint8_t)(i * 37 + 11);
                w->x[i] = 1.0f + (float)i;
            }
#pragma omp barrier
            per[omp_get_thread_num()] = best_ns(probes[p].fn, w);
            free(w);
        }
        qsort(per, (size_t)threads, sizeof(double), cmp);
        printf("%s %d %.4f\n", probes[p].name, threads, per[threads / 2]);
    }
    free(per);
    return 0;
}
