// Decode attention of a batched step on CPU: every decode row's one query (its query heads
// grouped by the key/value head they share) against that row's own keys and values, all rows in
// one call, in float32 arithmetic. A row's history is its exact tokens (float32 or bfloat16) and,
// optionally, encoded blocks held as resident pages (kvstrata/codecs/pages.py: int8s, kivi4,
// kivi2, kvmix), which are dequantized inside the loops here, never into a buffer. Built on first use by
// kvstrata/engine/batch/decode_kernel.py (see its docstring for why and for the measurements);
// that module falls back to torch where this is not built.
//
// Work items are (row, kv head) pairs, longest history first, dealt round-robin to the threads of
// torch's intra-op pool: one item is one thread's, so an item's arithmetic (and so its result)
// does not depend on how many threads run or how the rows are batched.
//
// Attention does not depend on the order of the keys (their positions are inside them, rotated
// in), so an item walks its pages in page-table order, then its exact tokens; the optional
// attention mass it adds up per token (for importance) follows the same order.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kLanes = 16;      // floats in one 512-bit vector
constexpr int kMaxGroup = 8;    // query heads per key/value head
constexpr int kMaxChunks = 16;  // head_dim / kLanes: head_dim up to 256
constexpr int kMaxHeadDim = kLanes * kMaxChunks;
constexpr int kChains = 4;  // independent sums of an int8s page's scores (a scale group: a multiple of 16 channels)
static_assert(kChains == 4, "int8s_scores adds the chains up as two pairs");

// page codecs: kvstrata.codecs.base.CodecId
constexpr int64_t kKivi4 = 5, kKivi2 = 6, kInt8s = 10, kKvmix = 11;
constexpr int64_t kTableColumns = 4;  // codec, byte offset, tokens, group

#pragma GCC push_options
#pragma GCC target("avx512f,f16c")

typedef float v16 __attribute__((vector_size(64)));
typedef int v16i __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 x;
  __builtin_memcpy(&x, p, sizeof x);
  return x;
}

inline void store16(float* p, v16 x) { __builtin_memcpy(p, &x, sizeof x); }

// Conversions go through intrinsics: GCC lowers __builtin_convertvector from a 16-byte vector
// to a 64-byte one element by element under a target pragma (a scalar convert per lane).

// 16 keys' or values' elements from `base` (float32, or bfloat16: its bits are a float's upper half)
inline v16 load_kv(const void* base, int64_t index, bool bf16) {
  if (bf16) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const unsigned short*>(base) + index));
    return reinterpret_cast<v16>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
  return load16(static_cast<const float*>(base) + index);
}

// 16 int8 codes as floats
inline v16 load_i8(const unsigned char* p) {
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<v16>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)));
}

// 16 bytes as 16 ints (0..255)
inline v16i load_u8(const unsigned char* p) {
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<v16i>(_mm512_cvtepu8_epi32(c));
}

inline v16 to_float(v16i x) { return reinterpret_cast<v16>(_mm512_cvtepi32_ps(reinterpret_cast<__m512i>(x))); }

inline float half_at(const unsigned char* p, int64_t index) {
  unsigned short h;
  __builtin_memcpy(&h, p + 2 * index, sizeof h);
  return _cvtsh_ss(h);
}

// 16 fp16 values as floats
inline v16 halves16(const unsigned char* p) {
  return reinterpret_cast<v16>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}

constexpr int64_t kAhead = 16;  // tokens of exact keys or values read ahead of the one computed

// Ask for the cache lines of the row `kAhead` tokens on: the hardware prefetchers restart at every
// 4 KiB page, and an item's keys and values are two streams read one after the other. SmolLM2, a
// decode step of 8 rows of 500 tokens in process (one process each, this project's Intel VM): bf16
// 60.1 -> 56.6-57.0 ms, fp32 98.3 -> 95.3 ms; 8 or 32 tokens ahead gave less than 16. Past a
// row's end this asks for lines never loaded: harmless.
// Into L2 (kL2), for the values of the tokens whose keys are being read: an item's values
// (64 KiB for 500 bf16 tokens of a 64-wide head) then wait in L2 for the pass over them, the two
// streams read from memory at once (SmolLM2, 8 rows of 500 tokens, a step's kernel calls, one
// process each, alternated, this project's Intel VM: bf16 12.5 / 12.8 -> 10.9 / 11.6 ms, fp32
// 19.1 / 19.0 -> 17.5 / 17.9 ms).
constexpr int kL1 = _MM_HINT_T0, kL2 = _MM_HINT_T1;
template <int Hint = kL1>
inline void prefetch_bytes(const char* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, static_cast<_mm_hint>(Hint));
}

// the first n (>= 1) of 16 lanes
inline __mmask16 lanes_below(int64_t n) { return n >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

inline void store_masked(float* p, __mmask16 valid, v16 x) {
  _mm512_mask_storeu_ps(p, valid, reinterpret_cast<__m512>(x));
}

// `count` (a multiple of 16) fp16 values to floats
inline void halves_to_floats(const unsigned char* p, int64_t count, float* out) {
  for (int64_t i = 0; i < count; i += kLanes) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * i));
    store16(out + i, reinterpret_cast<v16>(_mm512_cvtph_ps(h)));
  }
}

inline float hsum(v16 x) {
  x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return x[0];
}

// The sums of 16 vectors (p: 16 rows of 16 floats, 64-byte aligned) as one vector: lane j is
// the sum of row j. A tree of unpacks and lane shuffles, 30 shuffles where 16 horizontal sums
// take 64.
inline v16 sum16(const float* p) {
  __m512 a[kLanes];
  for (int j = 0; j < kLanes; ++j) a[j] = _mm512_load_ps(p + j * kLanes);
  __m512 b[8];  // per 128-bit lane: rows 2i and 2i+1, two partial sums each
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  __m512 c[4];  // per 128-bit lane: rows 4i .. 4i+3, that lane's sum of each
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    c[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 f0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], kEven), _mm512_shuffle_f32x4(c[0], c[1], kOdd));
  const __m512 f1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], kEven), _mm512_shuffle_f32x4(c[2], c[3], kOdd));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(f0, f1, kEven), _mm512_shuffle_f32x4(f0, f1, kOdd));
  return reinterpret_cast<v16>(r);
}

// exp of 16 floats: Cephes' expf (range reduction by ln 2, degree-5 polynomial), within 2 ulp.
inline v16 exp16(v16 x) {
  const v16 hi = v16{} + 88.3762626647949f, lo = v16{} - 87.3365447504f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const v16 fx = x * 1.44269504088896341f + 0.5f;
  v16i n = __builtin_convertvector(fx, v16i);  // truncates: floor for what follows
  n = __builtin_convertvector(n, v16) > fx ? n - 1 : n;
  const v16 fn = __builtin_convertvector(n, v16);
  x = x - fn * 0.693359375f - fn * -2.12194440e-4f;
  v16 y = v16{} + 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  const v16i bits = (n + 127) << 23;
  v16 scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// One page of one (layer, head): where its parts lie (kvstrata/codecs/pages.py).
struct Page {
  int64_t codec, tokens, group;
  const unsigned char* base;
};

// Key channels a kvmix page holds at 4 bits (the widest 3/8), the rest at 2.
inline int64_t mix_wide(int64_t dim) { return dim * 3 / 8; }

// bytes of one (layer, head) page
// Tokens a page's keys are padded to (int8s: whole vectors; kivi: whole 16-byte units of codes).
inline int64_t key_tokens(int64_t codec, int64_t tokens) {
  const int64_t span = codec == kInt8s ? kLanes : codec == kKivi4 ? 2 * kLanes : 4 * kLanes;  // kvmix: as kivi2
  return (tokens + span - 1) / span * span;
}

inline int64_t page_nbytes(int64_t codec, int64_t tokens, int64_t group, int64_t dim) {
  const int64_t padded = key_tokens(codec, tokens), per_token = dim / group;
  if (codec == kInt8s) return (padded + tokens) * dim + (padded + tokens) * per_token * 2;
  if (codec == kKvmix) {  // kvstrata/codecs/kvmix.py: order, wide and narrow key codes, values, scales
    const int64_t wide = mix_wide(dim);
    return dim + wide * padded / 2 + (dim - wide) * padded / 4 + tokens * dim / 4 + 4 * dim +
           2 * tokens * per_token * 2;
  }
  const int64_t per_byte = codec == kKivi4 ? 2 : 4;
  return (padded + tokens) * dim / per_byte + 2 * dim * 2 + 2 * tokens * per_token * 2;
}

inline void prefetch_page(const Page& p, int64_t dim) {
  prefetch_bytes<kL2>(reinterpret_cast<const char*>(p.base), page_nbytes(p.codec, p.tokens, p.group, dim));
}

// The next page, keys and values, asked for into L2 a slice at a time over the loop that reads
// this page's keys: an item's pages lie apart in the arena (a block's pages of every layer and
// head, then the next block's), so the hardware prefetchers start cold at each. Asked for whole
// when a page began, the lines made no difference: SmolLM2 bf16, 4,096 tokens, a step's kernel
// calls, int8s pages 6.7 ms with or without (this project's AMD VM; exact 3.9 ms, and int8s 2.4
// with every page in cache); in slices, 3.3 ms (KIVI-4 5.9 -> 3.2, kvmix 5.7 -> 3.6). The values
// pass then finds each page in L2 (asking for its next page's values again there made KIVI-4's
// token loop slower and nothing faster).
struct Ahead {
  const char* base = nullptr;
  int64_t bytes = 0, slice = 0;  // no bytes: nothing to ask for

  // the same bytes over a loop of `steps` (>= 1) calls of step()
  Ahead over(int64_t steps) const { return Ahead{base, bytes, (bytes / steps + 64) / 64 * 64}; }

  void step(int64_t i) const {
    const int64_t first = i * slice;
    if (first < bytes) prefetch_bytes<kL2>(base + first, std::min(slice, bytes - first));
  }
};

// One (row, kv head): what it attends to.
struct Item {
  const void* k;  // exact tokens
  const void* v;
  int64_t exact, kstride, vstride;
  const Page* pages;
  int64_t num_pages, total;
  float* mass;  // per token of the item's order (pages, then exact), or null
};

// The shape of one item's arithmetic: `groups` queries of `chunks` * 16 floats. FixedGroups /
// FixedChunks: the shape as compile-time constants (0: the run-time arguments), so that the
// common shapes keep their queries and accumulators in registers. Each method reads the shape into
// locals first: a member's value is not a constant to the compiler inside a method it does not
// inline, and with members the loops stayed rolled over a run-time count and the accumulators
// went through memory (SmolLM2 at 4,096 tokens, bf16: exact 7.0 -> 4.2 ms a step's kernel
// calls, int8s pages 11.1 -> 7.2, kivi4 9.7 -> 6.2, with the int8s loops and the max below).
template <int FixedGroups, int FixedChunks, bool BF16>
struct Attend {
  const int run_groups, run_chunks;  // the run-time shape, used where FixedGroups / FixedChunks are 0
  explicit Attend(int g, int c) : run_groups(g), run_chunks(c) {}

  // Scores of an int8s page, 16 tokens at a time: the page's keys lie channel by channel, so
  // q . k for 16 tokens is a sum over channels of q[d] times the 16 tokens' codes of channel d
  // (no horizontal sum), times each token's scale (per scale group of channels).
  void int8s_scores(const float* q, const Page& p, float* scores, int64_t padded, const Ahead& ahead) const {
    const int groups = FixedGroups ? FixedGroups : run_groups, chunks = FixedChunks ? FixedChunks : run_chunks;
    const int dim = chunks * kLanes;
    const int per_token = dim / p.group;
    const int64_t tp = key_tokens(kInt8s, p.tokens);
    const unsigned char* codes = p.base;
    const unsigned char* kscale = p.base + tp * dim + p.tokens * dim;
    const Ahead next = ahead.over(tp / kLanes);
    for (int64_t t = 0; t < p.tokens; t += kLanes) {
      next.step(t / kLanes);
      v16 total[kMaxGroup];
      for (int g = 0; g < groups; ++g) total[g] = v16{};
      for (int sg = 0; sg < per_token; ++sg) {
        // kChains sums a group, over alternate channels: one sum is a chain of dependent FMAs
        // (its latency, not the FMA units, bounds it: 64 channels took 4 cycles each)
        v16 acc[kMaxGroup][kChains];
        for (int g = 0; g < groups; ++g)
          for (int k = 0; k < kChains; ++k) acc[g][k] = v16{};
        for (int d = sg * p.group; d < (sg + 1) * p.group; d += kChains) {
          for (int k = 0; k < kChains; ++k) {
            const v16 x = load_i8(codes + (d + k) * tp + t);
            for (int g = 0; g < groups; ++g) acc[g][k] += q[g * dim + d + k] * x;
          }
        }
        const v16 s = halves16(kscale + 2 * (sg * tp + t));
        for (int g = 0; g < groups; ++g) total[g] += ((acc[g][0] + acc[g][1]) + (acc[g][2] + acc[g][3])) * s;
      }
      const __mmask16 valid = lanes_below(p.tokens - t);
      for (int g = 0; g < groups; ++g) store_masked(scores + g * padded + t, valid, total[g]);
    }
  }

  // Scores of a KIVI page: keys per channel, so q . (codes * s + z) = (q * s) . codes + q . z;
  // the codes lie channel by channel, a 16-byte unit holding 32 (4-bit) or 64 (2-bit) tokens.
  template <int Bits>
  void kivi_scores(const float* q, const Page& p, float* scores, int64_t padded, const Ahead& ahead) const {
    const int groups = FixedGroups ? FixedGroups : run_groups, chunks = FixedChunks ? FixedChunks : run_chunks;
    constexpr int per_byte = 8 / Bits, span = kLanes * per_byte, mask = (1 << Bits) - 1;
    const int dim = chunks * kLanes;
    const int64_t tp = key_tokens(Bits == 4 ? kKivi4 : kKivi2, p.tokens);
    const int64_t row = tp / per_byte;  // code bytes of one channel
    const unsigned char* codes = p.base;
    const unsigned char* kscale = p.base + dim * row + p.tokens * dim / per_byte;
    const unsigned char* kzero = kscale + 2 * dim;
    alignas(64) float s[kMaxHeadDim], z[kMaxHeadDim], qs[kMaxGroup * kMaxHeadDim];
    halves_to_floats(kscale, dim, s);
    halves_to_floats(kzero, dim, z);
    float qz[kMaxGroup];
    for (int g = 0; g < groups; ++g) {
      v16 dot = v16{};
      for (int c = 0; c < chunks; ++c) {
        const v16 qc = load16(q + g * dim + c * kLanes);
        store16(qs + g * dim + c * kLanes, qc * load16(s + c * kLanes));
        dot += qc * load16(z + c * kLanes);
      }
      qz[g] = hsum(dot);
    }
    const Ahead next = ahead.over(tp / span * chunks);  // a slice each 16 channels
    for (int64_t t = 0; t < p.tokens; t += span) {
      v16 acc[kMaxGroup][per_byte];
      for (int g = 0; g < groups; ++g)
        for (int k = 0; k < per_byte; ++k) acc[g][k] = v16{};
      for (int c = 0; c < chunks; ++c) {
        next.step(t / span * chunks + c);
        for (int d = c * kLanes; d < (c + 1) * kLanes; ++d) {
          const v16i bytes = load_u8(codes + d * row + t / per_byte);
          for (int k = 0; k < per_byte; ++k) {
            const v16 x = to_float((bytes >> (k * Bits)) & mask);
            for (int g = 0; g < groups; ++g) acc[g][k] += qs[g * dim + d] * x;
          }
        }
      }
      for (int k = 0; k < per_byte; ++k) {
        const int64_t first = t + k * kLanes;
        if (first >= p.tokens) break;
        const __mmask16 valid = lanes_below(p.tokens - first);
        for (int g = 0; g < groups; ++g) store_masked(scores + g * padded + first, valid, acc[g][k] + qz[g]);
      }
    }
  }

  // Values of an int8s page, weighted by the softmax numerators `w` (groups rows of `padded`).
  void int8s_values(v16 (&acc)[kMaxGroup][kMaxChunks], const Page& p, const float* w,
                    int64_t padded) const {
    const int groups = FixedGroups ? FixedGroups : run_groups, chunks = FixedChunks ? FixedChunks : run_chunks;
    const int dim = chunks * kLanes;
    const int per_token = dim / p.group;
    const int64_t tp = key_tokens(kInt8s, p.tokens);
    const unsigned char* codes = p.base + tp * dim;
    const unsigned char* vscale = codes + p.tokens * dim + tp * per_token * 2;
    if (per_token == 1) {  // one scale a token: folded into the weights, 16 tokens at a time
      for (int64_t t0 = 0; t0 < p.tokens; t0 += kLanes) {
        const int64_t n = std::min<int64_t>(kLanes, p.tokens - t0);
        v16 s;
        if (n == kLanes) {
          s = halves16(vscale + 2 * t0);
        } else {  // a short page's scales end before 16 (a read of 16 could leave the arena)
          s = v16{};
          for (int64_t i = 0; i < n; ++i) s[i] = half_at(vscale, t0 + i);
        }
        alignas(64) float ws[kMaxGroup][kLanes];
        for (int g = 0; g < groups; ++g) {
          const __m512 wg = _mm512_maskz_loadu_ps(lanes_below(n), w + g * padded + t0);
          store16(ws[g], reinterpret_cast<v16>(wg) * s);
        }
        for (int64_t t = 0; t < n; ++t) {
          for (int c = 0; c < chunks; ++c) {
            const v16 x = load_i8(codes + (t0 + t) * dim + c * kLanes);
            for (int g = 0; g < groups; ++g) acc[g][c] += ws[g][t] * x;
          }
        }
      }
      return;
    }
    for (int64_t t = 0; t < p.tokens; ++t) {  // a scale per group of channels
      for (int c = 0; c < chunks; ++c) {
        const v16 x = load_i8(codes + t * dim + c * kLanes) * half_at(vscale, t * per_token + c * kLanes / p.group);
        for (int g = 0; g < groups; ++g) acc[g][c] += w[g * padded + t] * x;
      }
    }
  }

  // Values of a KIVI page: per token (and value group) v = codes * s_t + z_t, so the weighted
  // sum is (w * s_t) . codes plus (w . z_t) per value group; a token's 16-byte unit of codes
  // unpacks into 2 (4-bit) or 4 (2-bit) vectors of consecutive channels.
  template <int Bits>
  void kivi_values(v16 (&acc)[kMaxGroup][kMaxChunks], const Page& p, const float* w,
                   int64_t padded) const {
    const int dim = (FixedChunks ? FixedChunks : run_chunks) * kLanes;
    constexpr int per_byte = 8 / Bits;
    const int64_t tp = key_tokens(Bits == 4 ? kKivi4 : kKivi2, p.tokens);
    const unsigned char* codes = p.base + dim * tp / per_byte;
    const unsigned char* vscale = codes + p.tokens * dim / per_byte + 4 * dim;
    token_values<Bits>(acc, p, codes, vscale, w, padded);
  }

  // Values quantized per token, `codes` then (after the keys' scales) `vscale` and the zeros.
  template <int Bits>
  void token_values(v16 (&acc)[kMaxGroup][kMaxChunks], const Page& p, const unsigned char* codes,
                    const unsigned char* vscale, const float* w, int64_t padded) const {
    const int groups = FixedGroups ? FixedGroups : run_groups, chunks = FixedChunks ? FixedChunks : run_chunks;
    constexpr int per_byte = 8 / Bits, span = kLanes * per_byte, mask = (1 << Bits) - 1;
    const int dim = chunks * kLanes, units = dim / span;
    const int per_token = dim / p.group;  // value groups per token
    const unsigned char* vzero = vscale + p.tokens * per_token * 2;
    float zsum[kMaxGroup][kMaxChunks];
    for (int g = 0; g < groups; ++g)
      for (int c = 0; c < per_token; ++c) zsum[g][c] = 0.0f;
    for (int64_t t = 0; t < p.tokens; ++t) {
      for (int u = 0; u < units; ++u) {
        const int vg = u * span / p.group;
        const float s = half_at(vscale, t * per_token + vg);
        float ws[kMaxGroup];
        for (int g = 0; g < groups; ++g) ws[g] = w[g * padded + t] * s;
        if (u * span % p.group == 0) {  // the group's first unit
          const float z = half_at(vzero, t * per_token + vg);
          for (int g = 0; g < groups; ++g) zsum[g][vg] += w[g * padded + t] * z;
        }
        const v16i bytes = load_u8(codes + t * (dim / per_byte) + u * kLanes);
        for (int k = 0; k < per_byte; ++k) {
          const v16 x = to_float((bytes >> (k * Bits)) & mask);
          for (int g = 0; g < groups; ++g) acc[g][u * per_byte + k] += ws[g] * x;
        }
      }
    }
    for (int g = 0; g < groups; ++g)
      for (int c = 0; c < chunks; ++c) acc[g][c] += zsum[g][c * kLanes / p.group];
  }

  // Scores of a kvmix page: keys per channel as KIVI's, in the page's channel order (the query
  // permuted to it once), the first mix_wide(dim) channels' codes 4-bit, the others 2-bit; 64
  // tokens at a time (a unit of 2-bit codes, two of 4-bit ones).
  void mix_scores(const float* q, const Page& p, float* scores, int64_t padded, const Ahead& ahead) const {
    const int groups = FixedGroups ? FixedGroups : run_groups, chunks = FixedChunks ? FixedChunks : run_chunks;
    const int dim = chunks * kLanes, wide = static_cast<int>(mix_wide(dim));
    const int64_t tp = key_tokens(kKvmix, p.tokens);
    const unsigned char* order = p.base;
    const unsigned char* wide_codes = order + dim;
    const unsigned char* narrow_codes = wide_codes + wide * tp / 2;
    const unsigned char* kscale = narrow_codes + (dim - wide) * tp / 4 + p.tokens * dim / 4;
    alignas(64) float s[kMaxHeadDim], z[kMaxHeadDim], qs[kMaxGroup * kMaxHeadDim];
    halves_to_floats(kscale, dim, s);
    halves_to_floats(kscale + 2 * dim, dim, z);
    float qz[kMaxGroup];
    for (int g = 0; g < groups; ++g) {
      float dot = 0.0f;
      for (int j = 0; j < dim; ++j) {
        const float qj = q[g * dim + order[j]];
        qs[g * dim + j] = qj * s[j];
        dot += qj * z[j];
      }
      qz[g] = dot;
    }
    constexpr int kEvery = 8;  // channels a slice (the wide ones are a multiple of 8)
    const Ahead next = ahead.over(tp / (4 * kLanes) * (dim / kEvery));
    for (int64_t t = 0; t < p.tokens; t += 4 * kLanes) {
      v16 acc[kMaxGroup][4];
      for (int g = 0; g < groups; ++g)
        for (int k = 0; k < 4; ++k) acc[g][k] = v16{};
      for (int j = 0; j < wide; ++j) {
        if (j % kEvery == 0) next.step(t / (4 * kLanes) * (dim / kEvery) + j / kEvery);
        for (int u = 0; u < 2; ++u) {  // tokens t + 32 u .. + 31
          const v16i bytes = load_u8(wide_codes + j * tp / 2 + t / 2 + u * kLanes);
          for (int k = 0; k < 2; ++k) {
            const v16 x = to_float((bytes >> (4 * k)) & 15);
            for (int g = 0; g < groups; ++g) acc[g][2 * u + k] += qs[g * dim + j] * x;
          }
        }
      }
      for (int j = wide; j < dim; ++j) {
        if (j % kEvery == 0) next.step(t / (4 * kLanes) * (dim / kEvery) + j / kEvery);
        const v16i bytes = load_u8(narrow_codes + (j - wide) * tp / 4 + t / 4);
        for (int k = 0; k < 4; ++k) {
          const v16 x = to_float((bytes >> (2 * k)) & 3);
          for (int g = 0; g < groups; ++g) acc[g][k] += qs[g * dim + j] * x;
        }
      }
      for (int k = 0; k < 4; ++k) {
        const int64_t first = t + k * kLanes;
        if (first >= p.tokens) break;
        const __mmask16 valid = lanes_below(p.tokens - first);
        for (int g = 0; g < groups; ++g) store_masked(scores + g * padded + first, valid, acc[g][k] + qz[g]);
      }
    }
  }

  // Rotated values of a kvmix page, added to `rotated` (turned back once per query, in run()).
  void mix_values(v16 (&rotated)[kMaxGroup][kMaxChunks], const Page& p, const float* w, int64_t padded) const {
    const int dim = (FixedChunks ? FixedChunks : run_chunks) * kLanes;
    const int64_t wide = mix_wide(dim), tp = key_tokens(kKvmix, p.tokens);
    const unsigned char* codes = p.base + dim + wide * tp / 2 + (dim - wide) * tp / 4;
    token_values<2>(rotated, p, codes, codes + p.tokens * dim / 4 + 4 * dim, w, padded);
  }

  // acc += H x for each query, H the normalised Hadamard matrix (a fast Walsh-Hadamard transform)
  void unrotate(v16 (&acc)[kMaxGroup][kMaxChunks], v16 (&x)[kMaxGroup][kMaxChunks]) const {
    const int groups = FixedGroups ? FixedGroups : run_groups, chunks = FixedChunks ? FixedChunks : run_chunks;
    const int dim = chunks * kLanes;
    const float norm = 1.0f / std::sqrt(static_cast<float>(dim));
    alignas(64) float h[kMaxHeadDim];
    for (int g = 0; g < groups; ++g) {
      for (int c = 0; c < chunks; ++c) store16(h + c * kLanes, x[g][c]);
      for (int len = 1; len < dim; len *= 2)
        for (int i = 0; i < dim; i += 2 * len)
          for (int j = i; j < i + len; ++j) {
            const float a = h[j], b = h[j + len];
            h[j] = a + b;
            h[j + len] = a - b;
          }
      for (int c = 0; c < chunks; ++c) acc[g][c] += load16(h + c * kLanes) * norm;
    }
  }

  void run(const float* q, const Item& it, float scale, float* scores, float* out) const {
    const int groups = FixedGroups ? FixedGroups : run_groups, chunks = FixedChunks ? FixedChunks : run_chunks;
    constexpr bool bf16 = BF16;
    const int64_t length = it.total;
    const int64_t padded = (length + kLanes - 1) / kLanes * kLanes;
    const int dim = chunks * kLanes;
    v16 qv[kMaxGroup][kMaxChunks];
    alignas(64) float qscaled[kMaxGroup * kMaxHeadDim];
    for (int g = 0; g < groups; ++g)
      for (int c = 0; c < chunks; ++c) {
        qv[g][c] = load16(q + (g * chunks + c) * kLanes) * scale;
        store16(qscaled + g * dim + c * kLanes, qv[g][c]);
      }
    int64_t t0 = 0;
    if (it.num_pages > 0) prefetch_page(it.pages[0], dim);
    for (int64_t i = 0; i < it.num_pages; ++i) {
      const Page& p = it.pages[i];
      Ahead ahead;  // the next page, while this one's keys are read
      if (i + 1 < it.num_pages) {
        const Page& n = it.pages[i + 1];
        ahead = Ahead{reinterpret_cast<const char*>(n.base), page_nbytes(n.codec, n.tokens, n.group, dim)};
      }
      if (p.codec == kInt8s) int8s_scores(qscaled, p, scores + t0, padded, ahead);
      else if (p.codec == kKivi4) kivi_scores<4>(qscaled, p, scores + t0, padded, ahead);
      else if (p.codec == kKvmix) mix_scores(qscaled, p, scores + t0, padded, ahead);
      else kivi_scores<2>(qscaled, p, scores + t0, padded, ahead);
      t0 += p.tokens;
    }
    // 16 tokens at a time: each token's products per query, then the 16 sums of each query in
    // one reduction (sum16); a horizontal sum per token and query spent most of this loop's
    // shuffles (SmolLM2, 8 rows of 500 tokens, a step's kernel calls: bf16 15.95 -> 14.65 ms, fp32
    // 22.6 -> 21.6 ms, one process each on this project's Intel VM)
    alignas(64) float partial[kMaxGroup][kLanes * kLanes];
    int64_t t = 0;
    constexpr int64_t element = bf16 ? 2 : 4;
    for (; t + kLanes <= it.exact; t += kLanes) {
      for (int j = 0; j < kLanes; ++j) {
        prefetch_bytes(static_cast<const char*>(it.k) + (t + j + kAhead) * it.kstride * element, dim * element);
        prefetch_bytes<kL2>(static_cast<const char*>(it.v) + (t + j + kAhead) * it.vstride * element, dim * element);
        v16 acc[kMaxGroup];
        for (int g = 0; g < groups; ++g) acc[g] = v16{};
        for (int c = 0; c < chunks; ++c) {
          const v16 kc = load_kv(it.k, (t + j) * it.kstride + c * kLanes, bf16);
          for (int g = 0; g < groups; ++g) acc[g] += qv[g][c] * kc;
        }
        for (int g = 0; g < groups; ++g) store16(partial[g] + j * kLanes, acc[g]);
      }
      for (int g = 0; g < groups; ++g) store16(scores + g * padded + t0 + t, sum16(partial[g]));
    }
    for (; t < it.exact; ++t) {
      v16 acc[kMaxGroup];
      for (int g = 0; g < groups; ++g) acc[g] = v16{};
      for (int c = 0; c < chunks; ++c) {
        const v16 kc = load_kv(it.k, t * it.kstride + c * kLanes, bf16);
        for (int g = 0; g < groups; ++g) acc[g] += qv[g][c] * kc;
      }
      for (int g = 0; g < groups; ++g) scores[g * padded + t0 + t] = hsum(acc[g]);
    }
    v16 lane;
    for (int i = 0; i < kLanes; ++i) lane[i] = static_cast<float>(i);
    float inverse[kMaxGroup];
    for (int g = 0; g < groups; ++g) {
      float* s = scores + g * padded;
      v16 tops = v16{} - INFINITY;
      for (int64_t t = 0; t < padded; t += kLanes) {
        const v16 x = load16(s + t);
        tops = lane < static_cast<float>(length - t) && x > tops ? x : tops;  // the padding is stale
      }
      float top = tops[0];
      for (int i = 1; i < kLanes; ++i) top = std::max(top, tops[i]);
      v16 total = v16{};
      for (int64_t t = 0; t < padded; t += kLanes) {
        v16 e = exp16(load16(s + t) - top);
        const auto valid = lane < static_cast<float>(length - t);
        e = valid ? e : v16{};  // the padding past the history weighs nothing
        store16(s + t, e);
        total += e;
      }
      inverse[g] = 1.0f / hsum(total);
    }
    v16 acc[kMaxGroup][kMaxChunks];
    for (int g = 0; g < groups; ++g)
      for (int c = 0; c < chunks; ++c) acc[g][c] = v16{};
    t0 = 0;
    bool rotated_pages = false;
    v16 rotated[kMaxGroup][kMaxChunks];
    for (int64_t i = 0; i < it.num_pages; ++i) {
      const Page& p = it.pages[i];
      if (p.codec == kKvmix && !rotated_pages) {
        rotated_pages = true;
        for (int g = 0; g < groups; ++g)
          for (int c = 0; c < chunks; ++c) rotated[g][c] = v16{};
      }
      if (p.codec == kInt8s) int8s_values(acc, p, scores + t0, padded);
      else if (p.codec == kKivi4) kivi_values<4>(acc, p, scores + t0, padded);
      else if (p.codec == kKvmix) mix_values(rotated, p, scores + t0, padded);
      else kivi_values<2>(acc, p, scores + t0, padded);
      t0 += p.tokens;
    }
    if (rotated_pages) unrotate(acc, rotated);
    for (int64_t t = 0; t < it.exact; ++t) {
      prefetch_bytes(static_cast<const char*>(it.v) + (t + kAhead) * it.vstride * element, dim * element);
      for (int c = 0; c < chunks; ++c) {
        const v16 vc = load_kv(it.v, t * it.vstride + c * kLanes, bf16);
        for (int g = 0; g < groups; ++g) acc[g][c] += scores[g * padded + t0 + t] * vc;
      }
    }
    for (int g = 0; g < groups; ++g)
      for (int c = 0; c < chunks; ++c) store16(out + (g * chunks + c) * kLanes, acc[g][c] * inverse[g]);
    if (it.mass != nullptr) {  // each token's probability, summed over the group's queries
      for (int64_t t = 0; t < padded; t += kLanes) {
        v16 m = v16{};
        for (int g = 0; g < groups; ++g) m += load16(scores + g * padded + t) * inverse[g];
        const int64_t n = std::min<int64_t>(kLanes, length - t);
        for (int i = 0; i < n; ++i) it.mass[t + i] += m[i];
      }
    }
  }
};

void attend(const float* q, const Item& it, int groups, int chunks, bool bf16, float scale,
            float* scores, float* out) {
#define KVSTRATA_SHAPE(G, C)                                                        \
  if (groups == G && chunks == C) {                                                 \
    if (bf16) return Attend<G, C, true>(groups, chunks).run(q, it, scale, scores, out); \
    return Attend<G, C, false>(groups, chunks).run(q, it, scale, scores, out);      \
  }
  KVSTRATA_SHAPE(3, 4)  // SmolLM2-135M: 9 query heads over 3, head_dim 64
  KVSTRATA_SHAPE(4, 4)
  KVSTRATA_SHAPE(2, 4)
  KVSTRATA_SHAPE(4, 8)  // Llama-3 8B: 32 over 8, head_dim 128
  KVSTRATA_SHAPE(8, 8)
#undef KVSTRATA_SHAPE
  if (bf16) return Attend<0, 0, true>(groups, chunks).run(q, it, scale, scores, out);
  Attend<0, 0, false>(groups, chunks).run(q, it, scale, scores, out);
}

#pragma GCC pop_options

// Tried and left out (2026-12-05): bf16 keys against the query with AVX512-BF16's vdpbf16ps (a
// bf16 model's query is exact in bf16, so each product is exact in float32) and values split into
// even and odd elements by a shift and a mask instead of widening: 8 rows of 500 SmolLM2 tokens,
// a step's calls 7.50 against 7.47 ms, alternated. The loops wait on memory, not on arithmetic.

bool page_fits(int64_t codec, int64_t group, int64_t dim) {
  if (codec == kKvmix)  // kvstrata/codecs/kvmix.py: fits()
    return (dim & (dim - 1)) == 0 && dim >= 64 && dim <= kMaxHeadDim && group % 64 == 0 && group >= 64 &&
           dim % group == 0;
  if (codec != kInt8s && codec != kKivi4 && codec != kKivi2) return false;
  const int64_t span = codec == kInt8s ? kLanes : codec == kKivi4 ? 2 * kLanes : 4 * kLanes;
  return group >= 1 && dim % span == 0 && group % span == 0 && dim % group == 0;
}

}  // namespace

bool supported() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c"); }

// query: (rows, kv_heads, group, head_dim) float32 or bfloat16; keys[r], values[r]: (1, kv_heads, length_r,
// head_dim), all float32 or all bfloat16, on CPU with the last dimension contiguous (the row's
// exact tokens). Optionally, per row: arenas[r] (uint8, the row's pages) with tables[r] (int64
// (pages, 4): codec, byte offset, tokens, group; see kvstrata/codecs/pages.py), read at `layer`
// of `num_layers`; masses[r] (float32 (kv_heads, >= tokens)) to which each token's attention
// probability (summed over its group's queries) is added. Returns (rows, kv_heads, group,
// head_dim) in the query's dtype: the arithmetic is float32, a bfloat16 result rounded once (as
// torch's .to() rounds; converted here, the two torch operators cost 1 ms of a 30-layer step).
at::Tensor decode_attention(const at::Tensor& query, const std::vector<at::Tensor>& keys,
                            const std::vector<at::Tensor>& values, double scale,
                            const std::vector<at::Tensor>& arenas, const std::vector<at::Tensor>& tables,
                            int64_t layer, int64_t num_layers, const std::vector<at::Tensor>& masses) {
  TORCH_CHECK(supported(), "decode_attention needs a CPU with AVX-512");
  TORCH_CHECK(query.dim() == 4 && (query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16) &&
                  query.device().is_cpu(),
              "query: float32 or bfloat16 (rows, kv_heads, group, head_dim) on CPU");
  const int64_t rows = query.size(0), heads = query.size(1), groups = query.size(2),
                dim = query.size(3);
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == rows && static_cast<int64_t>(values.size()) == rows,
              "one keys and one values tensor per row");
  TORCH_CHECK(rows >= 1, "at least one row");
  const bool paged = !arenas.empty();
  TORCH_CHECK(!paged || (static_cast<int64_t>(arenas.size()) == rows &&
                         static_cast<int64_t>(tables.size()) == rows),
              "one arena and one page table per row, or none");
  TORCH_CHECK(!paged || (num_layers >= 1 && layer >= 0 && layer < num_layers), "layer out of range");
  TORCH_CHECK(masses.empty() || static_cast<int64_t>(masses.size()) == rows, "one mass tensor per row, or none");
  const at::ScalarType kv_type = keys[0].scalar_type();
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kBFloat16, "keys and values: float32 or bfloat16");
  TORCH_CHECK(dim % kLanes == 0 && dim / kLanes <= kMaxChunks && groups >= 1 && groups <= kMaxGroup,
              "head_dim must be a multiple of 16 up to 256, and 1 to 8 query heads per kv head");
  std::vector<std::vector<Page>> pages(rows);
  std::vector<int64_t> totals(rows);
  for (int64_t r = 0; r < rows; ++r) {
    for (const at::Tensor* t : {&keys[r], &values[r]}) {
      TORCH_CHECK(t->dim() == 4 && t->size(0) == 1 && t->size(1) == heads && t->size(3) == dim &&
                      t->scalar_type() == kv_type && t->device().is_cpu() && t->stride(3) == 1,
                  "keys and values: all float32 or all bfloat16, (1, kv_heads, length, head_dim) "
                  "on CPU, last dim contiguous");
    }
    TORCH_CHECK(keys[r].size(2) == values[r].size(2), "a row's keys and values differ in length");
    int64_t total = keys[r].size(2);
    if (paged && tables[r].numel() > 0) {
      const at::Tensor& arena = arenas[r];
      const at::Tensor& table = tables[r];
      TORCH_CHECK(arena.dim() == 1 && arena.scalar_type() == at::kByte && arena.device().is_cpu() &&
                      arena.is_contiguous(),
                  "arenas: contiguous uint8 on CPU");
      TORCH_CHECK(table.dim() == 2 && table.size(1) == kTableColumns && table.scalar_type() == at::kLong &&
                      table.is_contiguous(),
                  "page tables: contiguous int64 (pages, 4)");
      const int64_t* rowsp = table.data_ptr<int64_t>();
      const unsigned char* base = arena.data_ptr<unsigned char>();
      for (int64_t i = 0; i < table.size(0); ++i) {
        const int64_t codec = rowsp[i * 4], offset = rowsp[i * 4 + 1], tokens = rowsp[i * 4 + 2],
                      group = rowsp[i * 4 + 3];
        TORCH_CHECK(page_fits(codec, group, dim), "a page of codec ", codec, " and group ", group,
                    " that this kernel does not read (head_dim ", dim, ")");
        TORCH_CHECK(tokens >= 1, "a page of no tokens");
        const int64_t nbytes = page_nbytes(codec, tokens, group, dim);
        TORCH_CHECK(offset >= 0 && offset + num_layers * heads * nbytes <= arena.numel(),
                    "a page lies outside its arena");
        pages[r].push_back(Page{codec, tokens, group, base + offset + layer * heads * nbytes});
        total += tokens;
      }
    }
    TORCH_CHECK(total >= 1, "a row attends to at least one token");
    totals[r] = total;
    if (!masses.empty() && masses[r].numel() > 0) {
      const at::Tensor& m = masses[r];
      TORCH_CHECK(m.dim() == 2 && m.size(0) == heads && m.size(1) >= total && m.scalar_type() == at::kFloat &&
                      m.stride(1) == 1 && m.device().is_cpu(),
                  "masses: float32 (kv_heads, >= tokens) on CPU, last dim contiguous");
    }
  }
  const at::Tensor q = query.contiguous();
  at::Tensor out = at::empty({rows, heads, groups, dim}, query.options());
  const int64_t items = rows * heads;
  std::vector<int64_t> order(items);
  for (int64_t i = 0; i < items; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return totals[a / heads] > totals[b / heads]; });
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  const bool bf16 = kv_type == at::kBFloat16;
  const int64_t element = bf16 ? 2 : 4;
  const bool bf16_query = query.scalar_type() == at::kBFloat16;
  std::vector<float> qfloats;
  if (bf16_query) {
    const at::BFloat16* from = q.data_ptr<at::BFloat16>();
    qfloats.resize(q.numel());
    for (int64_t i = 0; i < q.numel(); ++i) qfloats[i] = static_cast<float>(from[i]);
  }
  const float* qdata = bf16_query ? qfloats.data() : q.data_ptr<float>();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> item_out(bf16_query ? groups * dim : 0);
    std::vector<Page> head_pages;
    for (int64_t thread = begin; thread < end; ++thread) {
      for (int64_t i = thread; i < items; i += threads) {
        const int64_t r = order[i] / heads, h = order[i] % heads;
        const at::Tensor& k = keys[r];
        const at::Tensor& v = values[r];
        head_pages = pages[r];
        for (Page& p : head_pages) p.base += h * page_nbytes(p.codec, p.tokens, p.group, dim);
        float* mass = nullptr;
        if (!masses.empty() && masses[r].numel() > 0)
          mass = masses[r].data_ptr<float>() + h * masses[r].stride(0);
        const Item item{static_cast<const char*>(k.data_ptr()) + h * k.stride(1) * element,
                        static_cast<const char*>(v.data_ptr()) + h * v.stride(1) * element,
                        k.size(2),
                        k.stride(2),
                        v.stride(2),
                        head_pages.data(),
                        static_cast<int64_t>(head_pages.size()),
                        totals[r],
                        mass};
        scores.resize(groups * ((totals[r] + kLanes - 1) / kLanes * kLanes));
        const int64_t at = (r * heads + h) * groups * dim;
        float* result = bf16_query ? item_out.data() : out.data_ptr<float>() + at;
        attend(qdata + at, item, static_cast<int>(groups), static_cast<int>(dim / kLanes), bf16,
               static_cast<float>(scale), scores.data(), result);
        if (bf16_query) {
          at::BFloat16* to = out.data_ptr<at::BFloat16>() + at;
          for (int64_t j = 0; j < groups * dim; ++j) to[j] = static_cast<at::BFloat16>(result[j]);
        }
      }
    }
  });
  return out;
}

// layer_ops.cpp: the elementwise parts of a batched Llama step
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(at::Tensor hidden, const at::Tensor& delta, const at::Tensor& weight, double eps);
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
bool append_rows(const at::Tensor& keys, const at::Tensor& values, const std::vector<at::Tensor>& buffers,
                 std::vector<at::Tensor> views, const std::vector<int64_t>& sizes);

// decode_step.cpp: the decoder layers of a decode step
py::tuple decode_layers(at::Tensor hidden, at::Tensor x, const std::vector<at::Tensor>& weights,
                        const std::vector<double>& eps, const at::Tensor& cos, const at::Tensor& sin,
                        const std::vector<at::Tensor>& buffers, std::vector<at::Tensor> views, int64_t heads,
                        int64_t kv_heads, int64_t head_dim, double scaling, const std::vector<at::Tensor>& arenas,
                        const std::vector<at::Tensor>& tables, const std::vector<at::Tensor>& masses,
                        py::object interrupt);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "Whether this CPU runs the kernel (AVX-512 and F16C).");
  // the arguments are converted first; the GIL is then released, as torch's own operators do
  m.def("decode_attention", &decode_attention,
        "Decode rows' attention (fp32 or bf16 exact KV, int8s / kivi4 / kivi2 / kvmix pages), on CPU.",
        py::arg("query"), py::arg("keys"), py::arg("values"), py::arg("scale"),
        py::arg("arenas") = std::vector<at::Tensor>(), py::arg("tables") = std::vector<at::Tensor>(),
        py::arg("layer") = 0, py::arg("num_layers") = 1, py::arg("masses") = std::vector<at::Tensor>(),
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "transformers' LlamaRMSNorm of x's rows.", py::arg("x"), py::arg("weight"),
        py::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, "hidden += delta in place, then rms_norm(hidden).", py::arg("hidden"),
        py::arg("delta"), py::arg("weight"), py::arg("eps"));
  m.def("rotate", &rotate, "Rotary embedding of (tokens, heads, dim) as apply_rotary_pos_emb.", py::arg("x"),
        py::arg("cos"), py::arg("sin"));
  m.def("append_rows", &append_rows,
        "Append each row's new keys and values to its layer's buffer and lengthen its views in place.",
        py::arg("keys"), py::arg("values"), py::arg("buffers"), py::arg("views"), py::arg("sizes"));
  // releases the GIL itself (it takes it again to ask `interrupt`)
  m.def("decode_layers", &decode_layers,
        "A Llama decode step's decoder layers (every row one token, linears packed for oneDNN).",
        py::arg("hidden"), py::arg("x"), py::arg("weights"), py::arg("eps"), py::arg("cos"), py::arg("sin"),
        py::arg("buffers"), py::arg("views"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
        py::arg("scaling"), py::arg("arenas"), py::arg("tables"), py::arg("masses"), py::arg("interrupt"));
}
