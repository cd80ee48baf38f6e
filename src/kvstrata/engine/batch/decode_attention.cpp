// Decode attention of a batched step on CPU: every decode row's one query (its query heads
// grouped by the key/value head they share) against that row's own keys and values (float32 or
// bfloat16), all rows in one call, in float32 arithmetic. Built on first use by kvstrata/engine/batch/decode_kernel.py (see its docstring for
// why and for the measurements); that module falls back to torch's sdpa where this is not built.
//
// Work items are (row, kv head) pairs, longest history first, dealt round-robin to the threads of
// torch's intra-op pool: one item is one thread's, so an item's arithmetic (and so its result)
// does not depend on how many threads run or how the rows are batched.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kLanes = 16;      // floats in one 512-bit vector
constexpr int kMaxGroup = 8;    // query heads per key/value head
constexpr int kMaxChunks = 16;  // head_dim / kLanes: head_dim up to 256

#pragma GCC push_options
#pragma GCC target("avx512f")

typedef float v16 __attribute__((vector_size(64)));
typedef int v16i __attribute__((vector_size(64)));
typedef unsigned short v16h __attribute__((vector_size(32)));

inline v16 load16(const float* p) {
  v16 x;
  __builtin_memcpy(&x, p, sizeof x);
  return x;
}

inline void store16(float* p, v16 x) { __builtin_memcpy(p, &x, sizeof x); }

// 16 keys' or values' elements from `base` (float32, or bfloat16: its bits are a float's upper half)
inline v16 load_kv(const void* base, int64_t index, bool bf16) {
  if (bf16) {
    v16h half;
    __builtin_memcpy(&half, static_cast<const unsigned short*>(base) + index, sizeof half);
    const v16i bits = __builtin_convertvector(half, v16i) << 16;
    v16 x;
    __builtin_memcpy(&x, &bits, sizeof x);
    return x;
  }
  return load16(static_cast<const float*>(base) + index);
}

inline float hsum(v16 x) {
  x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return x[0];
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

// One (row, kv head): `groups` queries of `chunks` * 16 floats against `length` keys and values
// (`kstride` / `vstride` elements apart, bfloat16 if `bf16`). `scores`: room for groups * padded
// length floats.
// FixedGroups / FixedChunks: the shape as compile-time constants (0: the run-time arguments), so
// that the common shapes keep their queries and accumulators in registers.
template <int FixedGroups, int FixedChunks, bool BF16>
void attend_shape(const float* q, const void* k, const void* v, int64_t length, int groups_arg,
                  int chunks_arg, int64_t kstride, int64_t vstride, float scale, float* scores,
                  float* out) {
  const int groups = FixedGroups ? FixedGroups : groups_arg;
  const int chunks = FixedChunks ? FixedChunks : chunks_arg;
  constexpr bool bf16 = BF16;
  const int64_t padded = (length + kLanes - 1) / kLanes * kLanes;
  v16 qv[kMaxGroup][kMaxChunks];
  for (int g = 0; g < groups; ++g)
    for (int c = 0; c < chunks; ++c) qv[g][c] = load16(q + (g * chunks + c) * kLanes) * scale;
  for (int64_t t = 0; t < length; ++t) {
    v16 acc[kMaxGroup];
    for (int g = 0; g < groups; ++g) acc[g] = v16{};
    for (int c = 0; c < chunks; ++c) {
      const v16 kc = load_kv(k, t * kstride + c * kLanes, bf16);
      for (int g = 0; g < groups; ++g) acc[g] += qv[g][c] * kc;
    }
    for (int g = 0; g < groups; ++g) scores[g * padded + t] = hsum(acc[g]);
  }
  v16 lane;
  for (int i = 0; i < kLanes; ++i) lane[i] = static_cast<float>(i);
  float inverse[kMaxGroup];
  for (int g = 0; g < groups; ++g) {
    float* s = scores + g * padded;
    float top = s[0];
    for (int64_t t = 1; t < length; ++t) top = std::max(top, s[t]);
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
  for (int64_t t = 0; t < length; ++t) {
    for (int c = 0; c < chunks; ++c) {
      const v16 vc = load_kv(v, t * vstride + c * kLanes, bf16);
      for (int g = 0; g < groups; ++g) acc[g][c] += scores[g * padded + t] * vc;
    }
  }
  for (int g = 0; g < groups; ++g)
    for (int c = 0; c < chunks; ++c) store16(out + (g * chunks + c) * kLanes, acc[g][c] * inverse[g]);
}

void attend(const float* q, const void* k, const void* v, int64_t length, int groups, int chunks,
            int64_t kstride, int64_t vstride, bool bf16, float scale, float* scores, float* out) {
#define KVSTRATA_SHAPE(G, C)                                                                      \
  if (groups == G && chunks == C) {                                                               \
    if (bf16)                                                                                     \
      return attend_shape<G, C, true>(q, k, v, length, groups, chunks, kstride, vstride, scale,   \
                                      scores, out);                                               \
    return attend_shape<G, C, false>(q, k, v, length, groups, chunks, kstride, vstride, scale,    \
                                     scores, out);                                                \
  }
  KVSTRATA_SHAPE(3, 4)  // SmolLM2-135M: 9 query heads over 3, head_dim 64
  KVSTRATA_SHAPE(4, 4)
  KVSTRATA_SHAPE(2, 4)
  KVSTRATA_SHAPE(4, 8)  // Llama-3 8B: 32 over 8, head_dim 128
  KVSTRATA_SHAPE(8, 8)
#undef KVSTRATA_SHAPE
  if (bf16)
    return attend_shape<0, 0, true>(q, k, v, length, groups, chunks, kstride, vstride, scale,
                                    scores, out);
  attend_shape<0, 0, false>(q, k, v, length, groups, chunks, kstride, vstride, scale, scores, out);
}

#pragma GCC pop_options

}  // namespace

bool supported() { return __builtin_cpu_supports("avx512f"); }

// query: (rows, kv_heads, group, head_dim) float32; keys[r], values[r]: (1, kv_heads, length_r,
// head_dim), all float32 or all bfloat16, on CPU with the last dimension contiguous. Returns
// (rows, kv_heads, group, head_dim) float32.
at::Tensor decode_attention(const at::Tensor& query, const std::vector<at::Tensor>& keys,
                            const std::vector<at::Tensor>& values, double scale) {
  TORCH_CHECK(supported(), "decode_attention needs a CPU with AVX-512");
  TORCH_CHECK(query.dim() == 4 && query.scalar_type() == at::kFloat && query.device().is_cpu(),
              "query: float32 (rows, kv_heads, group, head_dim) on CPU");
  const int64_t rows = query.size(0), heads = query.size(1), groups = query.size(2),
                dim = query.size(3);
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == rows && static_cast<int64_t>(values.size()) == rows,
              "one keys and one values tensor per row");
  TORCH_CHECK(rows >= 1, "at least one row");
  const at::ScalarType kv_type = keys[0].scalar_type();
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kBFloat16, "keys and values: float32 or bfloat16");
  TORCH_CHECK(dim % kLanes == 0 && dim / kLanes <= kMaxChunks && groups >= 1 && groups <= kMaxGroup,
              "head_dim must be a multiple of 16 up to 256, and 1 to 8 query heads per kv head");
  for (int64_t r = 0; r < rows; ++r) {
    for (const at::Tensor* t : {&keys[r], &values[r]}) {
      TORCH_CHECK(t->dim() == 4 && t->size(0) == 1 && t->size(1) == heads && t->size(3) == dim &&
                      t->size(2) >= 1 && t->scalar_type() == kv_type && t->device().is_cpu() &&
                      t->stride(3) == 1,
                  "keys and values: all float32 or all bfloat16, (1, kv_heads, length >= 1, head_dim) "
                  "on CPU, last dim contiguous");
    }
    TORCH_CHECK(keys[r].size(2) == values[r].size(2), "a row's keys and values differ in length");
  }
  const at::Tensor q = query.contiguous();
  at::Tensor out = at::empty({rows, heads, groups, dim}, query.options());
  const int64_t items = rows * heads;
  std::vector<int64_t> order(items);
  for (int64_t i = 0; i < items; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return keys[a / heads].size(2) > keys[b / heads].size(2);
  });
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  const bool bf16 = kv_type == at::kBFloat16;
  const int64_t element = bf16 ? 2 : 4;
  const float* qdata = q.data_ptr<float>();
  float* odata = out.data_ptr<float>();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t thread = begin; thread < end; ++thread) {
      for (int64_t i = thread; i < items; i += threads) {
        const int64_t r = order[i] / heads, h = order[i] % heads;
        const at::Tensor& k = keys[r];
        const at::Tensor& v = values[r];
        const int64_t length = k.size(2);
        scores.resize(groups * ((length + kLanes - 1) / kLanes * kLanes));
        const char* kdata = static_cast<const char*>(k.data_ptr()) + h * k.stride(1) * element;
        const char* vdata = static_cast<const char*>(v.data_ptr()) + h * v.stride(1) * element;
        attend(qdata + (r * heads + h) * groups * dim, kdata, vdata, length, static_cast<int>(groups),
               static_cast<int>(dim / kLanes), k.stride(2), v.stride(2), bf16,
               static_cast<float>(scale), scores.data(), odata + (r * heads + h) * groups * dim);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "Whether this CPU runs the kernel (AVX-512).");
  // the arguments are converted first; the GIL is then released, as torch's own operators do
  m.def("decode_attention", &decode_attention, "Decode rows' attention (fp32 or bf16 KV), on CPU.",
        py::call_guard<py::gil_scoped_release>());
}
