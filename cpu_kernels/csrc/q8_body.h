/* The q8 Adam loop (q8.h), written once and compiled once per level.
 *
 * A level file defines Q8_LEVEL and two primitives with its own intrinsics, then includes this:
 *
 *   q8_dequant_block(dst, codes, absmax, map, len)   dst[i] = map[codes[i]] · absmax
 *   q8_quant_block(codes, x, absmax, table, zero, len) codes[i] = the code of x[i] / absmax
 *
 * Work goes one block of 256 at a time (the unit of an absmax): each input is read where it lies
 * (fp32) or widened / dequantized into an L1 buffer, one vectorised loop does the arithmetic into
 * L1 buffers, and the results leave narrowed (bf16, remainders) or quantized (q8: the block's
 * integer max, then one division per element). The arithmetic loop has only restrict-qualified
 * L1 outputs, so it vectorises whatever the inputs alias (in place, all of them do).
 */
#define Q8_CAT_(a, b) a##_##b
#define Q8_CAT(a, b) Q8_CAT_(a, b)
#define Q8_FN(name) Q8_CAT(name, Q8_LEVEL)

static inline void q8_widen(float *restrict dst, const void *src, int dt, int64_t off, int len)
{
    const uint16_t *s = (const uint16_t *)src + off;
    if (dt == DT_BF16) {
#pragma omp simd
        for (int i = 0; i < len; i++) dst[i] = bits_f32((uint32_t)s[i] << 16);
    } else if (dt == DT_F16) {
        for (int i = 0; i < len; i++) dst[i] = f16_to_f32(s[i]);
    } else {
        memcpy(dst, (const float *)src + off, (size_t)len * sizeof(float));
    }
}

/* A moment of this block as fp32: where it lies (fp32), or in buf (bf16 widened, q8 dequantized). */
static inline const float *q8_moment_in(float *restrict buf, const void *src, const float *absmax,
                                        int dt, int map, int64_t off, int len)
{
    if (dt == DT_F32) return (const float *)src + off;
    if (dt == DT_Q8) {
        q8_dequant_block(buf, (const uint8_t *)src + off, absmax[off / Q8_BLOCK], q8_maps[map], len);
    } else {
        q8_widen(buf, src, DT_BF16, off, len);
    }
    return buf;
}

/* A block's codes of its new moment x (fp32, in L1) in map (0 signed, 1 unsigned), given the bits
 * of its absmax (the largest |x|, taken by the caller), and the absmax. */
static inline void q8_codes_out(uint8_t *codes, float *absmax_out, const float *restrict x, uint32_t mx, int map,
                                int len)
{
    *absmax_out = bits_f32(mx);
    const int zero = map == 0 ? 127 : 0;
    if (mx == 0) memset(codes, zero, (size_t)len);  /* x = 0 when the absmax is 0 */
    else q8_quant_block(codes, x, bits_f32(mx), q8_buckets[map], zero, len);
}

/* The block's new fp32 master p stored as the bf16 param (its high half) and the remainder. */
static inline void q8_remainders_out(const q8_args_t *a, const float *restrict p, int64_t off, int len)
{
    uint16_t *po = (uint16_t *)a->param_out + off;
    int16_t *ro = a->remainder_out + off;
#pragma omp simd
    for (int i = 0; i < len; i++) {
        const uint32_t u = f32_bits(p[i]);
        po[i] = remainder_param_bits(u);
        ro[i] = (int16_t)(uint16_t)u;
    }
}

/* The block's new moment (fp32, in L1) stored in its format. */
static inline void q8_moment_out(void *dst, float *absmax_out, const float *restrict x, int dt, int map,
                                 int64_t off, int len)
{
    if (dt == DT_F32) {
        memcpy((float *)dst + off, x, (size_t)len * sizeof(float));
    } else if (dt == DT_BF16) {
        uint16_t *d = (uint16_t *)dst + off;
        for (int i = 0; i < len; i++) d[i] = f32_to_bf16(x[i]);
    } else {
        /* the largest magnitude on the bits: exact, and a NaN in the block is its absmax */
        uint32_t mx = 0;
#pragma omp simd reduction(max : mx)
        for (int i = 0; i < len; i++) {
            const uint32_t m = f32_bits(x[i]) & 0x7fffffffu;
            mx = m > mx ? m : mx;
        }
        q8_codes_out((uint8_t *)dst + off, absmax_out + off / Q8_BLOCK, x, mx, map, len);
    }
}

static inline __attribute__((always_inline)) void q8_math(
    const float *restrict pin, const float *restrict g, const float *restrict m, const float *restrict v,
    const float *restrict vmax, float *restrict pout, float *restrict mout, float *restrict vout,
    float *restrict vmaxout, int len, const q8_consts_t *c, const int amsgrad, const int l2)
{
    const float w1 = c->one_minus_beta1, b2 = c->beta2, w2 = c->one_minus_beta2;
    const float eps = c->eps, nss = c->neg_step_size, ib = c->inv_bias_correction2_sqrt;
    const float decay = c->decay, wd = c->l2, gscale = c->grad_scale;
#pragma omp simd
    for (int i = 0; i < len; i++) {
        const float p = pin[i];
        float gi = g[i] * gscale;
        if (l2) gi = p * wd + gi;
        const float mi = (gi - m[i]) * w1 + m[i];
        const float vi = (gi * gi) * w2 + v[i] * b2;
        float vv = vi;
        if (amsgrad) {
            vv = vmax[i] > vi ? vmax[i] : vi;  /* a NaN in v stays */
            vmaxout[i] = vv;
        }
        const float denom = __builtin_sqrtf(vv) * ib + eps;
        pout[i] = p * decay + (mi / denom) * nss;
        mout[i] = mi;
        vout[i] = vi;
    }
}

void Q8_FN(q8_range)(const q8_args_t *a, const q8_consts_t *c, int64_t begin, int64_t end)
{
    float gb[Q8_BLOCK] __attribute__((aligned(64))), pb[Q8_BLOCK] __attribute__((aligned(64)));
    float mb[Q8_BLOCK] __attribute__((aligned(64))), vb[Q8_BLOCK] __attribute__((aligned(64)));
    float xb[Q8_BLOCK] __attribute__((aligned(64)));
    float pob[Q8_BLOCK] __attribute__((aligned(64))), mob[Q8_BLOCK] __attribute__((aligned(64)));
    float vob[Q8_BLOCK] __attribute__((aligned(64))), xob[Q8_BLOCK] __attribute__((aligned(64)));
    const int mdt = a->exp_avg_dtype, vdt = a->exp_avg_sq_dtype, ams = c->amsgrad, l2 = c->l2_mode;
    const uint16_t *p16 = (const uint16_t *)a->param;
    for (int64_t off = begin; off < end; off += Q8_BLOCK) {
        const int len = (int)(end - off < Q8_BLOCK ? end - off : Q8_BLOCK);
        const float *pin;
        if (a->remainder) {  /* the fp32 master, decoded */
            const uint16_t *r = (const uint16_t *)(const void *)a->remainder + off;
#pragma omp simd
            for (int i = 0; i < len; i++) pb[i] = remainder_decode(p16[off + i], r[i]);
            pin = pb;
        } else {
            pin = (const float *)a->param + off;
        }
        const float *gin = (const float *)a->grad + off;
        if (a->grad_dtype != DT_F32) {
            q8_widen(gb, a->grad, a->grad_dtype, off, len);
            gin = gb;
        }
        const float *min = q8_moment_in(mb, a->exp_avg, a->exp_avg_absmax, mdt, 0, off, len);
        const float *vin = q8_moment_in(vb, a->exp_avg_sq, a->exp_avg_sq_absmax, vdt, 1, off, len);
        const float *xin = ams ? q8_moment_in(xb, a->max_exp_avg_sq, a->max_exp_avg_sq_absmax, vdt, 1, off, len)
                               : vin;

        if (ams) {
            if (l2) q8_math(pin, gin, min, vin, xin, pob, mob, vob, xob, len, c, 1, 1);
            else q8_math(pin, gin, min, vin, xin, pob, mob, vob, xob, len, c, 1, 0);
        } else {
            if (l2) q8_math(pin, gin, min, vin, xin, pob, mob, vob, xob, len, c, 0, 1);
            else q8_math(pin, gin, min, vin, xin, pob, mob, vob, xob, len, c, 0, 0);
        }

        if (a->remainder) {
            q8_remainders_out(a, pob, off, len);
        } else {
            memcpy((float *)a->param_out + off, pob, (size_t)len * sizeof(float));
        }
        if (a->param_copy) {
            uint16_t *cp = (uint16_t *)a->param_copy + off;
            if (a->copy_dtype == DT_BF16) for (int i = 0; i < len; i++) cp[i] = f32_to_bf16(pob[i]);
            else for (int i = 0; i < len; i++) cp[i] = f32_to_f16(pob[i]);
        }
        q8_moment_out(a->exp_avg_out, a->exp_avg_absmax_out, mob, mdt, 0, off, len);
        q8_moment_out(a->exp_avg_sq_out, a->exp_avg_sq_absmax_out, vob, vdt, 1, off, len);
        if (ams) q8_moment_out(a->max_exp_avg_sq_out, a->max_exp_avg_sq_absmax_out, xob, vdt, 1, off, len);
    }
}
