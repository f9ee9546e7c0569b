"""The rollout workloads of `rollout.py` through vLLM, as its subprocess (prints one JSON line).

    python benchmarks/vllm_rollout.py MODEL_DIR LORA_DIR|- '{"R": {"num_prompts": 32, "n": 8, "max_new": 256}}'

MODEL_DIR holds only a config.json (weights are random: `load_format="dummy"`); LORA_DIR a PEFT
adapter of rank 8 (every request uses it), or "-" for the base model. One process per mode, so
that each vLLM instance has the GPU to itself. Same settings as the reference measurement (reference/VLLM_GPU.md): bf16,
prefix caching, max_num_seqs 256, the logprob of each sampled token (`logprobs=0`), EOS ignored,
temperature 1, 128-token random prompts; each workload is warmed up with the same prompts first.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def main() -> None:
    model_dir, lora_dir, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    mode = "base" if lora_dir == "-" else "lora"
    out: dict = {"vllm": __import__("vllm").__version__, "workloads": {}}
    start = time.perf_counter()
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              enable_prefix_caching=True, max_num_seqs=256, max_model_len=4096, gpu_memory_utilization=0.85,
              **({"enable_lora": True, "max_lora_rank": 8} if mode == "lora" else {}))
    out[f"{mode}_startup_s"] = round(time.perf_counter() - start, 1)
    lora = LoRARequest("bench", 1, lora_dir) if mode == "lora" else None
    for k, (name, work) in enumerate(spec.items()):
        g = torch.Generator().manual_seed(1000 + 10 * k + (mode == "lora"))
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(100, 151836, (128,), generator=g).tolist())
                   for _ in range(work["num_prompts"])]
        params = SamplingParams(n=work["n"], max_tokens=work["max_new"], ignore_eos=True, logprobs=0,
                                temperature=1.0, detokenize=False)
        warm = SamplingParams(n=work["n"], max_tokens=8, ignore_eos=True, logprobs=0, temperature=1.0, detokenize=False)
        llm.generate(prompts, warm, lora_request=lora, use_tqdm=False)
        llm.reset_prefix_cache()
        torch.cuda.synchronize()
        start = time.perf_counter()
        results = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for r in results for c in r.outputs)
        assert tokens == work["num_prompts"] * work["n"] * work["max_new"]
        out["workloads"][name] = {f"{mode}_tok_per_s": round(tokens / seconds, 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
