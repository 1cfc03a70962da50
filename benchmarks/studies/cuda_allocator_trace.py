"""The CUDA caching allocator's own trace of training steps, for checking memscale's
model of it (include/memscale/predict/cuda_reserve.hpp) event by event.

Trains the example GPT of examples/gpt.hpp, written again in PyTorch (same layers,
same order of operations; AdamW without foreach, as LibTorch's C++ AdamW steps one
parameter at a time), for 1 warm-up + 3 steps, with the allocator's history
recorded from before the model is built, and writes per configuration
OUT/trace_<name>.json: the allocator's alloc/free events (address, size), the
peaks of the 3 steps after the warm-up (reserved, allocated; their peak stats
reset after it), the event index of that reset, the context (cudaMemGetInfo's used
bytes less the reserve) and the segments at the end.

    python3 benchmarks/studies/cuda_allocator_trace.py OUT [name ...]
"""
import json
import math
import os
import subprocess
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIGS = {  # name: (d_model, heads, layers, context, vocab, batch)
    "gpt-b64": (128, 4, 4, 128, 256, 64),
    "gpt-large-b16": (768, 12, 12, 256, 256, 16),
}


class Attention(nn.Module):
    def __init__(self, d, h, t, p):
        super().__init__()
        self.h = h
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.attn_drop = nn.Dropout(p)
        self.resid_drop = nn.Dropout(p)
        self.register_buffer("mask", torch.ones(t, t, dtype=torch.bool).triu(1))

    def forward(self, x):
        b, t, c = x.shape
        d = c // self.h
        parts = self.qkv(self.ln(x)).view(b, t, 3, self.h, d).permute(2, 0, 3, 1, 4)
        q, k, v = parts[0], parts[1], parts[2]
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        scores = scores.masked_fill(self.mask[:t, :t], float("-inf"))
        attention = self.attn_drop(torch.softmax(scores, -1))
        y = torch.matmul(attention, v).transpose(1, 2).reshape(b, t, c)
        return x + self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, d, p):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln(x)))))


class GPT(nn.Module):
    def __init__(self, d, h, layers, t, vocab, p=0.1):
        super().__init__()
        self.token = nn.Embedding(vocab, d)
        self.position = nn.Parameter(torch.randn(t, d) * 0.02)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.Sequential(Attention(d, h, t, p), MLP(d, p)))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        t = tokens.size(1)
        x = self.token(tokens) + self.position[:t]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def record(enabled):
    try:
        torch.cuda.memory._record_memory_history("all" if enabled else None, context=None, stacks="python",
                                                 max_entries=4_000_000)
    except TypeError:  # older signature
        torch.cuda.memory._record_memory_history(enabled, trace_alloc_max_entries=4_000_000)


def events_of(snapshot):
    out = []
    traces = snapshot.get("device_traces") or [[]]
    for e in traces[0]:
        if e.get("action") in ("alloc", "free_completed", "segment_alloc", "segment_free", "segment_map",
                               "segment_unmap"):
            out.append([e["action"], e.get("addr", 0), e.get("size", 0)])
    return out


def segments_of(snapshot):
    try:
        return [[s["address"], s["total_size"], s["allocated_size"], s.get("segment_type", ""),
                 [[b["size"], b["state"]] for b in s["blocks"]]] for s in snapshot["segments"]]
    except (KeyError, TypeError) as e:
        return [f"unreadable: {e!r}"]


def run(name, out_dir, device):
    d, h, layers, t, vocab, batch = CONFIGS[name]
    torch.manual_seed(7)
    cuda = device == "cuda"
    if cuda:
        record(True)
    model = GPT(d, h, layers, t, vocab).to(device)
    tokens = torch.randint(0, vocab, (batch, t), device=device)
    targets = torch.randint(0, vocab, (batch, t), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=False)
    reset_at = 0
    for s in range(4):
        if cuda:
            torch.cuda.synchronize()
        if s == 1 and cuda:
            reset_at = len(events_of(torch.cuda.memory._snapshot()))
            torch.cuda.reset_peak_memory_stats()
        opt.zero_grad(set_to_none=True)
        logits = model(tokens)
        loss = F.cross_entropy(logits.view(-1, vocab), targets.view(-1))
        loss.backward()
        opt.step()
    result = {"name": name, "config": CONFIGS[name], "torch": torch.__version__,
              "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "loss": float(loss)}
    if cuda:
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        free, total = torch.cuda.mem_get_info()
        snapshot = torch.cuda.memory._snapshot()
        record(False)
        result.update({
            "device": torch.cuda.get_device_name(),
            "reserved_peak": stats["reserved_bytes.all.peak"],
            "allocated_peak": stats["allocated_bytes.all.peak"],
            "reserved_now": stats["reserved_bytes.all.current"],
            "allocated_now": stats["allocated_bytes.all.current"],
            "segments_now": stats["segment.all.current"],
            "context": total - free - stats["reserved_bytes.all.current"],
            "data_bytes": tokens.nbytes + targets.nbytes,
            "reset_at": reset_at,
            "events": events_of(snapshot),
            "segments": segments_of(snapshot),
        })
        print(f"{name}: reserved peak {result['reserved_peak']}, allocated peak {result['allocated_peak']}, "
              f"reserve {result['reserved_peak'] - result['allocated_peak']}, context {result['context']}, "
              f"{len(result['events'])} events, {result['segments_now']} segments", flush=True)
    else:
        print(f"{name}: loss {result['loss']:.4f} on {device} (no allocator trace off CUDA)", flush=True)
    with open(os.path.join(out_dir, f"trace_{name}.json"), "w") as f:
        json.dump(result, f)


def main():
    out_dir = sys.argv[1]
    names = sys.argv[2:] or list(CONFIGS)
    if len(names) == 1:  # one configuration: this process
        run(names[0], out_dir, "cuda" if torch.cuda.is_available() else "cpu")
        return
    for name in names:  # each in a fresh process (a fresh allocator)
        subprocess.run([sys.executable, __file__, out_dir, name], check=False)


if __name__ == "__main__":
    main()
