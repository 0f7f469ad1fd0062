/* The Adam and grad-statistics loops, written once and compiled once per SIMD level.
 *
 * A level file defines LEVEL and the block primitives (load_block, store_block,
 * decode_block, encode_block, chunk_sumsq, finish_stores) with its own intrinsics, then
 * includes this body. Work goes
 * in blocks of BLK elements: grads (and bf16 moments) are widened into L1-resident fp32
 * buffers, one vectorised loop does the math, results are narrowed on the way out. fp32
 * state updated in place is read and written straight from memory; in bank mode (outputs
 * elsewhere) results leave with non-temporal stores — from registers where the level has a
 * register loop (AVX-512), else through L1 — so writing a spare bank costs no
 * read-for-ownership: bank mode moves the same bytes as in place. With remainders the fp32
 * master is decoded (bf16 param + int16 low half) into L1 and encoded on the way out.
 * exp_avg and exp_avg_sq (with max_exp_avg_sq) each have their own dtype, fp32 or bf16
 * (moment_dtype, exp_avg_sq_dtype); the pair is fixed for a call.
 * Compressed state (bf16 moments, remainders) runs in the level's register loop
 * (adam_c16_regs, HAVE_ADAM_C16_REGS: AVX-512, AVX2) over whole 32-element steps and in the
 * blocks below for the tail: the same arithmetic and rounding, so the same bits. A level may
 * send some fp32-state calls there too (C16_TAKES_FP32_STATE: AVX2's in-place steps with 16-bit
 * grads). The Arm
 * levels (HAVE_ADAM_RANGE_REGS: NEON, SVE) run every call in their own register loop.
 */
#define BLK 128
/* Explicit fused multiply-adds where the level has them, so the rounding is fixed by the
 * source (not by the compiler's contraction choices) and the level's register loop for bank
 * mode can repeat it exactly. */
#ifdef LEVEL_HAS_FMA
#define FMA(a, b, c) __builtin_fmaf((a), (b), (c))
#else
#define FMA(a, b, c) ((a) * (b) + (c))
#endif
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, LEVEL)

static inline __attribute__((always_inline)) void adam_math(
    const float *pin, const float *g, const float *m, const float *v, const float *vmax,
    float *pout, float *mout, float *vout, float *vmaxout, int len, const adam_consts_t *c,
    const int amsgrad, const int l2)
{
    const float w1 = c->one_minus_beta1, b2 = c->beta2, w2 = c->one_minus_beta2;
    const float eps = c->eps, nss = c->neg_step_size, ib = c->inv_bias_correction2_sqrt;
    const float decay = c->decay, wd = c->l2, gscale = c->grad_scale;
#pragma omp simd
    for (int i = 0; i < len; i++) {
        const float p = pin[i];
        float gi = g[i] * gscale;
        if (l2) gi = FMA(wd, p, gi);                /* Adam: L2 penalty folded into the grad */
        const float mi = FMA(w1, gi - m[i], m[i]);  /* torch's lerp(m, g, 1 - beta1) */
        const float vi = FMA(w2, gi * gi, v[i] * b2);
        float vv = vi;
        if (amsgrad) {
            vv = vmax[i] > vi ? vmax[i] : vi;
            vmaxout[i] = vv;
        }
        const float denom = FMA(__builtin_sqrtf(vv), ib, eps);
        pout[i] = FMA(p, decay, nss * (mi / denom));  /* AdamW: decay = 1 - lr * wd; Adam: 1 */
        mout[i] = mi;
        vout[i] = vi;
    }
}

#ifdef BLOCK_AHEAD
/* In place, on CPUs that gain by it (kernels.h, hybrid_get_block_prefetch), the streams a block
 * reads where they lie (the grad at its width; the fp32 param and moments) are prefetched
 * BLOCK_AHEAD elements ahead, a block of each (a prefetch never faults, past the end either).
 * always_inline: gcc (12.2) finds a function of prefetches alone free of side effects
 * (pure-const) and deletes its calls before a plain inline would place it. */
#define PREFETCH_LINES(at, bytes, rw) \
    for (int h_ = 0; h_ < (bytes); h_ += 64) __builtin_prefetch((const char *)(at) + h_, (rw), 3)

static inline __attribute__((always_inline)) void prefetch_block(const adam_args_t *a, int64_t at, const int ams)
{
    if (a->grad_dtype == DT_F32) PREFETCH_LINES((const float *)a->grad + at, 4 * BLK, 0);
    else PREFETCH_LINES((const uint16_t *)a->grad + at, 2 * BLK, 0);
    if (!a->remainder) PREFETCH_LINES(a->param + at, 4 * BLK, 1);
    if (a->moment_dtype == DT_F32) PREFETCH_LINES((const float *)a->exp_avg + at, 4 * BLK, 1);
    if (a->exp_avg_sq_dtype == DT_F32) {
        PREFETCH_LINES((const float *)a->exp_avg_sq + at, 4 * BLK, 1);
        if (ams) PREFETCH_LINES((const float *)a->max_exp_avg_sq + at, 4 * BLK, 1);
    }
}
#endif

#ifdef HAVE_ADAM_RANGE_REGS
/* The level steps every dtype and mode in its own register loop (the Arm levels: widening
 * loads and narrowing stores are single instructions there, tails predicated or padded), so
 * it defines no block primitives for Adam; adam_math is the arithmetic it repeats. */
void FN(adam_range)(const adam_args_t *a, const adam_consts_t *c, int64_t begin, int64_t end)
{
    adam_range_regs(a, c, begin, end);
}
#else
void FN(adam_range)(const adam_args_t *a, const adam_consts_t *c, int64_t begin, int64_t end)
{
    float gb[BLK] __attribute__((aligned(64)));
    float mb[BLK] __attribute__((aligned(64))), vb[BLK] __attribute__((aligned(64)));
    float xb[BLK] __attribute__((aligned(64)));
    float pob[BLK] __attribute__((aligned(64))), mob[BLK] __attribute__((aligned(64)));
    float vob[BLK] __attribute__((aligned(64))), xob[BLK] __attribute__((aligned(64)));
    /* mdt: exp_avg's dtype; vdt: exp_avg_sq's and max_exp_avg_sq's (each fp32 or bf16) */
    const int mdt = a->moment_dtype, vdt = a->exp_avg_sq_dtype;
    const int oop = c->out_of_place, ams = c->amsgrad, l2 = c->l2_mode;
#ifdef HAVE_ADAM_C16_REGS
#ifndef C16_TAKES_FP32_STATE
#define C16_TAKES_FP32_STATE(a, c) 0
#endif
    /* the level's register loop; the tail below */
    if (a->remainder || mdt != DT_F32 || vdt != DT_F32 || C16_TAKES_FP32_STATE(a, c)) {
        const int64_t vec_end = begin + ((end - begin) & ~(int64_t)31);
        adam_c16_regs(a, c, begin, vec_end);
        begin = vec_end;
    }
#endif
    /* fp32 moments updated in place are read and written in memory */
    const int mdirect = (mdt == DT_F32) && !oop, vdirect = (vdt == DT_F32) && !oop;
    const int rem = a->remainder != NULL;       /* param: bf16 high half + int16 remainder */
    float rb[BLK] __attribute__((aligned(64)));
#ifdef BLOCK_AHEAD
    const int ahead = !oop && hybrid_get_block_prefetch();  /* in place, where the CPU gains by it */
#endif

    for (int64_t off = begin; off < end; off += BLK) {
        const int len = (int)((end - off) < BLK ? (end - off) : BLK);
        const float *gi = (const float *)a->grad + off;  /* fp32 grads: read in place */
        if (a->grad_dtype != DT_F32) {
            load_block(gb, a->grad, a->grad_dtype, off, len, 1.0f);
            gi = gb;
        }
#ifdef BLOCK_AHEAD
        if (ahead) prefetch_block(a, off + BLOCK_AHEAD, ams);
#endif
        const float *pin = a->param + off;
        if (rem) {  /* the fp32 master, decoded into L1 */
            decode_block(rb, (const uint16_t *)(const void *)a->param, a->remainder, off, len);
            pin = rb;
        }
        const float *mi, *vi, *xi = NULL;
        if (mdt == DT_F32) {
            mi = (const float *)a->exp_avg + off;
        } else {
            load_block(mb, a->exp_avg, mdt, off, len, 1.0f);
            mi = mb;
        }
        if (vdt == DT_F32) {
            vi = (const float *)a->exp_avg_sq + off;
            if (ams) xi = (const float *)a->max_exp_avg_sq + off;
        } else {
            load_block(vb, a->exp_avg_sq, vdt, off, len, 1.0f);
            if (ams) load_block(xb, a->max_exp_avg_sq, vdt, off, len, 1.0f);
            vi = vb; xi = xb;
        }
#ifdef HAVE_ADAM_F32_REGS
        if (oop && !rem) {
            /* bank mode: the level's register loop (adam_math's arithmetic, FMA for FMA) stores
             * fp32 outputs straight from registers, non-temporal — no L1 round trip — and bf16
             * moments through L1 to be rounded */
            const int mf32 = mdt == DT_F32, vf32 = vdt == DT_F32;
            float *mo = mf32 ? (float *)a->exp_avg_out + off : mob;
            float *vo = vf32 ? (float *)a->exp_avg_sq_out + off : vob;
            float *xo = ams ? (vf32 ? (float *)a->max_exp_avg_sq_out + off : xob) : NULL;
            adam_f32_regs(pin, gi, mi, vi, ams ? xi : NULL, a->param_out + off, mo, vo, xo,
                          a->param_copy, a->copy_dtype, off, len, c, oop, oop && mf32 && vf32);
            if (!mf32) store_block(a->exp_avg_out, mdt, off, mob, len, oop);
            if (!vf32) {
                store_block(a->exp_avg_sq_out, vdt, off, vob, len, oop);
                if (ams) store_block(a->max_exp_avg_sq_out, vdt, off, xob, len, oop);
            }
            continue;
        }
#endif
        float *po = (oop || rem) ? pob : a->param_out + off;
        float *mo = mdirect ? (float *)a->exp_avg_out + off : mob;
        float *vo = vdirect ? (float *)a->exp_avg_sq_out + off : vob;
        float *xo = (vdirect && ams) ? (float *)a->max_exp_avg_sq_out + off : xob;

        if (ams) {
            if (l2) adam_math(pin, gi, mi, vi, xi, po, mo, vo, xo, len, c, 1, 1);
            else adam_math(pin, gi, mi, vi, xi, po, mo, vo, xo, len, c, 1, 0);
        } else {
            if (l2) adam_math(pin, gi, mi, vi, xi, po, mo, vo, xo, len, c, 0, 1);
            else adam_math(pin, gi, mi, vi, xi, po, mo, vo, xo, len, c, 0, 0);
        }

        if (rem) encode_block((uint16_t *)(void *)a->param_out, a->remainder_out, off, pob, len, oop);
        else if (po == pob) store_block(a->param_out, DT_F32, off, pob, len, 1);
        if (mo == mob) store_block(a->exp_avg_out, mdt, off, mob, len, oop);
        if (vo == vob) store_block(a->exp_avg_sq_out, vdt, off, vob, len, oop);
        if (ams && xo == xob) store_block(a->max_exp_avg_sq_out, vdt, off, xob, len, oop);
        if (a->param_copy) store_block(a->param_copy, a->copy_dtype, off, po, len, 1);
    }
    finish_stores();
}
#endif

/* Remainder encoding of an fp32 master over [begin, end), and back (see kernels.h). */
void FN(remainder_encode)(const float *m, uint16_t *p, int16_t *r, int64_t begin, int64_t end)
{
    for (int64_t off = begin; off < end; off += BLK) {
        const int len = (int)((end - off) < BLK ? (end - off) : BLK);
        encode_block(p, r, off, m + off, len, 0);
    }
}

void FN(remainder_decode)(const uint16_t *p, const int16_t *r, float *m, int64_t begin, int64_t end)
{
    for (int64_t off = begin; off < end; off += BLK) {
        const int len = (int)((end - off) < BLK ? (end - off) : BLK);
        decode_block(m + off, p, r, off, len);
    }
}

/* Sums of squares of chunks [chunk0, chunk1) into partials[chunk]; see kernels.h. */
void FN(grad_chunk_sums)(const void *g, int dt, int64_t n, int64_t chunk0, int64_t chunk1,
                         double *partials)
{
    for (int64_t k = chunk0; k < chunk1; k++) {
        const int64_t off = k * GRAD_STATS_CHUNK;
        const int64_t len = (n - off) < GRAD_STATS_CHUNK ? (n - off) : GRAD_STATS_CHUNK;
        double lanes[GRAD_STATS_LANES];
        chunk_sumsq(g, dt, off, len, lanes);
        double s8[8], s4[4];
        for (int i = 0; i < 8; i++) s8[i] = lanes[i] + lanes[i + 8];
        for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
        partials[k] = (s4[0] + s4[2]) + (s4[1] + s4[3]);
    }
}

/* The roofline probes: Adam's access pattern with none of its arithmetic, 28 bytes per
 * element at memory speed. In place: read p, g, m, v; write p, m, v back. Bank mode: the same
 * reads, the writes to three other arrays. A level with vector kernels defines its own
 * (HAVE_BW_REGS), streaming as its kernels do; these plain loops are the others' (FMA: the one
 * instruction per stream the in-place loop compiled to before the build said
 * -ffp-contract=off). */
#ifndef HAVE_BW_REGS
void FN(bw_inplace)(float *p, const float *g, float *m, float *v, int64_t begin, int64_t end)
{
#pragma omp simd
    for (int64_t i = begin; i < end; i++) {
        const float gi = g[i];
        p[i] = FMA(p[i], 0.999f, gi);
        m[i] = FMA(m[i], 0.999f, gi);
        v[i] = FMA(v[i], 0.999f, gi);
    }
}

void FN(bw_bank)(const float *p, const float *g, const float *m, const float *v, float *po, float *mo,
                 float *vo, int64_t begin, int64_t end)
{
#pragma omp simd
    for (int64_t i = begin; i < end; i++) {
        po[i] = FMA(p[i], 0.999f, g[i]);
        mo[i] = FMA(m[i], 0.999f, g[i]);
        vo[i] = FMA(v[i], 0.999f, g[i]);
    }
}
#endif

/* The per-pattern roofline probe: a kernel's own streams (kernels.h, BW_READ ... BW_WRITE_NT)
 * with trivial arithmetic, so that "% of roof" compares a kernel with the best streaming of the
 * bytes it moves, read/write mix and store kind included (one core streams a mix that reads
 * less faster: its reads in flight are the limit). Moved as the register loops move them: 32
 * elements a step (one 64-byte line of a 16-bit stream, two of an fp32 one), every read and
 * updated stream prefetched `ahead` elements ahead, BW_WRITE_NT streams written non-temporal
 * where line-aligned at `begin`. What it does to the data, so a
 * test can tell every element was moved: a BW_UPDATE element goes up by one (an integer of its
 * width, wrapping), every byte of a BW_WRITE(_NT) element becomes 0xFF, and it returns the XOR
 * of every 16-bit word of the BW_READ streams over [begin, end) (which keeps the reads live). */
#ifdef BW_PATTERN_M256
/* x86 (AVX2, AVX-512): 32-byte vectors; a step of a stream of width w is w of them */
typedef __m256i bw_acc_t;
static inline bw_acc_t bw_acc_zero(void) { return _mm256_setzero_si256(); }

static inline void bw_read_step(const char *q, const int w, bw_acc_t *acc)
{
    for (int l = 0; l < w; l++) *acc = _mm256_xor_si256(*acc, _mm256_loadu_si256((const __m256i *)(q + 32 * l)));
}

static inline void bw_update_step(char *q, const int w)
{
    for (int l = 0; l < w; l++) {
        __m256i *d = (__m256i *)(q + 32 * l);
        const __m256i x = _mm256_loadu_si256(d);
        _mm256_storeu_si256(d, w == 2 ? _mm256_add_epi16(x, _mm256_set1_epi16(1))
                                      : _mm256_add_epi32(x, _mm256_set1_epi32(1)));
    }
}

static inline void bw_write_step(char *q, const int w, const int nt)
{
    const __m256i ones = _mm256_set1_epi32(-1);
    for (int l = 0; l < w; l++) {
        if (nt) _mm256_stream_si256((__m256i *)(q + 32 * l), ones);
        else _mm256_storeu_si256((__m256i *)(q + 32 * l), ones);
    }
}

static inline void bw_prefetch_step(const char *q, const int w, int64_t ahead)
{
    for (int l = 0; l < w; l += 2) _mm_prefetch(q + ahead * w + 32 * l, _MM_HINT_T0);
}

static inline uint16_t bw_acc_fold(bw_acc_t acc)
{
    uint16_t u[16];
    _mm256_storeu_si256((__m256i *)u, acc);
    uint16_t x = 0;
    for (int k = 0; k < 16; k++) x ^= u[k];
    return x;
}

static inline void bw_fence(void) { _mm_sfence(); }
#else
/* other levels: plain loops the compiler vectorises, no prefetch, no streaming stores */
typedef uint16_t bw_acc_t;
static inline bw_acc_t bw_acc_zero(void) { return 0; }

static inline void bw_read_step(const char *q, const int w, bw_acc_t *acc)
{
    uint16_t u[64];
    memcpy(u, q, (size_t)(32 * w));
    uint16_t x = *acc;
    for (int k = 0; k < 16 * w; k++) x ^= u[k];
    *acc = x;
}

static inline void bw_update_step(char *q, const int w)
{
    if (w == 2) {
        uint16_t u[32];
        memcpy(u, q, sizeof u);
        for (int k = 0; k < 32; k++) u[k]++;
        memcpy(q, u, sizeof u);
    } else {
        uint32_t u[32];
        memcpy(u, q, sizeof u);
        for (int k = 0; k < 32; k++) u[k]++;
        memcpy(q, u, sizeof u);
    }
}

static inline void bw_write_step(char *q, const int w, const int nt)
{
    (void)nt;
    memset(q, 0xff, (size_t)(32 * w));
}

static inline void bw_prefetch_step(const char *q, const int w, int64_t ahead) { (void)q; (void)w; (void)ahead; }
static inline uint16_t bw_acc_fold(bw_acc_t acc) { return acc; }
static inline void bw_fence(void) {}
#endif

uint32_t FN(bw_pattern)(void *const *ptrs, const int *bytes, const int *kinds, int ns, int64_t ahead, int64_t begin,
                        int64_t end)
{
    /* the streams by kind, each at this range's start (loops over a few streams of one kind
     * each step: the branches repeat every step, and the step stays far under memory time) */
    char *rd[BW_MAX_STREAMS], *up[BW_MAX_STREAMS], *wr[BW_MAX_STREAMS];
    int rdw[BW_MAX_STREAMS], upw[BW_MAX_STREAMS], wrw[BW_MAX_STREAMS], wrnt[BW_MAX_STREAMS];
    int nr = 0, nu = 0, nw = 0, any_nt = 0;
    for (int k = 0; k < ns && k < BW_MAX_STREAMS; k++) {
        char *q = (char *)ptrs[k] + begin * bytes[k];
        if (kinds[k] == BW_READ) {
            rd[nr] = q, rdw[nr++] = bytes[k];
        } else if (kinds[k] == BW_UPDATE) {
            up[nu] = q, upw[nu++] = bytes[k];
        } else {
            wrnt[nw] = kinds[k] == BW_WRITE_NT && LINE_ALIGNED(q);
            any_nt |= wrnt[nw];
            wr[nw] = q, wrw[nw++] = bytes[k];
        }
    }
    bw_acc_t acc = bw_acc_zero();
    const int64_t len = end - begin;
    int64_t i = 0;
    for (; i + 32 <= len; i += 32) {
        for (int k = 0; k < nr; k++) {
            const char *q = rd[k] + i * rdw[k];
            bw_prefetch_step(q, rdw[k], ahead);
            bw_read_step(q, rdw[k], &acc);
        }
        for (int k = 0; k < nu; k++) {
            char *q = up[k] + i * upw[k];
            bw_prefetch_step(q, upw[k], ahead);
            bw_update_step(q, upw[k]);
        }
        for (int k = 0; k < nw; k++) bw_write_step(wr[k] + i * wrw[k], wrw[k], wrnt[k]);
    }
    uint16_t x = bw_acc_fold(acc);
    for (; i < len; i++) {
        for (int k = 0; k < nr; k++) {
            uint16_t u[2];
            memcpy(u, rd[k] + i * rdw[k], (size_t)rdw[k]);
            x ^= u[0];
            if (rdw[k] == 4) x ^= u[1];
        }
        for (int k = 0; k < nu; k++) {
            if (upw[k] == 2) ((uint16_t *)(void *)up[k])[i]++;
            else ((uint32_t *)(void *)up[k])[i]++;
        }
        for (int k = 0; k < nw; k++) memset(wr[k] + i * wrw[k], 0xff, (size_t)wrw[k]);
    }
    if (any_nt) bw_fence();
    return x;
}
