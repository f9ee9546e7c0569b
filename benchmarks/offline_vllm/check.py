"""Import and smoke check of vLLM 0.20.1 as install.sh installs it (PYTHONPATH=$VLIBS[:$PYLIBS]).
Prints OK/FAIL per check; exits 1 on any failure. Needs no GPU, except for the section that runs
vLLM's own CUDA kernels, which is skipped where torch sees no GPU (and then its imports fail:
libcuda.so.1). Run with --server-only to skip the offline-LLM module list."""
import importlib.metadata as md, json, os, sys, time, traceback

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
failures = []


def imp(stmt, env=None, label=None):
    label = label or stmt.splitlines()[0]
    t = time.time()
    try:
        exec(stmt, env if env is not None else {})
        print(f"OK    {label}  ({time.time() - t:.1f}s)", flush=True)
    except BaseException as e:  # noqa: BLE001
        failures.append(label)
        print(f"FAIL  {label}\n      {type(e).__name__}: {e}", flush=True)
        tb = traceback.format_exc().strip().splitlines()
        print("      " + "\n      ".join(tb[-6:]), flush=True)


print("python", sys.version.split()[0], sys.executable)
imp("import torch; print('      torch', torch.__version__, 'cuda', torch.version.cuda)")
imp("import vllm, os; print('      vllm', vllm.__version__, 'from', os.path.dirname(vllm.__file__))")
try:
    print("      patches:", open(os.path.join(os.path.dirname(__import__("vllm").__file__), "_OFFLINE_PATCHES.txt")).read().strip())
except Exception:  # noqa: BLE001
    pass

# carried third-party packages (what vLLM needs that the machine lacks), with where they come from
for m in ["cachetools", "cbor2", "msgspec", "zmq", "pybase64", "partial_json_parser",
          "openai_harmony", "blake3", "setproctitle", "depyf", "compressed_tensors",
          "outlines_core", "lmformatenforcer", "diskcache", "lark", "mistral_common",
          "watchfiles", "ijson", "pythonjsonlogger", "prometheus_fastapi_instrumentator",
          "loguru", "astor", "dill", "interegular", "jsonschema", "pydantic_extra_types", "gguf",
          "xgrammar", "llguidance", "llguidance.hf", "llguidance.torch",
          "pydantic", "pydantic_core", "fastapi", "starlette", "uvicorn", "httptools", "multipart",
          "openai", "jiter", "model_hosting_container_standards", "typing_extensions"]:
    imp(f"import {m}, os; v = getattr({m}, '__version__', getattr({m}, 'VERSION', '')); "
        f"print('     ', '{m}', v, os.path.dirname({m}.__file__))", label=f"import {m}")
# the machine's own
for m in ["transformers", "triton", "numba", "cloudpickle", "cpuinfo", "psutil", "prometheus_client",
          "uvloop", "aiohttp", "anyio", "httpx", "h11", "jinja2"]:
    imp(f"import {m}")

# native extensions (CUDA 13 / torch 2.11 ABI; they need the NVIDIA driver's libcuda.so.1)
imp("import vllm._C")
imp("import vllm._moe_C")
imp("import vllm._C_stable_libtorch")
imp("import vllm.cumem_allocator")
imp("from vllm.vllm_flash_attn.flash_attn_interface import FA3_AVAILABLE, FA3_UNAVAILABLE_REASON, FA2_AVAILABLE; "
    "print('      FA3_AVAILABLE', FA3_AVAILABLE, FA3_UNAVAILABLE_REASON or '', '| FA2_AVAILABLE', FA2_AVAILABLE, '(FA2 removed on purpose)'); "
    "assert FA3_AVAILABLE, FA3_UNAVAILABLE_REASON")

# vLLM's own CUDA kernels, run once each on the GPU (proves the pruned libraries still hold what
# this GPU loads): RMSNorm, SiLU-and-mul (_C), top-k softmax + MoE block alignment (_moe_C)
imp("""import torch
if not torch.cuda.is_available():
    print('      (no GPU here: kernel runs skipped)')
else:
    import vllm._C, vllm._moe_C
    print('     ', torch.cuda.get_device_name(), 'sm_%d%d' % torch.cuda.get_device_capability())
    x = torch.randn(8, 256, device='cuda', dtype=torch.bfloat16); w = torch.ones(256, device='cuda', dtype=torch.bfloat16)
    out = torch.empty_like(x); torch.ops._C.rms_norm(out, x, w, 1e-6)
    ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(out.float(), ref, atol=3e-2, rtol=3e-2), 'rms_norm'
    y = torch.randn(8, 512, device='cuda', dtype=torch.bfloat16); o = torch.empty(8, 256, device='cuda', dtype=torch.bfloat16)
    torch.ops._C.silu_and_mul(o, y)
    ref = torch.nn.functional.silu(y[:, :256].float()) * y[:, 256:].float()
    assert torch.allclose(o.float(), ref, atol=3e-2, rtol=3e-2), 'silu_and_mul'
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
    g = torch.randn(8, 16, device='cuda', dtype=torch.float32)
    tw = torch.empty(8, 2, device='cuda', dtype=torch.float32); ti = torch.empty(8, 2, device='cuda', dtype=torch.int32)
    ops.topk_softmax(tw, ti, torch.empty_like(ti), g, True)
    assert torch.equal(ti.sort(-1).values.long(), g.topk(2, -1).indices.sort(-1).values), 'topk_softmax'
    moe_align_block_size(ti, 16, 16)
    torch.cuda.synchronize()
    print('      rms_norm, silu_and_mul, topk_softmax, moe_align_block_size ran on the GPU')
""", label="vLLM CUDA kernels run (_C, _moe_C)")

# the LLM path: LLM(model, load_format='dummy', enable_lora=True, tensor_parallel_size=4) + generate
if "--server-only" not in sys.argv:
    for stmt in [
        "from vllm import LLM, SamplingParams",
        "from vllm.inputs import TokensPrompt",
        "from vllm.lora.request import LoRARequest",
        "import vllm.entrypoints.llm",
        "import vllm.platforms.cuda",
        "import vllm.config",
        "import vllm.engine.arg_utils",
        "import vllm.v1.engine.llm_engine",
        "import vllm.v1.engine.core",
        "import vllm.v1.engine.core_client",
        "import vllm.v1.executor.multiproc_executor",
        "import vllm.v1.worker.gpu_worker",
        "import vllm.v1.worker.gpu_model_runner",
        "import vllm.v1.structured_output",
        "import vllm.v1.sample.sampler",
        "import vllm.v1.attention.backends.flash_attn",
        "import vllm.v1.attention.backends.triton_attn",
        "import vllm.distributed.parallel_state",
        "import vllm.distributed.device_communicators.cuda_communicator",
        "import vllm.distributed.device_communicators.pynccl",
        "import vllm.distributed.device_communicators.custom_all_reduce",
        "import vllm.distributed.device_communicators.shm_broadcast",
        "import vllm.compilation.backends",
        "import vllm.compilation.decorators",
        "import vllm.model_executor.model_loader",
        "import vllm.model_executor.model_loader.dummy_loader",
        "import vllm.model_executor.models.registry",
        "import vllm.model_executor.models.llama",
        "import vllm.model_executor.models.qwen2",
        "import vllm.model_executor.models.qwen3_moe",
        "import vllm.model_executor.layers.fused_moe",
        "import vllm.model_executor.layers.fused_moe.fused_moe",
        "import vllm.lora.layers",
        "import vllm.lora.model_manager",
        "import vllm.lora.worker_manager",
        "import vllm.lora.punica_wrapper.punica_gpu",
        "import vllm.lora.ops.triton_ops",
        "import vllm.tokenizers",
        "import vllm.transformers_utils.config",
        "import vllm.usage.usage_lib",
    ]:
        imp(stmt)

# the OpenAI server path: python -m vllm.entrypoints.openai.api_server with the benchmark's flags
for stmt in [
    "import vllm.entrypoints.openai.api_server",
    "import vllm.entrypoints.openai.chat_completion.serving",
    "import vllm.entrypoints.openai.completion.serving",
    "import vllm.entrypoints.serve.instrumentator.metrics",
    "import vllm.entrypoints.serve.lora.api_router",
    "import vllm.tool_parsers.hermes_tool_parser",
    "import vllm.v1.structured_output.backend_xgrammar",
    "import vllm.v1.structured_output.backend_guidance",
    "import vllm.v1.structured_output.backend_outlines",
    "import vllm.v1.structured_output.backend_lm_format_enforcer",
    "import vllm.v1.metrics.prometheus",
]:
    imp(stmt)

SERVE_FLAGS = ["--model", "/nonexistent/model", "--load-format", "dummy", "--dtype", "bfloat16",
               "--enable-prefix-caching", "--enable-lora", "--max-lora-rank", "8",
               "--lora-modules", "bench=/nonexistent/lora", "--enable-auto-tool-choice",
               "--tool-call-parser", "hermes", "--enable-prompt-tokens-details",
               "--structured-outputs-config.backend", "xgrammar", "--max-model-len", "16384",
               "--gpu-memory-utilization", "0.85", "--port", "8011"]
env = {"SERVE_FLAGS": SERVE_FLAGS}
# 1. the command line parses, and the FastAPI app (all routes, /metrics) builds
imp("""import torch, vllm.platforms
if not torch.cuda.is_available():  # a machine without GPU (the build machine): let the defaults build
    vllm.platforms.current_platform.device_type = "cuda"
from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.openai.api_server import build_app
args = make_arg_parser(FlexibleArgumentParser()).parse_args(SERVE_FLAGS)
validate_parsed_serve_args(args)
app = build_app(args, supported_tasks=("generate",))
paths = {getattr(r, "path", "") for r in app.routes}
for p in ["/v1/chat/completions", "/v1/completions", "/v1/models", "/metrics", "/health"]:
    assert p in paths, p
print("      flags parse; app routes:", len(paths), "| structured outputs backend:", args.structured_outputs_config.backend)
""", env, label="api_server: the benchmark's flags parse, the FastAPI app builds")

# 1b. uvicorn serves that app as vLLM's launcher configures it (uvloop, httptools, h11 limits):
#     /openapi.json renders every request/response model's schema (pydantic), /metrics answers
imp("""import asyncio, socket, threading, time, httpx, uvicorn
import vllm.envs as envs
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); sock.listen(); port = sock.getsockname()[1]
config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level=args.uvicorn_log_level,
    access_log=not args.disable_uvicorn_access_log, timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
    ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
    ssl_cert_reqs=args.ssl_cert_reqs, ssl_ciphers=args.ssl_ciphers)
config.h11_max_incomplete_event_size = 4 * 1024 * 1024; config.h11_max_header_count = 256
config.load()
app.state.log_stats = False  # init_app_state would set it, with the engine
server = uvicorn.Server(config)
th = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True); th.start()
for _ in range(100):
    if server.started: break
    time.sleep(0.1)
assert server.started, "uvicorn did not start"
try:
    spec = httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=60)
    assert spec.status_code == 200, spec.text[:300]
    assert "/v1/chat/completions" in spec.json()["paths"]
    m = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
    assert m.status_code == 200 and "python_info" in m.text or "process_" in m.text, m.text[:300]
    print("      uvicorn", uvicorn.__version__, "http", config.http_protocol_class.__name__, "| /openapi.json", len(spec.json()["paths"]), "paths | /metrics", m.status_code)
finally:
    server.should_exit = True; th.join(10)
""", env, label="uvicorn serves the app as vLLM configures it: /openapi.json, /metrics")

# 2. a chat request with 3 tools and a named tool_choice -> hermes parser -> guided JSON ->
#    compiled by xgrammar and by llguidance against a byte-level BPE tokenizer built here
imp("""import json, torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import PreTrainedTokenizerFast
from types import SimpleNamespace
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers import ToolParserManager
tk = Tokenizer(models.BPE())
tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False); tk.decoder = decoders.ByteLevel()
tk.train_from_iterator(['{"city": "Paris", "unit": "celsius"} <tool_call> </tool_call> weather search'] * 50,
    trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>")
fn = lambda name, props, req: {"type": "function", "function": {"name": name, "parameters":
     {"type": "object", "properties": props, "required": req}}}
tools = [fn("get_weather", {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city", "unit"]),
         fn("search", {"query": {"type": "string"}, "top_k": {"type": "integer"}}, ["query"]),
         fn("finish", {"answer": {"type": "string"}}, ["answer"])]
req = ChatCompletionRequest.model_validate({"model": "bench", "messages": [{"role": "user", "content": "hi"}],
    "tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "logprobs": True, "top_logprobs": 2, "max_tokens": 64})
parser = ToolParserManager.get_tool_parser("hermes")(tok)
req = parser.adjust_request(req)
sp = req.to_sampling_params(64, {})
schema = sp.structured_outputs.json
assert isinstance(schema, (dict, str)) and "city" in json.dumps(schema), schema
assert sp.logprobs == 2, sp.logprobs
from vllm.v1.structured_output.backend_types import StructuredOutputOptions
from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend, validate_xgrammar_grammar
from vllm.v1.structured_output.backend_guidance import GuidanceBackend, validate_guidance_grammar
validate_xgrammar_grammar(sp)
cfg = SimpleNamespace(structured_outputs_config=SimpleNamespace(disable_any_whitespace=False,
      disable_additional_properties=False), speculative_config=None)
good = tok.encode('{"city": "Paris", "unit": "celsius"}', add_special_tokens=False) + [tok.eos_token_id]
bad = tok.encode('{"town": "Paris"}', add_special_tokens=False)
spec = json.dumps(schema) if not isinstance(schema, str) else schema
for B in (XgrammarBackend, GuidanceBackend):
    be = B(vllm_config=cfg, tokenizer=tok, vocab_size=len(tok))
    g = be.compile_grammar(StructuredOutputOptions.JSON, spec)
    bm = be.allocate_token_bitmask(1)
    g.fill_bitmask(bm, 0)
    logits = torch.zeros(1, len(tok))
    import xgrammar as xgr; xgr.apply_token_bitmask_inplace(logits, bm.to(logits.device))
    assert torch.isinf(logits).any() and not torch.isinf(logits[0, good[0]]), "mask"
    assert g.accept_tokens("r", good) and g.is_terminated(), f"{B.__name__}: valid JSON refused"
    g2 = be.compile_grammar(StructuredOutputOptions.JSON, spec)
    assert not g2.accept_tokens("r", bad), f"{B.__name__}: schema not enforced"
    print(f"      {B.__name__}: named tool_choice schema compiled; valid arguments accepted, wrong ones refused")
out = parser.extract_tool_calls('<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>', req)
assert out.tools_called and out.tool_calls[0].function.name == "search", out
print("      hermes parser: extracted", out.tool_calls[0].function.name, out.tool_calls[0].function.arguments)
from vllm.entrypoints.openai.chat_completion.protocol import (ChatCompletionResponse,
    ChatCompletionResponseChoice, ChatCompletionLogProbs, ChatCompletionLogProbsContent, ChatCompletionLogProb)
from vllm.entrypoints.openai.chat_completion.protocol import ChatMessage
from vllm.entrypoints.openai.engine.protocol import ToolCall, FunctionCall, UsageInfo, PromptTokenUsageInfo
msg = ChatMessage(role="assistant", content="", tool_calls=[ToolCall(function=FunctionCall(name="get_weather",
      arguments='{"city": "Paris", "unit": "celsius"}'))])
lp = ChatCompletionLogProbs(content=[ChatCompletionLogProbsContent(token="{", logprob=-0.1, bytes=[123],
      top_logprobs=[ChatCompletionLogProb(token="{", logprob=-0.1, bytes=[123])])])
resp = ChatCompletionResponse(model="bench", choices=[ChatCompletionResponseChoice(index=0, message=msg,
      logprobs=lp, finish_reason="tool_calls")], usage=UsageInfo(prompt_tokens=150, completion_tokens=12,
      total_tokens=162, prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=128)))
from openai.types.chat import ChatCompletion
c = ChatCompletion.model_validate_json(resp.model_dump_json())
assert c.choices[0].message.tool_calls[0].function.name == "get_weather"
assert c.usage.prompt_tokens_details.cached_tokens == 128 and c.choices[0].logprobs.content[0].logprob == -0.1
print("      response (tool call, logprobs, cached_tokens) round-trips through the openai SDK's ChatCompletion")
""", label="named tool_choice -> hermes -> guided JSON through xgrammar and llguidance")

try:
    print("vllm dist version:", md.version("vllm"))
except Exception as e:  # noqa: BLE001
    print("vllm dist metadata: FAIL", e); failures.append("metadata")

if failures:
    print(f"\nCHECK FAILED: {len(failures)} failure(s):", *failures, sep="\n  ")
    sys.exit(1)
print("\nCHECK OK")
