/* int8 and int8s quantization of a float32 block in one pass per group: the same bits as the
 * torch path of kvstrata.codecs._quant.quantize (int8) and kvstrata.codecs.int8s.quantize_sym.
 *
 * Per group of `group` consecutive values (one token's run of head_dim channels):
 * - int8 (asymmetric): zero = min rounded down to float16, scale = (max - zero) / 255 rounded up
 *   to float16, code = round((x - zero) / scale) clamped to [0, 255];
 * - int8s (symmetric): scale = max|x| / 127 rounded up to float16, code = round(x / scale)
 *   clamped to [-127, 127];
 * a zero scale divides by 1 (every code is then 0). Rounding is to nearest, ties to even (torch's
 * round); the divisions are float32 divisions (no reciprocal), so every code is torch's.
 *
 * Return values: 0, or 1 when the block holds NaN or inf (nothing meaningful written), or 2 when a
 * scale or zero point does not fit float16 (the caller raises the codec's error either way).
 *
 * int8s writes the resident page layout of kvstrata.codecs.int8s: per (layer, head), one page
 * [K codes (D, Tp) int8][V codes (T, D) int8][K scales (D/g, Tp) fp16][V scales (T, D/g) fp16],
 * Tp the tokens rounded up to 16, the padding zero. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

int kvs_quant_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx512f");
}

#define TARGET __attribute__((target("avx512f,f16c")))

TARGET static inline uint16_t half_up(float x) {
    return _cvtss_sh(x, _MM_FROUND_TO_POS_INF);
}

TARGET static inline uint16_t half_down(float x) {
    return _cvtss_sh(x, _MM_FROUND_TO_NEG_INF);
}

TARGET static inline float half_float(uint16_t h) { return _cvtsh_ss(h); }

TARGET static int all_finite(const float *x, int64_t count) {
    /* a float is finite unless its exponent bits are all ones */
    const __m512i exponent = _mm512_set1_epi32(0x7f800000);
    __mmask16 bad = 0;
    int64_t i = 0;
    for (; i + 16 <= count; i += 16) {
        const __m512i bits = _mm512_and_si512(_mm512_loadu_si512(x + i), exponent);
        bad |= _mm512_cmpeq_epi32_mask(bits, exponent);
    }
    int ok = bad == 0;
    for (; i < count; i++) ok &= isfinite(x[i]) != 0;
    return ok;
}

#define ROUND (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC) /* ties to even, as torch.round */

/* Codes of 16 values: round((v - shift) / div) clamped to [lo, hi], as bytes (two's complement). */
TARGET static inline __m128i codes16(const float *v, __m512 shift, __m512 div, __m512 lo, __m512 hi) {
    __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(v), shift), div), ROUND);
    q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
    return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q));
}

TARGET int kvs_int8_quant(const float *x, int64_t groups, int64_t group, uint8_t *codes, uint8_t *scale,
                          uint8_t *zero) {
    if (!all_finite(x, groups * group)) return 1;
    for (int64_t g = 0; g < groups; g++) {
        const float *v = x + g * group;
        float lo = v[0], hi = v[0];
        int64_t m = 0;
        if (group >= 16) {
            __m512 vlo = _mm512_loadu_ps(v), vhi = vlo;
            for (m = 16; m + 16 <= group; m += 16) {
                const __m512 w = _mm512_loadu_ps(v + m);
                vlo = _mm512_min_ps(vlo, w);
                vhi = _mm512_max_ps(vhi, w);
            }
            lo = _mm512_reduce_min_ps(vlo);
            hi = _mm512_reduce_max_ps(vhi);
        }
        for (int64_t j = m > 0 ? m : 1; j < group; j++) {
            lo = v[j] < lo ? v[j] : lo;
            hi = v[j] > hi ? v[j] : hi;
        }
        const uint16_t zh = half_down(lo);
        const float zf = half_float(zh);
        const uint16_t sh = half_up((hi - zf) / 255.0f);
        const float sf = half_float(sh);
        if (!isfinite(zf) || !isfinite(sf)) return 2;
        const float div = sf > 0.0f ? sf : 1.0f;
        uint8_t *c = codes + g * group;
        int64_t j = 0;
        const __m512 vz = _mm512_set1_ps(zf), vd = _mm512_set1_ps(div);
        const __m512 vlo = _mm512_setzero_ps(), vhi = _mm512_set1_ps(255.0f);
        for (; j + 16 <= group; j += 16) _mm_storeu_si128((__m128i *)(c + j), codes16(v + j, vz, vd, vlo, vhi));
        for (; j < group; j++) {
            float q = nearbyintf((v[j] - zf) / div);
            q = q < 0.0f ? 0.0f : (q > 255.0f ? 255.0f : q);
            c[j] = (uint8_t)q;
        }
        memcpy(scale + 2 * g, &sh, 2); /* any alignment: the caller's buffer is bytes */
        memcpy(zero + 2 * g, &zh, 2);
    }
    return 0;
}

/* One group of int8s: its codes into out (stride apart) and its scale's float16 bits. */
TARGET static int sym_group(const float *v, int64_t group, int8_t *out, int64_t stride, uint16_t *bits) {
    float hi = 0.0f;
    int64_t m = 0;
    if (group >= 16) {
        __m512 vhi = _mm512_setzero_ps();
        for (; m + 16 <= group; m += 16) vhi = _mm512_max_ps(vhi, _mm512_abs_ps(_mm512_loadu_ps(v + m)));
        hi = _mm512_reduce_max_ps(vhi);
    }
    for (int64_t j = m; j < group; j++) {
        const float a = fabsf(v[j]);
        hi = a > hi ? a : hi;
    }
    const uint16_t sh = half_up(hi / 127.0f);
    const float sf = half_float(sh);
    if (!isfinite(sf)) return 2;
    const float div = sf > 0.0f ? sf : 1.0f;
    int64_t j = 0;
    const __m512 zero = _mm512_setzero_ps(), vd = _mm512_set1_ps(div);
    const __m512 vlo = _mm512_set1_ps(-127.0f), vhi = _mm512_set1_ps(127.0f);
    if (stride == 1) {
        for (; j + 16 <= group; j += 16) _mm_storeu_si128((__m128i *)(out + j), codes16(v + j, zero, vd, vlo, vhi));
    } else {
        int8_t lane[16];
        for (; j + 16 <= group; j += 16) {
            _mm_storeu_si128((__m128i *)lane, codes16(v + j, zero, vd, vlo, vhi));
            for (int k = 0; k < 16; k++) out[(j + k) * stride] = lane[k];
        }
    }
    for (; j < group; j++) {
        float q = nearbyintf(v[j] / div);
        q = q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q);
        out[j * stride] = (int8_t)q;
    }
    *bits = sh;
    return 0;
}

TARGET int kvs_int8s_quant(const float *x, int64_t runs, int64_t tokens, int64_t padded, int64_t dim,
                           int64_t group, uint8_t *pages) {
    const int64_t per_token = dim / group;
    const int64_t page = (padded + tokens) * dim + (padded + tokens) * per_token * 2;
    if (!all_finite(x, 2 * runs * tokens * dim)) return 1;
    memset(pages, 0, (size_t)(runs * page));
    for (int64_t r = 0; r < runs; r++) {
        uint8_t *p = pages + r * page;
        int8_t *kc = (int8_t *)p, *vc = (int8_t *)(p + padded * dim);
        uint8_t *ks = p + (padded + tokens) * dim, *vs = ks + padded * per_token * 2;
        const float *keys = x + r * tokens * dim, *values = x + (runs + r) * tokens * dim;
        for (int64_t t = 0; t < tokens; t++)
            for (int64_t k = 0; k < per_token; k++) {
                uint16_t bits;
                /* keys lie channel by channel: channel d of token t at d * padded + t */
                if (sym_group(keys + t * dim + k * group, group, kc + k * group * padded + t, padded, &bits))
                    return 2;
                memcpy(ks + 2 * (k * padded + t), &bits, 2);
                if (sym_group(values + t * dim + k * group, group, vc + t * dim + k * group, 1, &bits))
                    return 2;
                memcpy(vs + 2 * (t * per_token + k), &bits, 2);
            }
    }
    return 0;
}
