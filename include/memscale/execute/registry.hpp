// memscale — the registry of models memscale manages, keyed
// by their root module, so detach() and is_optimized() can find an attachment.
#pragma once

#include <algorithm>
#include <memory>
#include <mutex>
#include <vector>

#include <torch/torch.h>

namespace memscale::core {

class attachment;

/// Models memscale manages, keyed by their root module.
class registry {
 public:
  static registry& global() {
    static registry instance;
    return instance;
  }

  [[nodiscard]] std::shared_ptr<attachment> find(const torch::nn::Module* key) {
    std::lock_guard<std::mutex> lock(mutex_);
    prune();
    for (const auto& e : entries_)
      if (e.key == key) return e.value;
    return nullptr;
  }

  void add(const std::shared_ptr<torch::nn::Module>& root, std::shared_ptr<attachment> value) {
    std::lock_guard<std::mutex> lock(mutex_);
    prune();
    entries_.push_back({root.get(), root, std::move(value)});
  }

  [[nodiscard]] std::shared_ptr<attachment> remove(const torch::nn::Module* key, const attachment* only = nullptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it)
      if (it->key == key && (only == nullptr || it->value.get() == only)) {
        auto value = std::move(it->value);
        entries_.erase(it);
        return value;
      }
    return nullptr;
  }

 private:
  struct entry {
    const torch::nn::Module* key;
    std::weak_ptr<torch::nn::Module> root;  // a model dropped without detach() is pruned
    std::shared_ptr<attachment> value;
  };
  void prune() {
    entries_.erase(std::remove_if(entries_.begin(), entries_.end(), [](const entry& e) { return e.root.expired(); }),
                   entries_.end());
  }

  std::mutex mutex_;
  std::vector<entry> entries_;
};

}  // namespace memscale::core
