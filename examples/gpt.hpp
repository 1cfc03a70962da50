// A GPT-style decoder for memscale's example and benchmarks, written the way
// LibTorch users write one: token and position embeddings, N pre-norm
// transformer blocks in a torch::nn::ModuleList looped over in forward (each
// call through memscale::forward, the one line that makes it a unit memscale
// can plan; each block calls its attention and MLP halves the same way), a
// final LayerNorm and an LM head. Also the embedded
// training text and a character-level batch sampler, so the example needs no files.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <memscale/memscale.hpp>

namespace gpt {

struct Options {
  std::int64_t vocab = 256;  // bytes
  std::int64_t context = 128;
  std::int64_t d_model = 128;
  std::int64_t heads = 4;
  std::int64_t layers = 4;
  double dropout = 0.1;
  /// Each block calls its attention and MLP halves through memscale::forward
  /// (two levels of units for memscale to weigh); false: it calls them
  /// directly, and the blocks are the only units.
  bool halves_as_units = true;
};

/// The GPT memscale's benchmark trains (benchmarks/bench_memscale.cpp, and the
/// studies beside it), at batch 16: wider and deeper than the example's default.
inline Options benchmark_options() {
  Options o;
  o.context = 128;
  o.d_model = 192;
  o.heads = 4;
  o.layers = 6;
  o.dropout = 0.1;
  return o;
}

/// The MLP half of a pre-norm block: x + dropout(fc_out(gelu(fc(ln(x))))). Each
/// position is computed on its own, so memscale may tile it along batch and
/// sequence (register_memscale_rule says so when it draws no dropout masks).
class MLPImpl : public torch::nn::Module {
 public:
  explicit MLPImpl(const Options& o)
      : options(o),
        ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})))),
        fc(register_module("fc", torch::nn::Linear(o.d_model, 4 * o.d_model))),
        fc_out(register_module("fc_out", torch::nn::Linear(4 * o.d_model, o.d_model))),
        drop(register_module("drop", torch::nn::Dropout(o.dropout))) {}

  torch::Tensor forward(torch::Tensor x) { return x + drop(fc_out(torch::gelu(fc(ln(x))))); }

  Options options;
  torch::nn::LayerNorm ln;
  torch::nn::Linear fc, fc_out;
  torch::nn::Dropout drop;
};
TORCH_MODULE(MLP);

/// The attention half of a pre-norm block: x + dropout(proj(attention(ln(x)))).
/// Causal attention written with plain ops (matmul, masked_fill, softmax), as
/// LibTorch 1.13 has no fused attention.
class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const Options& o)
      : options(o),
        ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})))),
        qkv(register_module("qkv", torch::nn::Linear(o.d_model, 3 * o.d_model))),
        proj(register_module("proj", torch::nn::Linear(o.d_model, o.d_model))),
        attn_drop(register_module("attn_drop", torch::nn::Dropout(o.dropout))),
        resid_drop(register_module("resid_drop", torch::nn::Dropout(o.dropout))) {
    mask = register_buffer("mask", torch::ones({o.context, o.context}, torch::kBool).triu(1));
  }

  torch::Tensor forward(torch::Tensor x) {
    const auto B = x.size(0), T = x.size(1), C = x.size(2), H = options.heads, D = C / H;
    auto parts = qkv(ln(x)).view({B, T, 3, H, D}).permute({2, 0, 3, 1, 4});  // 3, B, H, T, D
    auto q = parts[0], k = parts[1], v = parts[2];
    auto scores = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(D)));
    scores = scores.masked_fill(mask.slice(0, 0, T).slice(1, 0, T), -std::numeric_limits<float>::infinity());
    auto attention = attn_drop(torch::softmax(scores, -1));
    auto y = torch::matmul(attention, v).transpose(1, 2).reshape({B, T, C});
    return x + resid_drop(proj(y));
  }

  Options options;
  torch::nn::LayerNorm ln;
  torch::nn::Linear qkv, proj;
  torch::nn::Dropout attn_drop, resid_drop;
  torch::Tensor mask;
};
TORCH_MODULE(Attention);

/// Pre-norm block: the attention half, then the MLP half, each called through
/// memscale::forward, so that memscale may plan either the block or its halves
/// as units (it weighs both and says which it took).
class TransformerBlockImpl : public torch::nn::Module {
 public:
  explicit TransformerBlockImpl(const Options& o)
      : options(o), attn(register_module("attn", Attention(o))), mlp(register_module("mlp", MLP(o))) {}

  torch::Tensor forward(torch::Tensor x) {
    if (!options.halves_as_units) return mlp(attn(x));
    return memscale::forward(mlp, memscale::forward(attn, x));
  }

  Options options;
  Attention attn;
  MLP mlp;
};
TORCH_MODULE(TransformerBlock);

class GPTImpl : public torch::nn::Module {
 public:
  explicit GPTImpl(const Options& o)
      : options(o),
        token(register_module("token", torch::nn::Embedding(o.vocab, o.d_model))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.d_model})))),
        head(register_module("head", torch::nn::Linear(o.d_model, o.vocab))) {
    position = register_parameter("position", torch::randn({o.context, o.d_model}) * 0.02);
    for (std::int64_t i = 0; i < o.layers; ++i) blocks->push_back(TransformerBlock(o));
  }

  /// tokens [B, T] (int64) -> logits [B, T, vocab]
  torch::Tensor forward(torch::Tensor tokens) {
    const auto T = tokens.size(1);
    auto x = token(tokens) + position.slice(0, 0, T);
    for (const auto& block : *blocks) x = memscale::forward(*block->as<TransformerBlock>(), x);
    return head(ln_f(x));
  }

  Options options;
  torch::nn::Embedding token;
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm ln_f;
  torch::nn::Linear head;
  torch::Tensor position;
};
TORCH_MODULE(GPT);

inline torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

/// Static profiling rule for TransformerBlock: what its forward keeps for
/// backward, from the shapes (LibTorch CPU kernels, float32, training).
/// Checked against measurement by tests/test_profiler.cpp.
inline void register_memscale_rule() {
  memscale::register_layer_rule<TransformerBlockImpl>(
      [](const TransformerBlockImpl& m, const memscale::layer_input& in) -> std::optional<memscale::layer_estimate> {
        if (in.shape.size() != 3 || in.shape[2] != m.options.d_model || !c10::isFloatingType(in.dtype))
          return std::nullopt;
        const auto B = in.shape[0], T = in.shape[1], C = in.shape[2], H = m.options.heads;
        const auto elt = static_cast<std::int64_t>(c10::elementSize(in.dtype));
        const auto act = B * T * C * elt;            // one [B, T, C] activation
        const auto rows = B * T * 4 * 2;             // LayerNorm mean + rstd (float)
        const auto scores = B * H * T * T * elt;     // one [B, H, T, T] tensor
        const bool dropout = in.training && m.options.dropout > 0.0;
        memscale::layer_estimate e;
        e.output_shape = in.shape;
        e.output_dtype = in.dtype;
        e.saves_input = true;  // attn.ln keeps it
        // Kept for backward: attn.ln's output (by qkv), the q and k copies matmul makes
        // contiguous, softmax's output, the v copy, y (by proj), the attention half's
        // output x1 (by mlp.ln), mlp.ln's output, fc's and gelu's outputs (4 wide
        // each), LayerNorm statistics. The qkv output itself dies once q, k and v are
        // copied out of it.
        std::int64_t saved = act /*attn.ln*/ + 2 * act /*q, k*/ + scores /*softmax*/ + act /*v*/ + act /*y*/ +
                             act /*x1*/ + act /*mlp.ln*/ + 4 * act /*fc*/ + 4 * act /*gelu*/ + 2 * rows;
        // Dropout keeps its noise (input * noise on CPU) or a 1-byte mask (CUDA's
        // fused kernel); attention dropout's output is kept by the next matmul as well.
        if (dropout) {
          const bool mask = in.device == c10::kCUDA;
          saved += scores /*attention dropout output*/ + (mask ? scores / elt : scores) +
                   (mask ? 2 * act / elt : 2 * act) /*residual dropouts*/;
        }
        e.saved_bytes = saved;
        e.workspace_bytes = 2 * scores;  // raw and scaled scores before softmax
        e.flops = 2.0 * static_cast<double>(B * T) * (12.0 * static_cast<double>(C * C)) +
                  4.0 * static_cast<double>(B * H * T * T * (C / H));
        return e;
      });
  // The MLP half treats every position on its own (every dimension but the
  // features), unless its dropout draws masks: chunks would draw other masks than
  // the whole tensor does (judged whatever the mode: a plan made in evaluation
  // runs in training later).
  memscale::register_tileable<MLPImpl>([](const MLPImpl& m, const memscale::layer_input& in) {
    return m.options.dropout > 0.0 ? 0 : static_cast<int>(in.shape.size()) - 1;
  });
}

/// The embedded training text: generated deterministically, so the example
/// needs no files and every run sees the same data.
inline std::string training_text(std::size_t bytes = 1 << 16) {
  const std::vector<std::string> subjects = {"the model", "a layer", "the optimizer", "memory", "the gradient",
                                             "a segment", "the planner", "each block"};
  const std::vector<std::string> verbs = {"keeps", "recomputes", "frees", "measures", "moves", "checks",
                                          "plans", "saves"};
  const std::vector<std::string> objects = {"its activations", "the peak", "a budget", "the chain",
                                            "every tensor", "the step", "its inputs", "the backward pass"};
  std::string text;
  std::uint64_t state = 0x9E3779B97F4A7C15ull;
  auto next = [&state](std::size_t n) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return static_cast<std::size_t>(state % n);
  };
  while (text.size() < bytes)
    text += subjects[next(subjects.size())] + " " + verbs[next(verbs.size())] + " " +
            objects[next(objects.size())] + (next(4) == 0 ? ".\n" : ", and ");
  text.resize(bytes);
  return text;
}

/// A batch of (input, target) windows of the text, shifted by one byte.
struct Batch {
  torch::Tensor input, target;
};

inline Batch sample_batch(const torch::Tensor& data, std::int64_t batch, std::int64_t context,
                          std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int64_t> start(0, data.size(0) - context - 2);
  std::vector<torch::Tensor> xs, ys;
  for (std::int64_t i = 0; i < batch; ++i) {
    const auto s = start(rng);
    xs.push_back(data.slice(0, s, s + context));
    ys.push_back(data.slice(0, s + 1, s + context + 1));
  }
  return {torch::stack(xs), torch::stack(ys)};
}

inline torch::Tensor encode(const std::string& text) {
  std::vector<std::int64_t> ids(text.begin(), text.end());
  for (auto& id : ids) id &= 0xFF;
  return torch::tensor(ids, torch::kLong);
}

}  // namespace gpt
