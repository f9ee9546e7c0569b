"""What the GPU allows: the hardware bound (roofline) of each headline workload, measured on this GPU.

A workload's bound is the least time the GPU needs for the bytes it must move through HBM and the
FLOPs it must compute, at this GPU's own rates, measured in the same run:

- HBM bandwidth: the faster of a 2 GiB device-to-device copy (bytes read + written per second) and a
  2 GiB sum (bytes read per second: a decode step mostly reads);
- bf16 GEMM rate: an 8192 x 8192 x 8192 bf16 matrix product (FLOP/s, 2 per multiply-add).

    bound_s = max(bytes / bandwidth, flops / gemm_rate)

Both are lower bounds: a kernel can move no fewer bytes than it must read once, nor compute faster
than the GPU's dense GEMM rate. What each workload must move and compute (`ModelShape`):

- a decode step of `rows` sequences: every weight once (bf16; the input embedding table is read
  row by row and left out; of a mixture of experts the experts its rows route to, assuming uniform
  routing), each row's KV cache up to its position, each row's new K/V, the LoRA A and B, and the
  logits in float32 written and read once (the sampler's log-softmax); FLOPs: 2 per weight per
  row, and the attention's 4 per key per head dimension per query head;
- a prefill token: its weights' FLOPs as above, and attention to the keys before it;
- a LoRA training step of T tokens: forward 2 FLOPs per weight per token, backward 2 more (the
  input gradient; the frozen base takes no weight gradient), the LoRA factors' own gradients and
  the recomputation left out; attention 4x its forward;
- an RL iteration: its gather's decode bound plus its step's.

Left out everywhere: activations between kernels (they fit in L2 at decode sizes, not always at
prefill), kernel launch gaps, the host, and sampling beyond the logits pass. So a workload at
fraction f of its bound could at best be 1/f times faster.

    python benchmarks/roofline.py --device cuda        # the bound of every headline workload on this GPU
    python benchmarks/roofline.py --hbm-gb-s 3000 --bf16-tflops 790   # on paper (no GPU)
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch


def measure_device(device: torch.device, *, copy_bytes: int = 2 << 30, gemm_n: int = 8192) -> dict:
    """HBM bandwidth (GB/s: the faster of a copy's bytes read + written and a sum's bytes read), bf16
    GEMM rate (TFLOP/s) and PCIe bandwidth each way (GB/s: 256 MiB to and from pinned host memory,
    what the KV cache's host tier moves) of `device`, measured now: the best of 10 timed repetitions
    after 3 warm-ups each."""
    src = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    a = torch.randn(gemm_n, gemm_n, dtype=torch.bfloat16, device=device)
    b = torch.randn(gemm_n, gemm_n, dtype=torch.bfloat16, device=device)

    def best(fn, reps: int = 10) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return min(times)

    copy_s = best(lambda: dst.copy_(src))
    read_s = best(lambda: src.sum(dtype=torch.float32))
    gemm_s = best(lambda: torch.mm(a, b))
    pcie_bytes = 256 << 20
    host = torch.empty(pcie_bytes // 2, dtype=torch.bfloat16, pin_memory=True)
    staged = src[:pcie_bytes // 2]
    d2h_s = best(lambda: host.copy_(staged, non_blocking=True))
    h2d_s = best(lambda: staged.copy_(host, non_blocking=True))
    del src, dst, a, b, host, staged
    torch.cuda.empty_cache()
    copy, read = 2 * copy_bytes / copy_s / 1e9, copy_bytes / read_s / 1e9
    return {"gpu": torch.cuda.get_device_name(device), "hbm_gb_s": round(max(copy, read), 1),
            "copy_gb_s": round(copy, 1), "read_gb_s": round(read, 1),
            "bf16_tflops": round(2 * gemm_n**3 / gemm_s / 1e12, 1),
            "d2h_gb_s": round(pcie_bytes / d2h_s / 1e9, 1), "h2d_gb_s": round(pcie_bytes / h2d_s / 1e9, 1)}


@dataclass(frozen=True)
class ModelShape:
    """The sizes that set a transformer's bytes and FLOPs (bf16 weights and KV cache)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int  # a dense MLP's; 0 for a mixture of experts
    experts: int = 0
    expert_intermediate: int = 0
    experts_per_token: int = 0
    tied_embeddings: bool = False
    lora_rank: int = 8

    @classmethod
    def from_config(cls, c, lora_rank: int = 8) -> ModelShape:
        """From a transformers config (Llama/Qwen2/Qwen3 dense, Qwen3-MoE)."""
        return cls(layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
                   kv_heads=c.num_key_value_heads, head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                   vocab=c.vocab_size, intermediate=0 if getattr(c, "num_experts", 0) else c.intermediate_size,
                   experts=getattr(c, "num_experts", 0) or 0, expert_intermediate=getattr(c, "moe_intermediate_size", 0) or 0,
                   experts_per_token=getattr(c, "num_experts_per_tok", 0) or 0,
                   tied_embeddings=bool(c.tie_word_embeddings), lora_rank=lora_rank)

    # parameters, per layer and in all
    @property
    def attn_params(self) -> int:
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    @property
    def expert_params(self) -> int:  # one expert's gate, up and down
        return 3 * self.hidden * self.expert_intermediate

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate + (self.hidden * self.experts if self.experts else 0)  # + router

    @property
    def lora_params(self) -> int:
        """Rank-r LoRA on q/k/v/o and the MLP (every expert's gate/up/down for a mixture of experts)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.lora_rank * ((self.hidden + q) * 2 + (self.hidden + kv) * 2)
        if self.experts:
            mlp = self.experts * self.lora_rank * 3 * (self.hidden + self.expert_intermediate)
        else:
            mlp = self.lora_rank * 3 * (self.hidden + self.intermediate)
        return self.layers * (attn + mlp)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def active_params(self) -> int:
        """Weights one token multiplies by (the LM head included, the input embedding not)."""
        mlp = self.dense_mlp_params + self.experts_per_token * self.expert_params
        return self.layers * (self.attn_params + mlp) + self.vocab * self.hidden

    def experts_touched(self, rows: float) -> float:
        """Expected distinct experts per layer that `rows` tokens route to (uniform routing)."""
        if not self.experts:
            return 0.0
        return self.experts * (1 - (1 - self.experts_per_token / self.experts) ** rows)

    def decode_step_bytes(self, rows: float, context: float) -> float:
        """HBM bytes of one decode step of `rows` sequences whose KV caches hold `context` tokens on average."""
        weights = self.layers * (self.attn_params + self.dense_mlp_params
                                 + self.experts_touched(rows) * self.expert_params) + self.vocab * self.hidden
        return (2 * (weights + self.lora_params) + rows * (context + 1) * self.kv_bytes_per_token
                + rows * self.vocab * 4 * 2)

    def token_flops(self, context: float) -> float:
        """FLOPs of one token's forward pass attending to `context` earlier tokens."""
        return 2 * (self.active_params + self.lora_params) + 4 * context * self.heads * self.head_dim * self.layers

    def train_flops(self, tokens: int, mean_context: float) -> float:
        """FLOPs of a LoRA step's forward and backward over `tokens` tokens (see the module docstring)."""
        dense = 4 * (self.active_params + self.lora_params) * tokens
        return dense + 4 * 4 * mean_context * self.heads * self.head_dim * self.layers * tokens


def bound(bytes_: float, flops: float, hw: dict) -> dict:
    """{"bound_s", "memory_s", "compute_s"} of a workload at this GPU's rates."""
    memory_s = bytes_ / (hw["hbm_gb_s"] * 1e9)
    compute_s = flops / (hw["bf16_tflops"] * 1e12)
    return {"bound_s": round(max(memory_s, compute_s), 4), "memory_s": round(memory_s, 4),
            "compute_s": round(compute_s, 4)}


def decode_bound(shape: ModelShape, hw: dict, *, rows: int, prompt: int, new: int, prompts: int | None = None,
                 max_rows: int = 256) -> dict:
    """Sampling `new` tokens for each of `rows` sequences after a `prompt`-token prompt, `max_rows` at a
    time, and its tokens/s. The prefill of the `prompts` distinct prompts (default: one per row) is included."""
    waves = -(-rows // max_rows)
    per_wave = rows / waves
    bytes_ = waves * new * shape.decode_step_bytes(per_wave, prompt + new / 2)  # linear in the context
    flops = rows * new * shape.token_flops(prompt + new / 2) + (prompts or rows) * prompt * shape.token_flops(prompt / 2)
    out = bound(bytes_, flops, hw)
    out["tok_per_s"] = round(rows * new / out["bound_s"], 1)
    return out


def train_bound(shape: ModelShape, hw: dict, *, tokens: int, mean_context: float) -> dict:
    """A LoRA step over `tokens` tokens: compute-bound (the weights are read a few times per micro-batch)."""
    out = bound(0.0, shape.train_flops(tokens, mean_context), hw)
    out["tok_per_s"] = round(tokens / out["bound_s"], 1)
    return out


def agent_gather_bound(config, turns, shared_tokens: int, hw: dict, *, max_rows: int = 256) -> dict:
    """The least time for an agent gather's work (benchmarks/agent_rl.py's TurnRecords).

    Decode: every sampled token, at its context, in at least max(the longest rollout's sampled
    tokens, all sampled tokens / `max_rows`) steps (a rollout's turns run one after the other),
    each step reading the weights once. Prefill: with a perfect prefix cache only the new tokens
    of each request (the prompt less what the previous turn sent and sampled; the shared system
    prompt and tools, `shared_tokens`, once). Attention FLOPs at each token's position.
    """
    shape = ModelShape.from_config(config)
    decoded = sum(r.completion_tokens for r in turns)
    per_rollout: dict[int, int] = {}
    for r in turns:
        per_rollout[r.rollout] = per_rollout.get(r.rollout, 0) + r.completion_tokens
    steps = max(max(per_rollout.values()), decoded / max_rows)
    rows = decoded / steps
    kv_read = sum(r.completion_tokens * r.prompt_tokens + r.completion_tokens * (r.completion_tokens + 1) / 2
                  for r in turns) * shape.kv_bytes_per_token
    weights = steps * (shape.decode_step_bytes(rows, 0) - rows * shape.kv_bytes_per_token)
    new_tokens = shared_tokens + sum(r.prompt_tokens - (r.resent_tokens if r.turn else shared_tokens) for r in turns)
    flops = sum(r.completion_tokens * shape.token_flops(r.prompt_tokens + r.completion_tokens / 2) for r in turns)
    flops += sum((r.prompt_tokens - (r.resent_tokens if r.turn else shared_tokens))
                 * shape.token_flops((r.prompt_tokens + (r.resent_tokens if r.turn else shared_tokens)) / 2)
                 for r in turns)
    out = bound(weights + kv_read, flops, hw)
    out.update(decode_steps=round(steps), mean_rows=round(rows, 1), prefill_tokens_needed=int(new_tokens),
               kv_read_gb=round(kv_read / 1e9, 1), weights_read_gb=round(weights / 1e9, 1),
               generated_tok_per_s=round(decoded / out["bound_s"], 1))
    return out


def headline_bounds(hw: dict) -> dict:
    """The bound of each headline benchmark's workload (shapes and sizes as the benchmarks set them)."""
    qwen_1_5b = ModelShape(layers=28, hidden=1536, heads=12, kv_heads=2, head_dim=128, vocab=151936, intermediate=8960,
                           tied_embeddings=True)
    qwen3_8b = ModelShape(layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128, vocab=151936, intermediate=12288)
    moe = ModelShape(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, vocab=151936, intermediate=0,
                     experts=128, expert_intermediate=768, experts_per_token=8)
    out = {
        "rollout_R_1.5b": decode_bound(qwen_1_5b, hw, rows=256, prompt=128, new=256, prompts=32),
        "rollout_1024x1_1.5b": decode_bound(qwen_1_5b, hw, rows=1024, prompt=128, new=256),
        "rollout_long_1.5b": decode_bound(qwen_1_5b, hw, rows=512, prompt=128, new=2048, prompts=64),
        "moe_R_30b_a3b": decode_bound(moe, hw, rows=256, prompt=128, new=256, prompts=32),
        "train_step_1.5b_16x1024": train_bound(qwen_1_5b, hw, tokens=16 * 1024, mean_context=512),
        "train_step_8b_16x1024": train_bound(qwen3_8b, hw, tokens=16 * 1024, mean_context=512),
    }
    # rl_loop.py: 256 rollouts x 1,024 new tokens on 128-token prompts, then the step on 256 x 1,152 tokens
    gather = decode_bound(qwen_1_5b, hw, rows=256, prompt=128, new=1024, prompts=32)
    step = train_bound(qwen_1_5b, hw, tokens=256 * 1152, mean_context=576)
    out["rl_loop_iteration_1.5b"] = {"bound_s": round(gather["bound_s"] + step["bound_s"], 3),
                                     "gather_bound_s": gather["bound_s"], "train_bound_s": step["bound_s"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hbm-gb-s", type=float, default=None, help="use this bandwidth instead of measuring")
    parser.add_argument("--bf16-tflops", type=float, default=None, help="use this GEMM rate instead of measuring")
    args = parser.parse_args()
    if args.hbm_gb_s and args.bf16_tflops:
        hw = {"gpu": "given", "hbm_gb_s": args.hbm_gb_s, "bf16_tflops": args.bf16_tflops}
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no GPU: pass --hbm-gb-s and --bf16-tflops to compute bounds on paper")
        hw = measure_device(torch.device(args.device))
    print(json.dumps({"benchmark": "roofline", "date": time.strftime("%Y-%m-%d"), "hardware": hw,
                      "bounds": headline_bounds(hw)}))


if __name__ == "__main__":
    main()
