"""`tempering serve --adapter NAME=DIR`: the base model and named adapters from one engine, no trainer,
through the OpenAI routes with the real openai client; adapters added and removed while serving."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from openai import AsyncOpenAI, NotFoundError
from typer.testing import CliRunner

from tempering.cli import app

KEY = "adapter-test-key"
BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is 12+13? Answer with just the number."}]


@pytest.fixture(scope="module")
def served(trained_run, exported_adapter):
    """An AdapterServer of the default model serving the export as "export" and the run's checkpoint as
    "ckpt" (the same weights), behind the key, on a free port: (server, base URL)."""
    from tempering.service import create_app
    from tempering.service.adapter_server import AdapterServer
    from tempering.service.server import ServerThread

    server = AdapterServer(BASE, device="cpu")
    server.add_adapter("export", exported_adapter)
    server.add_adapter("ckpt", trained_run)  # a run directory: its latest checkpoint
    thread = ServerThread(create_app(server, api_key=KEY, adapters=server))
    thread.start()
    try:
        yield server, thread.base_url
    finally:
        thread.stop()
        server.close()


def client_of(served) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{served[1]}/v1", api_key=KEY, max_retries=0)


async def greedy(client, model, **options):
    completion = await client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0,
                                                      **options)
    choice = completion.choices[0]
    return choice.token_ids, choice.sampled_logprobs


def test_the_base_and_each_adapter_are_served_by_name_from_one_engine_without_a_trainer(served):
    server, url = served

    async def main():
        client = client_of(served)
        assert [m.id for m in (await client.models.list()).data] == [BASE, "export", "ckpt"]
        for name in (BASE, "export"):  # GET /v1/models/{id}: the base's hub id holds a "/"
            assert (await client.models.retrieve(name)).id == name
        with pytest.raises(NotFoundError, match="valid names"):
            await client.models.retrieve("HuggingFaceTB/nope")
        alone = {name: await greedy(client, name) for name in (BASE, "export", "ckpt")}
        together = await asyncio.gather(*(greedy(client, name) for name in (BASE, "export", "ckpt", BASE, "export")))
        with pytest.raises(NotFoundError, match="valid names"):
            await greedy(client, "nope")
        await client.close()
        return alone, together

    alone, together = asyncio.run(main())
    assert alone["export"] == alone["ckpt"]  # the export and its checkpoint: the same adapter
    assert alone[BASE][1] != alone["export"][1]  # the adapter is applied
    for (tokens, logprobs), name in zip(together, (BASE, "export", "ckpt", BASE, "export")):  # mixed in one batch
        assert tokens == alone[name][0] and logprobs == pytest.approx(alone[name][1], abs=1e-5)
    assert server.trainer is None and server.peft_model is not None  # the engine alone: nothing to train
    assert httpx.get(f"{url}/v1/models").status_code == 401  # the same key as every route


def test_an_adapter_streams_follows_a_schema_and_calls_tools(served):
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}

    async def main():
        client = client_of(served)
        tokens, _ = await greedy(client, "export")
        stream = await client.chat.completions.create(model="export", messages=QUESTION, max_tokens=8, temperature=0,
                                                      stream=True)
        streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        structured = await client.chat.completions.create(
            model="export", messages=QUESTION, max_tokens=16, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
        called = await client.chat.completions.create(model="ckpt", messages=QUESTION, max_tokens=64, temperature=0,
                                                      tools=[tool], tool_choice="required")
        await client.close()
        return tokens, streamed, structured.choices[0], called.choices[0]

    tokens, streamed, structured, called = asyncio.run(main())
    server = served[0]
    assert streamed == server.tokenizer.decode(tokens, skip_special_tokens=True)
    assert isinstance(json.loads(structured.message.content)["answer"], int)
    assert called.finish_reason == "tool_calls" and called.message.tool_calls[0].function.name == "get_time", called


def test_adapters_are_added_and_removed_while_serving_and_bad_ones_are_refused(served, exported_adapter,
                                                                                 tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    server, url = served
    auth = {"Authorization": f"Bearer {KEY}"}
    other = tmp_path / "other-model-adapter"  # a LoRA of a 64-wide model: its shapes are not this base's
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                   LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(other)

    def post(route, body, headers=auth):
        return httpx.post(f"{url}/v1/{route}", json=body, headers=headers, timeout=120)

    assert post("load_lora_adapter", {"lora_name": "late", "lora_path": str(exported_adapter)}, {}).status_code == 401
    loaded = post("load_lora_adapter", {"lora_name": "late", "lora_path": str(exported_adapter)})
    assert loaded.status_code == 200 and loaded.json()["name"] == "late"
    (late_ids, late_logprobs), (ids, logprobs) = (asyncio.run(greedy(client_of(served), name)) for name in ("late", "export"))
    assert late_ids == ids  # the same adapter under two names; "export" may find its prompt cached (float noise)
    assert max(abs(a - b) for a, b in zip(late_logprobs, logprobs)) < 1e-5
    for body, status, message in [
        ({"lora_name": "late", "lora_path": str(exported_adapter)}, 400, "already served"),
        ({"lora_name": BASE, "lora_path": str(exported_adapter)}, 400, "already served"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, 400, "neither a model's run directory"),
        ({"lora_name": "x", "lora_path": str(other)}, 400, "does not fit this base model"),
        ({"lora_name": "x@1", "lora_path": str(exported_adapter)}, 400, "cannot be a served model name"),
        ({"lora_name": "x"}, 422, "lora_path is required"),
    ]:
        response = post("load_lora_adapter", body)
        assert response.status_code == status and message in response.json()["error"]["message"], response.text
    assert [a["name"] for a in httpx.get(f"{url}/v1/adapters", headers=auth).json()["data"]] == ["export", "ckpt", "late"]
    assert post("unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    assert post("unload_lora_adapter", {"lora_name": "late"}).status_code == 404
    with pytest.raises(NotFoundError):
        asyncio.run(greedy(client_of(served), "late"))
    assert asyncio.run(greedy(client_of(served), "export"))[0]  # the server goes on serving
    assert "x" not in server.served_names()


def test_serve_adapter_options_are_checked_before_anything_loads(tmp_path, exported_adapter):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    config = json.loads((exported_adapter / "adapter_config.json").read_text())
    (elsewhere / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "google/gemma-3-270m"}))
    (elsewhere / "adapter_model.safetensors").write_bytes((exported_adapter / "adapter_model.safetensors").read_bytes())
    serve = ["serve", "--insecure", "--device", "cpu"]
    for args, message in [
        (["--adapter", "demo"], "NAME=DIR"),
        (["--adapter", f"a={exported_adapter}", "--gpus", "2"], "one device"),
        (["--adapter", f"a={exported_adapter}", "--adapter", f"a={exported_adapter}"], "two adapters are named 'a'"),
        (["--adapter", f"a={tmp_path / 'none'}"], "neither a model's run directory"),
        (["--adapter", f"a={exported_adapter}", "--adapter", f"b={elsewhere}"], "different base models"),
    ]:
        result = CliRunner().invoke(app, [*serve, *args])
        assert result.exit_code == 2 and message in " ".join(result.output.replace("│", " ").split()), (args, result.output)
