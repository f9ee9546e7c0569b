"""engine/grammar: specs, the compile cache, the per-step mask, and both engines under a grammar."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from tempering.chat import ChatRenderer
from tempering.engine import BasePolicy, Engine, EngineConfig, HFEngine, SamplingParams, engine_model_for
from tempering.engine.grammar import GrammarCompiler, GrammarMask, GrammarSpec, advance
from tempering.engine.sampler import sample, sampling_tensors
from tempering.errors import ConfigError

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def parts(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    renderer = ChatRenderer(tokenizer)
    compiler = GrammarCompiler(tokenizer, stop_token_ids=renderer.stop_token_ids, vocab_size=model.config.vocab_size)
    return model, tokenizer, renderer, compiler


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_specs_reject_values_of_the_wrong_shape():
    for make, value in [(GrammarSpec.choice, []), (GrammarSpec.choice, ["a", ""]), (GrammarSpec.choice, "ab"),
                        (GrammarSpec.regex, ""), (GrammarSpec.regex, 3), (GrammarSpec.json_schema, "[1, 2]"),
                        (GrammarSpec.json_schema, "{bad"), (GrammarSpec.json_schema, False), (GrammarSpec.grammar, " ")]:
        with pytest.raises(ConfigError):
            make(value)
    assert GrammarSpec.json_schema(True) == GrammarSpec.json_schema({})  # `true` accepts any JSON value


def test_a_spec_compiles_once_and_the_cache_ignores_where_it_came_from(parts):
    compiler = parts[3]
    first = compiler.compile(GrammarSpec.json_schema(SCHEMA, where="response_format"))
    assert compiler.compile(GrammarSpec.json_schema(json.dumps(SCHEMA), where="guided_json")) is first


def test_compile_errors_name_the_field_and_the_problem(parts):
    compiler = parts[3]
    with pytest.raises(ConfigError, match=r"guided_json cannot be used: .*dependentRequired"):
        compiler.compile(GrammarSpec.json_schema({"dependentRequired": {"a": ["b"]}}, where="guided_json"))
    with pytest.raises(ConfigError, match="(?s)guided_regex cannot be used: .*unclosed group"):
        compiler.compile(GrammarSpec.regex("(a", where="guided_regex"))


def test_the_mask_restricts_constrained_rows_renormalizes_them_and_leaves_free_rows_alone(parts):
    _, tokenizer, _, compiler = parts
    grammar = compiler.compile(GrammarSpec.choice(["yes", "no"]))
    mask = GrammarMask.fill([grammar.matcher(), None, grammar.matcher()], torch.device("cpu"))
    logprobs = torch.log_softmax(torch.randn(3, compiler.vocab_size, generator=torch.Generator().manual_seed(0)), -1)
    out = mask.apply(logprobs)
    assert torch.equal(out[1], logprobs[1])
    allowed = sorted(tokenizer.decode([t]) for t in torch.isfinite(out[0]).nonzero()[:, 0].tolist())
    assert {"yes", "no"} <= set(allowed) and all("yes".startswith(a) or "no".startswith(a) for a in allowed)
    assert out[0].exp().sum().item() == pytest.approx(1.0, abs=1e-5)
    shift = (out[0] - logprobs[0])[torch.isfinite(out[0])]
    assert torch.allclose(shift, shift[0].expand_as(shift))  # renormalized: the allowed tokens keep their ratios
    assert mask.forced() == [False, False, False]


def test_forced_is_true_exactly_where_one_token_is_allowed_and_the_sampler_draws_inside_the_mask(parts):
    _, tokenizer, _, compiler = parts
    grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    matcher = grammar.matcher()
    logits = torch.randn(1, compiler.vocab_size, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
    text, forced = [], []
    for step in range(40):
        mask = GrammarMask.fill([matcher], torch.device("cpu"))
        out = sample(logits, sampling_tensors([params], [7], [step]), mask)
        token = out.token_ids.item()
        allowed = torch.isfinite(mask.apply(torch.log_softmax(logits, -1)))[0]
        assert allowed[token]
        forced.append(mask.forced()[0])
        assert forced[-1] == (allowed.sum().item() == 1)
        assert out.logprobs.item() == pytest.approx(torch.log_softmax(logits, -1)[0, token].item(), abs=1e-5)  # unmasked
        if token in compiler.stop_token_ids:
            break
        advance([(matcher, token)])
        text.append(token)
    assert token in compiler.stop_token_ids and forced[-1]  # the complete object leaves only the stop token
    value = json.loads(tokenizer.decode(text))
    assert set(value) == {"name", "ok"} and forced[0]  # `{"` is the only way to start


def test_a_matcher_in_an_error_state_ends_its_sample_instead_of_failing_the_batch(parts):
    _, tokenizer, _, compiler = parts
    matcher = compiler.compile(GrammarSpec.choice(["yes", "no"])).matcher()
    assert not matcher.accept(ids_of(tokenizer, "maybe")[0]) and matcher.is_error
    mask = GrammarMask.fill([matcher], torch.device("cpu"))
    out = mask.apply(torch.log_softmax(torch.randn(1, compiler.vocab_size), -1))
    assert torch.isfinite(out[0]).nonzero()[:, 0].tolist() == compiler.stop_token_ids


@pytest.mark.parametrize("engine_kind", ["engine", "hf"])
def test_both_engines_sample_valid_json_under_a_schema_beside_a_free_request(parts, engine_kind):
    model, tokenizer, renderer, compiler = parts
    lock = threading.RLock()
    if engine_kind == "engine":
        engine = Engine(engine_model_for(model, 8192), tokenizer, stop_token_ids=renderer.stop_token_ids, lock=lock,
                        config=EngineConfig(cpu_kv_cache_bytes=128 << 20))
    else:
        engine = HFEngine(model, tokenizer, stop_token_ids=renderer.stop_token_ids, lock=lock)
    try:
        prompt = renderer.render_prompt([{"role": "user", "content": "Describe someone as JSON."}])
        grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA))
        constrained = engine.submit(prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=1, grammar=grammar), n=4,
                                    policy=BasePolicy())
        free = engine.submit(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=1), n=2, policy=BasePolicy())
        for c in constrained.result(timeout=300):
            assert c.finish_reason == "stop" and set(json.loads(c.text)) == {"name", "ok"}
            assert len(c.forced) == len(c.token_ids) and c.forced[-1]  # ends on the forced stop token
        assert all(c.forced is None for c in free.result(timeout=300))
    finally:
        engine.close()


def test_mask_worker_shards_give_the_same_masks_as_one_thread(parts):
    """Matchers are spread over separately compiled copies of a grammar (shards), and MaskWorker
    (rows grouped by copy, llguidance's pool of 3 threads: consume the last tokens, then fill)
    gives exactly the masks and states of doing it all on one thread."""
    from tempering.engine.grammar import MaskWorker

    model, tokenizer, renderer, _ = parts
    shards = 4  # as on a machine with 5+ CPUs (this one may have 2, where the default is 1)
    compiler = GrammarCompiler(tokenizer, stop_token_ids=renderer.stop_token_ids, vocab_size=model.config.vocab_size,
                               num_shards=shards)
    grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    rows = 2 * shards + 1
    inline = [grammar.matcher() for _ in range(rows)]
    threaded = [grammar.matcher() for _ in range(rows)]
    assert {m.shard for m in threaded} == set(range(shards))
    answers = [ids_of(tokenizer, json.dumps({"name": f"n{i}", "ok": i % 2 == 0})) for i in range(rows)]
    worker = MaskWorker(num_threads=shards - 1)
    try:
        for step in range(6):
            consume_a = [(m, a[step - 1]) for m, a in zip(inline, answers)] if step else None
            consume_b = [(m, a[step - 1]) for m, a in zip(threaded, answers)] if step else None
            live_a = [m if i % 3 else None for i, m in enumerate(inline)]  # some rows free this step
            live_b = [m if i % 3 else None for i, m in enumerate(threaded)]
            rows_a, bits_a = GrammarMask.compute(live_a, consume=consume_a)
            rows_b, bits_b = worker.submit(live_b, pinned=False, consume=consume_b).result()
            assert rows_a == rows_b and torch.equal(bits_a, bits_b)
            for i, r in enumerate(rows_b):  # each row allows its own next token
                t = answers[r][step]
                assert (int(bits_b[i, t // 32]) >> (t % 32)) & 1
    finally:
        worker.close()
    assert not any(m.is_error for m in inline + threaded)


def test_a_token_the_grammar_rejects_in_the_workers_consume_ends_that_sample_only(parts):
    """A rejected token in MaskWorker's consume flags its matcher (`failed`): its row may then only
    stop, the other rows keep their masks."""
    from tempering.engine.grammar import MaskWorker

    model, tokenizer, renderer, compiler = parts
    grammar = compiler.compile(GrammarSpec.choice(["yes sir", "no sir"]))
    good, bad = grammar.matcher(), grammar.matcher()
    worker = MaskWorker(num_threads=1)
    try:
        pending = worker.submit([good, bad], pinned=False,
                                consume=[(good, ids_of(tokenizer, "yes")[0]), (bad, ids_of(tokenizer, "maybe")[0])])
        pending.wait_filling()
        rows, bits = pending.result()
    finally:
        worker.close()
    assert bad.failed and bad.is_error and not good.failed
    allowed = GrammarMask(rows, bits, 2).apply(torch.zeros(2, compiler.vocab_size))
    assert torch.isfinite(allowed[1]).nonzero()[:, 0].tolist() == compiler.stop_token_ids
    assert torch.isfinite(allowed[0]).sum() >= 1 and not torch.isfinite(allowed[0, compiler.stop_token_ids]).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_masked_sampling_graph_draws_what_eager_sampling_draws(parts):
    """Decode steps under a grammar are sampled by a captured graph (logits + fused masked sampler);
    with the same seeds it gives the tokens, logprobs and forced flags of the eager path."""
    import copy

    model, tokenizer, renderer, compiler = parts
    gpu_model = copy.deepcopy(model).to("cuda", torch.bfloat16)
    prompt = renderer.render_prompt([{"role": "user", "content": "Describe someone as JSON."}])
    grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    outputs = {}
    for graphs in (True, False):
        engine = Engine(engine_model_for(gpu_model, 2048), tokenizer, stop_token_ids=renderer.stop_token_ids,
                        lock=threading.RLock(), config=EngineConfig(use_cuda_graphs=graphs))
        try:
            params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, grammar=grammar)
            outputs[graphs] = engine.submit(prompt, params, n=8, policy=BasePolicy()).result(timeout=300)
            if graphs:
                assert engine.runner.graphs.sample_graphs, "no masked-sampling graph was captured"
        finally:
            engine.close()
    for a, b in zip(outputs[True], outputs[False]):
        assert a.token_ids == b.token_ids and a.forced == b.forced
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
        if a.finish_reason == "stop":
            assert set(json.loads(a.text)) == {"name", "ok"}


def test_structured_outputs_need_no_extra_and_their_library_installs_where_torch_does():
    """llguidance is a core dependency whose range holds only releases with manylinux_2_28 wheels
    (torch's floor): from 1.7 on its Linux wheels need glibc 2.31, and pip on an older glibc would
    build the newest release from its sdist, with a Rust toolchain."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    [grammar] = [r for r in map(Requirement, project["dependencies"]) if r.name == "llguidance"]
    assert grammar.marker is None and "1.6.1" in grammar.specifier and "1.7.0" not in grammar.specifier


def test_a_grammar_library_that_takes_one_eos_id_ends_grammars_on_the_tokenizers_own():
    """llguidance 1.6 (the last release with wheels for glibc 2.28) takes a single EOS id."""
    from types import SimpleNamespace

    from tempering.engine.grammar.compiler import _lltokenizer

    calls = []

    def from_tokenizer(hf, *, n_vocab, eos_token):
        calls.append(eos_token)
        if not isinstance(eos_token, int):
            raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")
        return ("lltokenizer", eos_token)

    llg_1_6 = SimpleNamespace(hf=SimpleNamespace(from_tokenizer=from_tokenizer))
    hf = SimpleNamespace(eos_token_id=2)  # SmolLM2's <|im_end|>; its <|endoftext|> (0) also stops a sample
    assert _lltokenizer(llg_1_6, hf, 49152, [0, 2]) == ("lltokenizer", 2)
    assert calls == [[0, 2], 2]
    # the template's end of turn where the tokenizer's EOS is another stop id (Gemma 3's <eos> and
    # <end_of_turn>; SmolLM2's <|im_start|> as transformers 5.17 converts its GGUF)
    assert _lltokenizer(llg_1_6, SimpleNamespace(eos_token_id=1), 262144, [1, 106], 106) == ("lltokenizer", 106)


def test_byte_level_tokens_under_a_sequence_decoder_reach_the_grammar_as_their_bytes(parts):
    """transformers 5.17 converts SmolLM2's GGUF tokenizer with a decoder of ByteFallback + Fuse +
    Replace + ByteLevel; llguidance then read the token `Ġ"` as the bytes of its text, and a
    grammar-constrained tool call failed at the model's first space (seen on a GPU machine)."""
    import copy

    from tokenizers import decoders

    from tempering.engine.grammar.compiler import _lltokenizer, import_llguidance

    _, tokenizer, renderer, _ = parts
    converted = copy.deepcopy(tokenizer)
    converted.backend_tokenizer.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("\u2581", " "), decoders.ByteLevel()])
    [space_quote] = ids_of(tokenizer, ' "')
    assert converted.decode([space_quote]) == ' "'  # the tokenizer itself decodes it right
    lltokenizer = _lltokenizer(import_llguidance(), converted, len(tokenizer), renderer.stop_token_ids)
    assert lltokenizer.decode_bytes([space_quote]) == b' "'
