"""Rollouts traced in Langfuse (to a local OTLP collector) and Weave (to the SDK's trace-server seam)."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import json
import sys
import threading

import pytest

import tempering as art
from tempering.integrations.tracing import trace_rollout


def run(served, coro):
    return served[2].run_until_complete(coro)


async def qa(model, question: str, *, fail: bool = False) -> art.Trajectory:
    """A hand-built rollout (no capture scope): one plain and one streamed call through the model's client."""
    client = model.openai_client()
    traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": question}])
    reply = await client.chat.completions.create(model=model.name, messages=traj.messages(), max_tokens=4, seed=1)
    traj.messages_and_choices += [reply.choices[0], {"role": "user", "content": "And?"}]
    async for _ in await client.chat.completions.create(model=model.name, messages=traj.messages(), max_tokens=4, stream=True):
        pass
    if fail:
        raise RuntimeError("the judge is down")
    traj.reward = 0.25
    return traj


class Collector:
    """A local Langfuse endpoint: OTLP/HTTP spans (protobuf) and the score API, kept in memory."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans, self.scores = [], []
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path.endswith("/otel/v1/traces"):
                    request = ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    collector.spans += [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]
                elif self.path.endswith("/scores"):
                    collector.scores += json.loads(body)
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @staticmethod
    def attributes(span) -> dict:
        return {a.key: a.value.string_value or a.value.int_value or a.value.double_value for a in span.attributes}


@pytest.fixture
def langfuse_client():
    pytest.importorskip("langfuse")
    from langfuse import Langfuse
    from langfuse._client.resource_manager import LangfuseResourceManager

    collector = Collector()
    client = Langfuse(public_key="pk-lf-local", secret_key="sk-lf-local", base_url=collector.url)
    yield client, collector
    client.shutdown()
    LangfuseResourceManager.reset()  # no Langfuse client is left for the tests after this one
    collector.server.shutdown()


def test_langfuse_gets_the_rollout_as_a_span_with_each_chat_completion_as_a_generation_and_the_reward_as_a_score(
        served, langfuse_client):
    model, _, _ = served
    client, collector = langfuse_client
    traj = run(served, trace_rollout(qa)(model, "Name a colour."))
    with pytest.raises(RuntimeError, match="judge"):
        run(served, trace_rollout(name="qa-failing")(qa)(model, "Name a fruit.", fail=True))
    client.flush()

    [root] = [s for s in collector.spans if s.name == "qa"]
    [failed] = [s for s in collector.spans if s.name == "qa-failing"]
    generations = [s for s in collector.spans if s.name == "chat.completions" and s.parent_span_id == root.span_id]
    attrs = collector.attributes(root)
    assert json.loads(attrs["langfuse.observation.input"]) == {"model": {"model": model.name, "project": "tests"},
                                                               "question": "Name a colour."}
    assert model.inference_api_key not in attrs["langfuse.observation.input"]
    assert json.loads(attrs["langfuse.observation.output"])["reward"] == 0.25
    assert len(generations) == 2 and all(g.start_time_unix_nano < g.end_time_unix_nano for g in generations)
    first, second = sorted(generations, key=lambda g: g.start_time_unix_nano)
    first_attrs, second_attrs = collector.attributes(first), collector.attributes(second)
    assert first_attrs["langfuse.observation.type"] == "generation" and first_attrs["langfuse.observation.model.name"] == model.name
    assert json.loads(first_attrs["langfuse.observation.input"]) == [{"role": "user", "content": "Name a colour."}]
    assert json.loads(first_attrs["langfuse.observation.output"])["content"] == traj.messages()[1]["content"]
    usage = json.loads(second_attrs["langfuse.observation.usage_details"])  # the streamed one: counted from its token ids
    assert usage["input"] > 0 and 0 < usage["output"] <= 4
    assert collector.attributes(failed)["langfuse.observation.level"] == "ERROR"
    [score] = collector.scores
    assert score["name"] == "reward" and score["value"] == 0.25 and score["traceId"] == root.trace_id.hex()


class MemoryTraceServer:
    """The Weave client's exporter seam (its trace-server interface), keeping calls in memory."""

    def __init__(self) -> None:
        self.starts, self.ends = [], []

    def get_call_processor(self):
        return None  # no batching: each call goes to call_start / call_end

    def get_feedback_processor(self):
        return None

    def _digest(self, request) -> str:
        return hashlib.sha256(repr(request).encode()).hexdigest()[:32]

    def obj_create(self, request):
        from weave.vendor.weave_server_sdk.types.object_create_response import ObjectCreateResponse

        return ObjectCreateResponse(digest=self._digest(request))

    def file_create(self, request):
        from weave.vendor.weave_server_sdk.types.file_create_response import FileCreateResponse

        return FileCreateResponse(digest=self._digest(request))

    def call_start(self, request):
        from weave.vendor.weave_server_sdk.types.call_start_response import CallStartResponse

        self.starts.append(request["start"])
        return CallStartResponse(id=request["start"]["id"], trace_id=request["start"]["trace_id"])

    def call_end(self, request):
        self.ends.append(request["end"])
        return {}


@pytest.fixture
def weave_server():
    pytest.importorskip("weave")
    from weave.trace.context import weave_client_context
    from weave.trace.weave_client import WeaveClient

    server = MemoryTraceServer()
    client = WeaveClient("tempering", "tests", server=server, ensure_project_exists=False)
    weave_client_context.set_weave_client_global(client)  # what weave.init does once it reached W&B
    yield client, server
    weave_client_context.set_weave_client_global(None)


def test_weave_gets_the_rollout_as_an_op_call_with_its_trajectory_and_errors(served, weave_server):
    model, _, _ = served
    client, server = weave_server
    traced = trace_rollout(qa, backends=["weave"])
    traj = run(served, traced(model, "Name a colour."))
    with pytest.raises(RuntimeError, match="judge"):
        run(served, traced(model, "Name a fruit.", fail=True))
    client.flush()

    assert [s["op_name"].split("/op/")[1].split(":")[0] for s in server.starts] == ["qa", "qa"]
    assert server.starts[0]["inputs"]["model"] == {"model": model.name, "project": "tests"}
    assert server.starts[0]["inputs"]["question"] == "Name a colour."
    ok, failed = server.ends
    assert ok["output"]["reward"] == 0.25 and ok["exception"] is None
    assert [m["role"] for m in ok["output"]["messages"]] == [m["role"] for m in traj.messages()]
    assert "judge is down" in failed["exception"]


def test_without_an_sdk_set_up_a_rollout_runs_untraced_and_named_backends_are_checked(served, monkeypatch):
    model, _, _ = served
    assert run(served, trace_rollout(qa, backends=())(model, "Hi")).reward == 0.25
    with pytest.raises(art.ConfigError, match="unknown tracing backends"):
        trace_rollout(qa, backends=["wandb"])
    if "weave" in sys.modules:
        with pytest.raises(art.ConfigError, match=r"weave.init"):
            run(served, trace_rollout(qa, backends=["weave"])(model, "Hi"))
    monkeypatch.setitem(sys.modules, "weave", None)  # as if not installed
    with pytest.raises(art.MissingDependencyError, match=r'pip install "tempering\[weave\]"'):
        run(served, trace_rollout(qa, backends=["weave"])(model, "Hi"))
    assert run(served, trace_rollout(qa)(model, "Hi")).reward == 0.25  # detection: weave is not there
