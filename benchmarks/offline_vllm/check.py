"""Import check of vLLM 0.20.1 as install.sh installs it (PYTHONPATH=$VLIBS:$PYLIBS).
Prints OK/FAIL per import; exits 1 on any failure. Needs no GPU (only imports)."""
import importlib.metadata as md, os, sys, time, traceback

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
failures = []

def imp(stmt):
    t = time.time()
    try:
        exec(stmt, {})
        print(f"OK    {stmt}  ({time.time() - t:.1f}s)", flush=True)
    except BaseException as e:  # noqa: BLE001
        failures.append(stmt)
        print(f"FAIL  {stmt}\n      {type(e).__name__}: {e}", flush=True)
        tb = traceback.format_exc().strip().splitlines()
        print("      " + "\n      ".join(tb[-6:]), flush=True)

print("python", sys.version.split()[0], sys.executable)
imp("import torch; print('      torch', torch.__version__, 'cuda', torch.version.cuda)")
imp("import vllm, os; print('      vllm', vllm.__version__, 'from', os.path.dirname(vllm.__file__))")

# carried third-party deps (what vLLM needs that the machine lacks)
for m in ["cachetools", "cbor2", "msgspec", "zmq", "pybase64", "partial_json_parser",
          "openai_harmony", "blake3", "setproctitle", "depyf", "compressed_tensors",
          "outlines_core", "lmformatenforcer", "diskcache", "lark", "mistral_common",
          "watchfiles", "ijson", "pythonjsonlogger", "prometheus_fastapi_instrumentator",
          "loguru", "astor", "dill", "interegular", "jsonschema", "pydantic_extra_types"]:
    imp(f"import {m}")
# tempering's dependencies, and the machine's own
for m in ["pydantic", "fastapi", "starlette", "openai", "gguf", "transformers", "triton",
          "numba", "cloudpickle", "cpuinfo", "psutil", "prometheus_client", "uvloop"]:
    imp(f"import {m}")

# native extensions (CUDA 13 / torch 2.11 ABI)
imp("import vllm._C")
imp("import vllm._moe_C")
imp("import vllm._C_stable_libtorch")
imp("import vllm.cumem_allocator")
imp("from vllm.vllm_flash_attn.flash_attn_interface import FA3_AVAILABLE, FA3_UNAVAILABLE_REASON, FA2_AVAILABLE; "
    "print('      FA3_AVAILABLE', FA3_AVAILABLE, FA3_UNAVAILABLE_REASON or '', '| FA2_AVAILABLE', FA2_AVAILABLE, '(FA2 removed on purpose)'); "
    "assert FA3_AVAILABLE, FA3_UNAVAILABLE_REASON")

# the LLM path: LLM(model, load_format='dummy', enable_lora=True, tensor_parallel_size=4) + generate
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
    "import vllm.v1.structured_output.backend_xgrammar",
    "import vllm.v1.structured_output.backend_guidance",
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

try:
    print("vllm dist version:", md.version("vllm"))
except Exception as e:  # noqa: BLE001
    print("vllm dist metadata: FAIL", e); failures.append("metadata")

if failures:
    print(f"\nCHECK FAILED: {len(failures)} failure(s):", *failures, sep="\n  ")
    sys.exit(1)
print("\nCHECK OK")
