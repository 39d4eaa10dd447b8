"""The GGUF tokenizer against llama.cpp's ids (tests/fixtures/tokenizer_refs.json, made by
tests/fixtures/make_tokenizer_refs.py), plus round trips and streaming detokenization.

Vocabularies: the default model's (SmolLM2, byte-level BPE; slow, since reading its metadata takes seconds),
that vocabulary under other pre-tokenizers and with USER_DEFINED tokens, and a committed SentencePiece
vocabulary (Mistral v3) with and without add_space_prefix.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from pantheon.io.tokenizer import StreamingDecoder, Tokenizer, TokenizerError

FIXTURES = Path(__file__).parent / "fixtures"
REFS = json.loads((FIXTURES / "tokenizer_refs.json").read_text())
COMMON: list[str] = REFS["strings"]["common"]
SPM_STRINGS: list[str] = COMMON + REFS["strings"]["spm_extra"]
DEFAULT_MODEL = Path.home() / ".cache/pantheon/SmolLM2-135M-Instruct.Q4_1.gguf"

# Fixture name -> changes to the base vocabulary's metadata that give it (see make_tokenizer_refs.py).
BPE_VARIANTS: dict[str, dict[str, Any]] = {
    "smollm": {},
    **{pre: {"tokenizer.ggml.pre": pre} for pre in ("llama-bpe", "qwen2", "qwen35", "gpt-2", "default")},
    "userdef": {"userdef": True},
}
SPM_VARIANTS: dict[str, dict[str, Any]] = {"spm": {}, "spm-noprefix": {"tokenizer.ggml.add_space_prefix": False}}
# A Phi-3-like vocabulary (make_tokenizer_refs.PHI3_CHANGES): llama.cpp drops the whitespace after its special
# tokens, but <unk>, <s> and <|endoftext|>.
PHI3_RENAMED = {14: "<|user|>", 15: "<|assistant|>", 16: "<|end|>", 17: "<|system|>", 18: "<|endoftext|>"}


def read_metadata(path: Path) -> dict[str, Any]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith(("tokenizer.", "general."))}


def variant(meta: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    meta = dict(meta)
    if changes.get("userdef"):
        types = list(meta["tokenizer.ggml.token_type"])
        types[3:17] = [4] * 14
        meta["tokenizer.ggml.token_type"] = types
    else:
        meta.update(changes)
    return meta


@pytest.fixture(scope="module")
def smol_meta() -> dict[str, Any]:
    if not DEFAULT_MODEL.exists():
        pytest.skip(f"default model not present at {DEFAULT_MODEL}")
    return read_metadata(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def smol(smol_meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smol_meta)


@pytest.fixture(scope="module")
def spm_meta() -> dict[str, Any]:
    return read_metadata(FIXTURES / "spm_mistral_v3.vocab.gguf")


@pytest.fixture(scope="module")
def spm(spm_meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(spm_meta)


def assert_matches_llama_cpp(tok: Tokenizer, ref: dict[str, Any], strings: list[str]) -> None:
    assert len(ref["special"]) == len(strings)
    for text, special, plain in zip(strings, ref["special"], ref["plain"]):
        assert tok.encode(text) == special, f"parse_special=True: {text!r}"
        assert tok.encode(text, parse_special=False) == (special if plain is None else plain), (
            f"parse_special=False: {text!r}"
        )
    assert tok.vocab_size == ref["n_vocab"]
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (ref["bos"], ref["eos"], ref["add_bos"])
    assert sorted(tok.stop_ids) == ref["eog_ids"]
    assert sorted(tok.control_ids) == ref["control_ids"]
    for token_id, hex_bytes in ref.get("pieces", {}).items():
        assert tok.token_bytes(int(token_id)) == bytes.fromhex(hex_bytes), f"token {token_id}"


def stream(tok: Tokenizer, ids: list[int], skip_special: bool) -> list[str]:
    decoder = StreamingDecoder(tok, skip_special=skip_special)
    chunks = [decoder.push(i) for i in ids]
    chunks.append(decoder.flush())
    return chunks


# --- byte-level BPE: the default model's vocabulary -----------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", list(BPE_VARIANTS))
def test_bpe_matches_llama_cpp(smol_meta, name):
    tok = Tokenizer.from_gguf_metadata(variant(smol_meta, BPE_VARIANTS[name]))
    assert_matches_llama_cpp(tok, REFS["fixtures"][name], COMMON)


@pytest.mark.slow
def test_bpe_round_trip(smol):
    for text in COMMON:
        for parse_special in (True, False):
            assert smol.decode(smol.encode(text, parse_special)) == text, repr(text)


@pytest.mark.slow
def test_bpe_decode_matches_llama_detokenize(smol):
    ref = REFS["fixtures"]["smollm"]
    for ids, expected in zip(ref["special"], ref["detok"]):
        assert smol.decode(ids) == expected


@pytest.mark.slow
def test_bpe_special_tokens(smol):
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert len(smol.encode("<|im_start|>", parse_special=False)) > 1
    assert smol.decode(ids, skip_special=True) == "user\nhi"
    assert smol.token_text(1) == "<|im_start|>" and smol.token_bytes(1) == b"<|im_start|>"
    assert smol.token_bytes(smol.encode(" world")[0]) == b" world"
    assert smol.stop_ids >= {smol.eos_id}
    assert smol.add_bos is False


@pytest.mark.slow
def test_bpe_streaming(smol):
    for text in COMMON:
        ids = smol.encode(text)
        for skip in (False, True):
            chunks = stream(smol, ids, skip)
            assert "".join(chunks) == smol.decode(ids, skip_special=skip), repr(text)
            assert not any("\ufffd" in c for c in chunks), repr(text)


@pytest.mark.slow
def test_bpe_streaming_holds_partial_characters(smol):
    family = "👨‍👩‍👧‍👦"
    ids = smol.encode(family)
    assert len(ids) > 1 and any(not (smol.token_bytes(i).decode("utf-8", "ignore")) for i in ids)
    chunks = stream(smol, ids, skip_special=True)
    assert "".join(chunks) == family
    assert "" in chunks  # some token completed no character
    # Cut short: the incomplete tail comes out of flush() as U+FFFD.
    decoder = StreamingDecoder(smol)
    first = smol.encode("😀")
    assert [decoder.push(i) for i in first[:-1]] == [""] * (len(first) - 1)
    assert decoder.flush() == "\ufffd"


@pytest.mark.slow
def test_bpe_json_round_trip_and_timing(smol_meta):
    start = time.perf_counter()
    tok = Tokenizer.from_gguf_metadata(smol_meta)
    build_s = time.perf_counter() - start
    blob = tok.to_json()
    start = time.perf_counter()
    again = Tokenizer.from_json(blob)
    load_s = time.perf_counter() - start
    assert build_s < 2.0 and load_s < 1.0, (build_s, load_s)
    for text in COMMON:
        assert again.encode(text) == tok.encode(text)
    assert (again.vocab_size, again.bos_id, again.eos_id, again.add_bos) == (
        tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos
    )
    assert again.stop_ids == tok.stop_ids and again.control_ids == tok.control_ids
    assert again.to_json() == blob


@pytest.mark.slow
def test_unknown_pre_uses_default_regexes(smol_meta, caplog):
    with caplog.at_level(logging.WARNING, logger="pantheon.io.tokenizer"):
        tok = Tokenizer.from_gguf_metadata(variant(smol_meta, {"tokenizer.ggml.pre": "no-such-pre"}))
    assert "no-such-pre" in caplog.text
    ref = REFS["fixtures"]["default"]
    assert [tok.encode(t) for t in COMMON] == ref["special"]


@pytest.mark.slow
def test_bpe_hf_json_for_llguidance(smol):
    llguidance = pytest.importorskip("llguidance")
    ll = llguidance.LLTokenizer(smol.hf_tokenizer_json(), eos_token=smol.eos_id)
    assert ll.vocab_size == smol.vocab_size
    for text in COMMON:
        assert ll.tokenize_str(text, parse_special=True) == smol.encode(text), repr(text)


@pytest.mark.slow
def test_bpe_encode_speed(smol):
    text = " ".join(COMMON) * 12
    assert len(text) > 10_000
    start = time.perf_counter()
    ids = smol.encode(text)
    assert time.perf_counter() - start < 0.5
    assert smol.decode(ids) == text


# --- SentencePiece-style vocabulary --------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SPM_VARIANTS))
def test_spm_matches_llama_cpp(spm_meta, name):
    tok = Tokenizer.from_gguf_metadata(variant(spm_meta, SPM_VARIANTS[name]))
    assert_matches_llama_cpp(tok, REFS["fixtures"][name], SPM_STRINGS)


def test_phi3_drops_the_whitespace_after_special_tokens_as_llama_cpp(spm_meta):
    tokens = list(spm_meta["tokenizer.ggml.tokens"])
    for i, text in PHI3_RENAMED.items():
        tokens[i] = text
    meta = {**spm_meta, "tokenizer.ggml.tokens": tokens, "general.name": "Phi3"}
    assert_matches_llama_cpp(Tokenizer.from_gguf_metadata(meta), REFS["fixtures"]["spm-phi3"],
                             SPM_STRINGS + REFS["strings"]["phi3_extra"])
    # The rule follows the name, as llama.cpp's does ("phi-3" too, any case), and survives the cache's JSON.
    turn = "<|user|>\nHello there<|end|>\n<|assistant|>\n"
    phi3 = Tokenizer.from_json(Tokenizer.from_gguf_metadata({**meta, "general.name": "My PHI-3 mini"}).to_json())
    other = Tokenizer.from_gguf_metadata({**meta, "general.name": "Mistral"})
    assert phi3.encode(turn) == REFS["fixtures"]["spm-phi3"]["special"][len(SPM_STRINGS)] == [14, 23325, 1504, 16, 15]
    assert len(other.encode(turn)) > 5


def test_spm_decode_matches_llama_detokenize(spm):
    ref = REFS["fixtures"]["spm"]
    for ids, expected in zip(ref["special"], ref["detok"]):
        assert spm.decode(ids) == expected


@pytest.mark.parametrize("name", list(SPM_VARIANTS))
def test_spm_round_trip(spm_meta, name):
    tok = Tokenizer.from_gguf_metadata(variant(spm_meta, SPM_VARIANTS[name]))
    for text in SPM_STRINGS:
        # Special tokens left as text (parsed ones get llama.cpp's extra space after them, which stays), and
        # a literal '▁' comes back as a space, as in llama.cpp.
        if "▁" not in text:
            assert tok.decode(tok.encode(text, parse_special=False)) == text, repr(text)


def test_spm_space_and_byte_fallback(spm):
    hello = spm.encode("hello")
    assert spm.token_text(hello[0]).startswith("▁")  # add_space_prefix
    assert spm.decode(hello) == "hello"
    assert spm.add_bos is True and spm.bos_id == 1 and spm.eos_id == 2
    ids = spm.encode("\n")
    assert spm.token_text(ids[-1]) == "<0x0A>" and spm.token_bytes(ids[-1]) == b"\n"
    # After a parsed special token llama.cpp adds the space prefix again.
    inst = spm.encode("[INST]hi")
    assert spm.token_text(inst[0]) == "[INST]" and spm.token_bytes(inst[1]).startswith(b" ")


def test_spm_streaming(spm):
    for text in SPM_STRINGS:
        ids = spm.encode(text)
        for skip in (False, True):
            chunks = stream(spm, ids, skip)
            kept = [i for i in ids if not (skip and spm.is_hidden(i))]
            assert "".join(chunks) == b"".join(spm.token_bytes(i) for i in kept).decode(), repr(text)
            assert not any("\ufffd" in c for c in chunks), repr(text)


def test_spm_streaming_holds_byte_fallback_characters(spm):
    text = "𝔸"  # not in the vocabulary: four <0xNN> tokens
    ids = spm.encode(text)
    assert all(spm.token_text(i).startswith("<0x") for i in ids[-4:])
    chunks = stream(spm, ids, skip_special=True)
    assert chunks[-5:] == ["", "", "", "𝔸", ""]


def test_spm_json_round_trip(spm):
    again = Tokenizer.from_json(spm.to_json())
    for text in SPM_STRINGS:
        assert again.encode(text) == spm.encode(text)
    assert again.stop_ids == spm.stop_ids and again.control_ids == spm.control_ids


def test_spm_encode_speed(spm):
    text = " ".join(s for s in SPM_STRINGS if "▁" not in s) * 10
    assert len(text) > 10_000
    start = time.perf_counter()
    ids = spm.encode(text, parse_special=False)
    assert time.perf_counter() - start < 0.5
    assert spm.decode(ids) == text


def test_spm_hf_json_for_llguidance(spm):
    llguidance = pytest.importorskip("llguidance")
    ll = llguidance.LLTokenizer(spm.hf_tokenizer_json(), eos_token=spm.eos_id)
    assert ll.vocab_size == spm.vocab_size
    ids = spm.encode(" hello 😀 世界\n", parse_special=False)
    assert ll.decode_bytes(ids) == b"".join(spm.token_bytes(i) for i in ids)


# --- errors --------------------------------------------------------------------------------------------

def test_unsupported_model_is_named():
    with pytest.raises(TokenizerError, match="'bert'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


def test_missing_pieces_are_errors():
    with pytest.raises(TokenizerError, match="tokens"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama"})
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]})
    with pytest.raises(TokenizerError, match="format"):
        Tokenizer.from_json('{"format": -1}')
    with pytest.raises(TokenizerError, match="malformed"):
        Tokenizer.from_json('{"format": 2}')


def test_token_ids_are_checked(spm):
    with pytest.raises(TokenizerError):
        spm.token_bytes(-1)
    with pytest.raises(TokenizerError):
        spm.decode([spm.vocab_size])


@pytest.mark.parametrize("which", ["smol", "spm"])
def test_min_tokens_never_exceeds_the_encoding(which, request):
    """The length bound that refuses a huge prompt without encoding it is a true lower bound: texts of long
    runs (the vocabulary's longest tokens), special tokens' texts, and mixed scripts."""
    tok = request.getfixturevalue(which)
    longest = max(range(tok.vocab_size), key=lambda i: len(tok.token_bytes(i)))
    texts = [tok.token_bytes(longest).decode("utf-8", errors="replace") * 5, " " * 300, "-" * 500, "=" * 257,
             "<|im_start|>user\nhi<|im_end|>" * 20, "héllo wörld 日本語 😀 " * 30, "a", ""]
    for text in texts:
        n = len(tok.encode(text, parse_special=True))
        assert tok.min_tokens(text) <= n, (text[:40], tok.min_tokens(text), n)
    assert tok.min_tokens("x" * (tok.max_token_bytes * 1000)) == 1000
