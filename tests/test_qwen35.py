"""Qwen3.5 / Qwen3-Next hybrid models on the cpu backend, against transformers on tiny random-weight fixtures.

tests/fixtures/qwen35/make_qwen35_fixtures.py wrote the GGUFs and the goldens (transformers computing in
float32 on exactly the stored weights). Bar: at every position of the 100-token prompt, relative error below
1e-3 (the F32 fixture) or cosine >= 0.999 (quantized ones); 32 greedy tokens identical. Then the state
machinery: chunked prefill split anywhere, batch-invariant decode, turn-boundary checkpoints, and session
blobs that carry the recurrent state.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pantheon.engine import snapshot
from pantheon.io.gguf_file import open_gguf
from pantheon.kernels.cpu.backend import CpuBackend
from pantheon.models.base import BatchRow
from pantheon.models.registry import load_model

FIXTURES = Path(__file__).parent / "fixtures" / "qwen35"
# fixture -> (golden, all weights F32)
MODELS = {"qwen35": ("qwen35", True), "qwen35moe": ("qwen35moe", False), "qwen3next": ("qwen3next", False),
          "qwen3next-legacy": ("qwen3next", False)}


@pytest.fixture(scope="module", params=list(MODELS))
def fixture(request):
    name = request.param
    golden_name, f32 = MODELS[name]
    model = load_model(open_gguf(FIXTURES / f"{name}.gguf", None), CpuBackend())
    with np.load(FIXTURES / f"{golden_name}.npz") as data:
        golden = {k: data[k] for k in data.files}
    return name, model, golden, f32


@pytest.fixture(scope="module")
def qwen35moe():
    return load_model(open_gguf(FIXTURES / "qwen35moe.gguf", None), CpuBackend())


def greedy(model, state, slot: int, logits: np.ndarray, pos: int, n: int) -> tuple[list[int], list[np.ndarray]]:
    """n greedy tokens from `logits` (the last row), decoding one at a time in `slot` from position `pos`."""
    tokens, rows = [], []
    for _ in range(n):
        tok = int(np.argmax(logits[-1]))
        tokens.append(tok)
        logits = model.forward(state, [BatchRow(slot, np.array([tok], np.int32), pos)])
        rows.append(logits[0])
        pos += 1
    return tokens, rows


def close(a: np.ndarray, b: np.ndarray, rel: float = 1e-4) -> bool:
    return float(np.abs(a - b).max()) <= rel * float(np.abs(b).max())


# --- against transformers ------------------------------------------------------------------------------


def test_logits_at_every_position(fixture):
    name, model, golden, f32 = fixture
    ours = model.forward(model.new_state(1, 256), [BatchRow(0, golden["tokens"], 0, "all")])
    ref = golden["logits"]
    assert ours.shape == ref.shape
    rel = np.linalg.norm(ours - ref, axis=1) / np.linalg.norm(ref, axis=1)
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    if f32:
        assert rel.max() < 1e-3, f"{name}: max relative error {rel.max():.3g} at position {int(rel.argmax())}"
    assert cos.min() >= 0.999, f"{name}: min cosine {cos.min():.6f} at position {int(cos.argmin())}"


def test_32_greedy_tokens(fixture):
    name, model, golden, _ = fixture
    state = model.new_state(1, 256)
    tokens = golden["tokens"]
    logits = model.forward(state, [BatchRow(0, tokens, 0)])
    out, _ = greedy(model, state, 0, logits, len(tokens), len(golden["greedy"]))
    assert out == golden["greedy"].tolist()


def test_layer_layout_follows_the_metadata(fixture):
    name, model, _, _ = fixture
    expected = {"qwen35": "LLLALL", "qwen35moe": "LLLALLLA", "qwen3next": "LALLLA", "qwen3next-legacy": "LALLLA"}
    c = model.config
    assert "".join("L" if r else "A" for r in c.recurrent) == expected[name]  # MTP block of qwen35moe skipped
    assert c.tiled_value_heads == name.startswith("qwen35")
    assert c.ssm_key_heads != c.ssm_value_heads  # so the value-head order matters
    assert (model.output is model.tok_embd) == (name == "qwen35")  # tied output


# --- prefill, decode and batch invariance --------------------------------------------------------------


def test_prefill_split_anywhere_equals_one_call(fixture):
    _, model, golden, _ = fixture
    tokens = golden["tokens"]
    whole = model.forward(model.new_state(1, 256), [BatchRow(0, tokens, 0, "all")])
    state = model.new_state(1, 256)
    parts = []
    for a, b in [(0, 37), (37, 38), (38, 100)]:
        parts.append(model.forward(state, [BatchRow(0, tokens[a:b], a, "all")]))
    assert close(np.concatenate(parts), whole)


def test_decode_is_batch_invariant(qwen35moe):
    """A sequence's logits are bitwise the same decoded alone and inside a batch of others."""
    model = qwen35moe
    prompts = [np.arange(5, 45, dtype=np.int32), np.arange(100, 117, dtype=np.int32) % 280,
               (np.arange(70, dtype=np.int32) * 7) % 280]
    state = model.new_state(4, 128)
    alone_state = model.new_state(4, 128)
    slots = [3, 0, 2]
    for slot, p in zip(slots, prompts):
        model.forward(state, [BatchRow(slot, p, 0, "none")])
        model.forward(alone_state, [BatchRow(slot, p, 0, "none")])
    positions = [len(p) for p in prompts]
    for step in range(3):
        toks = [np.array([(17 * step + 3 * i) % 280], np.int32) for i in range(3)]
        batch = model.forward(state, [BatchRow(s, t, pos) for s, t, pos in zip(slots, toks, positions)])
        for i, (s, t, pos) in enumerate(zip(slots, toks, positions)):
            alone = model.forward(alone_state, [BatchRow(s, t, pos)])
            np.testing.assert_array_equal(alone[0], batch[i])
        positions = [p + 1 for p in positions]


def test_a_new_sequence_does_not_inherit_the_slots_recurrent_state(qwen35moe):
    model = qwen35moe
    tokens = np.arange(10, 60, dtype=np.int32)
    fresh = model.forward(model.new_state(1, 128), [BatchRow(0, tokens, 0)])
    state = model.new_state(1, 128)
    model.forward(state, [BatchRow(0, tokens[::-1].copy(), 0)])
    again = model.forward(state, [BatchRow(0, tokens, 0)])
    np.testing.assert_array_equal(again, fresh)


def test_continuing_at_another_position_than_the_state_holds_fails(qwen35moe):
    model = qwen35moe
    state = model.new_state(1, 128)
    model.forward(state, [BatchRow(0, np.arange(20, dtype=np.int32), 0)])
    with pytest.raises(ValueError, match="cannot continue at position 15"):
        model.forward(state, [BatchRow(0, np.array([1, 2], np.int32), 15)])


# --- checkpoints and session blobs ---------------------------------------------------------------------


def conversation(model, golden):
    """Turn 1 (prompt + 12 greedy tokens) and the turn-2 text that follows it, as token lists."""
    prompt1 = golden["tokens"][:60]
    state = model.new_state(1, 256)
    logits = model.forward(state, [BatchRow(0, prompt1, 0)])
    reply, _ = greedy(model, state, 0, logits, len(prompt1), 12)
    turn2 = golden["tokens"][60:]
    return prompt1, reply, turn2


def test_continue_from_checkpoint_equals_cold_prefill(fixture):
    """Turn 1 runs; a checkpoint is taken at the turn boundary; the slot then runs a turn-2 prompt that
    diverges from the real one; restoring the checkpoint and prefilling the real turn 2 gives what a cold
    prefill of the whole conversation gives."""
    _, model, golden, _ = fixture
    prompt1, reply, turn2 = conversation(model, golden)
    state = model.new_state(2, 256)
    logits = model.forward(state, [BatchRow(1, prompt1, 0)])
    pos = len(prompt1)
    committed, _ = greedy(model, state, 1, logits, pos, len(reply) - 1)  # the last reply token is not fed
    pos += len(committed)
    assert committed == reply[:-1]
    checkpoint = model.snapshot_slot(state, 1)
    assert checkpoint.n_tokens == pos and checkpoint.nbytes > 0
    history = np.concatenate([prompt1, np.array(reply, np.int32)])

    # A turn-2 prompt that diverges after the checkpoint moves the recurrent state on...
    model.forward(state, [BatchRow(1, np.concatenate([history[pos:], turn2[::-1]]), pos)])
    # ...so the real turn 2 restores the checkpoint and prefills from it.
    model.restore_slot(state, 1, checkpoint)
    full = np.concatenate([history, turn2])
    resumed = model.forward(state, [BatchRow(1, full[pos:], pos, "all")])
    resumed_greedy, _ = greedy(model, state, 1, resumed, len(full), 32)

    cold_state = model.new_state(1, 256)
    cold = model.forward(cold_state, [BatchRow(0, full, 0, "all")])
    cold_greedy, _ = greedy(model, cold_state, 0, cold, len(full), 32)
    assert close(resumed, cold[pos:])
    assert resumed_greedy == cold_greedy


def test_export_restore_continue_equals_the_uninterrupted_run(fixture):
    _, model, golden, _ = fixture
    tokens = golden["tokens"][:70]
    state = model.new_state(2, 256)
    logits = model.forward(state, [BatchRow(0, tokens, 0)])
    n = len(tokens)
    layout = model.slot_layout(n)
    arrays = model.read_slot(state, 0, n)
    assert [(k, a.shape) for k, a in arrays] == layout
    assert all(a.dtype == model.state_dtype for _, a in arrays)
    assert any(k.startswith("ssm") for k, _ in arrays) and any(k.startswith("conv") for k, _ in arrays)
    blob = snapshot.encode(snapshot.Snapshot(model.architecture, model.state_dims(), 1, tokens.tolist(), arrays))

    uninterrupted, _ = greedy(model, state, 0, logits, n, 16)

    restored = model.new_state(3, 256)
    snap = snapshot.decode(blob, architecture=model.architecture, dims=model.state_dims(), weights_version=1)
    assert [(k, a.shape) for k, a in snap.arrays] == layout
    model.write_slot(restored, 2, snap.arrays, n)
    continued, _ = greedy(model, restored, 2, logits, n, 16)
    assert continued == uninterrupted


def test_state_size_accounting(qwen35moe):
    model = qwen35moe
    c = model.config
    state = model.new_state(3, 64)
    total = sum(p.nbytes for pools in (state.k, state.v, state.conv, state.ssm) for p in pools if p is not None)
    assert total == model.state_bytes(3, 64)
    assert model.recurrent_bytes_per_slot() == 4 * sum(c.recurrent) * (
        (c.conv_kernel - 1) * c.conv_dim + c.ssm_value_heads * c.ssm_key_dim * c.ssm_value_dim)


# --- serving: template, reasoning and tool dialect -----------------------------------------------------


def test_a_lone_assistant_message_is_an_ordinary_turn_where_the_template_needs_a_user_query():
    """A conversation of one assistant message is continued from it where the template can render an empty
    conversation (llama-server's prefill); Qwen's template refuses one without a user query, so there the
    message is an ordinary turn instead of a 400."""
    from pantheon.chat.prompt import build_prompt
    from pantheon.chat.request import parse_chat_request
    from pantheon.chat.tools import dialect_for
    from pantheon.config import ModelOptions, read_env
    from pantheon.engine.loader import load_served_model

    served = load_served_model(ModelOptions(path=FIXTURES / "qwen35moe.gguf", name="tiny-qwen35moe"), read_env(),
                               CpuBackend())
    dialect = dialect_for(served.name, served.architecture, served.gguf.metadata.get("tokenizer.chat_template"))
    request = parse_chat_request({"messages": [{"role": "assistant", "content": "Once upon"}]})
    prompt = build_prompt(served, request, no_think_default=False, dialect=dialect, tools=[])
    assert prompt.text.startswith("<|im_start|>assistant\nOnce upon<|im_end|>\n<|im_start|>assistant\n")
    # A continued answer follows its reasoning in a closed block, thinking on or off; a continued message with
    # reasoning and no answer yet stays inside the open block.
    ask = {"role": "user", "content": "Hi"}
    for extra in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
        cases = [({"content": "Answer:", "reasoning_content": "I thought."},
                  "<|im_start|>assistant\n<think>\nI thought.\n</think>\n\nAnswer:", False),
                 ({"content": "Answer:"}, "<|im_start|>assistant\n<think>\n\n</think>\n\nAnswer:", False),
                 ({"content": "", "reasoning_content": "I thought"}, "<|im_start|>assistant\n<think>\nI thought", True)]
        for message, ending, open_block in cases:
            request = parse_chat_request({"messages": [ask, {"role": "assistant", **message}], **extra})
            prompt = build_prompt(served, request, no_think_default=False, dialect=dialect, tools=[])
            assert prompt.text.endswith(ending), (message, extra, prompt.text[-80:])
            assert prompt.opens_think is open_block and prompt.thinking is open_block


def test_served_fixture_renders_think_prompts_and_uses_the_qwen_xml_dialect():
    """The fixtures carry a Qwen3.5-style think template: enable_thinking opens or closes the think block,
    and the tool dialect of these architectures is Qwen3-Coder XML."""
    from pantheon.chat.prompt import build_prompt
    from pantheon.chat.request import parse_chat_request
    from pantheon.chat.tools import dialect_for
    from pantheon.config import ModelOptions, read_env
    from pantheon.engine.loader import load_served_model

    served = load_served_model(ModelOptions(path=FIXTURES / "qwen35moe.gguf", name="tiny-qwen35moe"), read_env(),
                               CpuBackend())
    assert served.template.is_think_style
    dialect = dialect_for(served.name, served.architecture, served.gguf.metadata.get("tokenizer.chat_template"))
    assert dialect.name == "qwen_xml"
    for thinking, ending in [(True, "<think>\n"), (False, "<think>\n\n</think>\n\n")]:
        request = parse_chat_request({"messages": [{"role": "user", "content": "Hello"}], "enable_thinking": thinking})
        prompt = build_prompt(served, request, no_think_default=False, dialect=dialect, tools=[])
        assert prompt.text.endswith("<|im_start|>assistant\n" + ending)
        assert prompt.opens_think == thinking
        think = served.tokenizer.encode("<think>", parse_special=True)
        assert len(think) == 1 and think[0] in prompt.tokens  # a special token, not its characters
