"""MCP•RL on a real MCP server (tests/integrations/mcp_unit_server.py, over stdio and streamable HTTP)
and the real default model: listing, scenario generation through the schema, rollouts whose tool
calls reach the server, bad input (a server that dies, arguments it rejects), RULER and a training step.
"""

from __future__ import annotations

import asyncio
import math
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp")

import tempering as art
import tempering.mcp as tm
from tempering.integrations.mcp.rollout import _call
from tempering.rewards import ruler_score_group

SERVER = [sys.executable, str(Path(__file__).with_name("mcp_unit_server.py"))]
SAFE_SERVER = [*SERVER, "--no-hazards"]  # no shutdown/wait: for rollouts where the model picks the tool
PROBE = [{"role": "user", "content": "How many meters are in a kilometer?"}]


@pytest.fixture(scope="module")
def model(served):
    """The shared default model (tests/integrations/conftest.py): policy, scenario generator and judge."""
    return served[0]


@pytest.fixture(scope="module")
def loop(served):
    return served[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_importing_tempering_leaves_mcp_alone_and_a_missing_sdk_names_the_extra():
    code = """
import sys
import tempering
assert "mcp" not in sys.modules, "import tempering imported the MCP SDK"
# nor torch's compiler stack (PyTorch's varlen_attn imports it, ~2 s of a process's start on a CPU), nor the
# HTTP stack, which only a serving process needs (not a worker rank, not a RemoteBackend's client)
assert "torch._dynamo" not in sys.modules, "import tempering imported torch._dynamo"
assert "fastapi" not in sys.modules, "import tempering imported FastAPI"
sys.modules["mcp"] = None  # as if the SDK were not installed
try:
    import tempering.mcp
except ImportError as error:
    from tempering.errors import MissingDependencyError
    assert isinstance(error, MissingDependencyError), type(error)
    print(error)
else:
    raise SystemExit("tempering.mcp imported without the SDK")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert 'pip install "tempering[mcp]"' in done.stdout


def test_the_types_have_arts_shapes_and_check_their_values():
    tool = tm.MCPTool.from_dict({"name": "convert", "description": "d", "input_schema": {"type": "object"}})
    assert tool.to_tool_schema() == {"type": "function", "function": {"name": "convert", "description": "d",
                                                                      "parameters": {"type": "object"}}}
    assert tm.complete_task_tool.parameters["required"] == ["summary"]
    assert tm.MCPResource.from_dict({"uri": "a://b", "name": "b", "mimeType": "text/plain"}).to_dict()["mimeType"] == "text/plain"
    with pytest.raises(ValueError, match="difficulty"):
        tm.GeneratedScenario("task", 6)
    with pytest.raises(ValueError, match="non-empty"):
        tm.GeneratedScenario("  ", 1)
    scenarios = tm.GeneratedScenarioCollection([tm.GeneratedScenario(f"task {i}", i % 5 + 1) for i in range(5)])
    train, val = scenarios.shuffle(seed=0).split(3)
    assert len(train) == 3 and len(val) == 2 and {s.task for s in [*train, *val]} == {s.task for s in scenarios}
    assert tm.GeneratedScenarioCollection.from_json(scenarios.to_json()).to_dicts() == scenarios.to_dicts()
    with pytest.raises(ValueError, match="train_size"):
        scenarios.split(6)


def test_a_stdio_server_lists_and_serves_and_rejected_arguments_come_back_as_tool_errors(loop):
    async def main():
        async with tm.connect(SERVER) as server:
            tools = {t.name: t for t in await server.list_tools()}
            assert {"convert", "list_units", "get_conversion", "shutdown"} <= set(tools)
            assert tools["convert"].parameters["required"] == ["value", "from_unit", "to_unit"]
            [table] = await server.list_resources()
            assert table.uri == "units://table" and "km: length" in await server.read_resource(table.uri)
            ok = await server.call_tool("convert", {"value": 3, "from_unit": "km", "to_unit": "m"})
            assert ok == tm.ToolResult("3 km = 3000 m", False)
            bad = await server.call_tool("convert", {"value": "three", "from_unit": "km"})  # not the schema
            assert bad.is_error and "value" in bad.text and "to_unit" in bad.text
            rejected = await server.call_tool("convert", {"value": 1, "from_unit": "kg", "to_unit": "m"})
            assert rejected.is_error and "cannot convert mass" in rejected.text
            assert (await server.call_tool("no_such_tool", {})).is_error
            not_json = await _call(server, "convert", '{"value": 3,')
            assert not_json.is_error and "not valid JSON" in not_json.text
            assert (await _call(server, "convert", "[1, 2]")).text == "Error: the arguments must be a JSON object."
            # after all that, the server still answers
            assert (await server.call_tool("list_units", {"kind": "mass"})).text == "g, kg, lb, oz"
            assert server.is_alive

    loop.run_until_complete(main())


def test_a_call_past_timeout_s_raises_and_the_connection_serves_on(loop):
    async def main():
        async with tm.connect(SERVER, timeout_s=1.0) as server:
            with pytest.raises(tm.MCPConnectionError, match="did not answer the call of tool 'wait' within 1.0 s"):
                await server.call_tool("wait", {"seconds": 3})
            return await server.call_tool("wait", {"seconds": 0})

    assert loop.run_until_complete(main()) == tm.ToolResult("waited 0 s", False)


def test_a_server_that_cannot_start_is_reported_with_the_end_of_its_stderr(loop):
    broken = [sys.executable, "-c", "import sys; print('bad config: no API key', file=sys.stderr); sys.exit(2)"]

    async def main():
        async with tm.connect(broken):
            pass

    with pytest.raises(tm.MCPConnectionError, match="could not connect") as error:
        loop.run_until_complete(main())
    assert "bad config: no API key" in str(error.value) and isinstance(error.value, ConnectionError)


def test_a_streamable_http_server_serves_and_its_death_fails_calls_at_once(loop):
    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    proc = subprocess.Popen([*SERVER, "http", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def main():
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        async with tm.connect(url) as server:
            assert "convert" in {t.name for t in await server.list_tools()}
            assert (await server.call_tool("convert", {"value": 1, "from_unit": "mi", "to_unit": "km"})).text == "1 mi = 1.60934 km"
            proc.kill()
            proc.wait()
            start = time.monotonic()
            with pytest.raises(tm.MCPConnectionError, match="closed the connection") as error:
                await server.call_tool("list_units", {"kind": "mass"})
            assert url in str(error.value) and time.monotonic() - start < 10
            assert not server.is_alive
        with pytest.raises(tm.MCPConnectionError, match="could not connect"):
            async with tm.connect(url):
                pass

    try:
        loop.run_until_complete(main())
    finally:
        proc.kill()


def test_arts_generate_scenarios_call_with_the_served_model_finishes_and_a_timeout_names_the_fix(loop, model):
    """The call as ART's docs write it, with ART's defaults (no max_tokens, no task bound): with the
    default model as the generator it once ran 13 minutes on the 2-core CPU and then failed."""
    from openai import AsyncOpenAI

    from tempering.errors import RequestTimeout
    from tempering.integrations.mcp.scenarios import TEMPERING_TASK_CHARS

    async def main():
        async with tm.connect(SERVER) as server:
            tools = [t for t in await server.list_tools() if t.name in ("convert", "list_units")]
            resources = await server.list_resources()
            scenarios = await tm.generate_scenarios(
                tools, resources, num_scenarios=2, show_preview=False, generator_model=model.get_inference_name(),
                generator_api_key=model.inference_api_key, generator_base_url=model.inference_base_url)
            impatient = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key, timeout=0.05)
            with pytest.raises(RequestTimeout) as error:
                await tm.generate_scenarios(tools, resources, num_scenarios=2, show_preview=False,
                                            generator_model=model.get_inference_name(), generator_client=impatient)
            return scenarios, str(error.value)

    scenarios, message = loop.run_until_complete(main())
    assert len(scenarios) == 2
    assert all(isinstance(s.difficulty, int) and 1 <= s.difficulty <= 5 and 0 < len(s.task) <= TEMPERING_TASK_CHARS
               for s in scenarios)
    assert message.startswith(f"generate_scenarios: request 1 of at most 3 to {model.get_inference_name()!r} at "
                              f"{model.inference_base_url}")
    assert re.search(r"got no answer in [\d.]+ s \(the client's timeout: 0.05 s\); pass a smaller max_tokens or "
                     r"max_task_chars", message)


def test_a_server_that_dies_mid_rollout_fails_the_rollout_clearly_and_gather_counts_it(loop, model):
    shutdown = {"type": "function", "function": {"name": "shutdown"}}

    async def main():
        async with tm.connect(SERVER) as server:
            groups = await art.gather_trajectory_groups(
                [art.TrajectoryGroup(tm.rollout(model, "Stop the server.", server, tool_choice=shutdown, max_tokens=16)
                                     for _ in range(2))], pbar_desc=None, max_exceptions=2)
        async with tm.connect(SERVER) as server:
            with pytest.raises(tm.MCPConnectionError):  # past the budget, gather raises it
                await art.gather_trajectory_groups(
                    [art.TrajectoryGroup([tm.rollout(model, "Stop.", server, tool_choice=shutdown, max_tokens=16)])],
                    pbar_desc=None, max_exceptions=0)
        # the tempering server keeps serving: a fresh MCP server and rollout work
        async with tm.connect(SERVER) as server:
            traj = await tm.rollout(model, "List the mass units.", server, max_turns=1, max_tokens=24,
                                    tool_choice={"type": "function", "function": {"name": "list_units"}})
        return groups, traj

    [group], traj = loop.run_until_complete(main())
    assert len(group.trajectories) == 0 and len(group.exceptions) == 2
    for error in group.exceptions:
        assert error.type == "MCPConnectionError" and "closed the connection" in error.message
        assert "shutting down on request" in error.message  # the end of the server's stderr
    assert traj.metrics["num_tool_calls"] == 1 and traj.messages()[-1]["role"] == "tool"


def test_a_call_the_server_rejects_is_answered_with_an_error_or_fails_the_rollout_if_asked(loop, model):
    lookup = {"type": "function", "function": {"name": "get_conversion"}}  # ids are random: any guess is rejected

    async def main():
        async with tm.connect(SERVER) as server:
            answered = await tm.rollout(model, "Show conversion 1a2b3c4d.", server, tool_choice=lookup, max_turns=1,
                                        max_tokens=40)
            [group] = await art.gather_trajectory_groups(
                [art.TrajectoryGroup([tm.rollout(model, "Show conversion 1a2b3c4d.", server, tool_choice=lookup,
                                                 max_turns=1, max_tokens=40, raise_on_tool_error=True)])],
                pbar_desc=None, max_exceptions=1)
            still = await server.call_tool("convert", {"value": 2, "from_unit": "lb", "to_unit": "kg"})
            return answered, group, still

    answered, group, still = loop.run_until_complete(main())
    tool_message = answered.messages()[-1]
    assert tool_message["role"] == "tool" and "no saved conversion has id" in tool_message["content"]
    assert answered.metrics["num_tool_errors"] == 1 and answered.metrics["task_completed"] == 0
    [error] = group.exceptions
    assert error.type == "MCPToolError" and "get_conversion" in error.message and "no saved conversion" in error.message
    assert still == tm.ToolResult("2 lb = 0.907185 kg", False)


async def probe(model):
    completion = await model.openai_client().chat.completions.create(model=model.name, messages=PROBE, max_tokens=4,
                                                                     temperature=0)
    return list(completion.choices[0].sampled_logprobs)


def test_mcp_rl_trains_one_step_on_rollouts_through_the_server_scored_by_ruler(loop, model):
    scenarios = [tm.GeneratedScenario("How many meters are 3 km?", 1)]

    async def judge(group):  # a greedy 135M judge gives every trajectory 0.5; sampled, its scores differ
        return await ruler_score_group(group, model.name, client=model.openai_client(), max_tokens=200,
                                       max_explanation_chars=40, temperature=1.0)

    async def main():
        before = await probe(model)
        async with tm.connect(SAFE_SERVER) as server:
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(tm.rollout(model, s, server, max_turns=1, max_tokens=64, tool_choice="required")
                                     for _ in range(3)) for s in scenarios),
                pbar_desc=None, after_each=judge)
        step = await model.get_step()
        result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))
        return groups, result, before, await probe(model), step

    groups, result, before, after, step = loop.run_until_complete(main())
    assert result.step == step + 1 and len(groups) == 1
    for group in groups:
        assert len(group) == 3
        for t in group:
            assert 0.0 <= t.reward <= 1.0 and t.metrics["ruler_score"] == t.reward and t.metrics["independent_reward"] == 0
            assert t.tools[-1]["function"]["name"] == "complete_task"
            assert t.metadata["difficulty"] == 1
    num_with_spread = sum(len(set(g.rewards())) > 1 for g in groups)
    assert result.num_groups_trainable == num_with_spread
    moved = max(abs(a - b) for a, b in zip(before, after))
    assert (moved > 1e-4) == (num_with_spread > 0), (moved, num_with_spread)  # the policy changed iff it could learn
    assert all(math.isfinite(v) for v in result.metrics.values())
