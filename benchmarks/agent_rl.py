"""Agent RL through the OpenAI endpoint: multi-turn tool-calling rollouts, then the step on them (one JSON line).

The workload is what an agent RL user runs, with the user's code on the client side: each rollout
is an `AsyncOpenAI` client (`model.openai_client()`) holding a conversation with the served model.
It starts with a shared system prompt (`--system-tokens`, about 1,500 tokens) and three JSON-schema
function tools (`search`, `read`, `compute`), and a task message of its group's scenario. Each of
`--turns` assistant turns is a chat completion with `tools=` and a named `tool_choice` (a forced
call: random weights call a tool only when made to); its `Choice` is appended to the
`Trajectory`, the user code "runs" the called tool and appends a `tool` message of
`--tool-tokens` tokens (seeded, 200-800), and the whole conversation goes back for the next turn,
as an agent's does. `gather_trajectory_groups` runs `--groups` x `--group-size` rollouts at once;
each trajectory gets a random reward.

Turn lengths are held fixed with random weights: each tool's only argument is a string of digits
of a fixed length (the pattern `^[0-9]{N}$`; the tokenizer splits digits one per token), so a call
of tool k is `--turn-tokens`[k] tokens (64/192/384 on a GPU), and each turn's tool is drawn from a
seeded generator. The conversations, tool results included, are the same for every engine.

Measured (tempering, in this process, through `LocalBackend`):
- gather: wall time, generated tokens/s, prompt tokens sent against those served from the prefix
  cache (the response's `usage.prompt_tokens_details.cached_tokens`) and against those re-sent
  (turn t > 0 re-sends turn t-1's prompt and completion), the prefill the engine actually computed
  (preemptions' recomputation included) and preemptions, per-turn latency p50/p99, and with
  `--kv-offloading-size` the tokens copied to the host tier and back instead of prefilled;
- host share: the same gather with the engine answering at once (the `endpoint_overhead.py`
  method: the client, HTTP, JSON, chat template and tokenization alone), over the real gather;
- train: `model.train` on the gathered groups (checkpoint and the new adapter served included),
  with the check that every sampled token is a trained token (multi-turn: no re-tokenization);
- iteration: gather + train, sequential, and `PipelineTrainer` pipelined (`--iterations`);
- profile (CUDA, `--profile-window-s S`): S seconds of the gather under torch.profiler: the GPU's
  busy fraction, its time per kernel class (attention, GEMM, LoRA, copies, sampling...) and the
  engine steps in the window (mean duration and decode rows);
- bound (CUDA): the least time the GPU needs for the gather's work at its measured HBM bandwidth
  and bf16 GEMM rate (roofline.py's `agent_gather_bound`), and the fraction of it reached.

`--vllm` first serves the same model directory (config, tokenizer, chat template; random weights)
and a rank-8 LoRA through vLLM's own OpenAI server (`vllm.entrypoints.openai.api_server`: LoRA,
prefix caching, the hermes tool parser, prompt-token details) in a subprocess, and drives it with
the same client code and conversations; its KV cache is held to tempering's size (same tokens),
and `--kv-offloading-size` gives it the same host memory (its native KV offloading).

    python benchmarks/agent_rl.py --device cuda --model 8b --vllm --vllm-path /root/vlibs --kv-offloading-size 48
    python benchmarks/agent_rl.py --device cuda --model 30b-a3b --skip-pipelined
    python benchmarks/agent_rl.py                       # CPU smoke test: the default model, 2 x 4, 3 turns

On CUDA the model is Qwen3-8B- or Qwen3-30B-A3B-shaped with random bf16 weights drawn on the GPU
(`load_format="dummy"`), the default model's tokenizer (its 49,152 ids; the model's vocabulary
stays 151,936) and a ChatML chat template that renders tools as Qwen's does (`CHAT_TEMPLATE`).
On CPU it is the default model, SmolLM2-135M-Instruct, with its own template.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                architectures=["Qwen3ForCausalLM"])
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, vocab_size=49152)  # head dim 64: the smallest vLLM's CPU attention takes
GPU_WORKLOAD = dict(groups=16, group_size=8, turns=6, system_tokens=1500, description_tokens=40,
                    turn_tokens="64,192,384", tool_tokens="200,800", context_cap=16384, iterations=3)
CPU_WORKLOAD = dict(groups=2, group_size=4, turns=3, system_tokens=100, description_tokens=8,
                    turn_tokens="12,16,24", tool_tokens="20,60", context_cap=2048, iterations=2)
TOOL_NAMES = ("search", "read", "compute")
TOOL_ARGS = ("query", "doc_id", "expression")

# ChatML with tools rendered as Qwen2.5/Qwen3 render them (the tool schemas in the system turn, calls in
# <tool_call> tags, results in <tool_response> tags inside a user turn), for the random-weight models,
# whose tokenizer (the default model's) has a template that ignores tools.
CHAT_TEMPLATE = (  # transformers renders with trim_blocks: a newline right after a block tag is written {{ '\n' }}
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\n' }}</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role in ('user', 'system') %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}"
    "{% if message.content or not loop.first %}{{ '\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}}"
    "\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ---------------------------------------------------------------- the workload (the same for every engine)

@dataclass
class Scenario:
    """One group's task: its user message, and per rollout and turn the tool to call and its result."""

    task: str
    turns: list[list[tuple[int, str]]]  # [rollout][turn] -> (tool index, tool result text)
    next_rollout: int = 0

    def take(self) -> int:
        """The index of the next rollout of this group (PipelineTrainer calls the rollout group_size times)."""
        j, self.next_rollout = self.next_rollout, self.next_rollout + 1
        return j % len(self.turns)


class Workload:
    """The seeded texts and tools of the agent workload, measured in the tokenizer's tokens."""

    def __init__(self, tokenizer, *, system_tokens: int, turn_tokens: list[int], tool_tokens: tuple[int, int],
                 turns: int, group_size: int, description_tokens: int = 40, seed: int = 0) -> None:
        self.tokenizer, self.turns, self.group_size = tokenizer, turns, group_size
        self.tool_tokens = tool_tokens
        words = [tokenizer.decode([i]).strip() for i in range(1000, 8000)]
        self.words = [w for w in words if w.isalpha() and len(w) > 2]
        rng = random.Random(seed)
        self.system = "You are a research agent. Follow the policies below.\n\n" + self.text(system_tokens, rng)
        self.turn_tokens = turn_tokens
        self.tools = []
        for k, (name, arg) in enumerate(zip(TOOL_NAMES, TOOL_ARGS)):
            # a call's completion: the arguments' JSON, the call's closing, the end of the turn (about 12 tokens)
            overhead = len(tokenizer(f'{{"{arg}": ""}}}}\n</tool_call>', add_special_tokens=False)["input_ids"]) + 1
            digits = max(1, turn_tokens[k] - overhead)
            self.tools.append({"type": "function", "function": {
                "name": name, "description": self.text(description_tokens, rng),
                "parameters": {"type": "object", "properties": {arg: {
                    "type": "string", "description": self.text(description_tokens // 4, rng),
                    "pattern": f"^[0-9]{{{digits}}}$"}},
                    "required": [arg], "additionalProperties": False}}})
        self._seed = seed

    def text(self, num_tokens: int, rng: random.Random) -> str:
        """Random words of about `num_tokens` tokens (within a few)."""
        out, count = [], 0
        while count < num_tokens:
            chunk = " ".join(rng.choice(self.words) for _ in range(max(1, (num_tokens - count) // 2)))
            count += len(self.tokenizer(" " + chunk, add_special_tokens=False)["input_ids"])
            out.append(chunk)
        return " ".join(out)

    def scenarios(self, count: int, offset: int) -> list[Scenario]:
        """`count` scenarios, the same for the same offset (`offset` numbers them across iterations)."""
        out = []
        for i in range(offset, offset + count):
            rng = random.Random(f"{self._seed}.{i}")
            task = f"Task {i}: " + self.text(60, rng)
            turns = [[(rng.randrange(len(self.tools)), self.text(rng.randint(*self.tool_tokens), rng))
                      for _ in range(self.turns)] for _ in range(self.group_size)]
            out.append(Scenario(task, turns))
        return out


@dataclass
class TurnRecord:
    rollout: int
    turn: int
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    resent_tokens: int  # of the prompt: the previous turn's prompt + completion (0 on the first turn)


@dataclass
class GatherLog:
    turns: list[TurnRecord] = field(default_factory=list)
    failed_calls: int = 0
    capped: int = 0  # conversations stopped by the context cap

    def clear(self) -> None:
        self.turns.clear()
        self.failed_calls = self.capped = 0


def make_rollout(workload: Workload, context_cap: int, log: GatherLog, *, client_of, model_name_of):
    """The user's rollout: `async rollout(model, scenario)` -> Trajectory (ART's signature)."""
    import tempering as art

    rewards = random.Random(7)
    counter = iter(range(1 << 62))

    async def rollout(model, scenario: Scenario, _config=None) -> art.Trajectory:
        client, name, number = client_of(model), model_name_of(model), next(counter)
        traj = art.Trajectory(messages_and_choices=[{"role": "system", "content": workload.system},
                                                    {"role": "user", "content": scenario.task}],
                              tools=workload.tools)
        previous = 0  # the previous turn's prompt + completion tokens
        for t, (k, result) in enumerate(scenario.turns[scenario.take()]):
            tool = workload.tools[k]["function"]
            if previous + workload.turn_tokens[k] + 64 > context_cap:
                log.capped += 1
                break
            sent = time.perf_counter()
            completion = await client.chat.completions.create(
                model=name, messages=traj.messages(), tools=workload.tools, temperature=1.0, logprobs=True,
                tool_choice={"type": "function", "function": {"name": tool["name"]}},
                max_tokens=workload.turn_tokens[k] + 64)  # room: the grammar ends the call at its length
            latency = time.perf_counter() - sent
            usage = completion.usage
            details = getattr(usage, "prompt_tokens_details", None)
            log.turns.append(TurnRecord(number, t, latency, usage.prompt_tokens, (details.cached_tokens or 0) if details else 0,
                                        usage.completion_tokens, previous if t else 0))
            previous = usage.prompt_tokens + usage.completion_tokens
            choice = completion.choices[0]
            traj.messages_and_choices.append(choice)
            calls = choice.message.tool_calls
            if not calls:
                log.failed_calls += 1
                break
            if t + 1 < workload.turns:
                traj.messages_and_choices.append({"role": "tool", "tool_call_id": calls[0].id, "content": result})
                previous += workload.tool_tokens[1] // 2  # an estimate for the cap check
        traj.reward = rewards.random()
        return traj

    return rollout


async def gather(rollout, model, scenarios: list[Scenario], group_size: int):
    import tempering as art

    return await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(model, s) for _ in range(group_size)) for s in scenarios), pbar_desc=None)


def summarize(log: GatherLog, wall_s: float) -> dict:
    turns = log.turns
    latencies = sorted(r.latency_s for r in turns)
    sent = sum(r.prompt_tokens for r in turns)
    cached = sum(r.cached_tokens for r in turns)
    later = [r for r in turns if r.turn > 0]
    generated = sum(r.completion_tokens for r in turns)

    def pct(q: float) -> float:
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 3) if latencies else 0.0

    return {
        "gather_s": round(wall_s, 3),
        "requests": len(turns),
        "generated_tokens": generated,
        "generated_tok_per_s": round(generated / wall_s, 1),
        "prompt_tokens_sent": sent,
        "prompt_tokens_cached": cached,
        "prefix_cache_hit": round(cached / max(1, sent), 4),
        # of what turn t > 0 re-sends (turn t-1's prompt and completion), the share served from the cache
        "prefix_cache_hit_resent": round(sum(min(r.cached_tokens, r.resent_tokens) for r in later)
                                         / max(1, sum(r.resent_tokens for r in later)), 4),
        "turn_latency_p50_s": pct(0.5), "turn_latency_p99_s": pct(0.99),
        "turn_latency_p50_by_turn_s": [round(statistics.median(r.latency_s for r in turns if r.turn == t), 3)
                                       for t in sorted({r.turn for r in turns})],
        "mean_prompt_tokens_last_turn": round(statistics.mean(r.prompt_tokens for r in turns
                                                              if r.turn == max(x.turn for x in turns)), 1),
        "failed_tool_calls": log.failed_calls,
        "capped_conversations": log.capped,
    }


# ---------------------------------------------------------------- model directories

def build_model_dir(kind: str, tokenizer_dir: Path, out: Path) -> Path:
    """config.json (random weights are drawn where they live: load_format "dummy"), the tokenizer and
    CHAT_TEMPLATE, for `kind` "8b" or "30b-a3b"."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3MoeConfig

    from moe import QWEN3_30B_A3B

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = dict(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
               pad_token_id=tokenizer.pad_token_id, dtype="bfloat16")
    if kind == "tiny":  # the GPU path's model directory at a size a CPU runs: a check of the script
        config = Qwen3Config(**{**QWEN3_8B, **TINY}, **ids)
    else:
        config = Qwen3Config(**QWEN3_8B, **ids) if kind == "8b" else Qwen3MoeConfig(**QWEN3_30B_A3B, **ids)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_lora(kind: str, model_dir: Path, lora_dir: Path) -> Path:
    """A rank-8 PEFT adapter with random non-zero A and B for vLLM: every projection of the dense
    shape; attention and each expert's gate/up/down of the MoE shape (the layout ART exports)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if kind != "30b-a3b":
        from vllm_rollout import write_model_and_lora

        with tempfile.TemporaryDirectory() as tmp:
            _, lora = write_model_and_lora(config, Path(tmp))
            lora_dir.mkdir(parents=True, exist_ok=True)
            for f in lora.iterdir():
                (lora_dir / f.name).write_bytes(f.read_bytes())
        return lora_dir
    from moe import write_expert_lora

    return write_expert_lora(config, lora_dir)


# ---------------------------------------------------------------- vLLM's OpenAI server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_metrics(url: str) -> dict[str, float]:
    """vLLM's Prometheus counters that the gather's figures need (summed over label sets)."""
    wanted = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
              "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    out = {k: 0.0 for k in wanted}
    for line in urllib.request.urlopen(url + "/metrics", timeout=30).read().decode().splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


class VLLMServer:
    """`python -m vllm.entrypoints.openai.api_server` in a process session of its own."""

    def __init__(self, model_dir: Path, lora_dir: Path, *, path: str | None, python: str, max_model_len: int,
                 kv_cache_bytes: int | None, dtype: str, extra: list[str], timeout_s: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", "base", "--load-format", "dummy", "--dtype", dtype,
               "--enable-prefix-caching", "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"bench={lora_dir}",
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-prompt-tokens-details",
               # the forced calls' arguments as tempering generates them: compact JSON, no free whitespace
               "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
               "--max-model-len", str(max_model_len), "--max-num-seqs", "256", "--host", "127.0.0.1",
               "--port", str(self.port), "--uvicorn-log-level", "warning", *extra]
        if kv_cache_bytes:
            cmd += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
        env = dict(os.environ)
        if path:
            env["PYTHONPATH"] = os.pathsep.join([path, env.get("PYTHONPATH", "")])
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".vllm.log", delete=False)
        self.command = " ".join(cmd)
        start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while True:
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=5).status == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.perf_counter() - start > timeout_s:
                self.close()
                raise RuntimeError(f"vLLM's server did not start: {self.tail()}")
            time.sleep(1.0)
        self.startup_s = time.perf_counter() - start

    def tail(self, chars: int = 3000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-chars:]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


async def run_vllm(args, workload: Workload, model_dir: Path, lora_dir: Path, kv_cache_bytes: int | None) -> dict:
    """The gather through vLLM's server: a warm-up gather, then the timed one (the same scenarios as tempering's)."""
    from openai import AsyncOpenAI

    extra = list(args.vllm_arg)
    offload = args.vllm_kv_offloading_size if args.vllm_kv_offloading_size is not None else args.kv_offloading_size
    if offload:  # the same host tier for vLLM: its native KV offloading
        extra += ["--kv-offloading-backend", "native", "--kv-offloading-size", str(offload)]
    server = VLLMServer(model_dir, lora_dir, path=args.vllm_path, python=args.vllm_python, max_model_len=args.context_cap,
                        kv_cache_bytes=kv_cache_bytes, dtype="bfloat16" if args.device == "cuda" else "float32",
                        extra=extra, timeout_s=args.vllm_timeout_s)
    try:
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", timeout=3600, max_retries=0)
        log = GatherLog()
        rollout = make_rollout(workload, args.context_cap, log, client_of=lambda m: client, model_name_of=lambda m: "bench")
        await gather(rollout, None, workload.scenarios(min(4, args.groups), offset=10_000), args.group_size)  # warm-up
        out = {"startup_s": round(server.startup_s, 1), "command": server.command}
        for run in range(args.gathers):
            log.clear()
            scenarios = workload.scenarios(args.groups, offset=run * args.groups)  # the dataset: not timed
            before = vllm_metrics(server.url)
            start = time.perf_counter()
            await gather(rollout, None, scenarios, args.group_size)
            wall = time.perf_counter() - start
            after = vllm_metrics(server.url)
            delta = {k.removeprefix("vllm:").removesuffix("_total"): after[k] - before[k] for k in after}
            record = summarize(log, wall)
            record["engine"] = {"prefilled_tokens": int(delta["prefix_cache_queries"] - delta["prefix_cache_hits"]),
                                "cached_tokens": int(delta["prefix_cache_hits"]),
                                "generated_tokens": int(delta["generation_tokens"]),
                                "preemptions": int(delta["num_preemptions"])}
            out.setdefault("gathers", []).append(record)
        await client.close()
        return out
    except Exception as exc:
        return {"error": f"{exc!r}", "log_tail": server.tail()}
    finally:
        server.close()


# ---------------------------------------------------------------- tempering

def instant_engine(service):
    """An engine.submit that answers every forced call at once with a whole call of its tool's length
    (the engine's work taken out: what remains of a gather is the host's)."""
    import concurrent.futures

    from tempering.engine.request import Completion

    tokenizer, end = service.tokenizer, service.renderer.end_of_turn_id

    def submit(prompt_ids, params, *, n=1, policy=None, on_token=None):
        schema = json.loads(params.grammar.spec.text)
        (arg, prop), = schema["properties"].items()
        digits = int(re.search(r"\{(\d+)\}", prop["pattern"]).group(1))
        raw = json.dumps({arg: "7" * digits}) + params.grammar.spec.suffix
        ids = tokenizer(raw, add_special_tokens=False)["input_ids"] + [end]
        text = raw[:raw.find("</tool_call>")]
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result([Completion(token_ids=ids, logprobs=[-1.0] * len(ids), top_logprobs=[[]] * len(ids),
                                      text=text, raw_text=raw, finish_reason="stop", logprob_temperature=1.0,
                                      forced=[False] * len(ids), policy_versions=[0] * len(ids))
                           for _ in range(n)])
        return future

    return submit


async def run_tempering(args, workload: Workload, base_model: str, root: Path, device: str) -> dict:
    import tempering as art
    from roofline import agent_gather_bound, measure_device

    engine_config = {"load_format": "dummy"} if args.model is not None else {}  # random weights drawn in place
    engine_config.update(json.loads(args.engine_config or "{}"))
    if args.kv_offloading_size is not None:
        engine_config["kv_offloading_size"] = args.kv_offloading_size
    model = art.TrainableModel(name="agent", project="bench", base_model=base_model)
    backend = art.LocalBackend(path=root, device=device, engine_config=engine_config)
    start = time.perf_counter()
    await model.register(backend)
    out: dict = {"register_s": round(time.perf_counter() - start, 1)}
    service = backend._registry.get(model.name)
    engine = service.engine
    out["kv_cache_tokens"] = engine.runner.num_blocks * engine.blocks.block_size
    out["host_kv_cache_tokens"] = engine.blocks.num_host_blocks * engine.blocks.block_size  # KV offloading
    client = model.openai_client()
    log = GatherLog()
    rollout = make_rollout(workload, args.context_cap, log, client_of=lambda m: client, model_name_of=lambda m: m.name)
    config = art.TrainConfig(learning_rate=1e-5)
    if args.host_only:  # the host's work alone, at any workload size: the engine answers at once
        service.engine.submit = instant_engine(service)
        runs = []
        for run in range(1 + args.gathers):  # the first warms up connections and caches
            log.clear()
            scenarios = workload.scenarios(args.groups, offset=run * args.groups)
            start = time.perf_counter()
            await gather(rollout, model, scenarios, args.group_size)
            runs.append(summarize(log, time.perf_counter() - start))
        out["host_only_gathers"] = runs[1:]
        await backend.close()
        return out

    if device == "cuda":  # warm-up: the first requests, a step (its CUDA graphs; the adapter is non-zero after it)
        warm = await gather(rollout, model, workload.scenarios(min(4, args.groups), offset=10_000), args.group_size)
        if not args.skip_train:
            await model.train(warm, config=config)

    gathers, batches = [], []
    for run in range(args.gathers):
        log.clear()
        stats = engine.stats
        before = (stats.num_prefill_tokens, stats.num_cached_tokens, stats.num_decode_tokens, stats.num_preemptions,
                  stats.num_offloaded_tokens, stats.num_restored_tokens, stats.num_steps)
        profiling = None
        if args.profile_window_s and device == "cuda" and run == 0:  # a window of the gather, from the middle
            profiling = asyncio.create_task(profile_window(engine, stats.num_decode_tokens + args.profile_after_tokens,
                                                           args.profile_window_s))
        scenarios = workload.scenarios(args.groups, offset=run * args.groups)
        start = time.perf_counter()
        groups = await gather(rollout, model, scenarios, args.group_size)
        wall = time.perf_counter() - start
        record = summarize(log, wall)
        if profiling is not None:
            record["profile"] = await profiling
        record["engine"] = {"prefilled_tokens": stats.num_prefill_tokens - before[0],
                            "cached_tokens": stats.num_cached_tokens - before[1],
                            "decoded_tokens": stats.num_decode_tokens - before[2],
                            "preemptions": stats.num_preemptions - before[3],
                            # the host tier (EngineConfig.kv_offloading_size): token slots copied out, and back
                            "offloaded_tokens": stats.num_offloaded_tokens - before[4],
                            "restored_tokens": stats.num_restored_tokens - before[5],
                            "steps": stats.num_steps - before[6],  # mean decode rows = decoded_tokens / steps
                            "mean_step_ms": round(wall * 1e3 / max(1, stats.num_steps - before[6]), 2)}
        gathers.append(record)
        batches.append((groups, list(log.turns)))
    out["gathers"] = gathers
    progress("tempering gathers", gathers)

    if device == "cuda":
        hw = measure_device(torch.device("cuda"))
        bound = agent_gather_bound(service.model.config, batches[-1][1], workload_shared_tokens(workload, service), hw)
        out["hardware"] = hw
        out["bound"] = {**bound, "fraction": round(bound["bound_s"] / gathers[-1]["gather_s"], 3)}
        progress("bound", out["bound"])

    if not args.skip_train:
        groups, _ = batches[-1]
        choices = [[c for c in t.messages_and_choices if not isinstance(c, dict)] for g in groups for t in g]
        sampled = sum(len(c.token_ids) for cs in choices for c in cs)
        # each conversation is one training sequence when its turns merge: its last prompt + completion
        merged = sum(len(cs[-1].prompt_token_ids) + len(cs[-1].token_ids) for cs in choices if cs)
        start = time.perf_counter()
        result = await model.train(groups, config=config)
        train_s = time.perf_counter() - start
        trained, through = int(result.metrics["data/step_completion_tokens"]), int(result.metrics["data/step_trainer_tokens"])
        out["train"] = {"s": round(train_s, 3), "sampled_tokens": sampled, "trained_tokens": trained,
                        "trained_equals_sampled": trained == sampled, "trainer_tokens": through,
                        "turns_merged_into_one_sequence": through == merged,
                        "trainer_tok_per_s": round(through / train_s, 1)}
        out["sequential_iteration_s"] = round(gathers[-1]["gather_s"] + train_s, 3)
        progress("train", out["train"])

        if not args.skip_pipelined:
            offset = 1000
            scenarios = iter(workload.scenarios(args.groups * (args.iterations + 2), offset=offset))
            pipeline = art.PipelineTrainer(model, backend, rollout, scenarios, group_size=args.group_size,
                                           groups_per_step=args.groups, max_staleness=1, max_steps=args.iterations,
                                           train_config=config, pbar=False)
            piped = await pipeline.train()
            steady = piped.step_wall_s[1:] or piped.step_wall_s
            out["pipelined_step_wall_s"] = [round(x, 3) for x in piped.step_wall_s]
            out["pipelined_iteration_s"] = round(statistics.mean(steady), 3)
            out["pipelined_over_sequential"] = round(out["pipelined_iteration_s"] / out["sequential_iteration_s"], 3)

    if not args.skip_host_share:  # the same gather with the engine answering at once
        real_submit = service.engine.submit
        service.engine.submit = instant_engine(service)
        try:
            log.clear()
            scenarios = workload.scenarios(args.groups, offset=(args.gathers - 1) * args.groups)
            start = time.perf_counter()
            await gather(rollout, model, scenarios, args.group_size)
            host = time.perf_counter() - start
        finally:
            service.engine.submit = real_submit
        out["host_gather_s"] = round(host, 3)
        out["host_share"] = round(host / gathers[-1]["gather_s"], 3)
    await backend.close()
    return out


KERNEL_CLASSES = (  # (class, substrings of kernel names), first match wins
    ("attention", ("attention", "attn", "_decode_split", "_merge_splits", "flash", "fmha")),
    ("lora", ("lora",)),
    ("moe", ("moe", "expert", "grouped")),
    ("gemm", ("gemm", "matmul", "cutlass", "nvjet", "sm90_", "sm80_", "cublas", "_mm_")),
    ("sampling", ("sampl", "argmax", "softmax", "logsumexp", "topk", "gumbel")),
    ("copy", ("memcpy", "memset", "copy", "index", "gather", "scatter", "cat")),
    ("norm, rotary, activation", ("norm", "rotary", "rope", "silu", "gelu", "act_")),
)


async def profile_window(engine, after_decode_tokens: int, window_s: float) -> dict:
    """The GPU's time over `window_s` of the gather, once the engine has decoded `after_decode_tokens`
    (torch.profiler, CUDA activity): busy fraction, time per kernel class, and the engine steps in
    the window (their mean duration and decode rows)."""
    from torch.profiler import ProfilerActivity, profile

    while engine.stats.num_decode_tokens < after_decode_tokens:
        await asyncio.sleep(0.05)
    steps, decoded = engine.stats.num_steps, engine.stats.num_decode_tokens
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        await asyncio.sleep(window_s)
        wall = time.perf_counter() - start
    steps, decoded = engine.stats.num_steps - steps, engine.stats.num_decode_tokens - decoded
    by_class: dict[str, float] = {}
    top = []
    for event in prof.key_averages():
        us = event.self_device_time_total
        if us <= 0:
            continue
        name = event.key.lower()
        kind = next((k for k, keys in KERNEL_CLASSES if any(x in name for x in keys)), "other")
        by_class[kind] = by_class.get(kind, 0.0) + us
        top.append((us, event.key[:80]))
    busy = sum(by_class.values()) / 1e6
    return {"window_s": round(wall, 2), "gpu_busy": round(busy / wall, 3), "steps": steps,
            "mean_step_ms": round(wall * 1e3 / max(1, steps), 2), "mean_decode_rows": round(decoded / max(1, steps), 1),
            "share_of_wall": {k: round(v / 1e6 / wall, 3) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": [(name, round(us / 1e3, 1)) for us, name in sorted(top, reverse=True)[:12]]}


def progress(phase: str, data) -> None:
    """A phase's figures on stderr as soon as they are known (a run cut short still reports them)."""
    print(f"[agent_rl] {phase}: {json.dumps(data)}", file=sys.stderr, flush=True)


def workload_shared_tokens(workload: Workload, service) -> int:
    """Tokens of the prompt every rollout shares (system prompt and tools), as the server renders it."""
    ids = service.renderer.render_prompt([{"role": "system", "content": workload.system}], workload.tools)
    return len(ids)


# ---------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", choices=["8b", "30b-a3b", "tiny"], default=None,
                        help="the random-weight shape (CUDA default 8b; tiny: a 2-layer Qwen3 that checks the "
                             "script's GPU path on a CPU); on a CPU without it, the default model")
    parser.add_argument("--tokenizer-dir", type=Path, default=None,
                        help="CUDA: tokenizer of the random model (default: the converted default model)")
    for name, value in GPU_WORKLOAD.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None,
                            help=f"default {value} on CUDA, {CPU_WORKLOAD[name]} on CPU")
    parser.add_argument("--gathers", type=int, default=1, help="timed gathers (each with new scenarios)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-config", default=None, help="JSON of EngineConfig fields for tempering")
    parser.add_argument("--kv-offloading-size", type=float, default=None,
                        help="GiB of host memory for evicted KV blocks: tempering's EngineConfig.kv_offloading_size "
                             "and, with --vllm, vLLM's native KV offloading of the same size")
    parser.add_argument("--profile-window-s", type=float, default=0.0,
                        help="CUDA: profile this many seconds of the first timed gather (per kernel class, GPU busy)")
    parser.add_argument("--profile-after-tokens", type=int, default=60_000,
                        help="start the profile once the gather has decoded this many tokens")
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--skip-pipelined", action="store_true")
    parser.add_argument("--skip-host-share", action="store_true")
    parser.add_argument("--skip-tempering", action="store_true", help="only vLLM (with --vllm)")
    parser.add_argument("--host-only", action="store_true",
                        help="only the host's work: tempering's engine answers every call at once (any device)")
    parser.add_argument("--vllm", action="store_true", help="first the same gather through vLLM's OpenAI server")
    parser.add_argument("--vllm-path", default=None, help="directories first on vLLM's PYTHONPATH")
    parser.add_argument("--vllm-arg", action="append", default=[], help="one more argument for vLLM's server")
    parser.add_argument("--vllm-python", default=sys.executable,
                        help="the interpreter that runs vLLM's server (default: this one)")
    parser.add_argument("--vllm-kv-tokens", type=int, default=None,
                        help="vLLM's KV cache in tokens (default: what tempering's cache holds on this GPU)")
    parser.add_argument("--vllm-kv-offloading-size", type=float, default=None,
                        help="GiB of vLLM's native KV offloading (default: --kv-offloading-size; 0: none)")
    parser.add_argument("--vllm-timeout-s", type=float, default=900)
    args = parser.parse_args()
    shapes = GPU_WORKLOAD if args.device == "cuda" else CPU_WORKLOAD
    for name, value in shapes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    turn_tokens = [int(x) for x in args.turn_tokens.split(",")]
    tool_tokens = tuple(int(x) for x in args.tool_tokens.split(","))
    if len(turn_tokens) != 3 or len(tool_tokens) != 2:
        parser.error("--turn-tokens takes three lengths (one per tool), --tool-tokens a range LOW,HIGH")

    from transformers import AutoTokenizer

    from tempering.service.base_model import default_model_dir

    record: dict = {"benchmark": "agent_rl", "device": args.device, "date": time.strftime("%Y-%m-%d"),
                    "machine": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        if args.device == "cuda" and args.model is None:
            args.model = "8b"
        if args.model is not None:
            model_dir = build_model_dir(args.model, args.tokenizer_dir or default_model_dir(), Path(tmp) / "model")
            base_model = str(model_dir)
            record["model"] = (f"Qwen3-{args.model.upper()}-shaped, random bf16 weights, live LoRA r8 "
                               f"({'attention and every expert' if args.model != '8b' else 'every projection'})")
        else:
            model_dir = default_model_dir()
            base_model = "SmolLM2-135M-Instruct"
            record["model"] = "SmolLM2-135M-Instruct (real weights), live LoRA r8"
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        workload = Workload(tokenizer, system_tokens=args.system_tokens, turn_tokens=turn_tokens,
                            tool_tokens=tool_tokens, turns=args.turns, group_size=args.group_size,
                            description_tokens=args.description_tokens, seed=args.seed)
        record["workload"] = {k: getattr(args, k) for k in shapes} | {"rollouts": args.groups * args.group_size}
        if args.vllm:
            lora_dir = write_lora(args.model, model_dir, Path(tmp) / "lora") if args.model is not None else None
            if lora_dir is None:  # CPU: a rank-8 adapter on the default model
                lora_dir = write_cpu_lora(model_dir, Path(tmp) / "lora")
            kv_bytes = None
            if args.vllm_kv_tokens:
                kv_bytes = args.vllm_kv_tokens * kv_bytes_per_token(model_dir)
            elif args.device == "cuda":
                kv_bytes = tempering_kv_tokens(model_dir) * kv_bytes_per_token(model_dir)
            record["vllm"] = asyncio.run(run_vllm(args, workload, model_dir, lora_dir, kv_bytes))
            progress("vllm", record["vllm"])
        if not args.skip_tempering:
            record["tempering"] = asyncio.run(run_tempering(args, workload, base_model, Path(tmp) / "runs", args.device))
        ours, theirs = record.get("tempering", {}).get("gathers"), record.get("vllm", {}).get("gathers")
        if ours and theirs:
            record["vs_vllm_generated_tok_per_s"] = round(ours[-1]["generated_tok_per_s"]
                                                          / theirs[-1]["generated_tok_per_s"], 3)
    print(file=sys.stderr, flush=True)
    print(json.dumps(record), flush=True)


def kv_bytes_per_token(model_dir: Path) -> int:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2  # K and V, bf16


def tempering_kv_tokens(model_dir: Path) -> int:
    """The tokens tempering's KV cache holds for this model on this GPU (EngineConfig's default sizing):
    `gpu_memory_fraction` of the memory free after the weights."""
    from transformers import AutoConfig

    from tempering.engine import EngineConfig

    c = AutoConfig.from_pretrained(model_dir)
    params = param_count(c)
    free = torch.cuda.mem_get_info()[0] - 2 * params
    return int(EngineConfig().gpu_memory_fraction * free) // kv_bytes_per_token(model_dir)


def param_count(c) -> int:
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attn = c.hidden_size * head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    if getattr(c, "num_experts", None):
        mlp = 3 * c.hidden_size * c.moe_intermediate_size * c.num_experts + c.hidden_size * c.num_experts
    else:
        mlp = 3 * c.hidden_size * c.intermediate_size
    embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return c.num_hidden_layers * (attn + mlp) + embed


def write_cpu_lora(model_dir: Path, lora_dir: Path) -> Path:
    from transformers import AutoConfig

    from vllm_rollout import write_model_and_lora

    with tempfile.TemporaryDirectory() as tmp:
        _, lora = write_model_and_lora(AutoConfig.from_pretrained(model_dir), Path(tmp))
        lora_dir.mkdir(parents=True, exist_ok=True)
        for f in lora.iterdir():
            (lora_dir / f.name).write_bytes(f.read_bytes())
    return lora_dir


if __name__ == "__main__":
    main()
