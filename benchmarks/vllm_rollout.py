"""The rollout workloads of `rollout.py` through vLLM, as its subprocess (prints one JSON line).

    python benchmarks/vllm_rollout.py MODEL_DIR LORA_DIR|- '{"R": {"num_prompts": 32, "n": 8, "max_new": 256}}' [TP [ROUNDS]]

MODEL_DIR holds only a config.json (weights are random: `load_format="dummy"`); LORA_DIR a PEFT
adapter of rank 8 (every request uses it), or "-" for the base model. One process per mode, so
that each vLLM instance has the GPU to itself. Same settings as the reference measurement (reference/VLLM_GPU.md): bf16,
prefix caching, max_num_seqs 256, the logprob of each sampled token (`logprobs=0`), EOS ignored,
temperature 1, 128-token random prompts; each workload is warmed up with the same prompts first.
TP (default 1): vLLM's tensor_parallel_size. ROUNDS (default 2): timed runs of each workload on the
one vLLM instance; the figure is the best, `{mode}_tok_per_s_runs` lists them all. `launch` runs it
from another benchmark.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    model_dir, lora_dir, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    tensor_parallel_size = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    mode = "base" if lora_dir == "-" else "lora"
    out: dict = {"vllm": __import__("vllm").__version__, "workloads": {}}
    start = time.perf_counter()
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              enable_prefix_caching=True, max_num_seqs=256, max_model_len=4096, gpu_memory_utilization=0.85,
              tensor_parallel_size=tensor_parallel_size,
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
        runs = []
        for _ in range(rounds):
            llm.reset_prefix_cache()
            torch.cuda.synchronize()
            start = time.perf_counter()
            results = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            tokens = sum(len(c.token_ids) for r in results for c in r.outputs)
            assert tokens == work["num_prompts"] * work["n"] * work["max_new"]
            runs.append(round(tokens / seconds, 1))
        out["workloads"][name] = {f"{mode}_tok_per_s": max(runs), f"{mode}_tok_per_s_runs": runs}
    print(json.dumps(out))


def write_model_and_lora(config, directory: Path, rank: int = 8) -> tuple[Path, Path]:
    """`directory`/model (config.json of `config`, a Llama-family transformers config, bfloat16) and
    `directory`/lora (a PEFT adapter of rank `rank` on every projection, A and B random, non-zero)."""
    model_dir, lora_dir = directory / "model", directory / "lora"
    config.torch_dtype = "bfloat16"
    config.save_pretrained(model_dir)
    write_lora(config, lora_dir, rank=rank)
    return model_dir, lora_dir


def write_lora(config, lora_dir: Path, *, rank: int = 8, seed: int = 1, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A PEFT adapter of rank `rank` on every projection of a model of `config`, A and B random
    (drawn from `seed`) and non-zero, in `dtype`, written to `lora_dir`."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # only the adapter's tensors are needed, from a meta-device model
        shell = AutoModelForCausalLM.from_config(config)
    peft = get_peft_model(shell, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(v.shape, generator=g).to(dtype) * (0.01 if "lora_A" in k else 0.02)
             for k, v in peft.state_dict().items() if "lora_" in k}
    lora_dir.mkdir(parents=True)
    peft.peft_config["default"].save_pretrained(lora_dir)
    save_file({k.replace(".default", ""): v.contiguous() for k, v in state.items()}, lora_dir / "adapter_model.safetensors")
    return lora_dir


def launch(model_dir: str | Path, lora_dir: str | Path | None, spec: dict, path: str | None = None,
           tensor_parallel_size: int = 1, timeout_s: float = 3000, rounds: int = 2) -> dict:
    """Run this script in a subprocess (vLLM then has the GPUs to itself until it exits).

    Args:
        model_dir: a directory with the model's config.json; lora_dir: a PEFT adapter (None: the base model).
        spec: the workloads ({"R": {"num_prompts": ..., "n": ..., "max_new": ...}}).
        path: directories put first on the subprocess's PYTHONPATH (where vLLM and its pins are).
        rounds: timed runs of each workload (the figure is the best of them).

    Returns:
        The subprocess's JSON line, or {"error": the end of its output}.
    """
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join([path, env.get("PYTHONPATH", "")])
    args = [sys.executable, str(Path(__file__)), str(model_dir), str(lora_dir) if lora_dir else "-", json.dumps(spec),
            str(tensor_parallel_size), str(rounds)]
    # a session of its own: a timeout ends vLLM's worker processes too (they hold the GPUs)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return {"error": f"vLLM did not finish in {timeout_s:.0f} s: {stderr[-1200:]}"}
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (stderr or stdout)[-1500:]}
    return json.loads(lines[-1])


if __name__ == "__main__":
    main()
