/* cpu_kernels: the q8 Adam step's entry point (q8.h): the level and the threads; the constants are
 * the Adam dispatcher's (adam_consts_init in dispatch.c).
 *
 * The level is the Adam dispatcher's (hybrid_get_level: detected once, lowered by
 * cpu_kernels.set_simd_level or HYBRID_OPT_SIMD); every level has a q8 kernel of its own. Each
 * thread takes one contiguous run of whole chunks of whole blocks, so a block's absmax is one
 * thread's and the bits do not depend on the thread count.
 */
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "q8.h"

/* dispatch.c's level selection */
int hybrid_get_level(void);
const char *hybrid_level_name(int rank);

typedef void (*q8_range_fn)(const q8_args_t *, const q8_consts_t *, int64_t, int64_t);

#define Q8_PARALLEL_MIN 65536  /* below this a fork/join costs more than it saves */
#define Q8_CHUNK 16384         /* the unit a thread's run is made of: 64 blocks */

/* The q8 kernel of each of dispatch.c's levels on this architecture, by the level's name. */
static const struct {
    const char *name;
    q8_range_fn range;
} Q8_LEVELS[] = {
    {"portable", q8_range_portable},
#if defined(__x86_64__)
    {"avx2", q8_range_avx2},
    {"avx512", q8_range_avx512},
#elif defined(__aarch64__)
    {"neon", q8_range_neon},
#ifdef HYBRID_HAVE_SVE
    {"sve", q8_range_sve},
#endif
#endif
};

static q8_range_fn q8_level(const char **name)
{
    const char *level = hybrid_level_name(hybrid_get_level());
    for (size_t k = 1; level && k < sizeof(Q8_LEVELS) / sizeof(Q8_LEVELS[0]); k++) {
        if (strcmp(level, Q8_LEVELS[k].name) == 0) {
            *name = Q8_LEVELS[k].name;
            return Q8_LEVELS[k].range;
        }
    }
    *name = Q8_LEVELS[0].name;
    return Q8_LEVELS[0].range;
}

/* The level the q8 step runs at now: "avx512", "avx2", "neon", "sve" or "portable". */
const char *hybrid_q8_level(void)
{
    const char *name;
    (void)q8_level(&name);
    return name;
}

/* The generated codebook, for the tests: map(signed) is 256 fp32 bit patterns, buckets(signed)
 * the two rows of Q8_KEYS entries. */
const uint32_t *hybrid_q8_map(int is_signed) { return q8_maps[is_signed ? 0 : 1]; }
const uint32_t *hybrid_q8_buckets(int is_signed) { return q8_buckets[is_signed ? 0 : 1]; }
int hybrid_q8_keys(void) { return Q8_KEYS; }

static int q8_moment_ok(int dt, const void *p, const float *absmax, const void *out, const float *absmax_out)
{
    if (!p || !out) return 0;
    if (dt == DT_Q8) return absmax && absmax_out;
    return dt == DT_F32 || dt == DT_BF16;
}

/* One q8 Adam step. Returns 0, or -1 when the arguments are inconsistent (a dtype code out of
 * range, a missing pointer); the Python binding checks everything first, so -1 means a caller
 * that bypassed it. Nothing is written then. */
int hybrid_q8_adam_step(const q8_args_t *a)
{
    if (!a || a->n < 0 || !a->param || !a->grad || !a->param_out) return -1;
    if (a->grad_dtype != DT_F32 && a->grad_dtype != DT_BF16 && a->grad_dtype != DT_F16) return -1;
    if (!q8_moment_ok(a->exp_avg_dtype, a->exp_avg, a->exp_avg_absmax, a->exp_avg_out, a->exp_avg_absmax_out) ||
        !q8_moment_ok(a->exp_avg_sq_dtype, a->exp_avg_sq, a->exp_avg_sq_absmax, a->exp_avg_sq_out,
                      a->exp_avg_sq_absmax_out))
        return -1;
    if (a->max_exp_avg_sq && !q8_moment_ok(a->exp_avg_sq_dtype, a->max_exp_avg_sq, a->max_exp_avg_sq_absmax,
                                           a->max_exp_avg_sq_out, a->max_exp_avg_sq_absmax_out))
        return -1;
    if ((a->remainder == NULL) != (a->remainder_out == NULL)) return -1;
    if (a->param_copy && a->copy_dtype != DT_BF16 && a->copy_dtype != DT_F16) return -1;

    const uint64_t fp_env = ieee_enter(); /* kernels.h */
    q8_consts_t c;
    adam_consts_init(&c, a->step, a->lr, a->beta1, a->beta2, a->eps, a->weight_decay, a->grad_scale, a->decoupled,
                     a->max_exp_avg_sq != NULL);

    const char *name;
    const q8_range_fn range = q8_level(&name);
    const int64_t n = a->n;
    (void)hybrid_get_q8_pipeline();  /* its lazy CPU check, before the threads read it */
#pragma omp parallel if (n >= Q8_PARALLEL_MIN)
    {
        /* each thread one contiguous run of whole chunks, not every other chunk: on a 2-core Zen 5
         * VM, 16 Mi elements, AVX-512, the busier thread's CPU time per step 6.4 -> 4.9 ms at 2
         * threads (the hardware prefetchers restart at every jump; one thread unchanged) */
        const uint64_t thread_fp_env = ieee_enter();
        int64_t k0, k1;
        chunk_range((n + Q8_CHUNK - 1) / Q8_CHUNK, &k0, &k1);
        const int64_t b = k0 * Q8_CHUNK, e = k1 * Q8_CHUNK < n ? k1 * Q8_CHUNK : n;
        if (b < e) range(a, &c, b, e);
        ieee_leave(thread_fp_env);
    }
    ieee_leave(fp_env);
    return 0;
}
