"""The default model against independent implementations (tests/golden/make_smollm2_golden.py made the data).

Bar: against transformers (exact f32 arithmetic on the same GGUF weights), at every prompt position cosine
similarity >= 0.999 and the same argmax, and 32 greedy tokens identical; against llama.cpp, the same 32
greedy tokens (its 8-bit activation rounding makes its per-position logits a different computation).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pantheon.config import ModelOptions, read_env
from pantheon.engine.loader import load_served_model
from pantheon.kernels.cpu.backend import CpuBackend
from pantheon.models.base import BatchRow

GOLDEN = Path(__file__).parent / "golden" / "smollm2_golden.npz"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(default_model_path: Path):
    return load_served_model(ModelOptions(path=default_model_path, name="smollm2"), read_env(), CpuBackend())


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(GOLDEN) as data:
        return {k: data[k] for k in data.files}


def reference_logits(g: dict[str, np.ndarray]) -> np.ndarray:
    return g["logits_q"].astype(np.float32) * g["logits_scale"][:, None] + g["logits_offset"][:, None]


def test_tokenization_of_the_golden_prompt_matches(served, golden) -> None:
    from tests.golden.make_smollm2_golden import PROMPT

    assert served.tokenizer.encode(PROMPT) == golden["tokens"].tolist()


def test_logits_at_every_position(served, golden) -> None:
    tokens = golden["tokens"]
    state = served.model.new_state(1, 512)
    ours = served.model.forward(state, [BatchRow(0, tokens, 0, "all")])
    ref = reference_logits(golden)
    assert ours.shape == ref.shape
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.999, f"min cosine {cos.min():.5f} at position {int(cos.argmin())}"
    assert np.array_equal(ours.argmax(1), golden["argmax"])


def test_logits_are_the_same_when_prefilled_in_chunks(served, golden) -> None:
    tokens = golden["tokens"]
    state = served.model.new_state(1, 512)
    whole = served.model.forward(state, [BatchRow(0, tokens, 0, "last")])
    state = served.model.new_state(1, 512)
    served.model.forward(state, [BatchRow(0, tokens[:30], 0, "none")])
    served.model.forward(state, [BatchRow(0, tokens[30:50], 30, "none")])
    chunked = served.model.forward(state, [BatchRow(0, tokens[50:], 50, "last")])
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=2e-3 * np.abs(whole).max())


def test_32_greedy_tokens(served, golden) -> None:
    tokens = golden["tokens"]
    state = served.model.new_state(1, 512)
    logits = served.model.forward(state, [BatchRow(0, tokens, 0)])
    pos = len(tokens)
    out = []
    for _ in range(len(golden["greedy"])):
        tok = int(np.argmax(logits[0]))
        out.append(tok)
        logits = served.model.forward(state, [BatchRow(0, np.array([tok], np.int32), pos)])
        pos += 1
    assert out == golden["greedy"].tolist()
    assert out == golden["greedy_llama_cpp"].tolist()
