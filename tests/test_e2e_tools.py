"""Tools and structured output end to end on the default model (issue 6).

SmolLM2-135M is far too small to call tools reliably on its own: these tests show what the grammar
guarantees whatever the model does (a well-formed call with every required argument typed right, JSON that
validates), plus the parser/renderer round trip through the HTTP layer.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
import trio

from tests.server_process import ServerProcess

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather and a forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "city name"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "metric": {"type": "boolean"}},
        "required": ["city", "days"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search_files", "description": "Search the project for a pattern",
    "parameters": {"type": "object", "properties": {
        "pattern": {"type": "string"}, "max_results": {"type": "integer"},
        "paths": {"type": "array", "items": {"type": "string"}}},
        "required": ["pattern"]}}}
TOOLS = [WEATHER, SEARCH]
PROMPTS = ["What's the weather in Paris for the next 3 days?", "Find every TODO in the code base.",
           "Is it going to rain in Oslo this week?", "Look for files that mention 'tokenizer'."]


def chat(server: ServerProcess, **body: object) -> dict:
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def check_call(call: dict) -> None:
    specs = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert call["type"] == "function" and call["id"].startswith("call_")
    name = call["function"]["name"]
    assert name in specs
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, specs[name])  # required keys present, every type right


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_required_returns_one_well_formed_call(smollm_server: ServerProcess, prompt: str, seed: int) -> None:
    body = chat(smollm_server, messages=[{"role": "user", "content": prompt}], tools=TOOLS, tool_choice="required",
                temperature=0.7, seed=seed, max_tokens=256)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    check_call(call)


def test_streamed_call_deltas_concatenate_to_the_call(smollm_server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "tools": TOOLS, "tool_choice": "required",
            "temperature": 0, "max_tokens": 160}
    plain = chat(smollm_server, **body)["choices"][0]["message"]["tool_calls"][0]
    opened, args, content = None, "", ""
    with httpx.stream("POST", smollm_server.base_url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=300) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    for e in events:
        delta = e["choices"][0]["delta"] if e["choices"] else {}
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert opened is None and call["type"] == "function" and call["function"]["arguments"] == ""
                opened = call
            else:
                args += call["function"]["arguments"]
    assert "<tool_call>" not in content and "<function" not in content
    assert opened["function"]["name"] == plain["function"]["name"]
    assert args == plain["function"]["arguments"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_named_function_is_compelled_with_the_grammar_on(default_model_path, tmp_path) -> None:
    server = ServerProcess(["--model", f"{default_model_path}:smol"], env={"PANTHEON_TOOL_GRAMMAR": "1"},
                           log_path=tmp_path / "serve.log").start()
    try:
        body = chat(server, messages=[{"role": "user", "content": "Hello!"}], tools=TOOLS,
                    tool_choice={"type": "function", "function": {"name": "search_files"}}, temperature=0,
                    max_tokens=160)
        (call,) = body["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "search_files"
        check_call(call)
        models = httpx.get(server.base_url + "/v1/models").json()["data"]
        assert models[0]["tool_choice_required_with_thinking"] is True
    finally:
        server.stop()


def test_grammar_off_reports_it_on_models(default_model_path, tmp_path) -> None:
    server = ServerProcess(["--model", f"{default_model_path}:smol"], env={"PANTHEON_TOOL_GRAMMAR": "0"},
                           log_path=tmp_path / "serve.log").start()
    try:
        models = httpx.get(server.base_url + "/v1/models").json()["data"]
        assert models[0]["tool_choice_required_with_thinking"] is False
    finally:
        server.stop()


def test_replayed_calls_and_results_render_and_continue(smollm_server: ServerProcess) -> None:
    messages = [
        {"role": "user", "content": PROMPTS[0]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": "{\"city\": \"Paris\", \"days\": 3}"}},
            {"id": "call_2", "type": "function", "function": {"name": "search_files",
                                                              "arguments": "not json {"}}]},  # replayed as is
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "no results"},
    ]
    body = chat(smollm_server, messages=messages, tools=TOOLS, temperature=0, max_tokens=24)
    assert body["choices"][0]["finish_reason"] in {"stop", "length", "tool_calls"}


def test_tool_choice_none_ignores_tools(smollm_server: ServerProcess) -> None:
    with_none = chat(smollm_server, messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice="none",
                     temperature=0, max_tokens=12)
    without = chat(smollm_server, messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=12)
    assert with_none["choices"][0]["message"] == without["choices"][0]["message"]
    assert with_none["usage"]["prompt_tokens"] == without["usage"]["prompt_tokens"]


@pytest.mark.parametrize("bad", [[{"type": "function"}], [{"type": "function", "function": {"name": 3}}], "x"])
def test_malformed_tools_are_400(smollm_server: ServerProcess, bad: object) -> None:
    r = httpx.post(smollm_server.base_url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "tools": bad})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_output_validates(smollm_server: ServerProcess, seed: int) -> None:
    body = chat(smollm_server, messages=[{"role": "user", "content": "Describe a fictional person."}],
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
                temperature=0.9, seed=seed, max_tokens=200)
    assert body["response_format_status"] == "applied", body
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), PERSON)


def test_json_object_and_statuses(smollm_server: ServerProcess) -> None:
    msgs = [{"role": "user", "content": "Give me some data."}]
    body = chat(smollm_server, messages=msgs, response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    assert body["response_format_status"] == "applied"
    assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)
    # Three tokens cannot hold a person with a name and an age: the constraint could not close the object.
    short = chat(smollm_server, messages=msgs, temperature=0, max_tokens=3,
                 response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert short["response_format_status"] == "not_enforced"
    assert short["choices"][0]["finish_reason"] == "length"
    other = chat(smollm_server, messages=msgs, response_format={"type": "yaml"}, temperature=0, max_tokens=3)
    assert other["response_format_status"] == "ignored_unknown_type"
    tools = chat(smollm_server, messages=msgs, response_format={"type": "json_object"}, tools=TOOLS,
                 temperature=0, max_tokens=3)
    assert tools["response_format_status"] == "ignored_tools_present"


def test_malformed_schema_is_400(smollm_server: ServerProcess) -> None:
    r = httpx.post(smollm_server.base_url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert r.status_code == 400 and "schema" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def eight_slot_server(default_model_path, tmp_path_factory):
    server = ServerProcess(["--model", f"{default_model_path}:smol", "--max-concurrent", "8"],
                           log_path=tmp_path_factory.mktemp("eight") / "serve.log").start()
    yield server
    server.stop()


async def test_constraint_holds_for_8_concurrent_streams(eight_slot_server: ServerProcess) -> None:
    results: list[dict] = []

    async def one(i: int) -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            r = await client.post(eight_slot_server.base_url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "tools": TOOLS,
                "tool_choice": "required", "temperature": 0.7, "seed": i, "max_tokens": 96, "stream": True})
            assert r.status_code == 200, r.text
            # Every stream is constrained on its own: reassemble each one's call from its deltas.
            calls: dict[int, dict] = {}
            for line in r.text.splitlines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    for piece in choice["delta"].get("tool_calls", []):
                        call = calls.setdefault(piece["index"], {"type": "function", "function": {"arguments": ""}})
                        if "id" in piece:
                            call["id"], call["function"]["name"] = piece["id"], piece["function"]["name"]
                        call["function"]["arguments"] += piece["function"]["arguments"]
            results.append({"choices": [{"message": {"tool_calls": list(calls.values())}}]})

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(one, i)
    assert len(results) == 8
    for body in results:
        (call,) = body["choices"][0]["message"]["tool_calls"]
        check_call(call)
