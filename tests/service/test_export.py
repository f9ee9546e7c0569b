"""`tempering export`: a trained checkpoint as a standalone PEFT adapter, or merged into its base, that
PEFT, transformers and tempering's own inference server load and answer alike."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from tempering.cli import app
from tempering.engine import SamplingParams
from tempering.service.export import export_model

pytestmark = pytest.mark.filterwarnings("ignore:.*_pattern keys did not match any targeted module")


def test_the_merged_export_loads_in_transformers_and_answers_as_tempering_serves_the_adapter(
        trained_run, exported_adapter, default_model_dir, tmp_path):
    """Greedy answers to held-out demo problems: the same tokens and rewards. Logprobs: transformers on
    the merged model equals transformers with PEFT's unmerged adapter, and tempering's served logprobs,
    within 1e-5 on average; the largest difference of either is float32 noise between two forwards
    (the merge rounds each weight once more), which tempering's engine shows against transformers on
    the base model alone too (1.6e-5 on these prompts, 2 CPU threads; 1.3e-5 merged against unmerged on
    another CPU), so the largest is held to 5e-5."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tempering.demo.task import AdditionTask
    from tempering.service.adapter_server import AdapterServer

    out = tmp_path / "merged"
    result = CliRunner().invoke(app, ["export", str(trained_run), "--merged", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "README.md"} <= {p.name for p in out.iterdir()}
    card = (out / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and "| step | 1 |" in card
    assert "val/reward at step 1" in card and f"tempering export {trained_run} --out {out} --merged" in card

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    unmerged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32),
                                         str(exported_adapter)).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    server = AdapterServer("HuggingFaceTB/SmolLM2-135M-Instruct", device="cpu")
    try:
        server.add_adapter("run", exported_adapter)
        served, _ = server.resolve("run")
        task = AdditionTask(temperature=0.0, max_tokens=12)
        differences, merge_differences = [], []
        for scenario in task.scenarios(3, seed=7):
            messages = [{"role": "user", "content": scenario.prompt}]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
            assert prompt == server.renderer.render_prompt(messages)  # the export's tokenizer and chat template
            [sample] = served.submit(prompt, SamplingParams(max_tokens=12, temperature=0.0)).result()
            ids, tokens = torch.tensor([prompt + sample.token_ids]), torch.tensor(sample.token_ids)[:, None]
            with torch.inference_mode():
                generated = merged.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)[0, len(prompt):]
                logprobs, peft_logprobs = (torch.log_softmax(m(ids).logits[0, len(prompt) - 1:-1].float(), -1)
                                           .gather(1, tokens)[:, 0] for m in (merged, unmerged))
            assert generated.tolist() == sample.token_ids
            merge_differences.append((logprobs - peft_logprobs).abs())
            differences.append((logprobs - torch.tensor(sample.logprobs)).abs())
            text = tokenizer.decode(generated, skip_special_tokens=True)
            assert task.reward(text, scenario) == task.reward(sample.text, scenario)
        for differences in (torch.cat(merge_differences), torch.cat(differences)):
            assert differences.mean() <= 1e-5 and differences.max() <= 5e-5, differences
    finally:
        server.close()


def test_the_adapter_export_names_the_hub_id_and_carries_the_tokenizer_and_a_model_card(
        exported_adapter, trained_run, default_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = json.loads((exported_adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and config["inference_mode"]
    files = {p.name for p in exported_adapter.iterdir()}
    assert {"adapter_model.safetensors", "tokenizer.json", "chat_template.jinja", "README.md"} <= files
    assert not files & {"optimizer.pt", "rng.pt", "trainer_state.json"}  # the training state stays in the run
    history = [json.loads(line) for line in (trained_run / "history.jsonl").read_text().splitlines()]
    val = next(row["val/reward"] for row in history if "val/reward" in row)
    assert f"| val/reward at step 1 | {val:.4f} |" in (exported_adapter / "README.md").read_text()
    from safetensors.torch import load_file

    saved = load_file(exported_adapter / "adapter_model.safetensors")
    assert any(v.abs().max() > 0 for k, v in saved.items() if "lora_B" in k)  # trained: B moved from zero
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(default_model_dir), str(exported_adapter))
    loaded = {name.replace(".default", ""): p for name, p in peft_model.named_parameters() if "lora_" in name}
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)  # PEFT itself loads it


def test_export_refuses_what_it_cannot_do_and_names_the_fix(trained_run, tmp_path):
    checkpoint = trained_run / "checkpoints" / "0001"
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    cases = [
        (["export", str(trained_run), "--out", str(taken)], "not empty"),
        (["export", str(trained_run), "--step", "5", "--out", str(tmp_path / "a")], "saved steps: [1]"),
        (["export", str(trained_run), "--best", "--metric", "train/reward", "--out", str(tmp_path / "a")],
         "no saved step"),
        (["export", str(checkpoint), "--step", "1", "--out", str(tmp_path / "a")], "pass its run directory"),
        (["export", str(tmp_path), "--out", str(tmp_path / "a")], "neither a model's run directory"),
        (["export", str(trained_run), "--dtype", "int8", "--out", str(tmp_path / "a")], "bfloat16, float16, float32"),
    ]
    for args, message in cases:
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and message in " ".join(result.output.replace("│", " ").split()), (args, result.output)
    assert (taken / "keep.txt").read_text() == "mine" and not (tmp_path / "a").exists()


def test_best_exports_the_step_with_the_highest_metric_and_a_checkpoint_exports_alone(trained_run, tmp_path):
    best = export_model(trained_run, out=tmp_path / "best", best=True)
    assert best.step == 1 and "val/reward" in best.rewards
    alone = export_model(trained_run / "checkpoints" / "0001", out=tmp_path / "alone", dtype="bfloat16")
    from safetensors.torch import load_file

    assert alone.step == 1 and {t.dtype for t in load_file(tmp_path / "alone" / "adapter_model.safetensors").values()} \
        == {torch.bfloat16}


def gemma3_dir(directory, tokenizer_dir):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"]))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_every_family_exports_an_adapter_peft_and_tempering_serve_and_a_merged_model_alike(
        family, tmp_path, default_model_dir, tiny_moe_dir):
    """Checkpoints as tempering's trainer writes them: Gemma 3, and Qwen3-MoE with LoRA on the stacked experts;
    the adapter export loaded by PEFT and served by `tempering serve --adapter`, the merged one by transformers."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tempering.engine import EngineConfig
    from tempering.service.adapter_server import AdapterServer
    from tempering.training import Trainer
    from tempering.types import LoRAConfig

    base_dir = gemma3_dir(tmp_path / "base", default_model_dir) if family == "gemma3" else tiny_moe_dir
    run = tmp_path / "run"
    (run / "checkpoints" / "0001").mkdir(parents=True)
    (run / "model.json").write_text(json.dumps({"name": "run", "base_model": str(base_dir)}))
    trainer = Trainer.new(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), LoRAConfig(rank=4))
    with torch.no_grad():
        for p in trainer.params:
            p.normal_(0, 0.1)
    trainer.save(run / "checkpoints" / "0001", step=1)
    config = json.loads((run / "checkpoints" / "0001" / "adapter_config.json").read_text())
    assert bool(config["target_parameters"]) == (family == "qwen3_moe")  # expert LoRA on the stacked weights

    adapter = export_model(run, out=tmp_path / "adapter")
    export_model(run, out=tmp_path / "merged", merged=True)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(base_dir.resolve())
    assert any("vLLM" in note for note in adapter.notes) == (family == "qwen3_moe")
    ids = torch.tensor([[1, 4093, 198, 1780, 314, 216, 33]])
    with torch.inference_mode():
        trained = trainer.peft_model.eval()(ids).logits
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                           str(tmp_path / "adapter")).eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()(ids).logits
    assert (trained - plain).abs().max() > 1e-3  # the adapter changes the model
    torch.testing.assert_close(loaded, trained, atol=1e-5, rtol=0)
    torch.testing.assert_close(merged, trained, atol=1e-4, rtol=0)

    server = AdapterServer(str(base_dir), device="cpu", engine_config=EngineConfig(cpu_kv_cache_bytes=16 << 20))
    try:  # tempering's engine serves the export as the trainer computed it
        server.add_adapter("run", tmp_path / "adapter")
        [sample] = server.resolve("run")[0].submit(ids[0].tolist(), SamplingParams(max_tokens=4, temperature=0)).result()
    finally:
        server.close()
    with torch.inference_mode():
        logits = trainer.peft_model(torch.tensor([ids[0].tolist() + sample.token_ids])).logits[0, ids.shape[1] - 1:-1]
    assert logits.argmax(-1).tolist() == sample.token_ids
    logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]
    assert (logprobs - torch.tensor(sample.logprobs)).abs().max() <= 1e-4
