"""The default model against independent implementations (tests/golden/make_smollm2_golden.py made the data).

Each arithmetic of the cpu backend against the implementation that computes the same way:
- float path (PANTHEON_CPU_INT8=0) against transformers (exact f32 arithmetic on the same GGUF weights): at
  every prompt position cosine similarity >= 0.999 and the same argmax;
- int8 path (the server's default where the CPU has the instructions: activations rounded to 8-bit blocks
  before each Q4_1 / Q8_0 matmul, their scales stored as float16, as llama.cpp's Q8_0 / Q8_1 blocks are; the two
  differ in the order of float sums and in the attention's arithmetic) against llama.cpp's logits: cosine >= 0.98
  at every position and a median >= 0.998; our top token one of the references' at >= 95% of positions and never more than 0.5
  below the top of llama.cpp's logits.
Both paths: the top token of each of 32 greedy steps is transformers' and llama.cpp's (the int8 path: or within
0.1 of ours at a near-tie, see test_32_greedy_tokens).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pantheon.config import ModelOptions, read_env
from pantheon.engine.loader import load_served_model
from pantheon.kernels.cpu import int8dot
from pantheon.kernels.cpu.backend import CpuBackend
from pantheon.models.base import BatchRow

GOLDEN = Path(__file__).parent / "golden" / "smollm2_golden.npz"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[False, True], ids=["float", "int8"])
def served(request, default_model_path: Path):
    if request.param and int8dot.INT8_ISA is None:
        pytest.skip("this CPU has neither VNNI nor AVX2: the int8 path does not exist here")
    backend = CpuBackend(int8=request.param)
    assert backend.int8 == request.param
    return load_served_model(ModelOptions(path=default_model_path, name="smollm2"), read_env(), backend)


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(GOLDEN) as data:
        return {k: data[k] for k in data.files}


def reference_logits(g: dict[str, np.ndarray], prefix: str = "") -> np.ndarray:
    return (g[f"{prefix}logits_q"].astype(np.float32) * g[f"{prefix}logits_scale"][:, None]
            + g[f"{prefix}logits_offset"][:, None])


def test_tokenization_of_the_golden_prompt_matches(served, golden) -> None:
    from tests.golden.make_smollm2_golden import PROMPT

    assert served.tokenizer.encode(PROMPT) == golden["tokens"].tolist()


def test_logits_at_every_position(served, golden) -> None:
    tokens = golden["tokens"]
    state = served.model.new_state(1, 512)
    ours = served.model.forward(state, [BatchRow(0, tokens, 0, "all")])
    int8 = served.model.backend.int8
    ref = reference_logits(golden, "llama_" if int8 else "")
    assert ours.shape == ref.shape
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    # int8 rounding makes the logits a step function of the activations: a last-bit change upstream flips a
    # few roundings and moves a sensitive position by ~1% (min 0.9897-0.9918 across two builds of the rope
    # kernel), while exact arithmetic sits at 0.955 from llama.cpp at its worst position.
    bar = 0.98 if int8 else 0.999
    assert cos.min() >= bar, f"min cosine {cos.min():.5f} at position {int(cos.argmin())}"
    assert np.median(cos) >= (0.998 if int8 else 0.9999), f"median cosine {np.median(cos):.5f}"
    if not int8:
        assert np.array_equal(ours.argmax(1), golden["argmax"])
    else:
        # Near-ties decide differently under int8 rounding (llama.cpp and transformers disagree at 2 of 76
        # positions; a last-bit change upstream moved ours at one more): our top token must be one of the
        # references' at >= 95% of positions, and everywhere within 0.5 of the top of llama.cpp's logits.
        top = ours.argmax(1)
        agree = (top == golden["argmax"]) | (top == golden["llama_argmax"])
        assert agree.mean() >= 0.95, f"top token differs from both references at {np.nonzero(~agree)[0].tolist()}"
        shortfall = ref.max(1) - ref[np.arange(len(top)), top]
        assert shortfall.max() <= 0.5, f"llama.cpp rates our top token {shortfall.max():.3f} below its own"


def test_logits_are_the_same_when_prefilled_in_chunks(served, golden) -> None:
    tokens = golden["tokens"]
    state = served.model.new_state(1, 512)
    whole = served.model.forward(state, [BatchRow(0, tokens, 0, "last")])
    state = served.model.new_state(1, 512)
    served.model.forward(state, [BatchRow(0, tokens[:30], 0, "none")])
    served.model.forward(state, [BatchRow(0, tokens[30:50], 30, "none")])
    chunked = served.model.forward(state, [BatchRow(0, tokens[50:], 50, "last")])
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=2e-3 * np.abs(whole).max())


# How far below our top logit the references' greedy token may be on the int8 path (see the test).
INT8_TIE = 0.1


def test_32_greedy_tokens(served, golden) -> None:
    """Along the references' 32-token greedy continuation (transformers' and llama.cpp's agree), our top
    token at every step is theirs. The float path must match exactly. The int8 path's logits are llama.cpp's
    up to rounding, and LLVM's vectorized reductions sum in an order that depends on the SIMD width (AVX2's
    8 lanes or AVX-512's 16), so a near-tie may go either way: there the reference token must be within
    INT8_TIE of our top logit, at two steps at most (step 1 of this prompt is one: 25.107 vs 25.070 on a
    Zen 3, which has no AVX-512)."""
    assert golden["greedy"].tolist() == golden["greedy_llama_cpp"].tolist()
    tokens = golden["tokens"]
    state = served.model.new_state(1, 512)
    logits = served.model.forward(state, [BatchRow(0, tokens, 0)])
    pos = len(tokens)
    ties = []
    for step, want in enumerate(golden["greedy"].tolist()):
        row = logits[0]
        top = int(np.argmax(row))
        if top != want:
            assert served.model.backend.int8, f"step {step}: top token {top}, the references' {want}"
            gap = float(row[top] - row[want])
            assert gap <= INT8_TIE, f"step {step}: the references' token {want} is {gap:.3f} below our top {top}"
            ties.append(step)
        logits = served.model.forward(state, [BatchRow(0, np.array([want], np.int32), pos)])
        pos += 1
    assert len(ties) <= 2, f"near-ties at steps {ties}"


@pytest.mark.parametrize("n_prompt", [40, 700])
def test_prefilled_and_decoded_positions_give_the_same_bits(served, n_prompt) -> None:
    """A prompt prefilled in one chunk and the same prompt whose last token is decoded on its own (what a turn
    cached up to its last token does) give the same logits for that token, bit for bit, also past the
    decode kernel's 512-key runs: prefill attention is the decode kernel's, one row per token."""
    rng = np.random.default_rng(n_prompt)
    tokens = rng.integers(0, served.model.vocab_size, n_prompt).astype(np.int32)
    model = served.model
    whole = model.forward(model.new_state(1, 800), [BatchRow(0, tokens, 0, "last")])
    state = model.new_state(1, 800)
    model.forward(state, [BatchRow(0, tokens[:-1], 0, "none")])
    last = model.forward(state, [BatchRow(0, tokens[-1:], n_prompt - 1, "last")])
    np.testing.assert_array_equal(last, whole)
