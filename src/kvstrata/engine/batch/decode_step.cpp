// The decoder layers of a batched Llama decode step (kvstrata/engine/batch/llama.py, LlamaStep) in
// one call, for the step where every row decodes one token over linear layers packed for oneDNN
// (bf16, or fp32 where the step's rows run on the packed copies): the same operators in the same
// order as the Python loop, so the same bits, without the Python between them. Per layer the loop
// ran about twenty torch and native calls from Python (module calls, views, splits, the packed
// linears through torch.ops' boxed path, the attention function's bookkeeping): 8-9 ms of an
// 8-row SmolLM2 bf16 step of 51-54 ms on this project's Intel VM (see llama.py's docstring), where
// vLLM runs its layers as one compiled graph.
//
// The GIL is released for the whole loop (as torch's own operators release it), and taken again
// only to ask `interrupt` before each layer's attention, as the Python loop asks.

#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string_view>
#include <vector>

// decode_attention.cpp and layer_ops.cpp
at::Tensor decode_attention(const at::Tensor& query, const std::vector<at::Tensor>& keys,
                            const std::vector<at::Tensor>& values, double scale,
                            const std::vector<at::Tensor>& arenas, const std::vector<at::Tensor>& tables,
                            int64_t layer, int64_t num_layers, const std::vector<at::Tensor>& masses);
at::Tensor add_rms_norm(at::Tensor hidden, const at::Tensor& delta, const at::Tensor& weight, double eps);
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
bool append_rows(const at::Tensor& keys, const at::Tensor& values, const std::vector<at::Tensor>& buffers,
                 std::vector<at::Tensor> views, const std::vector<int64_t>& sizes);

namespace {

constexpr int kPerLayer = 6;  // qkv, o, gate_up, down (packed weights), post-attention norm, next norm

// packed_linear.rows_bucket: one row as it is, up to 64 a multiple of 8, then a multiple of a
// quarter to an eighth of the power of two below
int64_t rows_bucket(int64_t rows) {
  if (rows <= 1) return rows;
  if (rows <= 64) return (rows + 7) / 8 * 8;
  int64_t bits = 0;
  for (int64_t r = rows - 1; r > 0; r >>= 1) ++bits;
  const int64_t step = int64_t{1} << (bits - 3);
  return (rows + step - 1) / step * step;
}

// packed_linear.packed_linear: oneDNN's kernel on a packed weight (no bias), the rows padded with
// zeros up to their bucket
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            std::string_view, c10::List<std::optional<c10::Scalar>>,
                            std::optional<std::string_view>)>();
  const int64_t features = x.size(-1);
  const int64_t rows = features ? x.numel() / features : 0;
  const int64_t bucket = rows_bucket(rows);
  const std::optional<at::Tensor> none;
  if (bucket == rows) return op.call(x, packed, none, "none", c10::List<std::optional<c10::Scalar>>(), std::string_view(""));
  const at::Tensor flat = x.reshape({rows, features});
  const at::Tensor padded = at::cat({flat, flat.new_zeros({bucket - rows, features})});
  const at::Tensor out = op.call(padded, packed, none, "none", c10::List<std::optional<c10::Scalar>>(), std::string_view("")).slice(0, 0, rows);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(out.size(-1));
  return out.reshape(shape);
}

// Each view back to `lengths` tokens (a view's sizes set in place, as append_rows lengthened it)
void shorten(std::vector<at::Tensor>& views, const std::vector<int64_t>& lengths, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    at::Tensor& view = views[i];
    const int64_t sizes[4] = {1, view.size(1), lengths[i], view.size(3)};
    view.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, view.strides());
  }
}

}  // namespace

// hidden: (1, rows, hidden_size) the residual stream (added to in place); x: the first layer's
// normed input. weights: per layer kPerLayer tensors (see kPerLayer), eps: per layer the two
// norms' epsilons. cos, sin: (rows, head_dim). buffers / views: per layer, per row, its key and
// value buffer / view (layer-major: buffers[2 * (layer * rows + row)] is a key buffer), each view
// lengthened by one token in place as append_rows does. arenas, tables, masses: per row, as
// decode_attention takes them (empty: none). Returns (0, x after the last layer's MLP, normed by
// the next norm: the final norm for the last layer), or (1, None) having done nothing where a
// buffer has no room or another dtype (the caller runs the Python loop, which grows it), or (2
// + layer, None) where `interrupt` asked to give the step up at that layer: every view is then
// as it was before the call.
py::tuple decode_layers(at::Tensor hidden, at::Tensor x, const std::vector<at::Tensor>& weights,
                        const std::vector<double>& eps, const at::Tensor& cos, const at::Tensor& sin,
                        const std::vector<at::Tensor>& buffers, std::vector<at::Tensor> views, int64_t heads,
                        int64_t kv_heads, int64_t head_dim, double scaling, const std::vector<at::Tensor>& arenas,
                        const std::vector<at::Tensor>& tables, const std::vector<at::Tensor>& masses,
                        py::object interrupt) {
  const int64_t layers = static_cast<int64_t>(weights.size()) / kPerLayer;
  const int64_t rows = x.size(1);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer && layers >= 1,
              "decode_layers: ", kPerLayer, " weights per layer");
  TORCH_CHECK(static_cast<int64_t>(eps.size()) == 2 * layers, "decode_layers: two epsilons per layer");
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && hidden.sizes() == x.sizes(), "decode_layers: x and hidden (1, rows, hidden)");
  TORCH_CHECK(static_cast<int64_t>(views.size()) == 2 * layers * rows && buffers.size() == views.size(),
              "decode_layers: a key and a value buffer and view per layer and row");
  TORCH_CHECK(heads % kv_heads == 0, "decode_layers: heads a multiple of kv_heads");
  for (size_t i = 0; i < views.size(); ++i) {  // room for one token everywhere, or nothing is done
    const at::Tensor &b = buffers[i], &v = views[i];
    if (b.scalar_type() != x.scalar_type() || v.size(2) + 1 > b.size(2)) return py::make_tuple(1, py::none());
  }
  std::vector<int64_t> lengths(views.size());
  for (size_t i = 0; i < views.size(); ++i) lengths[i] = views[i].size(2);
  const int64_t qk_size = (heads + kv_heads) * head_dim;
  const std::vector<int64_t> ones(rows, 1);
  const bool paged = !arenas.empty();
  int64_t given_up = -1;
  size_t appended = 0;  // views lengthened so far: undone where the step does not finish
  try {
    py::gil_scoped_release released;
    for (int64_t l = 0; l < layers; ++l) {
      const at::Tensor* w = weights.data() + l * kPerLayer;
      const at::Tensor qkv = packed_linear(x, w[0]);
      const at::Tensor query_key = rotate(qkv.narrow(-1, 0, qk_size).view({rows, heads + kv_heads, head_dim}), cos, sin);
      const at::Tensor key = query_key.narrow(1, heads, kv_heads).transpose(0, 1).unsqueeze(0);
      const at::Tensor value = qkv.narrow(-1, qk_size, kv_heads * head_dim).view({1, rows, kv_heads, head_dim}).transpose(1, 2);
      const size_t first = 2 * l * rows;
      const std::vector<at::Tensor> layer_buffers(buffers.begin() + first, buffers.begin() + first + 2 * rows);
      std::vector<at::Tensor> layer_views(views.begin() + first, views.begin() + first + 2 * rows);
      TORCH_CHECK(append_rows(key, value, layer_buffers, layer_views, ones), "decode_layers: append_rows refused");
      appended = first + 2 * rows;
      if (!interrupt.is_none()) {
        py::gil_scoped_acquire held;
        if (interrupt().cast<bool>()) {
          given_up = l;
          break;
        }
      }
      const at::Tensor query = query_key.narrow(1, 0, heads).reshape({rows, kv_heads, heads / kv_heads, head_dim});
      std::vector<at::Tensor> keys(rows), values(rows);
      for (int64_t r = 0; r < rows; ++r) {
        keys[r] = views[first + 2 * r];
        values[r] = views[first + 2 * r + 1];
      }
      const at::Tensor out = decode_attention(query, keys, values, scaling, arenas, tables, paged ? l : 0,
                                              paged ? layers : 1, masses);
      at::Tensor delta = packed_linear(out.view({1, rows, heads * head_dim}), w[1]);
      x = add_rms_norm(hidden, delta, w[4], eps[2 * l]);
      const auto parts = packed_linear(x, w[2]).chunk(2, -1);
      delta = packed_linear(at::silu(parts[0]).mul_(parts[1]), w[3]);
      x = add_rms_norm(hidden, delta, w[5], eps[2 * l + 1]);
    }
  } catch (...) {
    shorten(views, lengths, appended);
    throw;
  }
  if (given_up >= 0) {
    shorten(views, lengths, appended);
    return py::make_tuple(2 + given_up, py::none());
  }
  return py::make_tuple(0, x);
}
