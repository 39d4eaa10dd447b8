"""The tokenizer a GGUF file describes, built to give exactly llama.cpp's token ids.

Two vocabulary kinds are supported, chosen by `tokenizer.ggml.model`:

- ``gpt2``: byte-level BPE. Encoding runs on a `tokenizers` BPE model (GGUF tokens + merges) behind the
  pre-tokenizer regexes llama.cpp picks for `tokenizer.ggml.pre` (`_PRE_GROUPS`).
- ``llama``: SentencePiece-style BPE driven by token scores, with byte fallback (``<0xNN>`` tokens), '▁' for
  spaces and `add_space_prefix`. `tokenizers` has no model that merges by score the way llama.cpp does, so
  this one is a direct Python implementation of that algorithm (`_spm_tokenize`).

Both split special tokens out of the text first, in llama.cpp's order (`_partition`), so glued chat markup
such as ``<|im_start|>user`` gives the same ids. The token attribute fix-ups and the end-of-generation set
follow llama.cpp's vocab loader too, since they decide which tokens stop generation and which are hidden.

The whole state is the small JSON `to_json()` writes; everything else is derived in the constructor, so a
loader can cache the JSON keyed by file identity and skip GGUF parsing on the next start.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

log = logging.getLogger(__name__)

__all__ = ["StreamingDecoder", "Tokenizer", "TokenizerError"]


class TokenizerError(ValueError):
    """The GGUF vocabulary is missing, malformed or of a kind this module does not support."""


# GGUF tokenizer.ggml.token_type values (llama.cpp LLAMA_TOKEN_TYPE_*).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Token attributes as bit flags (llama.cpp LLAMA_TOKEN_ATTR_*), so the loader's fix-ups can be mirrored.
_A_UNDEFINED, _A_UNKNOWN, _A_UNUSED, _A_NORMAL, _A_CONTROL, _A_USER_DEFINED, _A_BYTE = 0, 1, 2, 4, 8, 16, 32
_TYPE_TO_ATTR = {
    _NORMAL: _A_NORMAL,
    _UNKNOWN: _A_UNKNOWN,
    _CONTROL: _A_CONTROL,
    _USER_DEFINED: _A_USER_DEFINED,
    _UNUSED: _A_UNUSED,
    _BYTE: _A_BYTE,
}
_RSTRIP_EXEMPT = frozenset({"<unk>", "<s>", "<|endoftext|>"})
_C_SPACE = " \t\n\v\f\r"
_A_HIDDEN = _A_CONTROL | _A_UNKNOWN  # not rendered unless special tokens are asked for
_A_SPECIAL = _A_CONTROL | _A_USER_DEFINED | _A_UNKNOWN  # matched as whole tokens before BPE

# Bump when the to_json() layout changes.
_FORMAT = 2  # 2: `rstrip_special` (the Phi-3 rule) is part of the state

# --- pre-tokenizer regexes (llama.cpp src/llama-vocab.cpp, llm_tokenizer_bpe) ---------------------------

_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RE_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_RE_LLAMA3 = (
    _RE_CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN2 = _RE_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_RE_QWEN35 = (
    _RE_CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# group -> (regexes applied in turn, ignore_merges, add_bos default)
_PRE_REGEXES: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"), False, False),
    "gpt2": ((_RE_GPT2,), False, False),
    "smollm": ((r"\p{N}", _RE_GPT2), False, False),
    "llama3": ((_RE_LLAMA3,), True, True),
    "dbrx": ((_RE_LLAMA3,), False, False),  # llama3's regex without its merge/BOS settings
    "qwen2": ((_RE_QWEN2,), False, False),
    "qwen35": ((_RE_QWEN35,), False, False),
}

# tokenizer.ggml.pre -> group, as llama.cpp's loader maps them. "gpt2" is not a llama.cpp name (it spells it
# "gpt-2") but is accepted as an alias.
_PRE_GROUPS: dict[str, str] = {
    "": "default",
    "default": "default",
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"], "smollm"
    ),
    **dict.fromkeys(
        ["gpt2", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
         "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4",
         "jina-v1-en", "jina-v2-code", "roberta-bpe"],
        "gpt2",
    ),
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano"],
        "llama3",
    ),
    **dict.fromkeys(["dbrx", "smaug-bpe"], "dbrx"),
    **dict.fromkeys(
        ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
         "grok-2"],
        "qwen2",
    ),
    "qwen35": "qwen35",
}

# --- llama.cpp's vocab fix-ups by token text (llama_vocab::impl::load) -----------------------------------

# Special ids found by text when their GGUF key is absent; a token found this way becomes CONTROL.
_DETECT_BY_TEXT: dict[str, tuple[str, ...]] = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
            "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# GGUF keys (under tokenizer.ggml.) for those ids; where two are set, the first listed wins, as in llama.cpp,
# which reads the deprecated names last.
_SPECIAL_KEYS: dict[str, tuple[str, ...]] = {
    "eot": ("eot_token_id",),
    "eom": ("eom_token_id",),
    "fim_pre": ("prefix_token_id", "fim_pre_token_id"),
    "fim_suf": ("suffix_token_id", "fim_suf_token_id"),
    "fim_mid": ("middle_token_id", "fim_mid_token_id"),
    "fim_pad": ("fim_pad_token_id",),
    "fim_rep": ("fim_rep_token_id",),
    "fim_sep": ("fim_sep_token_id",),
}
# Texts that end generation (llama.cpp special_eog_ids), besides eos/eot/eom and fim pad/rep/sep.
_EOG_TEXTS = frozenset(
    ["<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
     "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
     "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~["]
)
# gpt-oss: always rendered as text.
_FORCE_USER_DEFINED = frozenset(["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"])


# --- GPT-2 byte <-> unicode table ----------------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _byte_level_decode(text: str) -> bytes:
    # llama.cpp writes "[UNK_BYTE_...]" for a char outside the table; its UTF-8 is the useful fallback.
    if all(c in _CHAR_TO_BYTE for c in text):
        return bytes(_CHAR_TO_BYTE[c] for c in text)
    return b"".join(bytes([_CHAR_TO_BYTE[c]]) if c in _CHAR_TO_BYTE else c.encode() for c in text)


def _parse_byte_token(text: str) -> int | None:
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


# --- the tokenizer -------------------------------------------------------------------------------------

class Tokenizer:
    """Encode and decode with a GGUF vocabulary, matching llama.cpp.

    Build with `from_gguf_metadata` (or `from_json` from a cached `to_json`), not with the constructor.
    """

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    stop_ids: frozenset[int]
    control_ids: frozenset[int]

    def __init__(self, state: Mapping[str, Any]) -> None:
        self._state = dict(state)
        model = state["model"]
        tokens: list[str] = list(state["tokens"])
        types: list[int] = list(state["types"])
        self.vocab_size = len(tokens)
        self._model = model
        self._tokens = tokens
        # llama.cpp names empty tokens so they stay distinct in its text -> id map.
        texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._texts = texts
        self._token_to_id = {t: i for i, t in enumerate(texts)}  # later duplicates win, as in llama.cpp
        self.bos_id = state["bos_id"]
        self.eos_id = state["eos_id"]
        self.add_bos = bool(state["add_bos"])
        self._add_space_prefix = bool(state["add_space_prefix"]) and model == "llama"
        self._unk_id = state.get("unk_id")

        attrs = [_TYPE_TO_ATTR.get(t, _A_UNDEFINED) for t in types]
        self.stop_ids = self._fix_attrs_and_find_eog(attrs, state.get("special_ids") or {})
        self._attrs = attrs
        self.control_ids = frozenset(i for i, a in enumerate(attrs) if a & _A_CONTROL)
        self._hidden_ids = frozenset(i for i, a in enumerate(attrs) if a & _A_HIDDEN)
        # Longest first, as llama.cpp partitions (by UTF-8 length; ties keep id order).
        special = [i for i, a in enumerate(attrs) if a & _A_SPECIAL]
        special.sort(key=lambda i: -len(texts[i].encode()))
        self._special = [(texts[i], i, bool(attrs[i] & _A_HIDDEN)) for i in special]
        # Special tokens whose following whitespace the partition drops (llama.cpp's RSTRIP attribute): all of
        # them under `rstrip_special`, except the few llama.cpp exempts.
        self._rstrip_ids = frozenset(i for i in special if texts[i] not in _RSTRIP_EXEMPT) \
            if state.get("rstrip_special") else frozenset()

        self._token_bytes = self._build_token_bytes(attrs)
        # The most bytes of text one token can stand for (its bytes, or its spelling: a control token's text, a
        # SentencePiece piece), so that `min_tokens` bounds a text's count without encoding it.
        self.max_token_bytes = max(1, *(max(len(b), len(t.encode("utf-8"))) for b, t in zip(self._token_bytes, texts)))
        self._hf: HFTokenizer | None = None  # byte-level BPE only; SentencePiece encoding is in Python
        self._hf_json: str | None = None
        if model == "gpt2":
            group = _PRE_GROUPS.get(state["pre"])
            if group is None:
                # llama.cpp refuses such a file; the default regexes are the closest thing it has.
                log.warning("tokenizer.ggml.pre=%r is unknown; using llama.cpp's 'default' regexes", state["pre"])
                group = "default"
            self._hf = self._build_bpe(group)
        else:
            self._score = {t: float(state["scores"][i]) for t, i in self._token_to_id.items()}
            self._byte_ids = self._find_byte_ids()

    # --- construction ---

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (key -> plain Python value). Raises TokenizerError."""
        model = meta.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise TokenizerError(
                f"unsupported tokenizer.ggml.model {model!r} (supported: 'gpt2' byte-level BPE, "
                f"'llama' SentencePiece-style BPE)"
            )
        tokens = _string_list(meta, "tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("tokenizer.ggml.tokens is missing or empty")
        n = len(tokens)
        types = meta.get("tokenizer.ggml.token_type")
        types = [int(t) for t in types] if types is not None else [_NORMAL] * n
        if len(types) < n:
            raise TokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        state: dict[str, Any] = {
            "format": _FORMAT,
            "model": model,
            "pre": str(meta.get("tokenizer.ggml.pre") or ""),
            "tokens": tokens,
            "types": types[:n],
        }
        if model == "gpt2":
            if "tokenizer.ggml.merges" not in meta:
                raise TokenizerError("tokenizer.ggml.merges is missing (required for a 'gpt2' vocabulary)")
            state["merges"] = _string_list(meta, "tokenizer.ggml.merges")
            group = _PRE_GROUPS.get(state["pre"], "default")
            defaults = {"bos": None, "eos": None, "unk": None, "add_bos": _PRE_REGEXES[group][2], "prefix": False}
        else:
            scores = meta.get("tokenizer.ggml.scores")
            scores = [float(s) for s in scores] if scores is not None else [0.0] * n
            if len(scores) < n:
                raise TokenizerError(f"tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
            state["scores"] = scores[:n]
            defaults = {"bos": 1, "eos": 2, "unk": 0, "add_bos": True, "prefix": True}

        def token_id(key: str, default: int | None) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n:
                return value
            return default if default is not None and 0 <= default < n else None

        state["bos_id"] = token_id("bos_token_id", defaults["bos"])
        state["eos_id"] = token_id("eos_token_id", defaults["eos"])
        state["unk_id"] = token_id("unknown_token_id", defaults["unk"])
        special_ids: dict[str, int] = {}
        for name, keys in _SPECIAL_KEYS.items():
            for key in keys:
                found = token_id(key, None)
                if found is not None:
                    special_ids[name] = found
                    break
        state["special_ids"] = special_ids
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        state["add_bos"] = bool(add_bos) if isinstance(add_bos, bool) else defaults["add_bos"]
        prefix = meta.get("tokenizer.ggml.add_space_prefix")
        state["add_space_prefix"] = bool(prefix) if isinstance(prefix, bool) else defaults["prefix"]
        # llama.cpp strips the whitespace after a special token of a model whose name says Phi-3 (its templates
        # write "<|user|>\n"; the model was trained without those newlines as tokens of their own).
        name = meta.get("general.name")
        state["rstrip_special"] = isinstance(name, str) and any(k in name.lower() for k in ("phi-3", "phi3"))
        return cls(state)

    def to_json(self) -> str:
        """Everything needed to rebuild this tokenizer with `from_json`."""
        return orjson.dumps(self._state).decode()

    @classmethod
    def from_json(cls, s: str) -> Tokenizer:
        """Rebuild from `to_json` output. Raises TokenizerError if it is not one (e.g. an older format)."""
        try:
            state = orjson.loads(s)
        except orjson.JSONDecodeError as exc:
            raise TokenizerError(f"cached tokenizer is not JSON: {exc}") from None
        found = state.get("format") if isinstance(state, dict) else None
        if found != _FORMAT:
            raise TokenizerError(f"cached tokenizer has format {found!r}, expected {_FORMAT}")
        try:
            return cls(state)
        except (KeyError, TypeError, IndexError) as exc:
            raise TokenizerError(f"cached tokenizer is malformed: {exc!r}") from None

    def _fix_attrs_and_find_eog(self, attrs: list[int], special_ids: Mapping[str, int]) -> frozenset[int]:
        """Apply llama.cpp's text-based attribute fix-ups in place; return its end-of-generation ids."""
        ids = dict(special_ids)
        for name, texts in _DETECT_BY_TEXT.items():
            if name in ids:
                continue
            found = [self._token_to_id[t] for t in texts if t in self._token_to_id]
            if found:
                # llama.cpp takes the first hit in hash-map order; the lowest id is a stable stand-in.
                ids[name] = min(found)
                attrs[ids[name]] |= _A_CONTROL
        for i, text in enumerate(self._texts):
            if attrs[i] & _A_CONTROL and "unused" in text:
                attrs[i] |= _A_UNUSED
        eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if k in ids}
        for text in _EOG_TEXTS:
            i = self._token_to_id.get(text)
            if i is not None:
                eog.add(i)
                attrs[i] |= _A_CONTROL
        for text in _FORCE_USER_DEFINED:
            i = self._token_to_id.get(text)
            if i is not None:
                attrs[i] = _A_USER_DEFINED
        for i in (self.eos_id, ids.get("eot"), ids.get("eom")):
            if i is not None:
                eog.add(i)
        by_text = {self._texts[i]: i for i in eog}
        # Harmony / solar-open: "<|end|>" closes a message there, it does not end generation.
        if "<|end|>" in by_text and (
            ("<|return|>" in by_text and ("<|call|>" in by_text or "<|calls|>" in by_text))
            or ("<|calls|>" in by_text and "<|flush|>" in by_text)
        ):
            eog.discard(by_text["<|end|>"])
            attrs[by_text["<|end|>"]] = _A_USER_DEFINED
        # Gemma 4 / PLaMo: "</s>" is an ordinary token there.
        if "</s>" in by_text and ("<|tool_response>" in by_text or "<|plamo:eos|>" in by_text):
            eog.discard(by_text["</s>"])
            attrs[by_text["</s>"]] = _A_NORMAL
        return frozenset(eog)

    def _build_token_bytes(self, attrs: list[int]) -> list[bytes]:
        out: list[bytes] = []
        spm = self._model == "llama"
        for text, attr in zip(self._texts, attrs):
            if attr & (_A_HIDDEN | _A_USER_DEFINED):
                out.append(text.encode())
            elif attr & _A_NORMAL:
                out.append(text.replace("▁", " ").encode() if spm else _byte_level_decode(text))
            elif attr & _A_BYTE:
                b = _parse_byte_token(text)
                out.append(bytes([b]) if b is not None else b"")
            else:  # unused / undefined: llama.cpp renders nothing
                out.append(b"")
        return out

    def _build_bpe(self, group: str) -> HFTokenizer:
        regexes, ignore_merges, _ = _PRE_REGEXES[group]
        merges = []
        for m in self._state["merges"]:
            p = m.find(" ", 1)
            if p < 0:
                continue
            a, b = m[:p], m[p + 1 :]
            # tokenizers fails to build on a merge whose parts or result are not tokens; such a merge never
            # yields a token in llama.cpp either.
            if a in self._token_to_id and b in self._token_to_id and a + b in self._token_to_id:
                merges.append((a, b))
        hf = HFTokenizer(models.BPE(vocab=self._token_to_id, merges=merges, ignore_merges=ignore_merges))
        steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        barrier = self._missing_byte_chars()
        if barrier:
            # A byte with no token is dropped by both, but llama.cpp drops it after merging, so it keeps apart
            # the bytes on either side, while tokenizers drops it first and lets them merge. Cutting the word
            # there gives llama.cpp's result.
            chars = "".join(f"\\x{{{ord(c):X}}}" for c in barrier)
            steps.append(pre_tokenizers.Split(Regex(f"[{chars}]"), behavior="removed"))
        hf.pre_tokenizer = pre_tokenizers.Sequence(steps)
        hf.decoder = decoders.ByteLevel()
        self._add_hf_special_tokens(hf)
        # We split special tokens ourselves (llama.cpp's order); inside a fragment they are plain text.
        hf.encode_special_tokens = True
        return hf

    def _missing_byte_chars(self) -> list[str]:
        """Byte-level chars that are not tokens and occur in no token (typically 0xC0, 0xC1, 0xF5-0xFF)."""
        missing = [c for c in _BYTE_TO_CHAR.values() if c not in self._token_to_id]
        if not missing:
            return []
        in_tokens = set("".join(t for t in self._token_to_id if len(t) > 1))
        return [c for c in missing if c not in in_tokens]

    def _add_hf_special_tokens(self, hf: HFTokenizer) -> None:
        hidden = [AddedToken(t, special=True, normalized=False) for t, i, h in self._special if h]
        shown = [AddedToken(t, special=False, normalized=False) for t, i, h in self._special if not h]
        hf.add_special_tokens(hidden)
        hf.add_tokens(shown)

    def _find_byte_ids(self) -> list[int | None]:
        ids: list[int | None] = []
        for b in range(256):
            i = self._token_to_id.get(f"<0x{b:02X}>")
            if i is None and 0 < b < 0x80:  # llama.cpp's fallback: the byte itself as a token
                i = self._token_to_id.get(chr(b))
            ids.append(i)
        return ids

    # --- encoding ---

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        """Token ids for `text`, without BOS. Control tokens' texts become single ids when parse_special."""
        out: list[int] = []
        if not text:
            return out
        fragments = self._partition(text, parse_special)
        if self._hf is not None:
            # encode_batch, unlike encode, lets go of the GIL while it works: a long prompt encoded on a worker
            # thread does not stall the event loop.
            pieces = iter(self._hf.encode_batch([f for f in fragments if isinstance(f, str)], add_special_tokens=False))
            for frag in fragments:
                out.extend([frag] if isinstance(frag, int) else next(pieces).ids)
            return out
        prev_special = True  # llama.cpp prefixes a space at the start and after every special token
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
            else:
                if self._add_space_prefix and prev_special:
                    frag = " " + frag
                self._spm_tokenize(frag.replace(" ", "▁"), out)
                prev_special = False
        return out

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) from the text's length alone: no token covers more than
        max_token_bytes bytes of it."""
        return -(-len(text.encode("utf-8", errors="surrogatepass")) // self.max_token_bytes)

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split out special tokens the way llama.cpp does: each token in turn, longest first."""
        fragments: list[str | int] = [text]
        for tok_text, tok_id, hidden in self._special:
            if hidden and not parse_special:
                continue
            if tok_text not in text:
                continue
            split: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or tok_text not in frag:
                    split.append(frag)
                    continue
                start = 0
                while (hit := frag.find(tok_text, start)) >= 0:
                    if hit > start:
                        split.append(frag[start:hit])
                    split.append(tok_id)
                    start = hit + len(tok_text)
                    if tok_id in self._rstrip_ids:  # C's isspace: ASCII whitespace only
                        start = len(frag) - len(frag[start:].lstrip(_C_SPACE))
                if start < len(frag):
                    split.append(frag[start:])
            fragments = split
        return fragments

    def _spm_tokenize(self, text: str, out: list[int]) -> None:
        """llama.cpp's SPM merge: repeatedly join the adjacent pair whose joined text is the highest-scoring
        token (ties: leftmost), then emit tokens, or byte tokens for what never became one."""
        n = len(text)
        if n == 0:
            return
        score = self._score
        sym = list(text)  # each symbol's current text; "" once merged into its left neighbour
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int]] = []
        for i in range(n - 1):
            s = score.get(sym[i] + sym[i + 1])
            if s is not None:
                heap.append((-s, i, i + 1, 2))
        heapq.heapify(heap)
        push = heapq.heappush
        while heap:
            _, left, right, size = heapq.heappop(heap)
            a, b = sym[left], sym[right]
            if not a or not b or len(a) + len(b) != size:
                continue  # stale: one side has been merged since this pair was queued
            merged = a + b
            sym[left] = merged
            sym[right] = ""
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prv[after] = left
            before = prv[left]
            if before >= 0:
                joined = sym[before] + merged
                s = score.get(joined)
                if s is not None:
                    push(heap, (-s, before, left, len(joined)))
            if after >= 0:
                joined = merged + sym[after]
                s = score.get(joined)
                if s is not None:
                    push(heap, (-s, left, after, len(joined)))
        lookup = self._token_to_id
        i = 0
        while i >= 0:
            piece = sym[i]
            tok = lookup.get(piece)
            if tok is not None:
                out.append(tok)
            else:
                for byte in piece.encode():
                    tok = self._byte_ids[byte]
                    if tok is None:
                        tok = self._unk_id
                    if tok is None:
                        raise TokenizerError(f"vocabulary has no byte token for 0x{byte:02X} and no unknown token")
                    out.append(tok)
            i = nxt[i]

    # --- decoding ---

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (control tokens: their text; unused tokens: nothing)."""
        return self._token_bytes[self._check_id(token_id)]

    def token_text(self, token_id: int) -> str:
        """The token as the vocabulary spells it."""
        return self._tokens[self._check_id(token_id)]

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return token_id

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text for `ids`, like llama.cpp's llama_detokenize without its space clean-up (which is lossy).

        With add_space_prefix (SentencePiece vocabularies) one leading space of the first token is dropped,
        since encode() put it there.
        """
        if len(ids) and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            raise TokenizerError(f"token ids must be in [0, {self.vocab_size})")
        data = self._join_bytes(ids, skip_special)
        if self._add_space_prefix and len(ids) and self._token_bytes[ids[0]][:1] == b" " and data[:1] == b" ":
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def _join_bytes(self, ids: Iterable[int], skip_special: bool) -> bytes:
        table = self._token_bytes
        if skip_special:
            hidden = self._hidden_ids
            return b"".join(table[i] for i in ids if i not in hidden)
        return b"".join(table[i] for i in ids)

    def is_hidden(self, token_id: int) -> bool:
        """Whether decode(skip_special=True) drops this token (control and unknown tokens)."""
        return token_id in self._hidden_ids

    # --- export ---

    def hf_tokenizer_json(self) -> str:
        """A `tokenizers` JSON (Tokenizer.to_str()) for this vocabulary, e.g. for llguidance.LLTokenizer.

        For byte-level BPE it is the tokenizer encode() uses. For SentencePiece vocabularies it is a BPE with
        byte fallback whose merges are derived from the scores (as HF's converter does); its token table is
        exact, but its own encoding may differ from llama.cpp's in rare cases: use encode() for ids.
        """
        if self._hf_json is None:
            if self._hf is not None:
                hf = HFTokenizer.from_str(self._hf.to_str())
            else:
                hf = self._build_spm_export()
            hf.encode_special_tokens = False
            self._hf_json = hf.to_str()
        return self._hf_json

    def _build_spm_export(self) -> HFTokenizer:
        scores = self._state["scores"]
        vocab = self._token_to_id
        ranked: list[tuple[float, int, int, str, str]] = []
        for text, i in vocab.items():
            if not self._attrs[i] & _A_NORMAL or len(text) < 2:
                continue
            for k in range(1, len(text)):
                a, b = text[:k], text[k:]
                if a in vocab and b in vocab:
                    ranked.append((-scores[i], vocab[a], vocab[b], a, b))
        ranked.sort()
        merges = [(a, b) for _, _, _, a, b in ranked]
        hf = HFTokenizer(
            models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token=self._unk_text(), fuse_unk=True)
        )
        steps: list[Any] = [normalizers.Replace(" ", "▁")]
        if self._add_space_prefix:
            steps.insert(0, normalizers.Prepend("▁"))
        hf.normalizer = normalizers.Sequence(steps)
        hf.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            + ([decoders.Strip(" ", 1, 0)] if self._add_space_prefix else [])
        )
        self._add_hf_special_tokens(hf)
        return hf

    def _unk_text(self) -> str | None:
        return self._texts[self._unk_id] if self._unk_id is not None else None

    def __repr__(self) -> str:
        pre = f", pre={self._state['pre']!r}" if self._model == "gpt2" else ""
        return f"Tokenizer(model={self._model!r}{pre}, vocab_size={self.vocab_size})"


def _string_list(meta: Mapping[str, Any], key: str) -> list[str]:
    value = meta.get(key)
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not all(isinstance(v, str) for v in value):
        raise TokenizerError(f"{key} must be a list of strings")
    return list(value)


# --- streaming detokenization --------------------------------------------------------------------------

def _complete_prefix_len(data: bytes) -> int:
    """Length of `data` minus a trailing UTF-8 sequence that is still incomplete (at most 3 bytes held)."""
    n = len(data)
    for i in range(n - 1, max(n - 4, -1), -1):
        b = data[i]
        if b & 0xC0 == 0x80:
            continue  # continuation byte: keep looking for its lead byte
        if 0xC2 <= b <= 0xDF:
            need = 2
        elif 0xE0 <= b <= 0xEF:
            need = 3
        elif 0xF0 <= b <= 0xF4:
            need = 4
        else:
            return n  # ASCII or a byte that can never start a sequence
        return i if n - i < need else n
    return n


class StreamingDecoder:
    """Turns generated token ids into text chunks that never split a UTF-8 character.

    Bytes of a character spread over several tokens (emoji, CJK under byte fallback) are held back until it
    is complete. The concatenated chunks equal the decoded bytes of all pushed tokens; unlike
    `Tokenizer.decode`, no leading space is dropped for SentencePiece vocabularies, because generated text
    continues a prompt.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._pending = b""

    def push(self, token_id: int) -> str:
        """Text that became complete with this token ("" while a character is still partial)."""
        if self._skip_special and self._tokenizer.is_hidden(token_id):
            return ""
        data = self._pending + self._tokenizer.token_bytes(token_id)
        cut = _complete_prefix_len(data)
        self._pending = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        """Whatever is held back, with U+FFFD for an incomplete character; resets the decoder."""
        data, self._pending = self._pending, b""
        return data.decode("utf-8", errors="replace")
