"""Tensor parallelism (modeling/tensor_parallel.py) over two ranks against one process on the same model:
two CPU processes through gloo (float32, and the engine also in bfloat16, where the sharded forward
must be bitwise the one-process forward, through its segments LoRA path and, as on GPUs, its
spare-rows path), and (skipped without two GPUs) two GPU processes through NCCL: the engine in
bfloat16, training in float32. This model's bfloat16 gradients are chaotic, so no bf16 step can be
compared with another: on the CPU, rounding the rotary embedding once instead of per product
moves a step's grad norm from 0.025 to 0.038 (float32: 0.0244), and on an H100 the Triton rotary
(the more accurate one) gives 0.060 where torch's gives 0.025. In float32 the two-GPU step equals
the one-GPU step within 1e-4 (grad norm 0.02439 both, 2026-11-27).

A tiny random Llama (4 query heads, 2 KV heads: one KV head per rank) with a non-zero LoRA on every
projection. What is checked: each rank holds only its shard; the sharded forward's logits and the
engine's greedy tokens and logprobs (leader and follower) equal one process's, with and without the
adapter; a sharded LoRA training step equals the unsharded step (loss, grad norm, updated adapter),
the engine then serves the trained shards; the checkpoint is the full PEFT adapter, written once,
and resumes at TP 2 and at TP 1; a model that does not fit even when sharded is refused with its sizes.
Then the whole loop through LocalBackend (register, rollouts, train, checkpoint, resume) at TP 2 on
two processes and at 2 replicas x TP 2 on four.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
import rank_processes  # noqa: E402
from tp_model import (TINY, config, engine_for, full_adapter, generate, lora_grads, sequences, tiny_llama,
                      wrap_with_adapter)
from tp_rank import direct_logits

from tempering.errors import ConfigError
from tempering.modeling.tensor_parallel import sharded_weight_bytes
from tempering.service.base_model import check_fits, weight_bytes

RANK_SCRIPT = Path(__file__).with_name("tp_rank.py")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
DEVICES = ["cpu", pytest.param("cuda", marks=TWO_GPUS)]


def run_ranks(scenario: str, out: Path, device: str, timeout_s: float = 180) -> list[dict]:
    """Run tp_rank.py SCENARIO as 2 processes with torchrun's variables; their results."""
    return rank_processes.run_ranks(RANK_SCRIPT, scenario, out, device=device, timeout_s=timeout_s)


def tolerance(device: str) -> float:
    """Logits' absolute tolerance: float32 on the CPU; none in bfloat16 on the CPU, where the ranks' float32
    partial sums round as one process's sum does; bfloat16 on CUDA, whose kernels pick their summation
    order by shape (the shards' GEMMs are narrower)."""
    return {"cpu": 1e-5, "cpu-bf16": 0.0, "cpu-bf16-spare": 0.0}.get(device, 3e-2)


def assert_same_greedy(got: tuple[list, list], want: tuple[list, list], device: str, logprob_tol: float) -> None:
    """Greedy completions (token ids, logprobs per prompt) equal. In bfloat16 (CUDA) two sums of the same
    terms in another order may round a near tie the other way: a completion may then part from the
    reference, but only where the two chosen tokens were nearly tied (their logprobs within 0.05),
    and it matches up to there."""
    for tokens, logprobs, ref_tokens, ref_logprobs in zip(*got, *want):
        same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(ref_tokens))
        if device.startswith("cpu"):
            assert tokens == ref_tokens
        else:
            assert len(tokens) == len(ref_tokens)
            if same < len(tokens):
                assert abs(logprobs[same] - ref_logprobs[same]) < 0.05, f"not a near tie at token {same}"
        assert max((abs(a - b) for a, b in zip(logprobs[:same], ref_logprobs[:same])), default=0.0) <= logprob_tol


CPU_ENGINE_SPECS = ["cpu-bf16", "cpu-bf16-spare", "cpu"]


@pytest.fixture(scope="module")
def cpu_engine_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    """The engine scenario on two CPU ranks for every CPU variant, in one launch: {spec: ranks' results}."""
    ranks = run_ranks("engine", tmp_path_factory.mktemp("engine-cpu"), "+".join(CPU_ENGINE_SPECS))
    return {spec: [r[spec] for r in ranks] for spec in CPU_ENGINE_SPECS}


@pytest.fixture(scope="module", params=["cpu-bf16", "cpu-bf16-spare", *DEVICES])
def served(request, tmp_path_factory):
    """The engine scenario on two ranks, and the same on one process."""
    device = request.param
    if device in CPU_ENGINE_SPECS:
        ranks = request.getfixturevalue("cpu_engine_ranks")[device]
    else:
        ranks = run_ranks("engine", tmp_path_factory.mktemp(f"engine-{device}"), device)
    model = tiny_llama(device=device)
    peft = wrap_with_adapter(model, full_adapter())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: a CPU float32 GEMM's summation order depends on its threads
    try:
        reference = {"logits": direct_logits(model, peft, None)}
        engine = engine_for(model, peft, spare_rows=True if device.endswith("-spare") else None)
        try:
            reference["generated"] = generate(engine)
        finally:
            engine.close()
    finally:
        torch.set_num_threads(threads)
    return ranks, reference, device


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda-f32", marks=TWO_GPUS)])
def trained(request, tmp_path_factory):
    """The train scenario on two ranks from a saved full adapter, and the same steps on one process
    (float32 on either device: see the module's docstring)."""
    from tempering.training import Trainer

    device = request.param
    out = tmp_path_factory.mktemp(f"train-{device}")
    wrap_with_adapter(tiny_llama(), full_adapter()).save_pretrained(str(out / "start"))
    ranks = run_ranks("train", out, device)
    trainer = Trainer.from_adapter(tiny_llama(device=device), out / "start")
    engine = engine_for(trainer.model, trainer.peft_model)
    reference = {}
    try:
        reference["grads"] = lora_grads(trainer, sequences(1))
        reference["grads_sp"] = lora_grads(trainer, sequences(1)[:7])
        reference["metrics_1"] = trainer.step(sequences(1), config()).values
        reference["adapter_1"] = adapter_of(trainer)
        reference["generated_1"] = generate(engine)
        trainer.step(sequences(2), config())
        reference["adapter_2"] = adapter_of(trainer)
    finally:
        engine.close()
    return ranks, reference, out, device


def adapter_of(trainer) -> dict[str, torch.Tensor]:
    """The trainer's LoRA tensors by their saved names."""
    return {n.replace(".default", ""): p.detach().cpu().clone() for n, p in trainer.peft_model.named_parameters()
            if "lora_" in n}


def saved_adapter(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "adapter_model.safetensors"))


def assert_adapters_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], device: str,
                          start: dict[str, torch.Tensor]) -> None:
    """Equal up to float reassociation of the sharded sums, as Adam magnifies it (an entry whose
    gradient is near zero moves by about lr × sign; lr 1e-2 here). On CUDA, whose GEMMs pick their
    summation order by shape (the shards' are narrower), such entries may move either way, so there the update from `start` is compared as a whole: its difference
    within 25% of its size, tensor by tensor."""
    assert a.keys() == b.keys()
    for key in a:
        if device == "cpu":
            torch.testing.assert_close(a[key], b[key], rtol=1e-3, atol=1e-4, msg=key)
        else:
            update = b[key].float() - start[key].float()
            assert (a[key].float() - b[key].float()).norm() <= 0.25 * update.norm() + 1e-6, key


# ---- serving ----------------------------------------------------------------------------------


def test_each_rank_holds_only_its_shard_of_the_projections(served):
    ranks, _, _ = served
    full_q_rows = TINY["hidden_size"]  # 4 heads of 16
    assert [r["q_rows"] for r in ranks] == [full_q_rows // 2] * 2


def test_the_sharded_forward_gives_the_logits_of_one_process_with_and_without_lora(served):
    ranks, reference, device = served
    for key in ("base", "lora"):
        torch.testing.assert_close(ranks[0]["logits"][key], reference["logits"][key].cpu(), rtol=0,
                                   atol=tolerance(device))
    # the adapter changes the logits (it is applied, on both ranks' shards)
    assert (reference["logits"]["lora"] - reference["logits"]["base"]).abs().max() > 1e-2


def test_the_engine_at_tp2_samples_the_greedy_tokens_and_logprobs_of_one_process(served):
    ranks, reference, device = served
    for key in ("base", "lora"):
        assert_same_greedy(ranks[0]["generated"][key], reference["generated"][key], device, 10 * tolerance(device))
    assert reference["generated"]["base"][0] != reference["generated"]["lora"][0]
    assert "generated" not in ranks[1]  # the follower takes no requests


# ---- training ---------------------------------------------------------------------------------


@pytest.mark.parametrize("grads", ["grads", "grads_sp"])
def test_the_sharded_gradient_of_each_lora_tensor_equals_the_unsharded_one(trained, grads):
    """A row of 150 tokens runs sequence parallel (each rank 75 between the sharded layers); one of
    169, which does not split in two, all-reduces whole rows."""
    ranks, reference, _, device = trained
    assert ranks[0][grads].keys() == reference[grads].keys()
    worst = {}
    for name, full in reference[grads].items():
        assert torch.equal(ranks[1][grads][name], ranks[0][grads][name]), name  # the same gathered tensor
        worst[name] = ((ranks[0][grads][name] - full).norm() / full.norm().clamp_min(1e-12)).item()
    bad = sorted(((round(v, 4), k.replace("base_model.model.model.", "").replace(".default.weight", ""))
                  for k, v in worst.items() if v > 1e-4), reverse=True)
    assert not bad, f"{len(bad)} of {len(worst)} tensors differ (relative error, tensor): {bad[:8]}"


def test_a_sharded_lora_step_equals_the_unsharded_step(trained):
    ranks, reference, out, device = trained
    for key in ("loss/train", "loss/grad_norm", "loss/entropy"):
        assert ranks[0]["metrics_1"][key] == pytest.approx(reference["metrics_1"][key], rel=1e-4, abs=1e-6), key
        assert ranks[1]["metrics_1"][key] == ranks[0]["metrics_1"][key], key
    start = saved_adapter(out / "start")
    assert_adapters_close(saved_adapter(out / "ckpt1"), reference["adapter_1"], device, start)
    assert_adapters_close(saved_adapter(out / "ckpt2"), reference["adapter_2"], device, start)
    moved = max((reference["adapter_1"][k] - v).abs().max() for k, v in start.items())
    assert moved > 1e-3  # the step changed the adapter


def test_a_followers_training_step_starts_after_every_engine_step_its_leader_took_before(trained):
    """NCCL needs the engine's collectives and the trainer's in one order on every rank: the
    follower's step 2 waited for the leader's pause, having run the leader's generation first."""
    ranks, *_ = trained
    assert ranks[0]["engine_steps_before_step_2"] > 0
    assert ranks[1]["engine_steps_before_step_2"] == ranks[0]["engine_steps_before_step_2"]


def test_the_engine_serves_the_trained_shards(trained):
    ranks, reference, _, device = trained
    assert_same_greedy(ranks[0]["generated_1"]["lora"], reference["generated_1"]["lora"], device,
                       1e-3 if device == "cpu" else 0.1)


def test_the_checkpoint_is_the_full_peft_adapter_written_once(trained):
    from peft import PeftModel

    _, _, out, _ = trained
    assert sorted(p.name for p in out.iterdir() if p.name.startswith((".tmp", "ckpt"))) == ["ckpt1", "ckpt2"]
    assert {k: v.shape for k, v in saved_adapter(out / "ckpt1").items()} == \
        {k: v.shape for k, v in saved_adapter(out / "start").items()}
    PeftModel.from_pretrained(tiny_llama(), str(out / "ckpt1"))  # PEFT itself loads it onto the whole model
    optimizer = torch.load(out / "ckpt1" / "optimizer.pt", weights_only=True)
    assert optimizer["state"][0]["exp_avg"].shape == (4, TINY["hidden_size"])  # full, as one GPU's


def test_a_tp2_checkpoint_resumes_at_tp2_and_at_tp1(trained):
    from tempering.training import Trainer

    _, _, out, device = trained
    ckpt1 = saved_adapter(out / "ckpt1")
    assert_adapters_close(saved_adapter(out / "resumed2"), saved_adapter(out / "ckpt2"), device, ckpt1)
    single = Trainer.from_adapter(tiny_llama(device=device), out / "ckpt1")
    single.load_state(out / "ckpt1")
    single.step(sequences(2), config())
    assert_adapters_close(adapter_of(single), saved_adapter(out / "ckpt2"), device, ckpt1)


def test_a_tp2_checkpoint_exports_as_an_adapter_and_a_merged_model_of_the_whole_model(trained, tmp_path,
                                                                                      default_model_dir):
    """`tempering export` of a checkpoint that two tensor-parallel ranks wrote (their gathered shards)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tempering.service.export import export_model

    _, _, out, _ = trained
    base = tmp_path / "base"
    tiny_llama().save_pretrained(base)
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(base)  # any tokenizer: the export carries it
    adapter = export_model(out / "ckpt1", out=tmp_path / "adapter", base_model=str(base))
    export_model(out / "ckpt1", out=tmp_path / "merged", merged=True, base_model=str(base))
    assert adapter.step == 1 and adapter.base_model == str(base.resolve())
    ids = torch.tensor([[5, 17, 42, 9, 100, 3]])
    with torch.inference_mode():
        trained_logits = PeftModel.from_pretrained(tiny_llama(), str(out / "ckpt1")).eval()(ids).logits
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(tmp_path / "adapter"))
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(loaded.eval()(ids).logits, trained_logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(merged(ids).logits, trained_logits, atol=1e-4, rtol=0)


# ---- sizes ------------------------------------------------------------------------------------


def test_a_model_that_does_not_fit_even_when_sharded_is_refused_with_its_sizes(tmp_path):
    import transformers

    transformers.LlamaConfig(**TINY).save_pretrained(tmp_path)
    whole = weight_bytes(str(tmp_path), torch.bfloat16)
    per_rank = sharded_weight_bytes(transformers.LlamaConfig(**TINY), 2, torch.bfloat16)
    assert per_rank < whole
    free = (whole + per_rank) // 2  # enough for a half, not for the whole
    check_fits(str(tmp_path), torch.bfloat16, free_bytes=free, total_bytes=2 * free, device_name="cuda:0",
               tensor_parallel_size=2)
    with pytest.raises(ConfigError, match=r"GiB per GPU .* at tensor_parallel_size 2 .* GiB free of .* GiB"):
        check_fits(str(tmp_path), torch.bfloat16, free_bytes=per_rank // 2, total_bytes=free, device_name="cuda:0",
                   tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="larger tensor_parallel_size"):
        check_fits(str(tmp_path), torch.bfloat16, free_bytes=free, total_bytes=2 * free, device_name="cuda:0")


def test_a_split_that_does_not_divide_the_kv_heads_is_refused_naming_the_sizes():
    import transformers

    with pytest.raises(ConfigError, match="num_key_value_heads.* is 2, not divisible by tensor_parallel_size 4"):
        sharded_weight_bytes(transformers.LlamaConfig(**{**TINY, "num_attention_heads": 8}), 4, torch.bfloat16)


def _count_rendezvous(rank: int, port: int, made: int, results) -> None:
    """A forked rank: joins a gloo world of 2, says whether its group's rendezvous counts agree."""
    import torch.distributed as dist

    from tempering.modeling import tensor_parallel

    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    tensor_parallel._rendezvous_made = made
    results.put((rank, tensor_parallel.TensorParallel([0, 1]).rendezvous_counts_agree(torch.device("cpu"))))
    dist.destroy_process_group()


@pytest.mark.parametrize("made", [(0, 0), (2, 2), (1, 0)])
def test_ranks_that_made_different_numbers_of_rendezvous_skip_symmetric_memory(made):
    """torch numbers a process's symmetric-memory rendezvous from its first, so a driver that served a
    tensor-parallel model in an earlier run and its fresh workers would wait for each other forever
    (a 72B resume in one process, on four H200s): every rank learns that their counts differ."""
    import multiprocessing

    port = rank_processes.free_port()
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    ranks = [context.Process(target=_count_rendezvous, args=(r, port, made[r], results)) for r in (0, 1)]
    for p in ranks:
        p.start()
    seen = dict(results.get(timeout=60) for _ in ranks)
    for p in ranks:
        p.join(30)
    assert seen == {0: made[0] == made[1], 1: made[0] == made[1]}


# ---- a row-parallel layer's partial sums, in bfloat16 ------------------------------------------


def _row_parallel_case():
    """A bf16 o-like projection (in 128 -> out 64) with a rank-4 LoRA, and its two input halves."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(48, 128, generator=g).to(torch.bfloat16)
    W = (torch.randn(64, 128, generator=g) / 128 ** 0.5).to(torch.bfloat16)
    A = (torch.randn(4, 128, generator=g) * 0.1).to(torch.bfloat16)
    B = (torch.randn(64, 4, generator=g) * 0.1).to(torch.bfloat16)
    halves = [slice(0, 64), slice(64, 128)]  # rank r's input columns: its heads (o) or MLP columns (down)
    return x, W, A, B, halves


def test_row_parallel_partial_outputs_summed_in_float32_round_as_one_process():
    """Under TP a row-parallel layer (o, down) sums x A^T over the ranks before rounding it, adds the
    LoRA delta on the leader alone, and sums the partial outputs in float32 before the one rounding
    (engine/lora.row_parallel_delta, the trainer's lora_linear): in bf16 that equals the one-process
    product, where rounding each rank's output first changes 4 elements in 10 (CPU, the PyTorch
    twins of the GPU kernels; the two-process tests run the same code through gloo)."""
    from tempering.engine.lora import expand
    from tempering.modeling.precision import linear_f32
    from tempering.training.decoder import lora_linear

    x, W, A, B, halves = _row_parallel_case()
    scale, cols = 2.0, [slice(0, 64)]
    one = lora_linear(x, W, None, A, B, scale)  # one process: [48, 64] bf16, rounded once
    assert torch.equal(expand(linear_f32(x, W), linear_f32(x, A), [B], cols, [scale], torch.bfloat16), one)
    xa = sum(linear_f32(x[:, h], A[:, h]) for h in halves)  # x A^T summed over the ranks
    leader = expand(linear_f32(x[:, halves[0]], W[:, halves[0]]), xa, [B], cols, [scale], torch.float32,
                    round_dtype=torch.bfloat16)
    t = (xa * scale).to(torch.bfloat16)
    assert leader.dtype == torch.float32
    assert torch.equal(leader, linear_f32(x[:, halves[0]], W[:, halves[0]]) + linear_f32(t, B))  # the trainer's
    summed = (leader + linear_f32(x[:, halves[1]], W[:, halves[1]])).to(torch.bfloat16)
    rounded_per_rank = sum(lora_linear(x[:, h], W[:, h], None, A[:, h], B, scale) for h in halves)
    assert (rounded_per_rank != one).float().mean() > 0.2
    assert (summed != one).float().mean() < 0.01  # float32 sums in another order: a rare boundary case at most


def test_a_decode_steps_gemm_output_summed_whole_once_rounds_as_one_process():
    """The spare rows' path under TP (engine/lora.linear_with_lora, deferred delta): each rank's GEMM
    writes x_r W_r^T and x_r A_r^T side by side in float32, into a given buffer (as into the
    symmetric-memory one, `TensorParallel.all_reduce_buffer`), one all-reduce sums both, and the
    delta is added after the sum, on every rank: in bf16 the one-process product."""
    from tempering.engine.lora import expand
    from tempering.modeling.precision import linear_f32
    from tempering.training.decoder import lora_linear

    x, W, A, B, halves = _row_parallel_case()
    scale, cols = 2.0, [slice(0, 64)]
    one = lora_linear(x, W, None, A, B, scale)
    spare = torch.cat([W, A])  # A in the weight's spare rows
    buffers = [torch.full((48, 68), float("nan")) for _ in halves]
    partials = [linear_f32(x[:, h], spare[:, h], out=buf) for h, buf in zip(halves, buffers)]
    assert all(p is buf for p, buf in zip(partials, buffers))  # written where it is summed
    y = partials[0] + partials[1]  # the all-reduce
    got = expand(y[:, :64], y[:, 64:], [B], cols, [scale], torch.bfloat16)
    assert (got != one).float().mean() < 0.01  # float32 sums in another order: a rare boundary case at most


def test_a_float32_partial_output_has_the_gradients_of_the_rounded_one():
    """The trainer's o/down under TP (out_dtype float32): the same gradients as the bf16 output for
    the same upstream gradient (the backward runs in the model dtype either way)."""
    from tempering.training.decoder import lora_linear

    x, W, A, B, _ = _row_parallel_case()
    grad = torch.randn(48, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    grads = []
    for out_dtype in (None, torch.float32):
        xs, As, Bs = (t.clone().requires_grad_(True) for t in (x, A, B))
        y = lora_linear(xs, W, None, As, Bs, 2.0, out_dtype=out_dtype)
        y.backward(grad.to(y.dtype))
        grads.append((xs.grad, As.grad, Bs.grad))
    for rounded, unrounded in zip(*grads):
        assert torch.equal(rounded, unrounded)


def test_a_row_parallel_projection_without_lora_keeps_its_float32_sum_and_the_input_gradient():
    """Under TP a row-parallel projection that the adapter does not target (the trainer's
    _FrozenLinearF32): float32 output, the one-process product's sum; the input gradient of F.linear."""
    from tempering.modeling.precision import linear_f32
    from tempering.training.decoder import _FrozenLinearF32

    x, W, _, _, _ = _row_parallel_case()
    grad = torch.randn(48, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    xs = x.clone().requires_grad_(True)
    y = _FrozenLinearF32.apply(xs, W, None)
    assert y.dtype == torch.float32 and torch.equal(y, linear_f32(x, W))
    y.backward(grad.float())
    xr = x.clone().requires_grad_(True)
    torch.nn.functional.linear(xr, W).backward(grad)
    assert torch.equal(xs.grad, xr.grad)


# ---- the whole loop through LocalBackend ------------------------------------------------------


PROBE = dict(max_tokens=8, temperature=0.0, ignore_eos=True)


def probe(service) -> tuple[list[int], list[float]]:
    """Greedy tokens and logprobs of one prompt, wherever the router sends it."""
    from tempering.engine import SamplingParams

    prompt = service.renderer.render_prompt([{"role": "user", "content": "Tell me a story."}])
    completion = service.submit(prompt, SamplingParams(**PROBE)).result(120)[0]
    return completion.token_ids, completion.logprobs


def replica_probes(service) -> list[tuple[list[int], list[float]]]:
    """The probe on each replica's leader: rank 0's engine, and every other leader's (through its channel)."""
    from tempering.engine import SamplingParams

    prompt = service.renderer.render_prompt([{"role": "user", "content": "Tell me a story."}])
    futures = [service._submit_local(prompt, SamplingParams(**PROBE), n=1, step=None, on_token=None)]
    futures += [service._submit_remote(link, prompt, SamplingParams(**PROBE), n=1, step=None, on_token=None)
                for link in service.workers if link.rank % service.tp.size == 0]
    return [(f.result(120)[0].token_ids, f.result(120)[0].logprobs) for f in futures]


@pytest.mark.parametrize("gpus", [pytest.param(4, id="2-replicas")])
def test_the_whole_loop_at_tp2_through_local_backend_resumes_at_tp2_and_tp1(tiny_model_dir, tmp_path, gpus):
    """register, rollouts, train (checkpoint), close; a new backend of the same shape and a
    one-process backend resume it. 4 processes: 2 replicas x TP 2, trained data-parallel (which
    covers the single replica's path; `gpus=2` runs that alone, left out of the suite for time)."""
    import asyncio

    import tempering as art
    from tempering.engine import EngineConfig

    def backend(gpus: int, tp: int) -> art.LocalBackend:
        return art.LocalBackend(path=tmp_path, device="cpu", gpus=gpus, engine_config=EngineConfig(
            cpu_kv_cache_bytes=16 << 20, max_num_seqs=32, tensor_parallel_size=tp))

    async def session(gpus: int, tp: int, train: bool) -> dict:
        b = backend(gpus, tp)
        try:
            model = art.TrainableModel(name="tiny", project="tp", base_model=str(tiny_model_dir))
            await model.register(b)
            service = b.hub.service("tiny")
            q_proj = service.model.model.layers[0].self_attn.q_proj
            seen = {"step": await model.get_step(), "probe": probe(service),
                    "q_rows": getattr(q_proj, "base_layer", q_proj).weight.shape[0]}
            if train:
                client = model.openai_client()

                async def group(prompt: str) -> art.TrajectoryGroup:
                    messages = [{"role": "user", "content": prompt}]
                    completion = await client.chat.completions.create(model=model.name, messages=messages,
                                                                      max_tokens=8, n=4, temperature=1.0)
                    return art.TrajectoryGroup([art.Trajectory(messages_and_choices=[*messages, c], reward=float(i))
                                                for i, c in enumerate(completion.choices)])

                # at once, so that the router spreads them over the replicas
                groups = list(await asyncio.gather(*[group(p) for p in ("Say a number.", "Name a color.")]))
                seen["requests_per_replica"] = list(service.router.num_requests) if service.router else None
                await model.train(groups, config=art.TrainConfig(learning_rate=5e-2))
                seen["trained_probe"], seen["trained_step"] = probe(service), await model.get_step()
                seen["replica_probes"] = replica_probes(service)
            return seen
        finally:
            await b.close()

    first = asyncio.run(session(gpus, 2, train=True))
    assert first["q_rows"] == 32  # rank 0 holds 2 of the 4 heads
    assert first["step"] == 0 and first["trained_step"] == 1
    if gpus == 4:  # both replicas served, and hold the same adapter after the data-parallel step
        assert len(first["requests_per_replica"]) == 2 and min(first["requests_per_replica"]) >= 1
        assert len(first["replica_probes"]) == 2
        for other in first["replica_probes"]:
            assert other[0] == first["trained_probe"][0]
            assert other[1] == pytest.approx(first["trained_probe"][1], abs=1e-5)
    assert first["trained_probe"][1] != pytest.approx(first["probe"][1], abs=1e-3)  # the step changed the policy
    assert sorted(p.name for p in (tmp_path / "tp" / "models" / "tiny" / "checkpoints").iterdir()) == ["0001"]
    again = asyncio.run(session(gpus, 2, train=False))
    single = asyncio.run(session(1, 1, train=False))
    assert single["q_rows"] == 64
    for seen in (again, single):
        assert seen["step"] == 1
        assert seen["probe"][0] == first["trained_probe"][0]
        assert seen["probe"][1] == pytest.approx(first["trained_probe"][1], abs=1e-4)


def test_arts_engine_args_tensor_parallel_size_needs_a_run_of_that_many_gpus(tiny_model_dir, tmp_path):
    """ART's engine_args.tensor_parallel_size is EngineConfig.tensor_parallel_size: on one process it is
    refused at registration, naming the fix."""
    import asyncio

    import tempering as art

    async def register() -> None:
        backend = art.LocalBackend(path=tmp_path, device="cpu")
        try:
            model = art.TrainableModel(name="tiny", project="tp", base_model=str(tiny_model_dir),
                                       _internal_config={"engine_args": {"tensor_parallel_size": 2}})
            await model.register(backend)
        finally:
            await backend.close()

    with pytest.raises(ConfigError, match=r"tensor_parallel_size 2 .* this run has 1.*LocalBackend\(gpus=2\)"):
        asyncio.run(register())
