"""How closely the trainer's logprobs agree with the engine's, on the real default model.

The engine samples the demo's addition prompts (`--num-prompts` × `--n` samples, `--max-tokens`
new tokens) at each `--temperatures`; the trainer then computes, with the same weights, the
logprob of every sampled token. Printed per temperature, over all sampled tokens:

- `mean_abs`, `p99_abs`, `max_abs`: |engine logprob − trainer logprob| in nats;
- `bitwise_equal`: the fraction of tokens whose two float32 logprobs are the same bits;
- with `--batch-invariant`, the engine's teacher-forced rescoring against its sampled logprobs
  (`engine_score_vs_sampled`: the values exact on-policy training takes; bitwise_equal 1.0 expected);
- with `--reference`, the same against a float32 copy of the model run by transformers + PEFT
  (the truth both sides approximate), for the engine (`engine_vs_fp32`) and the trainer
  (`trainer_vs_fp32`).

`--adapter DIR` loads a PEFT checkpoint (e.g. `.tempering/tempering-demo/models/<run>/checkpoints/0012`)
so the comparison runs with a trained, non-zero LoRA as after the demo's steps; without it the
adapter is fresh (B = 0, the base model). `--grad` also takes one training step's gradient on the
samples (rewards from the addition task, PPO) and prints its norm and the largest per-token
importance ratio.

    python benchmarks/logprob_agreement.py                               # CPU, float32
    python benchmarks/logprob_agreement.py --device cuda --reference     # GPU, bfloat16
    python benchmarks/logprob_agreement.py --device cuda --adapter DIR --grad
    python benchmarks/logprob_agreement.py --device cuda --adapter DIR --batch-invariant
    python benchmarks/logprob_agreement.py --device cuda --base-model gemma-3-270m --task repeat-word
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import tempfile
import time
from pathlib import Path

import torch


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _summary(a: list[float], b: list[float]) -> dict[str, float]:
    diffs = [abs(x - y) for x, y in zip(a, b)]
    same = sum(struct.pack("f", x) == struct.pack("f", y) for x, y in zip(a, b))
    return {"mean_abs": sum(diffs) / max(len(diffs), 1), "p99_abs": _quantile(diffs, 0.99),
            "max_abs": max(diffs, default=math.nan), "bitwise_equal": same / max(len(diffs), 1)}


def load_adapter(trainer, directory: Path) -> None:
    """Copy a saved PEFT adapter's tensors into the trainer's live adapter (in place)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(Path(directory) / "adapter_model.safetensors"))
    with torch.no_grad():
        result = set_peft_model_state_dict(trainer.peft_model, state, adapter_name="default")
    missing = [k for k in getattr(result, "unexpected_keys", []) if "lora" in k]
    if missing:
        raise ValueError(f"adapter tensors that match no LoRA parameter: {missing[:4]}")


def sample(service, prompts: list[list[int]], temperature: float, n: int, max_tokens: int, seed: int):
    from tempering.engine import SamplingParams

    futures = [service.submit(p, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i), n=n)
               for i, p in enumerate(prompts)]
    return [(p, c) for p, f in zip(prompts, futures) for c in f.result()]


def sequences_of(samples, temperature: float, advantages: list[float] | None = None):
    from tempering.training.tokenize import TokenizedSequence

    out = []
    for i, (prompt, c) in enumerate(samples):
        ids = prompt + c.token_ids
        out.append(TokenizedSequence(
            token_ids=ids, loss_mask=[False] * len(prompt) + [True] * len(c.token_ids),
            sampled_logprobs=[math.nan] * len(prompt) + list(c.logprobs),
            temperatures=[1.0] * len(prompt) + [temperature] * len(c.token_ids),
            advantage=advantages[i] if advantages else 0.0, group_index=i // 8, trajectory_index=i % 8))
    return out


def trainer_logprobs(trainer, sequences) -> list[list[float]]:
    """The trainer's logprob of each sequence's trained tokens (its training forward, eagerly)."""
    from tempering.training.batching import pack_sequences

    out: list[list[float] | None] = [None] * len(sequences)  # trained tokens in order within a sequence
    index = {id(s): i for i, s in enumerate(sequences)}
    device = trainer.params[0].device
    for micro in pack_sequences(sequences, max_tokens=16384, share_prefixes=trainer.share_prompts):
        row = micro.row().to(device)
        with torch.no_grad():
            lp, _ = trainer._row_logprobs(row)
        for seq_index, value in zip(row.seq_index.tolist(), lp.tolist()):  # predictions, sequence by sequence
            slot = index[id(micro.sequences[seq_index])]
            out[slot] = (out[slot] or []) + [value]
    return out


def reference_logprobs(service, adapter_dir: Path | None, sequences) -> list[list[float]]:
    """float32 transformers (+ PEFT) logprobs of the trained tokens: the exact function both sides approximate."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(service.model.config._name_or_path, dtype=torch.float32)
    model = model.to(service.device).eval()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq.token_ids], device=service.device)
            logits = model(input_ids=ids).logits[0].float()  # [T, V]
            mask = torch.tensor(seq.loss_mask, device=service.device)
            temps = torch.tensor(seq.temperatures, device=service.device)
            pos = mask.nonzero().squeeze(1)
            lp = torch.log_softmax(logits[pos - 1] / temps[pos, None], dim=-1)
            out.append(lp.gather(1, ids[0, pos, None]).squeeze(1).tolist())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="bfloat16 or float32 (default: the service's for the device)")
    parser.add_argument("--adapter", type=Path, default=None)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--base-model", default=None,
                        help="the model (default: the demo's, SmolLM2-135M-Instruct), e.g. gemma-3-270m")
    parser.add_argument("--task", default=None, help="whose prompts to sample: addition or repeat-word (default: "
                                                        "the model's demo task)")
    parser.add_argument("--reference", action="store_true", help="also compare with float32 transformers")
    parser.add_argument("--grad", action="store_true", help="also one training step's gradient norm")
    parser.add_argument("--per-sequence", action="store_true", help="with --grad: each sample's gradient norm alone")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the engine's batch-invariant mode: also compare its teacher-forced rescoring "
                             "(Engine.score, the trainer's values in exact on-policy mode) with the sampled logprobs")
    parser.add_argument("--matmul-precision", default="highest", choices=["highest", "high", "medium"],
                        help="torch.set_float32_matmul_precision for a float32 model: highest = exact float32 "
                             "products, high = TF32 tensor cores (cuBLAS and the engine's Triton kernels alike)")
    args = parser.parse_args()
    torch.set_float32_matmul_precision(args.matmul_precision)

    from tempering.demo.run import TASKS, default_task
    from tempering.service.base_model import DEFAULT_BASE_MODEL
    from tempering.service.service import ModelService
    from tempering.storage import ModelPaths
    from tempering.types import TrainConfig

    dtype = getattr(torch, args.dtype) if args.dtype else None
    args.task = args.task or default_task(args.base_model or DEFAULT_BASE_MODEL)
    task = TASKS[args.task]()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        from tempering.engine import EngineConfig

        service = ModelService(ModelPaths(Path(tmp), "agreement", "probe"), args.base_model or DEFAULT_BASE_MODEL, device=args.device,
                               dtype=dtype, engine_config=EngineConfig(batch_invariant=args.batch_invariant))
        trainer = service._ensure_trainer(TrainConfig())
        if args.adapter is not None:
            load_adapter(trainer, args.adapter)
        scenarios = task.scenarios(args.num_prompts, seed=args.seed + 20_000)
        prompts = [service.renderer.render_prompt([{"role": "user", "content": s.prompt}]) for s in scenarios]
        result = {"base_model": args.base_model or DEFAULT_BASE_MODEL, "task": args.task,
                  "device": str(service.device), "dtype": str(service.dtype).removeprefix("torch."),
                  "matmul_precision": torch.get_float32_matmul_precision(),
                  "gpu": torch.cuda.get_device_name(service.device) if service.device.type == "cuda" else None,
                  "adapter": str(args.adapter) if args.adapter else None, "temperatures": {}}
        for temperature in args.temperatures:
            samples = sample(service, prompts, temperature, args.n, args.max_tokens, args.seed)
            rewards = [task.reward(c.text, scenarios[i // args.n]) for i, (_, c) in enumerate(samples)]
            sequences = sequences_of(samples, temperature)
            engine = [list(c.logprobs) for _, c in samples]
            ours = trainer_logprobs(trainer, sequences)
            flat_e = [x for xs in engine for x in xs]
            flat_t = [x for xs in ours for x in xs]
            entry = {"num_tokens": len(flat_e), "reward": sum(rewards) / len(rewards), **_summary(flat_e, flat_t)}
            if args.batch_invariant:
                scored = service._exact_scorer()([p + c.token_ids for p, c in samples],
                                                 [s.temperatures for s in sequences])
                flat_s = [x for (p, _), xs in zip(samples, scored) for x in xs[len(p) - 1:]]
                entry["engine_score_vs_sampled"] = _summary(flat_e, flat_s)
            worst = max(range(len(flat_e)), key=lambda i: abs(flat_e[i] - flat_t[i]))
            entry["worst"] = {"engine": flat_e[worst], "trainer": flat_t[worst]}
            if args.reference:
                ref = [x for xs in reference_logprobs(service, args.adapter, sequences) for x in xs]
                entry["engine_vs_fp32"] = _summary(flat_e, ref)
                entry["trainer_vs_fp32"] = _summary(flat_t, ref)
            if args.grad:
                entry["grad"] = gradient_probe(service, trainer, samples, rewards, temperature, args.n,
                                               per_sequence=args.per_sequence)
            result["temperatures"][str(temperature)] = entry
        service.close()
    result["seconds"] = time.perf_counter() - start
    print(json.dumps(result))


def gradient_probe(service, trainer, samples, rewards, temperature: float, n: int, *,
                   per_sequence: bool = False) -> dict:
    """One step's gradient norm on the samples (PPO, group-normalized advantages), without changing
    the adapter (learning rate ~0), once with the engine's logprobs as π_old and once with the
    trainer's own (so the importance ratio is 1: what the gradient is without the mismatch)."""
    from tempering.training.advantages import group_advantages
    from tempering.types import TrainConfig

    advantages = [a for g in range(0, len(rewards), n) for a in group_advantages(rewards[g:g + n], normalize=True)]
    config = TrainConfig(learning_rate=1e-30)
    out = {}
    for name in ("engine", "trainer"):
        sequences = [s for s in sequences_of(samples, temperature, advantages) if s.advantage != 0.0]
        if not sequences:
            return {"note": "no group with reward spread"}
        if name == "trainer":
            for s, lp in zip(sequences, trainer_logprobs(trainer, sequences)):
                k = s.loss_mask.index(True)
                s.sampled_logprobs[k:] = lp
        with service._training(trainer):
            metrics = trainer.step(sequences, config).values
        out[f"grad_norm_{name}_logprobs"] = metrics["loss/grad_norm"]
        out[f"ratio_max_{name}_logprobs"] = metrics["offpolicy/ratio_max"]
        if per_sequence:  # which samples carry the gradient: each alone
            norms = []
            for s in sequences:
                with service._training(trainer):
                    norms.append((trainer.step([s], config).values["loss/grad_norm"], s))
            norms.sort(key=lambda e: -e[0])
            out[f"top_sequences_{name}"] = [
                {"grad_norm": g, "advantage": s.advantage, "text": service.tokenizer.decode(s.token_ids[s.loss_mask.index(True):]),
                 "engine_logprobs": s.sampled_logprobs[s.loss_mask.index(True):]} for g, s in norms[:3]]
    return out


if __name__ == "__main__":
    main()
