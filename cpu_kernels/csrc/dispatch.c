/* cpu_kernels: run-time SIMD dispatch, OpenMP work split, and the exported C API.
 *
 * The level is detected once (x86-64: CPUID plus OS register-state support, through gcc's
 * __builtin_cpu_supports; AArch64: NEON always, SVE where the kernel's HWCAP_SVE says so)
 * and can be lowered, never raised, by the caller. Threads split
 * work by element ranges for Adam (elementwise: any split gives the same bits) and by
 * fixed chunks for grad_stats (see kernels.h), so results never depend on thread count.
 */
#define _GNU_SOURCE /* cpu_set_t, sched_setaffinity: hybrid_set_thread_cpus */
#include <math.h>
#include <stdlib.h>
#ifdef __linux__
#include <sched.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#include "kernels.h"

/* One row per SIMD level of this architecture, lowest first; a level's index is its rank
 * (what hybrid_get_level returns and Python's LEVELS lists). */
typedef struct {
    const char *name;
    void (*adam_range)(const adam_args_t *, const adam_consts_t *, int64_t, int64_t);
    void (*grad_chunk_sums)(const void *, int, int64_t, int64_t, int64_t, double *);
    void (*bw_inplace)(float *, const float *, float *, float *, int64_t, int64_t);
    void (*bw_bank)(const float *, const float *, const float *, const float *, float *, float *, float *,
                    int64_t, int64_t);
    void (*remainder_encode)(const float *, uint16_t *, int16_t *, int64_t, int64_t);
    void (*remainder_decode)(const uint16_t *, const int16_t *, float *, int64_t, int64_t);
    uint32_t (*bw_pattern)(void *const *, const int *, const int *, int, int64_t, int64_t, int64_t);
} level_t;

#define LEVEL_ROW(L) {#L, adam_range_##L, grad_chunk_sums_##L, bw_inplace_##L, bw_bank_##L, \
                      remainder_encode_##L, remainder_decode_##L, bw_pattern_##L}

static const level_t LEVEL_TABLE[] = {
    LEVEL_ROW(portable),
#if defined(__x86_64__)
    LEVEL_ROW(avx2),
    LEVEL_ROW(avx512),
#elif defined(__aarch64__)
    LEVEL_ROW(neon),  /* Advanced SIMD: part of every AArch64 CPU */
#ifdef HYBRID_HAVE_SVE
    LEVEL_ROW(sve),
#endif
#endif
};
#define LEVEL_COUNT ((int)(sizeof(LEVEL_TABLE) / sizeof(LEVEL_TABLE[0])))
enum { LEVEL_PORTABLE = 0, LEVEL_AVX2 = 1, LEVEL_AVX512 = 2 };  /* x86-64's ranks */
enum { LEVEL_NEON = 1, LEVEL_SVE = 2 };                      /* AArch64's */

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_SVE
#define HWCAP_SVE (1UL << 22)
#endif
#endif

static int detected_level(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return LEVEL_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return LEVEL_AVX2;
#elif defined(__aarch64__)
#if defined(HYBRID_HAVE_SVE)
    /* the kernel sets HWCAP_SVE only where the CPU has SVE and the kernel saves its state;
     * an SVE instruction elsewhere raises SIGILL */
    if (getauxval(AT_HWCAP) & HWCAP_SVE) return LEVEL_SVE;
#endif
    return LEVEL_NEON;
#endif
    return LEVEL_PORTABLE;
}

static int g_level = -1;

int hybrid_max_level(void) { return detected_level(); }

int hybrid_level_count(void) { return LEVEL_COUNT; }

/* The name of level `rank` ("portable", "avx2", "avx512" / "neon", "sve"), NULL past the end. */
const char *hybrid_level_name(int rank)
{
    return rank >= 0 && rank < LEVEL_COUNT ? LEVEL_TABLE[rank].name : NULL;
}

int hybrid_get_level(void)
{
    if (g_level < 0) g_level = detected_level();
    return g_level;
}

/* Returns 0, or -1 when the CPU cannot run the requested level. */
int hybrid_set_level(int level)
{
    if (level < LEVEL_PORTABLE || level > detected_level()) return -1;
    g_level = level;
    return 0;
}

int hybrid_arm_streaming_stores_on = 0;

/* Arm vector levels only (kernels.h): 0, or -1 when asked to turn them on elsewhere. */
int hybrid_set_arm_streaming_stores(int on)
{
#if defined(__aarch64__)
    hybrid_arm_streaming_stores_on = on ? 1 : 0;
    return 0;
#else
    return on ? -1 : 0;
#endif
}

int hybrid_get_arm_streaming_stores(void) { return hybrid_arm_streaming_stores_on; }

/* kernels.h: the choices an x86 CPU's vendor makes, -1 until first asked; plain x86-64 code (no
 * target pragma), as it may run on any CPU */
static int g_avx2_bank_nt = -1, g_block_prefetch = -1, g_q8_pipeline = -1;

static int cpu_is_intel(void)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") ? 1 : 0;
#else
    return 0;
#endif
}

int hybrid_get_avx2_bank_nt(void)
{
    if (g_avx2_bank_nt < 0) g_avx2_bank_nt = cpu_is_intel();
    return g_avx2_bank_nt;
}

int hybrid_get_block_prefetch(void)
{
    if (g_block_prefetch < 0) g_block_prefetch = cpu_is_intel();
    return g_block_prefetch;
}

int hybrid_get_q8_pipeline(void)
{
    if (g_q8_pipeline < 0) g_q8_pipeline = cpu_is_intel();
    return g_q8_pipeline;
}

/* 0, or -1 when asked to turn a choice on off x86-64 */
static int set_x86_choice(int *choice, int on)
{
#if defined(__x86_64__)
    *choice = on ? 1 : 0;
    return 0;
#else
    (void)choice;
    return on ? -1 : 0;
#endif
}

int hybrid_set_block_prefetch(int on) { return set_x86_choice(&g_block_prefetch, on); }

int hybrid_set_avx2_bank_nt(int on) { return set_x86_choice(&g_avx2_bank_nt, on); }

int hybrid_set_q8_pipeline(int on) { return set_x86_choice(&g_q8_pipeline, on); }

static const level_t *level_fns(void) { return &LEVEL_TABLE[hybrid_get_level()]; }

void hybrid_set_num_threads(int n)
{
#ifdef _OPENMP
    if (n > 0) omp_set_num_threads(n);
#else
    (void)n;
#endif
}

int hybrid_get_num_threads(void)
{
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* The cores the first n OpenMP threads may run on from now on: the calling thread and the pool
 * threads that every parallel region of up to n threads runs on, each allowed on all of
 * cpus[0 .. ncpus) (the OS places them within it). A worker steps on its own cores during
 * backward and on the trainer's too while step() waits for it (hybrid_opt/worker/main.py).
 * Returns how many threads kept their cores (refused: a cpuset without those cores), or -1
 * where threads have no affinity (not Linux). Results never depend on where threads run. */
int hybrid_set_thread_cpus(const int *cpus, int ncpus, int n)
{
#ifdef __linux__
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int k = 0; k < ncpus; k++)
        if (cpus[k] >= 0 && cpus[k] < CPU_SETSIZE) CPU_SET(cpus[k], &set);
    int refused = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(n > 0 ? n : 1) reduction(+ : refused)
#else
    (void)n;
#endif
    refused += sched_setaffinity(0, sizeof set, &set) != 0; /* 0: the calling thread */
    return refused;
#else
    (void)cpus;
    (void)ncpus;
    (void)n;
    return -1;
#endif
}

/* Below this many elements a fork/join costs more than it saves. */
#define PARALLEL_MIN 65536
/* Thread ranges start on multiples of this (a 64-byte line of fp32 and of bf16 pairs). */
#define SPLIT_ALIGN 64
/* Adam's unit of work per thread: 16K elements (64 KB of each fp32 stream) */
#define ADAM_CHUNK 16384

static void thread_range(int64_t n, int64_t *b, int64_t *e)
{
    int64_t u0, u1;
    chunk_range((n + SPLIT_ALIGN - 1) / SPLIT_ALIGN, &u0, &u1);
    *b = u0 * SPLIT_ALIGN;
    *e = u1 * SPLIT_ALIGN < n ? u1 * SPLIT_ALIGN : n;
}

/* This thread's run of whole ADAM_CHUNKs of [0, n) (chunk_range), as chunk indices [k0, k1):
 * chunk k covers [k * ADAM_CHUNK, chunk_end(k, n)). */
static void thread_chunks(int64_t n, int64_t *k0, int64_t *k1)
{
    chunk_range((n + ADAM_CHUNK - 1) / ADAM_CHUNK, k0, k1);
}

static inline int64_t chunk_end(int64_t k, int64_t n)
{
    return (k + 1) * ADAM_CHUNK < n ? (k + 1) * ADAM_CHUNK : n;
}

void adam_consts_init(adam_consts_t *c, int64_t step, double lr, double beta1, double beta2, double eps,
                      double weight_decay, double grad_scale, int decoupled, int amsgrad)
{
    /* Bias corrections in double, as torch.optim computes them in Python floats. */
    const double bc1 = 1.0 - pow(beta1, (double)step);
    const double bc2 = 1.0 - pow(beta2, (double)step);
    c->grad_scale = (float)grad_scale;
    c->beta1 = (float)beta1;
    c->one_minus_beta1 = (float)(1.0 - beta1);
    c->beta2 = (float)beta2;
    c->one_minus_beta2 = (float)(1.0 - beta2);
    c->eps = (float)eps;
    c->neg_step_size = (float)(-(lr / bc1));
    c->inv_bias_correction2_sqrt = (float)(1.0 / sqrt(bc2));
    c->decay = decoupled ? (float)(1.0 - lr * weight_decay) : 1.0f;
    c->l2 = decoupled ? 0.0f : (float)weight_decay;
    c->l2_mode = !decoupled && weight_decay != 0.0;
    c->amsgrad = amsgrad;
    c->out_of_place = 0;
}

/* Where boundary `at` of the calls' elements taken end to end falls: the call it lies in (count
 * past the end) and the element there, rounded down to a whole ADAM_CHUNK of the call (a call
 * smaller than one goes whole to one thread). starts: each call's first element, end to end. */
static void many_cut(const int64_t *starts, const adam_args_t *args, int64_t count, int64_t at,
                     int64_t *call, int64_t *elem)
{
    int64_t lo = 0, hi = count;  /* the last call that starts at or before `at` */
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (starts[mid] <= at) lo = mid;
        else hi = mid;
    }
    const int64_t off = (at - starts[lo]) / ADAM_CHUNK * ADAM_CHUNK;
    if (off >= args[lo].n) {  /* at the end of the call: the next one's start */
        *call = lo + 1;
        *elem = 0;
    } else {
        *call = lo;
        *elem = off;
    }
}

/* `count` independent Adam calls in one parallel region, each bit for bit as hybrid_adam_step
 * steps it (the kernels are elementwise): the threads split the calls' elements taken end to end,
 * each one contiguous run, so a list of small tensors (a model's biases and norms, below
 * PARALLEL_MIN each) shares the cores and pays one fork and join, not one call each. Returns 0,
 * or -1 when out of memory (nothing stepped). */
int hybrid_adam_step_many(const adam_args_t *args, int64_t count)
{
    if (count <= 0) return 0;
    const uint64_t fp_env = ieee_enter();
    adam_consts_t stack_consts[64];
    int64_t stack_starts[65];
    adam_consts_t *consts = stack_consts;
    int64_t *starts = stack_starts;
    if (count > 64) {
        consts = (adam_consts_t *)malloc((size_t)count * sizeof *consts);
        starts = (int64_t *)malloc((size_t)(count + 1) * sizeof *starts);
        if (!consts || !starts) {
            free(consts);
            free(starts);
            ieee_leave(fp_env);
            return -1;
        }
    }
    int64_t total = 0;
    for (int64_t i = 0; i < count; i++) {
        const adam_args_t *a = &args[i];
        adam_consts_init(&consts[i], a->step, a->lr, a->beta1, a->beta2, a->eps, a->weight_decay, a->grad_scale,
                         a->decoupled, a->max_exp_avg_sq != NULL);
        consts[i].out_of_place = a->param_out != a->param;
        starts[i] = total;
        total += a->n;
    }
    starts[count] = total;
    const level_t *fns = level_fns();
    if (fns->adam_range == adam_range_avx512) (void)hybrid_get_avx512_bf16();  /* its lazy CPU check, before the threads read it */
#pragma omp parallel if (total >= PARALLEL_MIN)
    {
        const uint64_t thread_fp_env = ieee_enter();
#ifdef _OPENMP
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
        const int64_t nt = 1, t = 0;
#endif
        /* this thread's one contiguous run of the elements end to end (torch's split), not every
         * other chunk: on a 2-core Zen 5 VM, 2 threads, 16Mi elements, interleaved rounds, 3-4 %
         * faster for every AVX2 kernel (fp32 0.424 -> 0.408 ns an element, fused 0.453 -> 0.433,
         * bf16 moments + remainders 0.278 -> 0.260, bf16 moments + copy 0.326 -> 0.308) — each
         * thread's streams run on without a jump every 16Ki elements, which the hardware
         * prefetchers restart at. Its ends are cut as the neighbours' are, so the runs tile
         * every call. */
        int64_t i0, o0, i1, o1;
        many_cut(starts, args, count, total * t / nt, &i0, &o0);
        if (t + 1 == nt) {
            i1 = count;
            o1 = 0;
        } else {
            many_cut(starts, args, count, total * (t + 1) / nt, &i1, &o1);
        }
        for (int64_t i = i0; i <= i1 && i < count; i++) {
            const int64_t b = i == i0 ? o0 : 0, e = i == i1 ? o1 : args[i].n;
            for (int64_t k = b; k < e; k += ADAM_CHUNK)
                fns->adam_range(&args[i], &consts[i], k, e - k > ADAM_CHUNK ? k + ADAM_CHUNK : e);
        }
        ieee_leave(thread_fp_env);
    }
    if (consts != stack_consts) {
        free(consts);
        free(starts);
    }
    ieee_leave(fp_env);
    return 0;
}

/* The Adam calls of `count` runs of one piece, into out: each is *base with its n and grad from
 * its run (runs[3i] the grads' address, runs[3i + 1] the run's first element, runs[3i + 2] its
 * elements) and every pointer field moved by that first element times the field's stride (bytes an
 * element, in strides[] in the struct's order, grad left out: _lib.EXPAND_FIELDS; 0: it stays). The host step builds a model of a
 * thousand small tensors' calls here (ArenaSteps._adam_argv), where Python paid a microsecond each. */
void hybrid_adam_expand_runs(const adam_args_t *base, const int64_t *strides, const int64_t *runs, int64_t count,
                             adam_args_t *out)
{
    for (int64_t i = 0; i < count; i++) {
        adam_args_t a = *base;
        const int64_t first = runs[3 * i + 1];
        a.n = runs[3 * i + 2];
        a.grad = (const void *)(uintptr_t)runs[3 * i];
#define MOVE(field, k) \
    if (strides[k]) a.field = (void *)((char *)(uintptr_t)a.field + first * strides[k])
        MOVE(param, 0);
        MOVE(exp_avg, 1);
        MOVE(exp_avg_sq, 2);
        MOVE(max_exp_avg_sq, 3);
        MOVE(param_out, 4);
        MOVE(exp_avg_out, 5);
        MOVE(exp_avg_sq_out, 6);
        MOVE(max_exp_avg_sq_out, 7);
        MOVE(param_copy, 8);
        MOVE(remainder, 9);
        MOVE(remainder_out, 10);
#undef MOVE
        out[i] = a;
    }
}

/* One Adam call: each thread a contiguous run of whole ADAM_CHUNKs (hybrid_adam_step_many). */
void hybrid_adam_step(const adam_args_t *a)
{
    (void)hybrid_adam_step_many(a, 1);  /* one call needs no allocation: it cannot fail */
}

/* Remainder encoding (kernels.h) of n fp32 values into bf16 bits + int16, and back. */
void hybrid_remainder_encode(const float *m, uint16_t *p, int16_t *r, int64_t n)
{
    const level_t *fns = level_fns();
#pragma omp parallel if (n >= PARALLEL_MIN)
    {
        const uint64_t fp_env = ieee_enter();
        int64_t b, e;
        thread_range(n, &b, &e);
        if (b < e) fns->remainder_encode(m, p, r, b, e);
        ieee_leave(fp_env);
    }
}

void hybrid_remainder_decode(const uint16_t *p, const int16_t *r, float *m, int64_t n)
{
    const level_t *fns = level_fns();
#pragma omp parallel if (n >= PARALLEL_MIN)
    {
        const uint64_t fp_env = ieee_enter();
        int64_t b, e;
        thread_range(n, &b, &e);
        if (b < e) fns->remainder_decode(p, r, m, b, e);
        ieee_leave(fp_env);
    }
}

/* The sums of squares of `count` grads (ptrs[i]: ns[i] elements of dtype dts[i]) into out, in
 * one parallel region: the threads split all the grads' chunks end to end. Each grad's chunks
 * are summed in chunk order: the same bits for every split. Returns 0, or -1 when out of memory
 * (out untouched). */
int hybrid_grad_stats_many(const void *const *ptrs, const int32_t *dts, const int64_t *ns, int64_t count,
                           double *out)
{
    if (count <= 0) return 0;
    int64_t stack_bases[65];
    int64_t *bases = count <= 64 ? stack_bases : (int64_t *)malloc((size_t)(count + 1) * sizeof *bases);
    if (!bases) return -1;
    int64_t chunks = 0, total = 0;  /* bases[i]: tensor i's first chunk, end to end */
    for (int64_t i = 0; i < count; i++) {
        bases[i] = chunks;
        chunks += (ns[i] + GRAD_STATS_CHUNK - 1) / GRAD_STATS_CHUNK;
        total += ns[i];
    }
    bases[count] = chunks;
    double stack_partials[256];
    double *partials = chunks <= 256 ? stack_partials : (double *)malloc((size_t)chunks * sizeof(double));
    if (!partials) {
        if (bases != stack_bases) free(bases);
        return -1;
    }
    const level_t *fns = level_fns();
    const uint64_t fp_env = ieee_enter();
#pragma omp parallel if (total >= 2 * GRAD_STATS_CHUNK)
    {
        const uint64_t thread_fp_env = ieee_enter();
        int64_t c0, c1;
        chunk_range(chunks, &c0, &c1);
        for (int64_t i = 0; i < count && bases[i] < c1; i++) {
            const int64_t lo = c0 > bases[i] ? c0 : bases[i], hi = c1 < bases[i + 1] ? c1 : bases[i + 1];
            if (lo < hi) fns->grad_chunk_sums(ptrs[i], dts[i], ns[i], lo - bases[i], hi - bases[i], partials + bases[i]);
        }
        ieee_leave(thread_fp_env);
    }
    for (int64_t i = 0; i < count; i++) {
        double s = 0.0;
        for (int64_t k = bases[i]; k < bases[i + 1]; k++) s += partials[k];  /* fixed: chunk order */
        out[i] = s;
    }
    ieee_leave(fp_env);
    if (partials != stack_partials) free(partials);
    if (bases != stack_bases) free(bases);
    return 0;
}

/* Returns 0 and the sum of squares in *out, or -1 when out of memory. */
int hybrid_grad_stats(const void *g, int dt, int64_t n, double *out)
{
    const int32_t d = dt;
    return hybrid_grad_stats_many(&g, &d, &n, 1, out);
}

/* The roofline probes (adam_body.h): Adam's 28 bytes an element in place, and bank mode's
 * pattern (read p, g, m, v, write three other arrays as the level's bank mode writes them).
 * Split over threads as hybrid_adam_step splits its work (a run of whole ADAM_CHUNKs a
 * thread), or, for the in-place probe with contiguous = 1, one range per thread on 64-element
 * bounds (torch's split); the bench takes the faster as the roof. */
void hybrid_bw_inplace(float *p, const float *g, float *m, float *v, int64_t n, int contiguous)
{
    const level_t *fns = level_fns();
#pragma omp parallel if (n >= PARALLEL_MIN)
    {
        if (contiguous) {
            int64_t b, e;
            thread_range(n, &b, &e);
            if (b < e) fns->bw_inplace(p, g, m, v, b, e);
        } else {
            int64_t k0, k1;
            thread_chunks(n, &k0, &k1);
            for (int64_t k = k0; k < k1; k++) fns->bw_inplace(p, g, m, v, k * ADAM_CHUNK, chunk_end(k, n));
        }
    }
}

void hybrid_bw_bank(const float *p, const float *g, const float *m, const float *v,
                    float *po, float *mo, float *vo, int64_t n)
{
    const level_t *fns = level_fns();
#pragma omp parallel if (n >= PARALLEL_MIN)
    {
        int64_t k0, k1;
        thread_chunks(n, &k0, &k1);
        for (int64_t k = k0; k < k1; k++) fns->bw_bank(p, g, m, v, po, mo, vo, k * ADAM_CHUNK, chunk_end(k, n));
    }
}

/* The per-pattern probe (adam_body.h, bw_pattern): `ns` streams of `bytes[k]`-byte elements
 * (2 or 4), each of kind kinds[k] (kernels.h), n elements, split over threads as
 * hybrid_adam_step splits its work (a run of whole ADAM_CHUNKs a thread), or with
 * contiguous = 1 one range per thread on 64-element bounds (torch's split); the read and updated
 * streams prefetched `ahead` elements ahead (0 to 65536). Returns the XOR of the BW_READ streams'
 * 16-bit words, or -1 for a bad stream list. */
int64_t hybrid_bw_pattern(void *const *ptrs, const int *bytes, const int *kinds, int ns, int64_t n, int contiguous,
                          int64_t ahead)
{
    if (ns < 1 || ns > BW_MAX_STREAMS || ahead < 0 || ahead > 65536) return -1;
    for (int k = 0; k < ns; k++)
        if ((bytes[k] != 2 && bytes[k] != 4) || kinds[k] < BW_READ || kinds[k] > BW_WRITE_NT) return -1;
    const level_t *fns = level_fns();
    uint32_t x = 0;
#pragma omp parallel if (n >= PARALLEL_MIN) reduction(^ : x)
    {
        if (contiguous) {
            int64_t b, e;
            thread_range(n, &b, &e);
            if (b < e) x ^= fns->bw_pattern(ptrs, bytes, kinds, ns, ahead, b, e);
        } else {
            int64_t k0, k1;
            thread_chunks(n, &k0, &k1);
            for (int64_t k = k0; k < k1; k++)
                x ^= fns->bw_pattern(ptrs, bytes, kinds, ns, ahead, k * ADAM_CHUNK, chunk_end(k, n));
        }
    }
    return (int64_t)x;
}

/* Undo one Adam/AdamW step in place, in fp64, from the post-step state and the same grads
 * and hyperparameters. Forward (fp32): g = grad*scale [+ wd*p0 for Adam];
 * m1 = m0 + (1-b1)(g-m0); v1 = b2 v0 + (1-b2) g^2; p1 = p0*decay - ss*m1/(sqrt(v1)/bc2s + eps).
 * Element-wise guards: an element whose grad or recovered values are not finite is left
 * as it is (never NaN, never zeroed), and v is clamped at 0. */
void hybrid_adam_inverse(const adam_inverse_args_t *a)
{
    const uint64_t fp_env = ieee_enter();
    const double b1 = a->beta1, b2 = a->beta2;
    const double bc1 = 1.0 - pow(b1, (double)a->step), bc2 = 1.0 - pow(b2, (double)a->step);
    const double ss = a->lr / bc1, ib = (double)(float)(1.0 / sqrt(bc2));
    const double decay = a->decoupled ? (double)(float)(1.0 - a->lr * a->weight_decay) : 1.0;
    const double wd = a->decoupled ? 0.0 : (double)(float)a->weight_decay;
    const double scale = (double)(float)a->grad_scale, eps = (double)(float)a->eps;
    const double w1 = (double)(float)(1.0 - b1), w2 = (double)(float)(1.0 - b2);
    const double fb1 = 1.0 - w1, fb2 = (double)(float)b2;
    const int64_t n = a->n;
#pragma omp parallel if (n >= PARALLEL_MIN)
    {
        const uint64_t thread_fp_env = ieee_enter();
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const double g0 = (double)(float)((double)load_scalar(a->grad, a->grad_dtype, i) * scale);
        const double p1 = a->param[i], m1 = a->exp_avg[i], v1 = a->exp_avg_sq[i];
        if (!isfinite(g0) || !isfinite(p1) || !isfinite(m1) || !isfinite(v1)) continue;
        const double denom = sqrt(v1) * ib + eps;
        const double p0 = (p1 + ss * m1 / denom) / decay;
        const double g = g0 + wd * p0;
        const double m0 = (m1 - w1 * g) / fb1;
        double v0 = (v1 - w2 * g * g) / fb2;
        if (v0 < 0.0) v0 = 0.0;
        /* judged after the cast: a finite double can still round to an fp32 inf */
        const float p0f = (float)p0, m0f = (float)m0, v0f = (float)v0;
        if (!isfinite(p0f) || !isfinite(m0f) || !isfinite(v0f)) continue;
        a->param[i] = p0f;
        a->exp_avg[i] = m0f;
        a->exp_avg_sq[i] = v0f;
    }
        ieee_leave(thread_fp_env);
    }
    ieee_leave(fp_env);
}
