"""Tools and structured output end to end on the default model (issue 6).

SmolLM2-135M is far too small to call tools reliably on its own: these tests show what the grammar
guarantees whatever the model does (a well-formed call with every required argument typed right, JSON that
validates), plus the parser/renderer round trip through the HTTP layer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

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


def check_call_or_cut(body: dict, max_tokens: int, name: str | None = None) -> bool:
    """A "required" turn gives one well-formed call (True), unless the model was still inside it when
    max_tokens ran out (a 135M model can ramble in a string argument): then the turn ends there with "length"
    and the unfinished call is reported in tool_call_error, not returned (False)."""
    choice = body["choices"][0]
    if choice["finish_reason"] == "length":
        assert body["usage"]["completion_tokens"] == max_tokens, body
        assert "tool_calls" not in choice["message"], choice
        assert name is None or choice["tool_call_error"].get("function") in (name, None), choice
        return False
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    check_call(call)
    assert name is None or call["function"]["name"] == name
    return True


@pytest.mark.parametrize("prompt", PROMPTS)
def test_required_returns_one_well_formed_call(smollm_server: ServerProcess, prompt: str) -> None:
    # The 135M model finishes its call within 256 tokens for 50-75% of the seeds, depending on the prompt (12
    # seeds each, measured): with 3 seeds, all three failing happened by chance after a change in the last bits
    # of the logits. With 8, that chance is under 0.4%.
    made = [check_call_or_cut(chat(smollm_server, messages=[{"role": "user", "content": prompt}], tools=TOOLS,
                                   tool_choice="required", temperature=0.7, seed=seed, max_tokens=256), 256)
            for seed in range(8)]
    assert any(made), made


def test_logprobs_of_a_constrained_call_are_numbers(smollm_server: ServerProcess) -> None:
    """Where the call's grammar allows fewer tokens than top_logprobs asks for (its opener: one), the other
    alternatives are masked tokens: each reported with logprob -9999, as OpenAI and vLLM do, not as null (the
    -inf that JSON cannot carry, which typed clients refuse)."""
    body = chat(smollm_server, messages=[{"role": "user", "content": PROMPTS[0]}], tools=TOOLS, tool_choice="required",
                temperature=0, max_tokens=4, logprobs=True, top_logprobs=3)
    entries = body["choices"][0]["logprobs"]["content"]
    alternatives = [alt for entry in entries for alt in entry["top_logprobs"]]
    assert len(entries) == 4 and all(len(entry["top_logprobs"]) == 3 for entry in entries), entries
    assert all(isinstance(e["logprob"], float) and e["logprob"] <= 0.0 for e in entries + alternatives), entries
    assert -9999.0 in [alt["logprob"] for alt in alternatives], entries  # the opener's masked alternatives


@pytest.mark.parametrize("max_tokens", [1, 3, 10, 20])
def test_max_tokens_is_a_hard_cap_on_a_required_call(smollm_server: ServerProcess, max_tokens: int) -> None:
    """A constrained call cut short by max_tokens ends there with "length", as llama.cpp and vLLM do: the
    unfinished call is not returned as a call, and the stream never sent any of it (cut after the function
    name, or inside the arguments, alike)."""
    request = dict(messages=[{"role": "user", "content": PROMPTS[0]}], tools=TOOLS, tool_choice="required",
                   temperature=0, max_tokens=max_tokens)
    body = chat(smollm_server, **request)
    choice = body["choices"][0]
    assert body["usage"]["completion_tokens"] == max_tokens, body["usage"]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"], choice
    # Even cut inside the opener ("<tool"), what the grammar forced is a call, not answer text.
    assert not choice["message"]["content"] and choice["tool_call_error"]["code"] == "unfinished_tool_call", choice
    r = httpx.post(smollm_server.base_url + "/v1/chat/completions", json={**request, "stream": True}, timeout=300)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert not "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]), r.text
    assert not [c for c in chunks if c["choices"] and "tool_calls" in c["choices"][0]["delta"]], r.text
    assert chunks[-1]["choices"][0]["tool_call_error"]["code"] == "unfinished_tool_call", chunks[-1]


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
        # Greedy, this model loops inside `paths` until max_tokens; sampled, most seeds close the call.
        made = [check_call_or_cut(chat(server, messages=[{"role": "user", "content": "Hello!"}], tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "search_files"}},
                                       temperature=0.7, seed=seed, max_tokens=160), 160, "search_files")
                for seed in range(3)]
        assert any(made), made
        # Enforced, a choice must name an offered function.
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hello!"}], "tools": TOOLS, "max_tokens": 4,
            "tool_choice": {"type": "function", "function": {"name": "not_offered"}}})
        assert r.status_code == 400 and "not_offered" in r.json()["error"]["message"], r.text
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


@pytest.mark.parametrize("bad", [[{"type": "function"}], [{"type": "function", "function": {"name": 3}}], "x",
                                 [{"type": "function", "function": {"name": "a<b>c"}}],
                                 [{"type": "function", "function": {"name": "get weather"}}],
                                 [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]])
def test_malformed_tools_are_400(smollm_server: ServerProcess, bad: object) -> None:
    r = httpx.post(smollm_server.base_url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "tools": bad})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_required_call_with_an_invalid_parameter_schema_is_400(smollm_server: ServerProcess) -> None:
    """The schemas become the grammar of a "required" turn: one that is not a JSON schema is refused rather
    than decoded unconstrained. Without a grammar (tool_choice "auto", the default) it is only rendered."""
    weird = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "weird"}}}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": weird, "max_tokens": 4}
    url = smollm_server.base_url + "/v1/chat/completions"
    r = httpx.post(url, timeout=60, json={**body, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "'f'" in r.json()["error"]["message"] and "schema" in r.json()["error"]["message"]
    assert httpx.post(url, timeout=60, json=body).status_code == 200


@pytest.mark.parametrize("argument", [{"type": "integer", "minimum": 5, "maximum": 1}, {"enum": []}, {"not": {}},
                                      {"allOf": [{"type": "string"}, {"enum": []}]},
                                      {"type": "string", "minLength": 5, "maxLength": 2},
                                      {"type": "string", "pattern": "(?=a)b"}])
def test_a_required_call_whose_schema_cannot_be_enforced_is_400(smollm_server: ServerProcess, argument: dict) -> None:
    """A schema that passes the metaschema but that the grammar cannot enforce (no integer is both >= 5 and
    <= 1; an empty enum; not anything) is refused too, streamed or not, instead of a "required" turn decoded
    without its grammar, or with a call whose arguments its own schema refuses."""
    unsatisfiable = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": argument}, "required": ["x"]}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": unsatisfiable, "max_tokens": 4,
            "tool_choice": "required"}
    url = smollm_server.base_url + "/v1/chat/completions"
    for stream in (False, True):
        r = httpx.post(url, timeout=60, json={**body, "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert "cannot be enforced" in r.json()["error"]["message"]
    assert httpx.post(url, timeout=60, json={**body, "tool_choice": "auto"}).status_code == 200


def test_a_required_calls_string_arguments_meet_their_constraints(smollm_server: ServerProcess) -> None:
    """The default model's dialect (Qwen XML) writes a string argument as bare text: its maxLength, pattern and
    format hold that text, so the call's arguments validate against the tool's own schema (the 135M model, left
    free, wrote tags of its own in them: 36 characters against a maxLength of 3)."""
    schema = {"type": "object", "required": ["code", "pin", "day"], "properties": {
        "code": {"type": "string", "maxLength": 3}, "pin": {"type": "string", "pattern": "^[0-9]{4}$"},
        "day": {"type": "string", "format": "date"}}}
    tools = [{"type": "function", "function": {"name": "book", "parameters": schema}}]
    made = 0
    for seed in range(3):
        body = chat(smollm_server, messages=[{"role": "user", "content": "Book it."}], tools=tools,
                    tool_choice="required", temperature=0.7, seed=seed, max_tokens=96)
        if body["choices"][0]["finish_reason"] == "tool_calls":
            (call,) = body["choices"][0]["message"]["tool_calls"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), schema,
                                format_checker=jsonschema.FormatChecker())
            made += 1
    assert made, "no seed finished its call within 96 tokens"


@pytest.mark.parametrize("tools", [None, []])
def test_required_without_tools_is_400(smollm_server: ServerProcess, tools: list | None) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required", "max_tokens": 4}
    if tools is not None:
        body["tools"] = tools
    r = httpx.post(smollm_server.base_url + "/v1/chat/completions", timeout=60, json=body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_response_format_applies_when_tool_choice_none_turns_the_tools_off(smollm_server: ServerProcess) -> None:
    body = chat(smollm_server, messages=[{"role": "user", "content": "Give me some data."}], tools=TOOLS,
                tool_choice="none", response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    assert body["response_format_status"] == "applied", body
    assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}


def test_json_schema_output_validates(smollm_server: ServerProcess) -> None:
    """Sampled answers under a schema: each one the constraint closed validates against it. A sampled answer
    may also ramble inside a string until max_tokens (seed 1 of these once the activations' scales became
    float16, 2026-12-07): that one is reported not_enforced and cut on length, never returned as applied."""
    applied = 0
    for seed in range(6):
        body = chat(smollm_server, messages=[{"role": "user", "content": "Describe a fictional person."}],
                    response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
                    temperature=0.9, seed=seed, max_tokens=200)
        choice = body["choices"][0]
        if body["response_format_status"] == "applied":
            jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
            applied += 1
        else:
            assert body["response_format_status"] == "not_enforced" and choice["finish_reason"] == "length", body
    assert applied >= 4, f"only {applied} of 6 sampled answers closed the schema's object"


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


def test_a_stop_string_that_cuts_the_json_short_is_not_enforced(smollm_server: ServerProcess) -> None:
    """spec: "not_enforced" when the output did not close a complete JSON object. The grammar sees the closing
    brace and completes, but the stop string "}" takes it out of the content: the answer is not JSON."""
    body = {"messages": [{"role": "user", "content": 'Output exactly this JSON and nothing else: {"ok": true}'}],
            "response_format": {"type": "json_object"}, "temperature": 0, "max_tokens": 40}
    whole = chat(smollm_server, **body)
    assert whole["response_format_status"] == "applied"
    assert whole["choices"][0]["message"]["content"].rstrip().endswith("}")
    cut = chat(smollm_server, **body, stop=["}"])
    assert cut["choices"][0]["finish_reason"] == "stop"
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut["choices"][0]["message"]["content"])
    assert cut["response_format_status"] == "not_enforced"
    # A stop string past the closed object leaves it whole.
    after = chat(smollm_server, **body, stop=["}\n", "}}"])
    assert isinstance(json.loads(after["choices"][0]["message"]["content"]), dict)
    assert after["response_format_status"] == "applied"
    with httpx.stream("POST", smollm_server.base_url + "/v1/chat/completions",
                      json={**body, "stop": ["}"], "stream": True}, timeout=300) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [c["response_format_status"] for c in chunks if "response_format_status" in c] == ["not_enforced"]


@pytest.mark.parametrize("json_schema", [None, {"name": "x"}, {"name": "x", "schema": 5},
                                         {"name": "x", "schema": {"type": "nonsense"}}])
def test_a_schema_that_cannot_be_used_is_downgraded_to_json(smollm_server: ServerProcess,
                                                           json_schema: dict | None) -> None:
    """spec: json_schema gets the JSON constraint; a schema missing or not a JSON schema cannot shape it, so the
    answer is constrained to a JSON object alone ("schema_downgraded"), not refused."""
    response_format = {"type": "json_schema", **({} if json_schema is None else {"json_schema": json_schema})}
    body = chat(smollm_server, messages=[{"role": "user", "content": "Give me some data."}],
                response_format=response_format, temperature=0, max_tokens=200)
    assert body["response_format_status"] == "schema_downgraded", body
    assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)


def _nested(depth: int, leaf: object) -> object:
    """A JSON schema whose one property is an object whose one property ... (depth levels) ends in leaf."""
    node = leaf
    for _ in range(depth):
        node = {"type": "object", "properties": {"p": node}}
    return node


def test_json_nested_past_pythons_recursion_is_never_a_500(smollm_server: ServerProcess) -> None:
    """JSON the body parser takes (it stops at 1024 levels) can still nest deeper than the schema code recurses
    (RecursionError, once a 500): a response_format schema so deep is not usable (downgraded to the JSON
    constraint), a tool's parameters so deep are the request's error (400), and a replayed call's arguments so
    deep are kept as text, like any arguments that do not parse."""
    deep_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(100, {"type": "string"})}}
    body = chat(smollm_server, messages=[{"role": "user", "content": "Give me some data."}],
                response_format=deep_schema, temperature=0, max_tokens=200)
    assert body["response_format_status"] == "schema_downgraded", body
    assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)

    # Written out by hand: the json module here would meet its own recursion limit encoding the second.
    for parameters, choice in ((json.dumps(_nested(100, {"type": "string"})), "required"),
                               ('{"a":' * 500 + "1" + "}" * 500, "auto")):
        tool = '{"type": "function", "function": {"name": "f", "parameters": %s}}' % parameters
        r = httpx.post(smollm_server.base_url + "/v1/chat/completions", timeout=300,
                       content='{"messages": [{"role": "user", "content": "hi"}], "tools": [%s], "tool_choice": "%s", '
                               '"max_tokens": 4}' % (tool, choice))
        assert r.status_code == 400, (choice, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"

    replayed = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 1000 + "]" * 1000}}]}
    body = chat(smollm_server, messages=[{"role": "user", "content": "hi"}, replayed,
                                         {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
                temperature=0, max_tokens=4)
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("response_format, status", [({"type": "text"}, "applied"), ({}, "ignored_unknown_type")])
def test_a_text_or_typeless_response_format_reports_its_status(smollm_server: ServerProcess,
                                                               response_format: dict, status: str) -> None:
    # spec: response_format_status is there "when the request sent response_format".
    body = chat(smollm_server, messages=[{"role": "user", "content": "hi"}], response_format=response_format,
                temperature=0, max_tokens=4)
    assert body["response_format_status"] == status


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "not_offered"}},
                                         {"type": "function"}, {}])
def test_a_named_tool_choice_without_the_grammar_behaves_like_auto(smollm_server: ServerProcess,
                                                                   tool_choice: dict) -> None:
    """spec: a named tool_choice is enforced only under PANTHEON_TOOL_GRAMMAR=1, "otherwise it behaves like
    'auto'": whatever it names (or fails to), the turn is the auto turn's."""
    msgs = [{"role": "user", "content": "hi"}]
    auto = chat(smollm_server, messages=msgs, tools=TOOLS, temperature=0, max_tokens=8)
    named = chat(smollm_server, messages=msgs, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=8)
    assert named["choices"][0]["message"] == auto["choices"][0]["message"]
    assert named["usage"]["prompt_tokens"] == auto["usage"]["prompt_tokens"]


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
                "tool_choice": "required", "temperature": 0.7, "seed": i, "max_tokens": 200, "stream": True,
                "stream_options": {"include_usage": True}})
            assert r.status_code == 200, r.text
            # Every stream is constrained on its own: reassemble each one's call from its deltas.
            calls: dict[int, dict] = {}
            body: dict = {"choices": [{"message": {}}]}
            for line in r.text.splitlines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                body["usage"] = chunk.get("usage") or body.get("usage")
                for choice in chunk["choices"]:
                    for key in ("finish_reason", "tool_call_error"):
                        if choice.get(key):
                            body["choices"][0][key] = choice[key]
                    for piece in choice["delta"].get("tool_calls", []):
                        call = calls.setdefault(piece["index"], {"type": "function", "function": {"arguments": ""}})
                        if "id" in piece:
                            call["id"], call["function"]["name"] = piece["id"], piece["function"]["name"]
                        call["function"]["arguments"] += piece["function"]["arguments"]
            if body["choices"][0].get("finish_reason") == "tool_calls":
                body["choices"][0]["message"] = {"content": None, "tool_calls": list(calls.values())}
            results.append(body)

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(one, i)
    assert len(results) == 8
    made = [check_call_or_cut(body, 200) for body in results]
    # Every body was checked above: a well-formed call, or a turn cut inside one and reported. How many finish
    # is the model's luck (50-75% a seed, see test_required_returns_one_well_formed_call): at least 4 of 8 failed
    # by chance ~6% of the time; at least 2, ~0.2%.
    assert sum(made) >= 2, made


# --- MiniCPM's attribute dialect (a llama model whose template writes BOS) ---

ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def minicpm_server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The default model's weights under its template with a leading BOS: served in MiniCPM's dialect."""
    import gguf

    tmp = tmp_path_factory.mktemp("minicpm")
    field = gguf.GGUFReader(str(default_model_path)).fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode("utf-8")
    copy = tmp / "minicpm-like.gguf"
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--chat-template",
                    "{{ bos_token }}" + template, str(default_model_path), str(copy)], check=True,
                   capture_output=True)
    server = ServerProcess(["--model", f"{copy}:minicpm-like"], log_path=tmp / "serve.log").start()
    yield server
    server.stop()


@pytest.mark.parametrize("prompt", ["Say hi.", "Add 2 and 3."])
@pytest.mark.parametrize("stream", [False, True])
def test_a_minicpm_required_turn_makes_one_typed_call(minicpm_server: ServerProcess, prompt: str,
                                                     stream: bool) -> None:
    """No grammar models MiniCPM's free text, but a turn that must call gets one: its end token is refused
    until an offered function's call is complete (spec: "every dialect"), with typed arguments."""
    body = {"model": "minicpm-like", "messages": [{"role": "user", "content": prompt}], "tools": [ADD],
            "tool_choice": "required", "temperature": 0, "max_tokens": 60}
    if stream:
        r = httpx.post(minicpm_server.base_url + "/v1/chat/completions", json={**body, "stream": True}, timeout=300)
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        deltas = [c["choices"][0] for c in chunks if c["choices"]]
        assert deltas[-1]["finish_reason"] == "tool_calls", r.text
        calls = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
        name = calls[0]["function"]["name"]
        arguments = "".join(call["function"]["arguments"] for call in calls)
    else:
        choice = chat(minicpm_server, **body)["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
        (call,) = choice["message"]["tool_calls"]
        name, arguments = call["function"]["name"], call["function"]["arguments"]
    assert name == "add"
    jsonschema.validate(json.loads(arguments), ADD["function"]["parameters"])
    auto = chat(minicpm_server, **{**body, "tool_choice": "auto"})["choices"][0]
    assert prompt != "Say hi." or auto["finish_reason"] == "stop" and auto["message"]["content"], auto


# --- JSON calls (served names starting "ornith") ---


@pytest.fixture(scope="module")
def ornith_server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The default model served under a name that starts "ornith": its tools and calls are in the JSON dialect."""
    server = ServerProcess(["--model", f"{default_model_path}:ornith-x"],
                           log_path=tmp_path_factory.mktemp("ornith") / "serve.log").start()
    yield server
    server.stop()


@pytest.mark.parametrize(("function", "declared"), [
    ({"name": "ping", "parameters": {"type": "object", "properties": {}}}, set()),
    ({"name": "ping"}, set()),  # no parameters at all
    ({"name": "set_level", "parameters": {"type": "object", "required": ["level"],
                                          "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}}}}, {"level"}),
])
def test_a_json_call_has_only_the_arguments_its_tool_declares(ornith_server: ServerProcess, function: dict,
                                                              declared: set[str]) -> None:
    """A JSON-dialect call under its grammar takes only the keys the tool declares, as the XML dialects write them
    (the 135M model put the tool's own schema into the arguments, {"type": "object", "properties": {}}, or kept
    writing keys into the arguments of a tool without parameters until max_tokens ran out)."""
    for seed in range(3):
        choice = chat(ornith_server, model="ornith-x", messages=[{"role": "user", "content": "call it"}],
                      tools=[{"type": "function", "function": function}], tool_choice="required", seed=seed,
                      max_tokens=100)["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        arguments = json.loads(call["function"]["arguments"])
        assert set(arguments) == declared and call["function"]["name"] == function["name"], (seed, arguments)


# --- tool schemas no call can meet: a 400 in every dialect once a grammar is armed ---

SERVED = {"smollm_server": "SmolLM2-135M-Instruct", "minicpm_server": "minicpm-like", "ornith_server": "ornith-x"}


def _arg(schema: object) -> dict:
    return {"type": "object", "properties": {"a": schema}, "required": ["a"]}


@pytest.mark.parametrize("parameters", [
    _arg({"enum": []}), _arg({"not": {}}), _arg(False),
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": "a"},  # not a JSON schema
    _arg({"allOf": [{"type": "string"}, {"type": "integer"}]}),  # no type meets both
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["q"], "additionalProperties": False},
    _arg({"allOf": [{"const": "x"}, {"const": "y"}]}),  # no value meets both (200 with "x")
    _arg({"allOf": [{"type": "string"}, {"enum": [1, 2]}]}),  # no value of the enum is a string
])
@pytest.mark.parametrize("server_fixture", list(SERVED))
def test_parameters_no_call_meets_are_400_in_every_dialect(request: pytest.FixtureRequest, server_fixture: str,
                                                           parameters: dict) -> None:
    """Qwen XML (the default), MiniCPM's attribute XML and JSON refuse the same schemas through one check: MiniCPM's
    call grammar skipped it (an empty enum gave 200 and a call its schema refuses), and an allOf of types with none
    in common (200, {"a": "x"}) or a required key that additionalProperties: false forbids (200, an unfinished call)
    went through everywhere. With tool_choice "auto" the grammar is off and the schema is only shown to the model."""
    server: ServerProcess = request.getfixturevalue(server_fixture)
    body = {"model": SERVED[server_fixture], "messages": [{"role": "user", "content": "call it"}],
            "tools": [{"type": "function", "function": {"name": "t", "parameters": parameters}}],
            "tool_choice": "required", "max_tokens": 40, "seed": 1}
    url = server.base_url + "/v1/chat/completions"
    for stream in (False, True):
        r = httpx.post(url, timeout=60, json={**body, "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert "'t'" in r.json()["error"]["message"], r.text
    assert httpx.post(url, timeout=300, json={**body, "tool_choice": "auto"}).status_code == 200


def test_a_replayed_call_with_a_lone_surrogate_escape_is_replayed_as_written(smollm_server: ServerProcess) -> None:
    """Arguments JSON text holding "\\ud800" (valid JSON grammar, no character) were decoded into a lone surrogate
    that the tokenizer then failed on (a 500): they are replayed as written, as other text that is not JSON."""
    body = chat(smollm_server, messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}], max_tokens=2)
    assert body["usage"]["completion_tokens"] >= 1


# --- schemas the grammars hold calls to (seeds 0-5, as the audit ran them) ---


def _required_turns(server: ServerProcess, model: str, parameters: dict, *, seeds: int = 6,
                    max_tokens: int = 80) -> list[dict]:
    body = {"model": model, "messages": [{"role": "user", "content": "Call do_it."}],
            "tools": [{"type": "function", "function": {"name": "do_it", "parameters": parameters}}],
            "tool_choice": "required", "max_tokens": max_tokens}
    return [chat(server, **body, seed=seed)["choices"][0] for seed in range(seeds)]


def _check_calls_or_cuts(choices: list[dict], parameters: dict) -> list[dict]:
    """Each choice is one call whose arguments meet `parameters`, or a call max_tokens cut (finish "length", the
    unfinished call in tool_call_error): never a turn that stopped inside the call. The calls' arguments."""
    made = []
    for choice in choices:
        if choice["finish_reason"] == "length":
            assert choice["tool_call_error"]["code"] == "unfinished_tool_call", choice
            continue
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, parameters)
        made.append(arguments)
    return made


PATTERN_KEY = {"type": "object", "properties": {"a": {"type": "string"}},
               "patternProperties": {"^q$": {"type": "integer"}}, "required": ["q"]}


@pytest.mark.parametrize("server_fixture", list(SERVED))
def test_a_key_only_a_pattern_declares_is_written_and_typed(request: pytest.FixtureRequest,
                                                            server_fixture: str) -> None:
    """A required key that only patternProperties types: the JSON grammar let ", " follow the last key, then only
    blanks and the end token (3 of 6 seeds stopped with no call), and the XML grammars wrote it as text ("\n\n",
    or text up to max_tokens)."""
    server: ServerProcess = request.getfixturevalue(server_fixture)
    made = _check_calls_or_cuts(_required_turns(server, SERVED[server_fixture], PATTERN_KEY), PATTERN_KEY)
    assert made, "no seed finished its call"


ALL_OF_BOUNDS = {"type": "object", "required": ["name", "color", "level"], "properties": {
    "name": {"allOf": [{"type": "string", "maxLength": 10}, {"type": "string", "maxLength": 2}]},
    "color": {"allOf": [{"enum": ["red", "green", "blue"]}, {"enum": ["blue", "black"]}]},
    "level": {"allOf": [{"type": "integer", "minimum": 0, "maximum": 1000}, {"minimum": 500, "maximum": 510}]}}}


@pytest.mark.parametrize("server_fixture", list(SERVED))
def test_an_all_of_holds_arguments_to_every_member(request: pytest.FixtureRequest, server_fixture: str) -> None:
    """An allOf's members each narrow the argument ("function_a" for a maxLength of 2, "red" for an enum without
    it, 200 for a minimum of 500 came back: only the first member's keywords were read)."""
    server: ServerProcess = request.getfixturevalue(server_fixture)
    made = _check_calls_or_cuts(_required_turns(server, SERVED[server_fixture], ALL_OF_BOUNDS), ALL_OF_BOUNDS)
    assert made, "no seed finished its call"


UNEVALUATED = {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}}],
               "unevaluatedProperties": False, "required": ["a"]}


def test_a_json_call_takes_no_key_unevaluated_properties_forbids(ornith_server: ServerProcess) -> None:
    """unevaluatedProperties: false closes the arguments over the keys the schema and its allOf declare
    ({"a": 1, "b": "feller"} came back)."""
    made = _check_calls_or_cuts(_required_turns(ornith_server, "ornith-x", UNEVALUATED), UNEVALUATED)
    assert made and all(set(arguments) == {"a"} for arguments in made), made


@pytest.mark.parametrize("max_tokens", [2, 3, 6])
def test_a_json_call_cut_before_its_head_is_an_unfinished_call(ornith_server: ServerProcess,
                                                               max_tokens: int) -> None:
    """A forced JSON call cut by max_tokens before the parser knew it for a call ("```json\n{\n  \"") is an
    unfinished call with no content, streamed or not, as in the XML dialects (it came back as content)."""
    request = {"model": "ornith-x", "messages": [{"role": "user", "content": "Weather in Paris?"}],
               "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                   "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
               "tool_choice": "required", "temperature": 0, "max_tokens": max_tokens}
    choice = chat(ornith_server, **request)["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"], choice
    assert not choice["message"]["content"] and choice["tool_call_error"]["code"] == "unfinished_tool_call", choice
    r = httpx.post(ornith_server.base_url + "/v1/chat/completions", json={**request, "stream": True}, timeout=300)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert not "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]), r.text
    assert chunks[-1]["choices"][0]["tool_call_error"]["code"] == "unfinished_tool_call", chunks[-1]
