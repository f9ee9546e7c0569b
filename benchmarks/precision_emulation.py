"""How far apart two GPU kernels' logprobs can be, by the precision they compute in: an emulation on the CPU.

The engine and the trainer run the same model with different kernels, which sum each product in a
different order. In float32 two orders differ by ~1e-7 relative; what makes that visible is the
rounding that follows. This script computes the real default model's (SmolLM2-135M-Instruct, or
`--model-dir`) logprobs of sampled tokens twice per scheme, once summing every matrix product's
inner dimension in one pass and once in three chunks added in reverse (as a split-K or another
tile order would), exactly in float64/float32 otherwise, and reports the per-token
|logprob(order a) - logprob(order b)|: the engine/trainer mismatch that scheme allows at best.

Schemes (the weights are bfloat16 in every one but fp32):
- bf16: bfloat16 activations, every product's output rounded to bfloat16 (the GPU default today);
- fp32_residual: the same with the residual stream kept in float32;
- tf32: float32 activations, each product's operands rounded to TF32 (10-bit mantissa: what
  tensor cores read in TF32 mode), outputs kept in float32, attention on TF32 operands;
- tf32_kv_bf16: tf32 with the keys and values rounded to bfloat16 (a bfloat16 KV cache);
- fp32: float32 activations and products (operands not rounded).

Prints one JSON line: per scheme, the mismatch's mean, 99th percentile and max over the sampled
tokens, and its distance from the float32 model (the precision's own error, the same on both
sides). Issue targets for the engine/trainer agreement: mean <= 0.01, p99 <= 0.1.

    python benchmarks/precision_emulation.py [--prompts 8] [--new-tokens 24] [--adapter DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SCHEMES = ("bf16", "fp32_residual", "tf32", "tf32_kv_bf16", "fp32")
WORDS = ["cat", "blue", "tree", "night", "rain", "stone", "fire", "light", "sea", "road", "gold", "song"]


def tf32(t: torch.Tensor) -> torch.Tensor:
    """t rounded to TF32 (float32 with a 10-bit mantissa, round to nearest, ties away from zero)."""
    bits = t.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


class Emulator:
    """The Llama-family forward of `model` (HF, float32 weights) in one scheme and one summation order."""

    def __init__(self, model) -> None:
        self.model = model
        c = model.config
        self.H, self.nh, self.nkv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
        self.D = getattr(c, "head_dim", None) or self.H // self.nh
        self.eps = c.rms_norm_eps
        theta = getattr(c, "rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.D, 2).float() / self.D))

    def matmul(self, x: torch.Tensor, w: torch.Tensor, split: bool) -> torch.Tensor:
        """x @ w.T (operands already rounded) in float32, in one pass or in three K-chunks added in reverse."""
        if not split:
            return x @ w.transpose(-1, -2)
        K = x.shape[-1]
        cuts = [0, K // 3, 2 * K // 3, K]
        parts = [x[..., a:b] @ w[..., a:b].transpose(-1, -2) for a, b in zip(cuts, cuts[1:])]
        return (parts[2] + parts[1]) + parts[0]

    def forward(self, ids: torch.Tensor, scheme: str, split: bool) -> torch.Tensor:
        """Logits [T, V] (float32) of one sequence."""
        weight = (lambda w: w.float()) if scheme == "fp32" else bf16
        operand = {"bf16": bf16, "fp32_residual": bf16, "tf32": tf32, "tf32_kv_bf16": tf32, "fp32": lambda t: t}[scheme]
        output = bf16 if scheme in ("bf16", "fp32_residual") else (lambda t: t)
        residual = bf16 if scheme == "bf16" else (lambda t: t)
        kv = bf16 if scheme in ("bf16", "fp32_residual", "tf32_kv_bf16") else operand

        def linear(x, w):
            return output(self.matmul(operand(x), weight(w), split))

        def rms(x, g):
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return output(weight(g) * x)

        m, T, D = self.model.model, ids.shape[0], self.D
        angles = torch.outer(torch.arange(T).float(), self.inv_freq)
        cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]

        def rotate(x):
            x1, x2 = x[..., : D // 2], x[..., D // 2:]
            return output(x * cos + torch.cat([-x2, x1], -1) * sin)

        h = weight(m.embed_tokens.weight)[ids]
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        for layer in m.layers:
            a = layer.self_attn
            x = rms(h, layer.input_layernorm.weight)
            q = rotate(linear(x, a.q_proj.weight).view(T, self.nh, D))
            k = kv(rotate(linear(x, a.k_proj.weight).view(T, self.nkv, D)))
            v = kv(linear(x, a.v_proj.weight).view(T, self.nkv, D))
            k = k.repeat_interleave(self.nh // self.nkv, 1)
            v = v.repeat_interleave(self.nh // self.nkv, 1)
            scores = self.matmul(operand(q).transpose(0, 1), operand(k).transpose(0, 1), split) / math.sqrt(D)
            p = scores.masked_fill(causal, float("-inf")).softmax(-1)  # [heads, T, T]
            o = output(self.matmul(operand(p), operand(v).permute(1, 2, 0), split)).transpose(0, 1).reshape(T, -1)
            h = residual(h + linear(o, a.o_proj.weight))
            x = rms(h, layer.post_attention_layernorm.weight)
            act = output(F.silu(linear(x, layer.mlp.gate_proj.weight)) * linear(x, layer.mlp.up_proj.weight))
            h = residual(h + linear(act, layer.mlp.down_proj.weight))
        x = rms(h, m.norm.weight)
        head = m.embed_tokens.weight if self.model.config.tie_word_embeddings else self.model.lm_head.weight
        return self.matmul(operand(x), weight(head), split)  # the LM head's logits in float32 on every side


def sampled_sequences(model, tokenizer, num_prompts: int, new_tokens: int, seed: int) -> list[tuple[torch.Tensor, int]]:
    """(token ids [T], prompt length) of sampled chat completions (temperature 1.0)."""
    torch.manual_seed(seed)
    out = []
    for word in (WORDS * (num_prompts // len(WORDS) + 1))[:num_prompts]:
        messages = [{"role": "user", "content": f"Write one word that rhymes with {word}."}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        ids = ids if torch.is_tensor(ids) else ids["input_ids"]
        full = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0)
        out.append((full[0], ids.shape[1]))
    return out


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    return torch.log_softmax(logits[start - 1:-1].double(), -1).gather(1, ids[start:, None])[:, 0]


def stats(d: torch.Tensor) -> dict:
    d = d.abs()
    return {"mean": round(float(d.mean()), 5), "p99": round(float(d.quantile(0.99)), 5),
            "max": round(float(d.max()), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="default: the converted default model")
    parser.add_argument("--adapter", type=Path, default=None, help="a PEFT LoRA adapter to merge first")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.model_dir is None:
        from tempering.service.base_model import default_model_dir

        args.model_dir = Path(default_model_dir())
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    if args.adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(args.adapter)).merge_and_unload().eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    emulator = Emulator(model)
    with torch.no_grad():
        sequences = sampled_sequences(model, tokenizer, args.prompts, args.new_tokens, args.seed)
        exact = torch.cat([token_logprobs(model(ids[None]).logits[0], ids, s) for ids, s in sequences])
        record = {}
        for scheme in SCHEMES:
            a, b = (torch.cat([token_logprobs(emulator.forward(ids, scheme, split), ids, s) for ids, s in sequences])
                    for split in (False, True))
            record[scheme] = {"order_a_vs_b": stats(a - b), "vs_fp32_model": stats(a - exact)}
    print(json.dumps({"benchmark": "precision_emulation", "model": args.model_dir.name,
                      "adapter": str(args.adapter) if args.adapter else None, "tokens": int(exact.numel()),
                      "targets": {"mean": 0.01, "p99": 0.1}, "schemes": record,
                      "seconds": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
