// The elementwise parts of a batched Llama step (kvstrata/engine/batch/llama.py) as one call each:
// RMSNorm, the residual add fused with the next RMSNorm, and rotary embedding of queries and keys.
// Each is a handful of torch operators in transformers' code; on a CPU the
// weights a decode step streams through its linear layers evict the caches, and every operator
// after a linear layer pays its dispatch and its misses again (an RMSNorm of one row took 45 us
// right after a linear layer against 15 us alone, measured on this project's Intel VM).
//
// Rounding follows the torch operators they replace: arithmetic in float32, and for bfloat16
// tensors each intermediate that torch would store is rounded to bfloat16 where torch rounds it
// (so rotary gives torch's bits; RMSNorm's sum of squares is added up in another order, a float32
// rounding difference before the result is rounded). SiLU(gate) * up stays torch's: written here
// with the scalar exp it took 65 against 15 us for 8 rows in bf16, 1.26 against 0.22 ms for a
// 160-token prefill chunk (torch's operator is vectorized); these take 1-10 us for 8 rows, where
// torch's take 16-24 (timed in a loop, this project's Intel VM).

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

template <typename T>
inline float f32(T x) {
  return static_cast<float>(x);
}

// a float rounded to T as torch stores a result (c10::BFloat16 rounds to nearest even)
template <typename T>
inline float stored(float x) {
  return static_cast<float>(static_cast<T>(x));
}

template <typename T>
void rms_rows(const T* x, int64_t x_stride, const T* w, T* y, int64_t rows, int64_t n, float eps) {
  constexpr int kSums = 16;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    T* yr = y + r * n;
    float sums[kSums] = {};
    int64_t i = 0;
    for (; i + kSums <= n; i += kSums)
      for (int k = 0; k < kSums; ++k) sums[k] += f32(xr[i + k]) * f32(xr[i + k]);
    for (; i < n; ++i) sums[0] += f32(xr[i]) * f32(xr[i]);
    float total = 0.0f;
    for (int k = 0; k < kSums; ++k) total += sums[k];
    const float inverse = 1.0f / std::sqrt(total / static_cast<float>(n) + eps);
    for (int64_t j = 0; j < n; ++j) yr[j] = static_cast<T>(f32(w[j]) * stored<T>(f32(xr[j]) * inverse));
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.stride(-1) == 1, name, ": a CPU tensor, last dim contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, ": float32 or bfloat16");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(),
              name, ": a weight of the rows' size and dtype");
}

// rows of `x` (..., n) with their last dim contiguous and rows evenly strided
int64_t row_stride(const at::Tensor& x) {
  const int64_t n = x.size(-1);
  const int64_t rows = x.numel() / std::max<int64_t>(n, 1);
  if (rows <= 1) return n;
  const at::Tensor flat = x.reshape({rows, n});  // a view where the rows are evenly strided
  TORCH_CHECK(flat.data_ptr() == x.data_ptr(), "rows must be evenly strided");
  return flat.stride(0);
}

}  // namespace

// transformers' LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), per row of x
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (rows == 0) return y;
  const int64_t stride = row_stride(x);
  if (x.scalar_type() == at::kBFloat16)
    rms_rows(x.data_ptr<at::BFloat16>(), stride, weight.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(),
             rows, n, static_cast<float>(eps));
  else
    rms_rows(x.data_ptr<float>(), stride, weight.data_ptr<float>(), y.data_ptr<float>(), rows, n,
             static_cast<float>(eps));
  return y;
}

// hidden += delta (in place), then rms_norm(hidden): the residual add and the next layer's norm
at::Tensor add_rms_norm(at::Tensor hidden, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_rows(hidden, weight, "add_rms_norm");
  TORCH_CHECK(hidden.is_contiguous() && delta.sizes() == hidden.sizes() &&
                  delta.scalar_type() == hidden.scalar_type() && delta.stride(-1) == 1,
              "add_rms_norm: a contiguous hidden state and a delta of its shape and dtype");
  const int64_t n = hidden.size(-1), rows = hidden.numel() / std::max<int64_t>(n, 1);
  const int64_t stride = row_stride(delta);
  if (hidden.scalar_type() == at::kBFloat16) {
    auto* h = hidden.data_ptr<at::BFloat16>();
    const auto* d = delta.data_ptr<at::BFloat16>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < n; ++j) h[r * n + j] = static_cast<at::BFloat16>(f32(h[r * n + j]) + f32(d[r * stride + j]));
  } else {
    float* h = hidden.data_ptr<float>();
    const float* d = delta.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < n; ++j) h[r * n + j] += d[r * stride + j];
  }
  return rms_norm(hidden, weight, eps);
}

namespace {

template <typename T>
void rotate_rows(const T* x, int64_t token_stride, const T* cos, const T* sin, T* y, int64_t tokens,
                 int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + t * dim;
    const T* s = sin + t * dim;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xh = x + t * token_stride + h * dim;
      T* yh = y + (t * heads + h) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        // x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[half:], x[:half])
        const float rotated = d < half ? -f32(xh[d + half]) : f32(xh[d - half]);
        yh[d] = static_cast<T>(stored<T>(f32(xh[d]) * f32(c[d])) + stored<T>(rotated * f32(s[d])));
      }
    }
  }
}

}  // namespace

// x: (tokens, heads, dim) with its last two dims contiguous (queries and keys side by side);
// cos, sin: (tokens, dim) contiguous. Returns x rotated as transformers' apply_rotary_pos_emb.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.device().is_cpu() && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotate: (tokens, heads, dim) on CPU, its heads contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rotate: float32 or bfloat16");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0, "rotate: an even head_dim");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == tokens && t->size(1) == dim && t->is_contiguous() &&
                    t->scalar_type() == x.scalar_type(),
                "rotate: cos and sin (tokens, head_dim), contiguous, of x's dtype");
  at::Tensor y = at::empty({tokens, heads, dim}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.scalar_type() == at::kBFloat16)
    rotate_rows(x.data_ptr<at::BFloat16>(), x.stride(0), cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(),
                y.data_ptr<at::BFloat16>(), tokens, heads, dim);
  else
    rotate_rows(x.data_ptr<float>(), x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
                y.data_ptr<float>(), tokens, heads, dim);
  return y;
}

// Appends each row's new keys and values to its layer, for all rows of one layer in one call (a
// decode step appended one token per row and layer with a dozen torch operators, 2.9 ms of an
// 8-row SmolLM2 step). keys, values: (1, kv_heads, tokens, dim), any strides, the rows' tokens in
// order, sizes[i] of them for row i. buffers[2i], buffers[2i+1]: row i's layer's key and value
// buffers, (1, kv_heads, capacity, dim) with dim and tokens contiguous;
// views[2i], views[2i+1]: its `keys` and `values`, their first `length` tokens
// (kvstrata/integrations/transformers/layer.py). The new tokens are written after each view's
// tokens and the views are lengthened in place (as_strided_ on the very tensors the layers hold).
// Returns false, having written nothing, when a row's buffer has no room for its tokens or its
// dtype differs from the new tokens' (the caller then appends row by row, growing the buffer).
bool append_rows(const at::Tensor& keys, const at::Tensor& values, const std::vector<at::Tensor>& buffers,
                 std::vector<at::Tensor> views, const std::vector<int64_t>& sizes) {
  const size_t rows = sizes.size();
  TORCH_CHECK(buffers.size() == 2 * rows && views.size() == 2 * rows, "append_rows: two buffers and views per row");
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes() && keys.size(0) == 1 && keys.device().is_cpu() &&
                  values.device().is_cpu() && keys.stride(3) == 1 && values.stride(3) == 1,
              "append_rows: keys and values (1, kv_heads, tokens, dim) on CPU, dim contiguous");
  const int64_t heads = keys.size(1), dim = keys.size(3);
  int64_t total = 0;
  for (const int64_t n : sizes) {
    TORCH_CHECK(n >= 0, "append_rows: sizes >= 0");
    total += n;
  }
  TORCH_CHECK(total == keys.size(2), "append_rows: the sizes add up to the new tokens");
  for (size_t i = 0; i < 2 * rows; ++i) {
    const at::Tensor &b = buffers[i], &v = views[i];
    TORCH_CHECK(b.dim() == 4 && b.size(0) == 1 && b.size(1) == heads && b.size(3) == dim && b.stride(3) == 1 &&
                    b.stride(2) == dim && b.device().is_cpu(),
                "append_rows: each buffer (1, kv_heads, capacity, dim) on CPU, its tokens contiguous");
    TORCH_CHECK(v.dim() == 4 && v.size(1) == heads && v.size(3) == dim && v.strides() == b.strides() &&
                    v.storage().is_alias_of(b.storage()) &&
                    v.storage_offset() == b.storage_offset() && v.size(2) <= b.size(2),
                "append_rows: each view the first tokens of its buffer");
    if (b.scalar_type() != keys.scalar_type() || values.scalar_type() != keys.scalar_type()) return false;
    if (v.size(2) + sizes[i / 2] > b.size(2)) return false;
  }
  const size_t element = keys.element_size();
  int64_t first = 0;
  for (size_t r = 0; r < rows; ++r) {
    const int64_t n = sizes[r];
    for (int pair = 0; pair < 2; ++pair) {
      const at::Tensor& source = pair == 0 ? keys : values;
      at::Tensor& view = views[2 * r + pair];
      const int64_t length = view.size(2);
      char* base = static_cast<char*>(buffers[2 * r + pair].data_ptr());  // an empty view's is null
      const char* from = static_cast<const char*>(source.data_ptr());
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t t = 0; t < n; ++t) {
          std::memcpy(base + (h * view.stride(1) + (length + t) * dim) * element,
                      from + (h * source.stride(1) + (first + t) * source.stride(2)) * element, dim * element);
        }
      }
      // the view's sizes changed where they are (torch's as_strided_ went through the dispatcher:
      // 2 us a view, as long as the copies of 8 rows); its strides and offset stay the buffer's
      const int64_t sizes_now[4] = {1, heads, length + n, dim};
      view.unsafeGetTensorImpl()->set_sizes_and_strides(sizes_now, view.strides());
    }
    first += n;
  }
  return true;
}
