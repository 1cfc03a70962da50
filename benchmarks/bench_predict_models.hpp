// memscale_bench_predict's models (bench_predict.cpp's only includer): the example
// GPT and the harness's ResNet-style CNN and MLP, models the predictor was not
// developed on (a GRU, a ViT around nn::MultiheadAttention), each built with its example input, loss and targets at a
// batch, and the Config each row predicts and trains with.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

#include <torch/torch.h>

#include <memscale/memscale.hpp>

#include "gpt.hpp"
#include "resnet.hpp"

namespace {

using i64 = std::int64_t;
constexpr double MiB = 1024.0 * 1024.0;

struct Case {
  std::string model;
  i64 batch;
  bool aggressive;
  torch::Device device = torch::kCPU;
  i64 budget = 0;  ///< Config::memory_budget_gb in bytes (0: unset)
};

/// A model, its example input at `batch`, its loss (taking the first rows of its
/// targets) and how one step's input is drawn.
struct Built {
  std::shared_ptr<torch::nn::Module> root;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::function<torch::Tensor(const torch::Tensor&)> loss;
  torch::Tensor input;
  std::function<memscale::Prediction(torch::optim::Optimizer&, const memscale::Config&)> predict;
  std::function<memscale::OptimizationGuard(const memscale::Config&)> optimize;
};

template <class M>
Built finish(M model, torch::Tensor input, torch::Tensor targets,
             std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> loss, torch::Device device) {
  model->to(device);
  input = input.to(device);
  targets = targets.to(device);
  Built b;
  b.root = model.ptr();
  b.forward = [model](const torch::Tensor& x) mutable { return model->forward(x); };
  b.loss = [targets, loss](const torch::Tensor& out) { return loss(out, targets.narrow(0, 0, out.size(0))); };
  b.input = input;
  b.predict = [model, input, l = b.loss](torch::optim::Optimizer& opt, const memscale::Config& c) mutable {
    return memscale::predict(model, input, opt, l, c);
  };
  b.optimize = [model, input](const memscale::Config& c) mutable { return memscale::optimize(model, input, c); };
  return b;
}

torch::nn::Sequential mlp(int blocks, i64 width, i64 hidden, bool batchnorm) {
  torch::nn::Sequential seq;
  for (int i = 0; i < blocks; ++i) {
    seq->push_back(torch::nn::Linear(width, hidden));
    if (batchnorm) seq->push_back(torch::nn::BatchNorm1d(hidden));
    seq->push_back(torch::nn::GELU());
    seq->push_back(torch::nn::Linear(hidden, width));
    seq->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  }
  return seq;
}

/// A recurrent classifier written as users write one: token embeddings, a
/// batch-first two-layer GRU (LibTorch's CPU GRU runs a cell per time step, so a
/// step makes many small tensors: under glibc's mmap threshold at small batches,
/// in its heap), a linear head on the last step's output.
struct GRUNetImpl : torch::nn::Module {
  GRUNetImpl(i64 vocab, i64 embed, i64 hidden, i64 classes)
      : emb(register_module("emb", torch::nn::Embedding(vocab, embed))),
        gru(register_module("gru", torch::nn::GRU(torch::nn::GRUOptions(embed, hidden).num_layers(2).batch_first(true)))),
        head(register_module("head", torch::nn::Linear(hidden, classes))) {}
  torch::Tensor forward(const torch::Tensor& tokens) {
    auto out = std::get<0>(gru->forward(emb->forward(tokens)));
    return head->forward(out.select(1, -1));
  }
  torch::nn::Embedding emb;
  torch::nn::GRU gru;
  torch::nn::Linear head;
};
TORCH_MODULE(GRUNet);

/// A vision transformer written as users write one: 4x4 patches embedded by a
/// strided convolution, pre-norm blocks around nn::MultiheadAttention (which
/// takes [tokens, batch, dim] and asks equal(query, key) to pick its
/// self-attention path) and a GELU MLP, mean-pooled into a linear head.
struct ViTBlockImpl : torch::nn::Module {
  explicit ViTBlockImpl(i64 dim, i64 heads)
      : norm1(register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        attn(register_module("attn", torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(dim, heads)))),
        norm2(register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        mlp(register_module("mlp", torch::nn::Sequential(torch::nn::Linear(dim, 4 * dim), torch::nn::GELU(),
                                                          torch::nn::Linear(4 * dim, dim)))) {}
  torch::Tensor forward(torch::Tensor x) {  // [tokens, batch, dim]
    const auto h = norm1->forward(x);
    x = x + std::get<0>(attn->forward(h, h, h));
    return x + mlp->forward(norm2->forward(x));
  }
  torch::nn::LayerNorm norm1;
  torch::nn::MultiheadAttention attn;
  torch::nn::LayerNorm norm2;
  torch::nn::Sequential mlp;
};
TORCH_MODULE(ViTBlock);

struct ViTImpl : torch::nn::Module {
  ViTImpl(i64 dim, i64 heads, int depth, i64 classes)
      : patches(register_module("patches", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, dim, 4).stride(4)))),
        position(register_parameter("position", torch::randn({64, 1, dim}) * 0.02)),
        blocks(register_module("blocks", torch::nn::Sequential())),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        head(register_module("head", torch::nn::Linear(dim, classes))) {
    for (int i = 0; i < depth; ++i) blocks->push_back(ViTBlock(dim, heads));
  }
  torch::Tensor forward(const torch::Tensor& images) {  // [batch, 3, 32, 32]
    auto x = patches->forward(images).flatten(2).permute({2, 0, 1}) + position;  // [64, batch, dim]
    x = norm->forward(blocks->forward(x));
    return head->forward(x.mean(0));
  }
  torch::nn::Conv2d patches;
  torch::Tensor position;
  torch::nn::Sequential blocks;
  torch::nn::LayerNorm norm;
  torch::nn::Linear head;
};
TORCH_MODULE(ViT);

/// Models for a new user's trial (not in the default list): LibTorch's own
/// nn::TransformerEncoder, a MobileNet-style net of depthwise convolutions, a
/// convolutional autoencoder with ConvTranspose2d, and a bidirectional LSTM tagger.
struct EncoderNetImpl : torch::nn::Module {
  EncoderNetImpl(i64 vocab, i64 dim, i64 heads, i64 layers, i64 context, i64 classes)
      : emb(register_module("emb", torch::nn::Embedding(vocab, dim))),
        position(register_parameter("position", torch::zeros({context, 1, dim}))),
        encoder(register_module("encoder", torch::nn::TransformerEncoder(torch::nn::TransformerEncoderOptions(
                                               torch::nn::TransformerEncoderLayerOptions(dim, heads)
                                                   .dim_feedforward(4 * dim)
                                                   .dropout(0.1),
                                               layers)))),
        head(register_module("head", torch::nn::Linear(dim, classes))) {}
  torch::Tensor forward(const torch::Tensor& tokens) {  // [batch, context]
    auto x = emb->forward(tokens).transpose(0, 1) + position;  // [context, batch, dim]
    return head->forward(encoder->forward(x).mean(0));
  }
  torch::nn::Embedding emb;
  torch::Tensor position;
  torch::nn::TransformerEncoder encoder;
  torch::nn::Linear head;
};
TORCH_MODULE(EncoderNet);

torch::nn::Sequential mobilenet(i64 classes) {
  torch::nn::Sequential seq;
  const auto conv_bn = [&seq](i64 in, i64 out, i64 kernel, i64 stride, i64 groups) {
    seq->push_back(torch::nn::Conv2d(
        torch::nn::Conv2dOptions(in, out, kernel).stride(stride).padding(kernel / 2).groups(groups).bias(false)));
    seq->push_back(torch::nn::BatchNorm2d(out));
    seq->push_back(torch::nn::ReLU6());
  };
  conv_bn(3, 32, 3, 1, 1);
  i64 c = 32;
  for (auto [out, stride] : {std::pair<i64, i64>{64, 1}, {128, 2}, {128, 1}, {256, 2}, {256, 1}}) {
    conv_bn(c, c, 3, stride, c);  // depthwise
    conv_bn(c, out, 1, 1, 1);     // pointwise
    c = out;
  }
  seq->push_back(torch::nn::AdaptiveAvgPool2d(torch::nn::AdaptiveAvgPool2dOptions(1)));
  seq->push_back(torch::nn::Flatten());
  seq->push_back(torch::nn::Linear(c, classes));
  return seq;
}

torch::nn::Sequential autoencoder() {
  const auto down = [](i64 in, i64 out) { return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 4).stride(2).padding(1)); };
  const auto up = [](i64 in, i64 out) {
    return torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(in, out, 4).stride(2).padding(1));
  };
  return torch::nn::Sequential(down(3, 32), torch::nn::ReLU(), down(32, 64), torch::nn::ReLU(), down(64, 128),
                               torch::nn::ReLU(), up(128, 64), torch::nn::ReLU(), up(64, 32), torch::nn::ReLU(),
                               up(32, 3), torch::nn::Sigmoid());
}

struct TaggerImpl : torch::nn::Module {
  TaggerImpl(i64 vocab, i64 embed, i64 hidden, i64 tags)
      : emb(register_module("emb", torch::nn::Embedding(vocab, embed))),
        lstm(register_module("lstm", torch::nn::LSTM(torch::nn::LSTMOptions(embed, hidden)
                                                         .num_layers(2)
                                                         .dropout(0.2)
                                                         .bidirectional(true)
                                                         .batch_first(true)))),
        head(register_module("head", torch::nn::Linear(2 * hidden, tags))) {}
  torch::Tensor forward(const torch::Tensor& tokens) {  // [batch, steps] -> [batch * steps, tags]
    auto out = std::get<0>(lstm->forward(emb->forward(tokens)));
    return head->forward(out).flatten(0, 1);
  }
  torch::nn::Embedding emb;
  torch::nn::LSTM lstm;
  torch::nn::Linear head;
};
TORCH_MODULE(Tagger);

Built build(const std::string& name, i64 batch, torch::Device device) {
  torch::manual_seed(7);
  const auto cross_entropy = [](const torch::Tensor& out, const torch::Tensor& t) {
    return torch::cross_entropy_loss(out, t);
  };
  const auto mse = [](const torch::Tensor& out, const torch::Tensor& t) { return torch::mse_loss(out, t); };
  if (name == "gpt" || name == "gpt-wide" || name == "gpt-large") {
    gpt::Options o;  // train_gpt's defaults
    if (name == "gpt-wide") {
      o.d_model = 256;
      o.layers = 2;
      o.context = 64;
      o.heads = 8;
    } else if (name == "gpt-large") {  // memscale_bench_gpu's
      o.d_model = 768;
      o.layers = 12;
      o.context = 256;
      o.heads = 12;
    }
    const auto tokens = torch::randint(0, o.vocab, {batch, o.context}, torch::kLong);
    const auto targets = torch::randint(0, o.vocab, {batch, o.context}, torch::kLong);
    return finish(gpt::GPT(o), tokens, targets, [](const torch::Tensor& out, const torch::Tensor& t) {
      return gpt::loss(out, t);
    }, device);
  }
  if (name == "resnet" || name == "cnn-deep" || name == "resnet-bottleneck") {
    const bool bottleneck = name == "resnet-bottleneck";  // ResNet-50's blocks, 1x1 convolutions among them
    const i64 side = bottleneck ? 16 : 32;
    const auto x = torch::randn({batch, 3, side, side});
    const auto t = torch::randint(10, {batch}, torch::kLong);
    return finish(bottleneck             ? resnet::ResNet(3, 256, 10, resnet::Block::bottleneck)
                  : name == "cnn-deep" ? resnet::ResNet(8, 32)
                                       : resnet::ResNet(4, 64),
                  x, t, cross_entropy, device);
  }
  if (name == "mlp" || name == "mlp-bn") {
    const bool bn = name == "mlp-bn";
    const i64 width = bn ? 96 : 64, hidden = bn ? 384 : 256;
    const auto x = torch::randn({batch, width});
    const auto t = torch::randn({batch, width});
    return finish(mlp(bn ? 6 : 8, width, hidden, bn), x, t, mse, device);
  }
  if (name == "gru" || name == "gru-big") {  // 10k and 100k tokens (the latter's embedding gradient: 48.8 MiB)
    const i64 vocab = name == "gru" ? 10000 : 100000, steps = 48;
    const auto tokens = torch::randint(0, vocab, {batch, steps}, torch::kLong);
    const auto t = torch::randint(10, {batch}, torch::kLong);
    return finish(GRUNet(vocab, 128, 256, 10), tokens, t, cross_entropy, device);
  }
  if (name == "vit") {  // 32x32 images in 64 patches, 4 blocks of width 192
    const auto x = torch::randn({batch, 3, 32, 32});
    const auto t = torch::randint(10, {batch}, torch::kLong);
    return finish(ViT(192, 6, 4, 10), x, t, cross_entropy, device);
  }
  if (name == "encoder") {  // nn::TransformerEncoder: 3 layers of width 128, 64 tokens
    const auto tokens = torch::randint(0, 8000, {batch, 64}, torch::kLong);
    const auto t = torch::randint(4, {batch}, torch::kLong);
    return finish(EncoderNet(8000, 128, 4, 3, 64, 4), tokens, t, cross_entropy, device);
  }
  if (name == "mobilenet" || name == "autoencoder") {
    const auto x = torch::rand({batch, 3, 32, 32});
    if (name == "autoencoder")
      return finish(autoencoder(), x, x.clone(), [](const torch::Tensor& out, const torch::Tensor& t) {
        return torch::binary_cross_entropy(out, t);
      }, device);
    const auto t = torch::randint(10, {batch}, torch::kLong);
    return finish(mobilenet(10), x, t, cross_entropy, device);
  }
  if (name == "tagger") {  // per-token tags: the targets are [batch * 64]
    const auto tokens = torch::randint(0, 5000, {batch, 64}, torch::kLong);
    const auto t = torch::randint(20, {batch * 64}, torch::kLong);
    return finish(Tagger(5000, 100, 128, 20), tokens, t, cross_entropy, device);
  }
  throw std::invalid_argument("unknown model " + name);
}

memscale::Config config_for(const Case& k) {
  memscale::Config c;
  c.enable_logging = false;
  if (k.aggressive) c.mode = memscale::OptimizationMode::Aggressive;
  if (k.budget > 0) c.memory_budget_gb = static_cast<double>(k.budget) / (1024.0 * 1024.0 * 1024.0);
  return c;
}

}  // namespace
