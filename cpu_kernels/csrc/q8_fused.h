/* The fused q8 pass (q8.h) for the x86 levels, written once over a level's vector primitives.
 *
 * q8 exp_avg and exp_avg_sq, no amsgrad, no param copy, fp32 / bf16 grads, whole blocks: one pass
 * does the arithmetic, stores the param where it goes (fp32 in place or out, or via remainders)
 * and takes both moments' absmax on the way; the moments wait in L1 for their quantizer. Same
 * operations in the same order as q8_body.h's q8_math, so the same bits. Other formats, and a
 * range's last partial block, take the generic loop.
 *
 * A level file includes q8_body.h (as Q8_GENERIC's level), defines Q8_LEVEL again and these, then
 * includes this file:
 *   Q8_W lanes; q8_vf / q8_vi its float / int vector; Q8_GENERIC the generic range function;
 *   q8f_set1 load loadu store storeu add sub mul div sqrt (floats), q8f_bf16 (Q8_W bf16 widened),
 *   q8i_zero max_u32 and (ints), q8i_abs_bits (|x|'s bits as ints), q8i_hmax_u32 (largest lane),
 *   and q8_dequant_block / q8_quant_block, as q8_body.h asks; it stores as q8_body.h does
 *   (q8_codes_out, q8_remainders_out). Optional: Q8_CODES_OUT_PAIR(m codes, m absmax out, m, m's
 *   absmax bits, v codes, v absmax out, v, v's absmax bits, len), both moments' q8_codes_out at once;
 *   Q8_MOMENT_IN(k, codes, absmax), Q8_W lanes of moment k (0 exp_avg, 1 exp_avg_sq) dequantized from
 *   their codes inside the arithmetic loop (without it, each moment is dequantized into L1 first);
 *   Q8_LANES_AHEAD, a distance in lanes: the loop prefetches each stream's line that far on;
 *   Q8_PAIR_CHUNK(m codes, m, 1/m's absmax (vector), m's absmax, v codes, v, 1/v's absmax, v's absmax),
 *   Q8_W lanes of both moments' codes where both absmaxes are q8_recip_ok. With it, and where the CPU's
 *   vendor chose it (hybrid_get_q8_pipeline: Intel), the range is a pipeline: block k's codes are
 *   written by block k + 1's arithmetic loop, beside its divisions and square roots, which on their
 *   own leave the other vector ports idle (an Intel core's divider takes 22 cycles per 16 lanes of
 *   both), and the last block's after the loop. Elsewhere each block's codes follow its own loop.
 * Q8_FN(q8_range) steps a range; Q8_FN(q8_block)(a, c, off) steps one whole block of a fusable step,
 * codes and all (a level's own range loop may call it).
 */

static inline int q8_fusable(const q8_args_t *a, const q8_consts_t *c)
{
    return a->exp_avg_dtype == DT_Q8 && a->exp_avg_sq_dtype == DT_Q8 && !c->amsgrad && !a->param_copy &&
           (a->grad_dtype == DT_F32 || a->grad_dtype == DT_BF16);
}

/* A block whose new moments wait in L1 for their codes (Q8_PAIR_CHUNK's pipeline, below): the next
 * block's arithmetic loop writes them, Q8_W lanes an iteration, beside its own divisions. */
typedef struct {
    float m[Q8_BLOCK] __attribute__((aligned(64))), v[Q8_BLOCK] __attribute__((aligned(64)));
    uint8_t *mc, *vc;
    float ma, va;
    int live;
} Q8_FN(q8_pending_t);

static inline __attribute__((always_inline)) void q8_fused_block(const q8_args_t *a, const q8_consts_t *c,
                                                                 int64_t off, const int l2, const int bf16_grad,
                                                                 const int remainders, Q8_FN(q8_pending_t) *now,
                                                                 const Q8_FN(q8_pending_t) *prev, const int quant,
                                                                 const int pipe)
{
    float *restrict mb = now->m, *restrict vb = now->v;
    float pb[Q8_BLOCK] __attribute__((aligned(64)));
    const int64_t blk = off / Q8_BLOCK;
#ifdef Q8_MOMENT_IN
    const uint8_t *mcodes = (const uint8_t *)a->exp_avg + off, *vcodes = (const uint8_t *)a->exp_avg_sq + off;
    const float mabs = a->exp_avg_absmax[blk], vabs = a->exp_avg_sq_absmax[blk];
#else
    q8_dequant_block(mb, (const uint8_t *)a->exp_avg + off, a->exp_avg_absmax[blk], q8_maps[0], Q8_BLOCK);
    q8_dequant_block(vb, (const uint8_t *)a->exp_avg_sq + off, a->exp_avg_sq_absmax[blk], q8_maps[1], Q8_BLOCK);
#endif
    const float *pin = (const float *)a->param + off;
    float *pout = (float *)a->param_out + off;
    if (remainders) {
        const uint16_t *p16 = (const uint16_t *)a->param + off, *r = (const uint16_t *)(const void *)a->remainder + off;
#pragma omp simd
        for (int i = 0; i < Q8_BLOCK; i++) pb[i] = remainder_decode(p16[i], r[i]);
        pin = pout = pb;
    }
    const q8_vf w1 = q8f_set1(c->one_minus_beta1), b2 = q8f_set1(c->beta2);
    const q8_vf w2 = q8f_set1(c->one_minus_beta2), eps = q8f_set1(c->eps);
    const q8_vf nss = q8f_set1(c->neg_step_size), ib = q8f_set1(c->inv_bias_correction2_sqrt);
    const q8_vf decay = q8f_set1(c->decay), wd = q8f_set1(c->l2);
    const q8_vf gscale = q8f_set1(c->grad_scale);
#ifdef Q8_PAIR_CHUNK
    const q8_vf psm = q8f_set1(quant ? 1.0f / prev->ma : 0.0f), psv = q8f_set1(quant ? 1.0f / prev->va : 0.0f);
    /* the block before, in locals: a code's byte store may alias any field the loop would reload */
    uint8_t *const pmc = prev->mc, *const pvc = prev->vc;
    const float *const pm = prev->m, *const pv = prev->v;
    const float pma = prev->ma, pva = prev->va;
#else
    (void)prev;
    (void)quant;
#endif
    /* g·1 is g, bit for bit (a signalling NaN is quieted by the next operation as by this one): the
     * multiply leaves the chain to the divide, 3 % of the pass at AVX-512 (in L1, 16 Ki elements) */
    const int scaled = c->grad_scale != 1.0f;
    const uint16_t *const g16 = (const uint16_t *)a->grad + off;
    const float *const g32 = (const float *)a->grad + off;
    q8_vi mx_m = q8i_zero(), mx_v = q8i_zero();
#ifdef Q8_LANES_AHEAD
    /* each stream's line Q8_LANES_AHEAD lanes on, prefetched as the loop reaches it (the codes' each
     * 64 lanes): past the end it never faults */
    const int psz = remainders ? 2 : 4, gsz = bf16_grad ? 2 : 4;
    const int64_t ahead = off + Q8_LANES_AHEAD;
    const char *ahead_p = (const char *)a->param + ahead * psz, *ahead_g = (const char *)a->grad + ahead * gsz;
    const char *ahead_r = remainders ? (const char *)(a->remainder + ahead) : NULL;
    const char *ahead_m = (const char *)a->exp_avg + ahead, *ahead_v = (const char *)a->exp_avg_sq + ahead;
#endif
    for (int i = 0; i < Q8_BLOCK; i += Q8_W) {
#ifdef Q8_LANES_AHEAD
        __builtin_prefetch(ahead_p + i * psz, 0, 3);
        __builtin_prefetch(ahead_g + i * gsz, 0, 3);
        if (remainders) __builtin_prefetch(ahead_r + i * 2, 0, 3);
        if (i % 64 == 0) {
            __builtin_prefetch(ahead_m + i, 0, 3);
            __builtin_prefetch(ahead_v + i, 0, 3);
        }
#endif
        const q8_vf p = q8f_loadu(pin + i);
        q8_vf g = bf16_grad ? q8f_bf16(g16 + i) : q8f_loadu(g32 + i);
        if (scaled) g = q8f_mul(g, gscale);
        if (l2) g = q8f_add(q8f_mul(p, wd), g);
#ifdef Q8_MOMENT_IN
        const q8_vf m0 = Q8_MOMENT_IN(0, mcodes + i, mabs), v0 = Q8_MOMENT_IN(1, vcodes + i, vabs);
#else
        const q8_vf m0 = q8f_load(mb + i), v0 = q8f_load(vb + i);
#endif
        const q8_vf m = q8f_add(q8f_mul(q8f_sub(g, m0), w1), m0);
        const q8_vf v = q8f_add(q8f_mul(q8f_mul(g, g), w2), q8f_mul(v0, b2));
        const q8_vf denom = q8f_add(q8f_mul(q8f_sqrt(v), ib), eps);
        q8f_storeu(pout + i, q8f_add(q8f_mul(p, decay), q8f_mul(q8f_div(m, denom), nss)));
        q8f_store(mb + i, m);
        q8f_store(vb + i, v);
        mx_m = q8i_max_u32(mx_m, q8i_abs_bits(m));
        mx_v = q8i_max_u32(mx_v, q8i_abs_bits(v));
#ifdef Q8_PAIR_CHUNK
        if (quant) Q8_PAIR_CHUNK(pmc + i, pm + i, psm, pma, pvc + i, pv + i, psv, pva);
#endif
    }
    if (remainders) q8_remainders_out(a, pb, off, Q8_BLOCK);
    uint8_t *mc = (uint8_t *)a->exp_avg_out + off, *vc = (uint8_t *)a->exp_avg_sq_out + off;
    float *ma_out = a->exp_avg_absmax_out + blk, *va_out = a->exp_avg_sq_absmax_out + blk;
    const uint32_t mx_m_bits = q8i_hmax_u32(mx_m), mx_v_bits = q8i_hmax_u32(mx_v);
#ifdef Q8_PAIR_CHUNK
    /* in a pipeline, the codes wait for the next block's loop where both absmaxes take the reciprocal
     * (the chunk's bounded quantizer); else they are written now, the one-moment way */
    now->ma = bits_f32(mx_m_bits);
    now->va = bits_f32(mx_v_bits);
    now->live = pipe && q8_recip_ok(now->ma) && q8_recip_ok(now->va);
    if (now->live) {
        *ma_out = now->ma;
        *va_out = now->va;
        now->mc = mc;
        now->vc = vc;
        return;
    }
#else
    (void)pipe;
#endif
#ifdef Q8_CODES_OUT_PAIR
    Q8_CODES_OUT_PAIR(mc, ma_out, mb, mx_m_bits, vc, va_out, vb, mx_v_bits, Q8_BLOCK);
#else
    q8_codes_out(mc, ma_out, mb, mx_m_bits, 0, Q8_BLOCK);
    q8_codes_out(vc, va_out, vb, mx_v_bits, 1, Q8_BLOCK);
#endif
}

/* One whole block of a fusable step: its flags as constants, one loop per combination. quant: prev
 * (live) is the block before, whose codes this block's loop writes; pipe: this block's codes may wait
 * for the next block's loop in turn. */
static inline __attribute__((always_inline)) void q8_block_flags(const q8_args_t *a, const q8_consts_t *c,
                                                                 int64_t off, Q8_FN(q8_pending_t) *now,
                                                                 const Q8_FN(q8_pending_t) *prev, const int quant,
                                                                 const int pipe)
{
    const int l2 = c->l2_mode, bf16 = a->grad_dtype == DT_BF16, rem = a->remainder != NULL;
    if (rem) {
        if (bf16) q8_fused_block(a, c, off, l2, 1, 1, now, prev, quant, pipe);
        else q8_fused_block(a, c, off, l2, 0, 1, now, prev, quant, pipe);
    } else if (l2) {
        if (bf16) q8_fused_block(a, c, off, 1, 1, 0, now, prev, quant, pipe);
        else q8_fused_block(a, c, off, 1, 0, 0, now, prev, quant, pipe);
    } else {
        if (bf16) q8_fused_block(a, c, off, 0, 1, 0, now, prev, quant, pipe);
        else q8_fused_block(a, c, off, 0, 0, 0, now, prev, quant, pipe);
    }
}

static inline __attribute__((always_inline)) void Q8_FN(q8_block_into)(const q8_args_t *a, const q8_consts_t *c,
                                                                       int64_t off, Q8_FN(q8_pending_t) *now,
                                                                       const Q8_FN(q8_pending_t) *prev)
{
#ifdef Q8_PAIR_CHUNK
    if (prev->live) {
        q8_block_flags(a, c, off, now, prev, 1, 1);
        return;
    }
#endif
    q8_block_flags(a, c, off, now, prev, 0, 1);
}

/* One whole block, its codes written before it returns (a level's own range loop may call it). */
static inline void Q8_FN(q8_block)(const q8_args_t *a, const q8_consts_t *c, int64_t off)
{
    Q8_FN(q8_pending_t) now, none = {.live = 0};
    q8_block_flags(a, c, off, &now, &none, 0, 0);
}

#ifdef Q8_PAIR_CHUNK
/* Whole blocks [begin, whole) as a pipeline (hybrid_get_q8_pipeline): block k's loop writes block
 * k - 1's codes, the two alternating between two L1 buffers; the last block's codes after the loop. */
static void Q8_FN(q8_pipeline)(const q8_args_t *a, const q8_consts_t *c, int64_t begin, int64_t whole)
{
    Q8_FN(q8_pending_t) buf[2];
    buf[0].live = buf[1].live = 0;
    int k = 0;
    for (int64_t off = begin; off < whole; off += Q8_BLOCK, k ^= 1) Q8_FN(q8_block_into)(a, c, off, &buf[k], &buf[k ^ 1]);
    const Q8_FN(q8_pending_t) *last = &buf[k ^ 1];
    if (last->live) {
        const q8_vf sm = q8f_set1(1.0f / last->ma), sv = q8f_set1(1.0f / last->va);
        for (int i = 0; i < Q8_BLOCK; i += Q8_W)
            Q8_PAIR_CHUNK(last->mc + i, last->m + i, sm, last->ma, last->vc + i, last->v + i, sv, last->va);
    }
}
#endif

void Q8_FN(q8_range)(const q8_args_t *a, const q8_consts_t *c, int64_t begin, int64_t end)
{
    if (!q8_fusable(a, c)) {
        Q8_GENERIC(a, c, begin, end);
        return;
    }
    const int64_t whole = begin + (end - begin) / Q8_BLOCK * Q8_BLOCK;
#ifdef Q8_PAIR_CHUNK
    if (hybrid_get_q8_pipeline()) Q8_FN(q8_pipeline)(a, c, begin, whole);
    else
#endif
        for (int64_t off = begin; off < whole; off += Q8_BLOCK) Q8_FN(q8_block)(a, c, off);
    if (whole < end) Q8_GENERIC(a, c, whole, end);
}
