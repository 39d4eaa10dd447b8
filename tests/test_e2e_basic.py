"""End to end on the default model: a real server process, httpx and the official openai client."""

from __future__ import annotations

import httpx
import openai
import orjson
import pytest

from pantheon.buildinfo import compiled_backend
from tests.server_process import ServerProcess

pytestmark = pytest.mark.slow

# Greedy SmolLM2 names Tokyo here in both cpu arithmetics (float32 and int8 activations) by a wide margin;
# for France the int8 path answers "L'Étoile, la Cité, ..." instead of naming Paris.
QUESTION = "What is the capital of Japan?"
ANSWER = "Tokyo"
CHAT = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24, "temperature": 0}


def test_health(smollm_server: ServerProcess) -> None:
    r = httpx.get(smollm_server.base_url + "/")
    assert r.status_code == 200
    body = r.json()
    assert body["service"] == "pantheon" and body["status"] == "ok"
    # The installed backend (cuda when the extra is installed); no GPU here, so every pass runs on the host.
    assert body["backend"] == compiled_backend() and body["accelerator"] is False and body["dies_visible"] == 0
    assert isinstance(body["build"], str) and body["build"]
    assert r.headers["access-control-allow-origin"] == "*" and r.headers["connection"] == "close"


def test_models_lists_the_default_model(smollm_server: ServerProcess) -> None:
    body = httpx.get(smollm_server.base_url + "/v1/models").json()
    assert body["object"] == "list" and body["backend"] == compiled_backend()
    (entry,) = body["data"]
    assert entry["id"] == "SmolLM2-135M-Instruct" and entry["object"] == "model"
    assert entry["owned_by"] == "pantheon" and entry["max_sessions"] == 4
    assert entry["context_window"] == entry["context_length"] == entry["max_model_len"] == 8192
    assert "graphs" not in entry and "attention" not in entry


def test_chat_completion_answers_sensibly(smollm_server: ServerProcess) -> None:
    # cache_prompt false: cold, whatever earlier tests left in the server's anonymous prefix caches.
    r = httpx.post(smollm_server.base_url + "/v1/chat/completions", json={**CHAT, "cache_prompt": False},
                   timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert ANSWER in choice["message"]["content"]
    assert choice["finish_reason"] in {"stop", "length"}
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    # The same request again, cache_prompt left on (the default): it resumes from what that turn left in its
    # slot, all of the prompt but the token whose logits give the first new one, and answers the same.
    again = httpx.post(smollm_server.base_url + "/v1/chat/completions", json=CHAT, timeout=120).json()
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": usage["prompt_tokens"] - 1}
    assert again["choices"][0]["message"] == choice["message"]


def test_streaming_matches_non_streaming(smollm_server: ServerProcess) -> None:
    plain = httpx.post(smollm_server.base_url + "/v1/chat/completions", json=CHAT, timeout=120).json()
    chunks = []
    with httpx.stream("POST", smollm_server.base_url + "/v1/chat/completions", json={**CHAT, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    events = [orjson.loads(c) for c in chunks[:-1]]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert text == plain["choices"][0]["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]


def test_openai_client_streaming_and_not(smollm_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=smollm_server.base_url + "/v1", api_key="unused")
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=24,
                                           messages=[{"role": "user", "content": QUESTION}])
    assert ANSWER in reply.choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="anything", temperature=0, max_tokens=24, stream=True,
        messages=[{"role": "user", "content": QUESTION}]) if c.choices]
    assert "".join(pieces) == reply.choices[0].message.content
