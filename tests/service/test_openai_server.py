"""The OpenAI-compatible server of LocalBackend, driven by the real `openai` client."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch


@pytest.fixture(scope="module")
def served(serve_default_model):
    """A LocalBackend serving an untrained default model; yields (model, backend, loop)."""
    with serve_default_model("server-test") as served:
        yield served

def _chat(served, **kwargs):
    model, _, loop = served
    kwargs.setdefault("model", model.name)
    kwargs.setdefault("messages", [{"role": "user", "content": "What is 2+3? Answer with just the number."}])
    return loop.run_until_complete(model.openai_client().chat.completions.create(**kwargs))


def test_chat_completion_returns_text_token_ids_and_logprobs(served):
    completion = _chat(served, max_tokens=16, temperature=0)
    choice = completion.choices[0]
    assert choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert len(choice.token_ids) == len(choice.sampled_logprobs) > 0
    assert choice.logprobs is None  # OpenAI's per-token objects only when asked for (next test)
    assert choice.prompt_token_ids[:1] == [1]  # <|im_start|>
    assert completion.usage.completion_tokens == len(choice.token_ids)


def test_greedy_output_equals_transformers_and_logprobs_match_a_forward_pass(served, hf_model):
    reference, tokenizer = hf_model
    choice = _chat(served, max_tokens=24, temperature=0, logprobs=True, top_logprobs=3).choices[0]
    prompt, sampled = choice.prompt_token_ids, choice.token_ids
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    assert sampled == expected[: len(sampled)]
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + sampled])).logits[0, len(prompt) - 1 : -1]
    forward = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(sampled)[:, None]).squeeze(1)
    served_lp = torch.tensor(choice.sampled_logprobs)
    entries = choice.logprobs.content  # OpenAI's: the content's tokens only (no <|im_end|>)
    assert [c.logprob for c in entries] == choice.sampled_logprobs[: len(entries)]
    assert "".join(c.token for c in entries) == choice.message.content
    max_abs_diff = (forward - served_lp).abs().max().item()
    print(f"max |logprob(server) - logprob(forward)| = {max_abs_diff:.2e} over {len(sampled)} tokens")
    assert max_abs_diff < 1e-3
    assert len(choice.logprobs.content[0].top_logprobs) == 3
    assert choice.logprobs.content[0].top_logprobs[0].logprob == pytest.approx(choice.logprobs.content[0].logprob, abs=1e-5)


def test_n_samples_with_a_seed_are_reproducible(served):
    a = _chat(served, max_tokens=12, temperature=1.0, n=4, seed=123)
    b = _chat(served, max_tokens=12, temperature=1.0, n=4, seed=123)
    assert len(a.choices) == 4
    assert [c.token_ids for c in a.choices] == [c.token_ids for c in b.choices]
    assert len({tuple(c.token_ids) for c in a.choices}) > 1  # the n samples differ from each other
    assert all(c.logprob_temperature == 1.0 for c in a.choices)


def test_stop_string_cuts_the_text(served):
    choice = _chat(served, max_tokens=24, temperature=0, stop=["="]).choices[0]
    assert "=" not in choice.message.content
    assert choice.finish_reason == "stop"


def test_concurrent_requests_all_complete(served):
    model, _, loop = served
    client = model.openai_client()

    async def many():
        return await asyncio.gather(*[
            client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": f"Count to {i}."}],
                                           max_tokens=8, temperature=0.7)
            for i in range(12)
        ])

    results = loop.run_until_complete(many())
    assert all(r.choices[0].token_ids for r in results)


def test_text_completions_route(served):
    model, _, loop = served
    out = loop.run_until_complete(model.openai_client().completions.create(
        model=model.name, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2))
    choice = out.choices[0]
    assert choice.text
    assert len(choice.logprobs.token_logprobs) == len(choice.token_ids)


def test_models_route_lists_the_model(served):
    model, _, loop = served
    names = [m.id for m in loop.run_until_complete(model.openai_client().models.list()).data]
    assert model.name in names and f"{model.name}@0" in names
    client = model.openai_client()
    for name in (model.name, f"{model.name}@0"):  # client.models.retrieve: GET /v1/models/{id}
        assert loop.run_until_complete(client.models.retrieve(name)).id == name
    for missing in ("no-such-model", f"{model.name}@7", f"{model.name}@x"):
        with pytest.raises(openai.NotFoundError, match="valid names"):
            loop.run_until_complete(client.models.retrieve(missing))


def test_unknown_model_is_404_naming_the_valid_names(served):
    with pytest.raises(openai.NotFoundError) as info:
        _chat(served, model="no-such-model", max_tokens=4)
    assert "server-test" in str(info.value)
    with pytest.raises(openai.NotFoundError, match="no checkpoint of step 7"):
        _chat(served, model="server-test@7", max_tokens=4)


def test_malformed_bodies_get_4xx_and_the_server_keeps_serving(served):
    model, backend, _ = served
    headers = {"Authorization": f"Bearer {model.inference_api_key}"}
    url = f"{model.inference_base_url}/chat/completions"
    bad_bodies = [
        b"{not json",
        b'{"model": "server-test"}',
        b'{"model": "server-test", "messages": [{"content": "no role"}]}',
        b'{"model": "server-test", "messages": [{"role": "user", "content": "x"}], "temperature": -1}',
        b'{"model": "server-test", "messages": [{"role": "user", "content": "x"}], "n": 0}',
        b'{"model": "server-test", "messages": [{"role": "user", "content": "x"}], "stop": [""]}',
    ]
    for body in bad_bodies:
        response = httpx.post(url, content=body, headers={**headers, "Content-Type": "application/json"}, timeout=30)
        assert 400 <= response.status_code < 500, (body, response.status_code, response.text)
        assert response.json()["error"]["message"]
    assert _chat(served, max_tokens=4, temperature=0).choices[0].token_ids


def test_requests_without_the_api_key_are_rejected(served):
    model, _, _ = served
    response = httpx.get(f"{model.inference_base_url}/models", timeout=30)
    assert response.status_code == 401
    response = httpx.get(f"{model.inference_base_url}/models", headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert response.status_code == 401


def test_a_generation_stopped_because_its_client_left_leaves_no_unretrieved_exception():
    """Otherwise asyncio prints "Future exception was never retrieved ... RequestAborted" when the
    server's loop drops it: all a user saw when generate_scenarios' requests timed out."""
    import concurrent.futures
    import gc

    from fastapi import HTTPException

    from tempering.errors import RequestAborted
    from tempering.service.openai_routes import _generated

    class ClientGone:
        async def receive(self):
            return {"type": "http.disconnect"}

    class Service:  # what Engine.abort does to a running request
        def abort(self, future):
            future.set_running_or_notify_cancel()
            future.set_exception(RequestAborted("the request was aborted"))

    reported = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context["message"]))
        with pytest.raises(HTTPException) as stopped:
            await _generated(ClientGone(), Service(), concurrent.futures.Future())
        assert stopped.value.status_code == 499
        del stopped  # its traceback holds the wrapper
        await asyncio.sleep(0.01)  # the engine's exception reaches the wrapper, which nothing awaits now
        gc.collect()

    asyncio.run(main())
    assert reported == []


def test_response_bodies_are_the_json_of_json_dumps_and_refuse_non_finite_floats():
    """The fast serializer writes what json.dumps would (the same values, compact), text that
    merely says NaN or Infinity included; a non-finite float is refused as before."""
    import json

    from tempering.service.openai_routes import json_body

    body = {"choices": [{"message": {"content": "NaN, Infinity and ünïcode"}, "token_ids": [1, 2, 3],
                         "sampled_logprobs": [-0.1, -1e-9, -12.5, 0.0], "prompt_token_ids": []}], "n": None}
    out = json_body(body)
    assert json.loads(out) == body
    assert out == json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    with pytest.raises(ValueError):
        json_body({"sampled_logprobs": [-float("inf")]})
