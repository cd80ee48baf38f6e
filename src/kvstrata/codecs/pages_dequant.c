/* Resident pages (kvstrata/codecs/pages.py) of one layer dequantized into float32 keys and
 * values, for attention that needs them as tensors (a prefill continuing a session: one layer at a
 * time, into a scratch buffer the next layer reuses).
 *
 * The arithmetic is the codecs' own, with the same bits as their torch decode: int8s
 * `code * scale`; KIVI `code * scale + zero`, the product rounded to float32, then the sum (two
 * intrinsics, never fused); kvmix as KIVI, its values then turned back by the fast Walsh-Hadamard
 * transform in kvstrata/codecs/kvmix.py's order of butterflies, times 1 / sqrt(head_dim). Keys lie channel by channel in a page and are written token by token
 * with scatters of 16 tokens; values lie token by token.
 *
 * table: pages x 4 int64 (codec id, byte offset of the block's pages in `arena`, tokens, group),
 * each block's pages (layers, heads, page bytes); out_k / out_v: float32, or bfloat16 with `bf16`
 * (each float32 result rounded to nearest even, as torch's .to(torch.bfloat16) rounds: the same
 * bits as float32 then converted, without writing the float32 layer and reading it again), the
 * block's tokens in table order, element (h, t, d) at h * head_stride + t * token_stride + d. The
 * caller has checked the table against the arena (kvstrata/codecs/_pages_native.py). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

enum { KIVI4 = 5, KIVI2 = 6, INT8S = 10, KVMIX = 11, LANES = 16 };

int kvs_pages_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c");
}

static int64_t key_tokens(int64_t codec, int64_t tokens) {
    int64_t span = codec == INT8S ? LANES : codec == KIVI4 ? 2 * LANES : 4 * LANES; /* kvmix: as KIVI2 */
    return (tokens + span - 1) / span * span;
}

/* key channels a kvmix page holds at 4 bits */
static int64_t mix_wide(int64_t dim) { return dim * 3 / 8; }

int64_t kvs_page_nbytes(int64_t codec, int64_t tokens, int64_t group, int64_t dim) {
    int64_t padded = key_tokens(codec, tokens), per_token = dim / group;
    if (codec == INT8S) return (padded + tokens) * dim + (padded + tokens) * per_token * 2;
    if (codec == KVMIX)
        return dim + mix_wide(dim) * padded / 2 + (dim - mix_wide(dim)) * padded / 4 + tokens * dim / 4 + 4 * dim +
               2 * tokens * per_token * 2;
    int64_t per_byte = codec == KIVI4 ? 2 : 4;
    return (padded + tokens) * dim / per_byte + 2 * dim * 2 + 2 * tokens * per_token * 2;
}

#define TARGET __attribute__((target("avx512f,f16c")))

TARGET static inline __m512 halves16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

TARGET static inline float half_at(const uint8_t *p, int64_t index) {
    uint16_t h;
    memcpy(&h, p + 2 * index, sizeof h);
    return _cvtsh_ss(h);
}

TARGET static inline __m512 int8s16(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

TARGET static inline __mmask16 lanes_below(int64_t n) {
    return n >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

/* 16 tokens' values of one channel into column `d` of rows token_stride apart */
TARGET static inline void scatter16(float *column, int64_t token_stride, __mmask16 valid, __m512 x) {
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)token_stride));
    _mm512_mask_i32scatter_ps(column, valid, rows, x, 4);
}

/* 16 floats rounded to bfloat16, nearest even (finite inputs: dequantized values always are) */
TARGET static inline __m256i bf16x16(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

/* Where dequantized rows go: float32 rows, or bfloat16 rows (token_stride in elements either way) */
typedef struct {
    void *base;
    int64_t token_stride;
    int bf16;
} Rows;

/* 16 floats at (token t, channel d) on */
TARGET static inline void put16(Rows r, int64_t t, int64_t d, __m512 x) {
    if (r.bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)r.base + t * r.token_stride + d), bf16x16(x));
    else
        _mm512_storeu_ps((float *)r.base + t * r.token_stride + d, x);
}

/* A page's keys lie channel by channel: 16 tokens of each channel go into a float tile (scatters
 * within L1), whose rows are then written out token by token */
enum { TILE_DIM = 256 };
typedef struct {
    float v[LANES][TILE_DIM];
} KeyTile;

TARGET static inline void tile_put(KeyTile *tile, int64_t d, __mmask16 valid, __m512 x) {
    scatter16(&tile->v[0][d], TILE_DIM, valid, x);
}

TARGET static inline void tile_out(const KeyTile *tile, Rows r, int64_t t, int64_t n, int64_t dim) {
    for (int64_t i = 0; i < n; ++i)
        for (int64_t d = 0; d < dim; d += LANES) put16(r, t + i, d, _mm512_loadu_ps(&tile->v[i][d]));
}

/* The next block's page of the same (layer, head), asked for into L2 a slice at a time over the loop
 * writing this page's keys (see decode_attention.cpp's Ahead): 30 layers of 4,096 SmolLM2 tokens,
 * int8s 13.5 -> 11.0 ms, KIVI-4 11.8 -> 9.7 (this project's AMD VM) */
typedef struct {
    const char *base;
    int64_t bytes, slice;
} Ahead;

static inline Ahead ahead_over(Ahead a, int64_t steps) {
    a.slice = (a.bytes / steps + 64) / 64 * 64;
    return a;
}

static inline void ahead_step(Ahead a, int64_t i) {
    const int64_t first = i * a.slice;
    if (first >= a.bytes) return;
    const int64_t end = first + a.slice < a.bytes ? first + a.slice : a.bytes;
    for (int64_t b = first; b < end; b += 64) _mm_prefetch(a.base + b, _MM_HINT_T1);
}

TARGET static void int8s_page(const uint8_t *base, int64_t tokens, int64_t group, int64_t dim, Rows ok,
                              Rows ov, Ahead ahead) {
    const int64_t tp = key_tokens(INT8S, tokens), per_token = dim / group;
    const uint8_t *kc = base, *vc = base + tp * dim;
    const uint8_t *ks = vc + tokens * dim, *vs = ks + tp * per_token * 2;
    KeyTile tile;
    const Ahead next = ahead_over(ahead, tp / LANES);
    for (int64_t t = 0; t < tokens; t += LANES) {
        ahead_step(next, t / LANES);
        const __mmask16 valid = lanes_below(tokens - t);
        for (int64_t d = 0; d < dim; ++d)
            tile_put(&tile, d, valid, _mm512_mul_ps(int8s16(kc + d * tp + t), halves16(ks + 2 * ((d / group) * tp + t))));
        tile_out(&tile, ok, t, tokens - t < LANES ? tokens - t : LANES, dim);
    }
    for (int64_t t = 0; t < tokens; ++t)
        for (int64_t d = 0; d < dim; d += LANES) {
            __m512 s = _mm512_set1_ps(half_at(vs, t * per_token + d / group));
            put16(ov, t, d, _mm512_mul_ps(int8s16(vc + t * dim + d), s));
        }
}

TARGET static void kivi_page(const uint8_t *base, int64_t codec, int64_t tokens, int64_t group, int64_t dim,
                             Rows ok, Rows ov, Ahead ahead) {
    const int bits = codec == KIVI4 ? 4 : 2, per_byte = 8 / bits, span = LANES * per_byte;
    const int64_t tp = key_tokens(codec, tokens), row = tp / per_byte, per_token = dim / group;
    const uint8_t *kc = base, *vc = base + dim * row;
    const uint8_t *ks = vc + tokens * dim / per_byte, *kz = ks + 2 * dim;
    const uint8_t *vs = kz + 2 * dim, *vz = vs + tokens * per_token * 2;
    const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
    KeyTile tile;
    const Ahead next = ahead_over(ahead, (tokens + LANES - 1) / LANES);
    for (int64_t first = 0; first < tokens; first += LANES) {
        ahead_step(next, first / LANES);
        /* tokens first .. first + 16: bits k * bits of the 16-byte unit of codes holding them */
        const int64_t t = first / span * span, k = (first - t) / LANES;
        const __mmask16 valid = lanes_below(tokens - first);
        for (int64_t d = 0; d < dim; ++d) {
            const __m512 s = _mm512_set1_ps(half_at(ks, d)), z = _mm512_set1_ps(half_at(kz, d));
            const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(kc + d * row + t / per_byte)));
            const __m512i code = _mm512_and_si512(_mm512_srli_epi32(bytes, (unsigned)(k * bits)), mask);
            tile_put(&tile, d, valid, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(code), s), z));
        }
        tile_out(&tile, ok, first, tokens - first < LANES ? tokens - first : LANES, dim);
    }
    for (int64_t t = 0; t < tokens; ++t)
        for (int64_t u = 0; u < dim / span; ++u) {
            const int64_t vg = u * span / group;
            const __m512 s = _mm512_set1_ps(half_at(vs, t * per_token + vg));
            const __m512 z = _mm512_set1_ps(half_at(vz, t * per_token + vg));
            const __m512i bytes =
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(vc + t * (dim / per_byte) + u * LANES)));
            for (int k = 0; k < per_byte; ++k) {
                const __m512i code = _mm512_and_si512(_mm512_srli_epi32(bytes, (unsigned)(k * bits)), mask);
                const __m512 x = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(code), s), z);
                put16(ov, t, u * span + k * LANES, x);
            }
        }
}

/* kvstrata/codecs/kvmix.py: keys in the page's channel order, the first mix_wide(dim) 4-bit;
 * values 2-bit of the rotated values, each token's row turned back */
TARGET static void kvmix_page(const uint8_t *base, int64_t tokens, int64_t group, int64_t dim, Rows ok, Rows ov,
                              Ahead ahead) {
    const int64_t wide = mix_wide(dim), tp = key_tokens(KVMIX, tokens), per_token = dim / group;
    const uint8_t *order = base, *kw = base + dim, *kn = kw + wide * tp / 2;
    const uint8_t *vc = kn + (dim - wide) * tp / 4, *ks = vc + tokens * dim / 4, *kz = ks + 2 * dim;
    const uint8_t *vs = kz + 2 * dim, *vz = vs + tokens * per_token * 2;
    const __m512i mask4 = _mm512_set1_epi32(15), mask2 = _mm512_set1_epi32(3);
    KeyTile tile;
    const Ahead next = ahead_over(ahead, (tokens + LANES - 1) / LANES);
    for (int64_t first = 0; first < tokens; first += LANES) {
        ahead_step(next, first / LANES);
        const int64_t t = first / 64 * 64, k = (first - t) / LANES; /* vector k of the 64 tokens from t */
        const __mmask16 valid = lanes_below(tokens - first);
        for (int64_t j = 0; j < dim; ++j) {
            const __m512 s = _mm512_set1_ps(half_at(ks, j)), z = _mm512_set1_ps(half_at(kz, j));
            __m512i code;
            if (j < wide) {
                const uint8_t *unit = kw + j * (tp / 2) + t / 2 + (k / 2) * LANES;
                const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)unit));
                code = _mm512_and_si512(_mm512_srli_epi32(bytes, (unsigned)(4 * (k % 2))), mask4);
            } else {
                const uint8_t *unit = kn + (j - wide) * (tp / 4) + t / 4;
                const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)unit));
                code = _mm512_and_si512(_mm512_srli_epi32(bytes, (unsigned)(2 * k)), mask2);
            }
            tile_put(&tile, order[j], valid, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(code), s), z));
        }
        tile_out(&tile, ok, first, tokens - first < LANES ? tokens - first : LANES, dim);
    }
    const float norm = 1.0f / __builtin_sqrtf((float)dim);
    float row[TILE_DIM] __attribute__((aligned(64)));
    for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t u = 0; u < dim / 64; ++u) {
            const int64_t vg = u * 64 / group;
            const __m512 s = _mm512_set1_ps(half_at(vs, t * per_token + vg));
            const __m512 z = _mm512_set1_ps(half_at(vz, t * per_token + vg));
            const __m512i bytes =
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(vc + t * (dim / 4) + u * LANES)));
            for (int k = 0; k < 4; ++k) {
                const __m512i code = _mm512_and_si512(_mm512_srli_epi32(bytes, (unsigned)(2 * k)), mask2);
                _mm512_storeu_ps(row + u * 64 + k * LANES, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(code), s), z));
            }
        }
        for (int64_t len = 1; len < dim; len *= 2)
            for (int64_t i = 0; i < dim; i += 2 * len)
                for (int64_t j = i; j < i + len; ++j) {
                    const float a = row[j], b = row[j + len];
                    row[j] = a + b;
                    row[j + len] = a - b;
                }
        for (int64_t d = 0; d < dim; d += LANES)
            put16(ov, t, d, _mm512_mul_ps(_mm512_loadu_ps(row + d), _mm512_set1_ps(norm)));
    }
}

TARGET void kvs_pages_dequant(const uint8_t *arena, const int64_t *table, int64_t pages, int64_t layer,
                              int64_t heads, int64_t dim, void *out_k, void *out_v, int64_t head_stride,
                              int64_t token_stride, int64_t bf16) {
    const int64_t element = bf16 ? 2 : 4;
    int64_t t0 = 0;
    for (int64_t p = 0; p < pages; ++p) {
        const int64_t codec = table[4 * p], offset = table[4 * p + 1], tokens = table[4 * p + 2],
                      group = table[4 * p + 3];
        const int64_t nbytes = kvs_page_nbytes(codec, tokens, group, dim);
        for (int64_t h = 0; h < heads; ++h) {
            const uint8_t *base = arena + offset + (layer * heads + h) * nbytes;
            Ahead ahead = {0, 0, 0};
            if (p + 1 < pages) {
                const int64_t *n = table + 4 * (p + 1);
                const int64_t next_bytes = kvs_page_nbytes(n[0], n[2], n[3], dim);
                ahead.base = (const char *)arena + n[1] + (layer * heads + h) * next_bytes;
                ahead.bytes = next_bytes;
            }
            const int64_t at = (h * head_stride + t0 * token_stride) * element;
            const Rows ok = {(char *)out_k + at, token_stride, (int)bf16};
            const Rows ov = {(char *)out_v + at, token_stride, (int)bf16};
            if (codec == INT8S)
                int8s_page(base, tokens, group, dim, ok, ov, ahead);
            else if (codec == KVMIX)
                kvmix_page(base, tokens, group, dim, ok, ov, ahead);
            else
                kivi_page(base, codec, tokens, group, dim, ok, ov, ahead);
        }
        t0 += tokens;
    }
}

/* Every layer of the table's pages into out_k / out_v, layer l's at l * layer_stride elements: one
 * call for a block a restore decodes into its buffer (through ctypes a call costs about as much as
 * dequantizing one layer of a 16-token block). */
TARGET void kvs_pages_dequant_layers(const uint8_t *arena, const int64_t *table, int64_t pages, int64_t layers,
                                     int64_t heads, int64_t dim, void *out_k, void *out_v, int64_t layer_stride,
                                     int64_t head_stride, int64_t token_stride, int64_t bf16) {
    const int64_t step = layer_stride * (bf16 ? 2 : 4);
    for (int64_t layer = 0; layer < layers; ++layer)
        kvs_pages_dequant(arena, table, pages, layer, heads, dim, (char *)out_k + layer * step,
                          (char *)out_v + layer * step, head_stride, token_stride, bf16);
}
