// A ResNet-style CNN for memscale's benchmark and tests, written the way a
// LibTorch port of torchvision's ResNet is: basic residual blocks (conv, BatchNorm,
// in-place ReLU, conv, BatchNorm, plus the input, in-place ReLU), or ResNet-50's
// bottleneck blocks (1x1 down to a quarter of the channels, 3x3, 1x1 back up),
// kept in a torch::nn::ModuleList and looped over in forward, each call through
// memscale::forward.
#pragma once

#include <cstdint>

#include <torch/torch.h>

#include <memscale/memscale.hpp>

namespace resnet {

/// A convolution as ResNet's are: no bias (a BatchNorm follows), padded to keep the size at stride 1.
inline torch::nn::Conv2dOptions conv(std::int64_t in, std::int64_t out, std::int64_t kernel) {
  return torch::nn::Conv2dOptions(in, out, kernel).padding(kernel / 2).bias(false);
}

class BasicBlockImpl : public torch::nn::Module {
 public:
  explicit BasicBlockImpl(std::int64_t channels)
      : conv1(register_module("conv1", torch::nn::Conv2d(conv(channels, channels, 3)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(channels))),
        conv2(register_module("conv2", torch::nn::Conv2d(conv(channels, channels, 3)))),
        bn2(register_module("bn2", torch::nn::BatchNorm2d(channels))) {}

  torch::Tensor forward(torch::Tensor x) {
    auto y = bn1(conv1(x)).relu_();
    y = bn2(conv2(y));
    return (y + x).relu_();
  }

  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
};
TORCH_MODULE(BasicBlock);

/// ResNet-50's block: 1x1 to channels/4, 3x3, 1x1 back to channels, each with
/// BatchNorm, plus the input. On CPU its unstrided 1x1 convolutions run oneDNN's
/// kernels from 16 rows on one thread, LibTorch's own below.
class BottleneckImpl : public torch::nn::Module {
 public:
  explicit BottleneckImpl(std::int64_t channels)
      : conv1(register_module("conv1", torch::nn::Conv2d(conv(channels, channels / 4, 1)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(channels / 4))),
        conv2(register_module("conv2", torch::nn::Conv2d(conv(channels / 4, channels / 4, 3)))),
        bn2(register_module("bn2", torch::nn::BatchNorm2d(channels / 4))),
        conv3(register_module("conv3", torch::nn::Conv2d(conv(channels / 4, channels, 1)))),
        bn3(register_module("bn3", torch::nn::BatchNorm2d(channels))) {}

  torch::Tensor forward(torch::Tensor x) {
    auto y = bn1(conv1(x)).relu_();
    y = bn2(conv2(y)).relu_();
    y = bn3(conv3(y));
    return (y + x).relu_();
  }

  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
  torch::nn::Conv2d conv3;
  torch::nn::BatchNorm2d bn3;
};
TORCH_MODULE(Bottleneck);

enum class Block { basic, bottleneck };

/// stem conv + BatchNorm + ReLU, `blocks` basic or bottleneck blocks, global average pool, classifier.
class ResNetImpl : public torch::nn::Module {
 public:
  ResNetImpl(int blocks, std::int64_t channels, std::int64_t classes = 10, Block block = Block::basic)
      : stem(register_module("stem", torch::nn::Conv2d(conv(3, channels, 3)))),
        stem_bn(register_module("stem_bn", torch::nn::BatchNorm2d(channels))),
        layers(register_module("layers", torch::nn::ModuleList())),
        fc(register_module("fc", torch::nn::Linear(channels, classes))) {
    for (int i = 0; i < blocks; ++i) {
      if (block == Block::basic) layers->push_back(BasicBlock(channels));
      else layers->push_back(Bottleneck(channels));
    }
  }

  /// images [B, 3, H, W] -> logits [B, classes]
  torch::Tensor forward(torch::Tensor x) {
    x = stem_bn(stem(x)).relu_();
    for (const auto& layer : *layers) {
      if (auto* basic = layer->as<BasicBlock>()) x = memscale::forward(*basic, x);
      else x = memscale::forward(*layer->as<Bottleneck>(), x);
    }
    return fc(x.mean({2, 3}));
  }

  torch::nn::Conv2d stem;
  torch::nn::BatchNorm2d stem_bn;
  torch::nn::ModuleList layers;
  torch::nn::Linear fc;
};
TORCH_MODULE(ResNet);

}  // namespace resnet
