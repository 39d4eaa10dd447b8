"""Load one served model: GGUF -> model on a backend, tokenizer (cached by file identity), chat template."""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pantheon.config import DEFAULT_CTX_CAP, EnvKnobs, ModelOptions
from pantheon.engine.constraints import grammar_tokenizer
from pantheon.engine.side_compile import CpuSettings, SideCompile, mark_warm, warm_key
from pantheon.engine.side_compile import start as start_side_compile
from pantheon.errors import ModelLoadError
from pantheon.io.chat_template import ChatTemplate, TemplateRenderError
from pantheon.io.gguf_file import GGUFFile, open_gguf
from pantheon.io.tokenizer import Tokenizer, TokenizerError
from pantheon.models.base import last_backend, layer_backend
from pantheon.models.registry import load_model
from pantheon.sched.memory import read_meminfo

log = logging.getLogger("pantheon.models")


@dataclass
class LoadedModel:
    name: str
    options: ModelOptions
    gguf: GGUFFile
    model: Any
    tokenizer: Tokenizer
    template: ChatTemplate
    ctx_cap: int  # the configured per-session window (before any memory-ladder clamp)
    weights_version: int
    created: int
    # llguidance's view of the vocabulary (grammar-constrained decoding); None if it could not be built.
    lltokenizer: Any = None

    @property
    def architecture(self) -> str:
        return self.gguf.architecture


def _load_tokenizer(gguf: GGUFFile, cache_dir: Path | None) -> Tokenizer:
    cache_file = cache_dir / f"{gguf.identity}.tokenizer.json" if cache_dir else None
    if cache_file is not None and cache_file.exists():
        try:
            return Tokenizer.from_json(cache_file.read_text())
        except (TokenizerError, ValueError, KeyError):
            pass  # stale or damaged cache: rebuild below
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    if cache_file is not None:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(".tmp")
            tmp.write_text(tokenizer.to_json())
            tmp.replace(cache_file)
        except OSError:
            pass
    return tokenizer


SAMPLE_STRIDE = 1 << 20  # one 64-byte sample per MiB of tensor data


def weights_version_of(gguf: GGUFFile) -> int:
    """Identifies the weights without reading them all: the file size, the tensor table (names, types, shapes,
    offsets), each tensor's first and last 64 bytes and one 64-byte sample per MiB (about 1/16000 of the
    data, page-cache friendly). The same file gives the same value across restarts and paths; another
    model, quantization or fine-tune differs in the table or the samples. A single byte edited elsewhere
    inside a tensor is not detected: that would need hashing every byte at every load."""
    digest = hashlib.sha256()
    digest.update(str(gguf.path.stat().st_size).encode())
    for name in sorted(gguf.tensors):
        t = gguf.tensors[name]
        digest.update(f"{name}|{t.qtype}|{t.shape}|{t.offset}|{t.nbytes}".encode())
        data = gguf.tensor_bytes(name)
        digest.update(data[:64].tobytes())
        digest.update(data[-64:].tobytes())
        for start in range(SAMPLE_STRIDE, len(data) - 64, SAMPLE_STRIDE):
            digest.update(data[start : start + 64].tobytes())
    return int.from_bytes(digest.digest()[:7], "big")  # < 2**56: exact in JSON numbers everywhere


def _grammar_tokenizer(tokenizer: Tokenizer) -> Any:
    try:
        return grammar_tokenizer(tokenizer)
    except Exception as exc:  # noqa: BLE001 - constrained decoding is optional; serving is not
        log.warning("grammar-constrained decoding unavailable: %s", exc)
        return None


def warm_prefill(model: Any, state: Any = None) -> None:
    """The prefill half of the warm-up (see `_warm_up`): the sampler's and the repetition detector's compiled
    helpers, a 40-token and a 2-token prefill (into slots 0 and 1 of `state`, else of a new one)."""
    from pantheon.engine.repetition import RepetitionDetector
    from pantheon.engine.sampling import (Sampler, SamplingParams, _draw, _kept, _sample_top_k, sample_rows,
                                         top_k)
    from pantheon.models.base import BatchRow

    RepetitionDetector().push(0)
    top_k(np.zeros(4, dtype=np.float32), 2)
    _sample_top_k(np.zeros(4, dtype=np.float32), 2, 1.0, 0.9, 0.05, 0.5)
    _draw(np.zeros(4, dtype=np.float32), 1.0, 0.5)
    _kept(np.zeros(4), 4.0, 0.9, 0.05)
    for rows in (1, 2):  # the batched pick, on one thread and over the threads
        greedy = [(row, Sampler(SamplingParams(temperature=0.0), 4), None) for row in range(rows)]
        sample_rows(np.zeros((rows, 4), dtype=np.float32), greedy)
    state = model.new_state(2, 48) if state is None else state
    model.forward(state, [BatchRow(0, np.arange(40, dtype=np.int32) % model.vocab_size, 0)])
    model.forward(state, [BatchRow(1, np.array([1, 2], np.int32), 0)])


def _warm_up(model: Any, side: SideCompile | None = None) -> None:
    """Run every kernel path once (a short and a long prefill, a batched decode) so numba's compiled code is
    loaded before the first request, which would otherwise pay for it and skew the measured prefill rate.
    The repetition detector's and the sampler's compiled helpers too (the detector runs in the event loop,
    where a first compile would stall every stream). With a child compiling the prefill path (`side`), the
    decode step first (first tokens in both slots), then the child's kernels into the cache, then the rest."""
    from pantheon.models.base import BatchRow

    state = model.new_state(2, 48)
    began = time.perf_counter()
    if side is not None:
        model.forward(state, [BatchRow(0, np.array([3], np.int32), 0), BatchRow(1, np.array([3], np.int32), 0)])
        decoded = time.perf_counter()
        copied = side.finish(decoded - began)
        waited = time.perf_counter()
    warm_prefill(model, state)
    model.forward(state, [BatchRow(0, np.array([3], np.int32), 40), BatchRow(1, np.array([3], np.int32), 2)])
    if side is not None:
        log.info("warm-up %.1f s: the decode step %.1f s, the child %.1f s more (%d of its functions copied into the "
                 "cache), the rest %.1f s", time.perf_counter() - began, decoded - began, waited - decoded, copied,
                 time.perf_counter() - waited)


def _side_compile(options: ModelOptions, env: EnvKnobs, backend: Any) -> tuple[SideCompile | None, str | None]:
    """A child compiling the prefill path beside this load (`side_compile`), and the key of the marker a
    finished warm-up leaves; (None, None) off the cpu backend."""
    from pantheon.kernels.cpu.backend import CpuBackend

    if not isinstance(backend, CpuBackend):
        return None, None
    settings = CpuSettings(int8=backend.int8, threads=backend.threads, quantize=options.quantize)
    key = warm_key(options.path, settings)
    try:
        available = read_meminfo(env.meminfo_path).available_bytes
    except (OSError, ValueError):  # no meminfo to read (not Linux): no child, as with too little memory
        available = 0
    return start_side_compile(options.path, settings, key, available), key


class QuantizeAtLoad:
    """A backend view whose float matrices (F32/F16/BF16, width a multiple of 32) are quantized to Q8_0 as
    they are loaded (`quantize: true`): about half the memory of F16 and a quarter of F32, at ~0.2% relative
    error per weight. Quantized tensors are kept as they are; norms and other vectors stay float."""

    FLOAT_TYPES = (0, 1, 30)
    Q8_0 = 8

    def __init__(self, inner: Any, quantized: list[int] | None = None) -> None:
        self._inner = inner
        self.quantized = quantized if quantized is not None else [0]  # matrices quantized so far (shared)
        self._views: dict[int, QuantizeAtLoad] = {}  # the same view of each die's backend (model on several dies)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _view(self, inner: Any) -> "QuantizeAtLoad":
        if inner is self._inner:
            return self
        if id(inner) not in self._views:
            self._views[id(inner)] = QuantizeAtLoad(inner, self.quantized)
        return self._views[id(inner)]

    def for_layer(self, layer: int, n_layers: int) -> "QuantizeAtLoad":
        """On several dies, this view of the layer's die (its matrices quantized too); else this view."""
        return self._view(layer_backend(self._inner, layer, n_layers))

    @property
    def last(self) -> "QuantizeAtLoad":
        return self._view(last_backend(self._inner))

    def without_int8(self) -> "QuantizeAtLoad":
        """The inner backend's float-activation view, still quantizing at load (a model that asks for it, the
        hybrids, must not lose `quantize: true` on the way)."""
        return QuantizeAtLoad(self._inner.without_int8(), self.quantized)

    def quantizes(self, info: Any) -> bool:
        """Whether the tensor `info` (a GGUF tensor's info) is quantized as it is loaded: a float matrix whose
        rows are whole Q8_0 blocks. Others load as they are (`weight`), so a model may stack them (llama.py)."""
        return info.qtype in self.FLOAT_TYPES and info.cols % 32 == 0 and len(info.shape) >= 2

    def weight(self, gguf: GGUFFile, name: str) -> Any:
        info = gguf.tensors[name]
        if not self.quantizes(info):
            return self._inner.weight(gguf, name)
        from gguf import GGMLQuantizationType, quants

        dense = quants.dequantize(gguf.tensor_bytes(name).reshape(info.rows, -1),
                                  GGMLQuantizationType(info.qtype)).reshape(info.rows, info.cols)
        packed = quants.quantize(dense.astype(np.float32), GGMLQuantizationType.Q8_0)
        self.quantized[0] += 1
        return self._inner.weight_from_raw(np.ascontiguousarray(packed).view(np.uint8), self.Q8_0,
                                           info.rows, info.cols)


def quantized_weights_version(file_version: int) -> int:
    """The weights version of a file's weights after `QuantizeAtLoad` changed some of them: other weights than
    the file's, so a session blob from one never restores into the other (409, as for another file)."""
    digest = hashlib.sha256(f"q8_0-at-load|{file_version}".encode()).digest()
    return int.from_bytes(digest[:7], "big")


@dataclass
class ModelFile:
    """What a load reads from the file, with no backend: the metadata (a child process parses a file seen for
    the first time: seconds), the tokenizers and the chat template. `read_model_file` can run on any thread;
    only building the model and its warm-up forward (`load_served_model`) belong on the forward thread, where
    every other model's decode steps wait behind them."""

    gguf: GGUFFile
    tokenizer: Tokenizer
    template: ChatTemplate
    lltokenizer: Any  # llguidance's view of the vocabulary, or None
    weights_version: int


def read_model_file(options: ModelOptions, env: EnvKnobs) -> ModelFile:
    gguf = open_gguf(options.path, env.cache_dir)
    try:
        tokenizer = _load_tokenizer(gguf, env.cache_dir)
        bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
        eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
        template = ChatTemplate(gguf.metadata.get("tokenizer.chat_template"), bos_token=bos, eos_token=eos)
        return ModelFile(gguf=gguf, tokenizer=tokenizer, template=template,
                         lltokenizer=_grammar_tokenizer(tokenizer), weights_version=weights_version_of(gguf))
    except (TokenizerError, TemplateRenderError) as exc:
        gguf.close()
        raise ModelLoadError(f"{options.path}: {exc}") from None
    except Exception:
        gguf.close()
        raise


def load_served_model(options: ModelOptions, env: EnvKnobs, backend: Any, file: ModelFile | None = None,
                      side_compile: bool = False) -> LoadedModel:
    """The model of options.path on backend, warmed up, with its tokenizer and template. `file`: what
    `read_model_file` read already (elsewhere), which this then owns. `side_compile`: on a first load with
    these settings, compile the prefill path's kernels in a child process meanwhile (`side_compile`)."""
    if file is None:
        file = read_model_file(options, env)
    side, key = _side_compile(options, env, backend) if side_compile else (None, None)
    quantizing = QuantizeAtLoad(backend) if options.quantize else None
    try:
        try:
            model = load_model(file.gguf, quantizing or backend)
        except Exception:
            file.gguf.close()
            raise
        _warm_up(model, side)
    except BaseException:
        if side is not None:
            side.abandon()
        raise
    weights_version = file.weights_version
    if quantizing is not None and quantizing.quantized[0]:
        weights_version = quantized_weights_version(weights_version)
    if key is not None:
        mark_warm(key)
    ctx_cap = options.ctx_cap if options.ctx_cap > 0 else min(DEFAULT_CTX_CAP, model.context_length)
    if ctx_cap > model.context_length:  # asked for: served, as llama-server serves it (memory admission still applies)
        log.warning("%s: --ctx-cap %d is past the %d tokens the model was trained on; positions beyond that may "
                    "give poor output", options.name, ctx_cap, model.context_length)
    return LoadedModel(
        lltokenizer=file.lltokenizer,
        name=options.name,
        options=options,
        gguf=file.gguf,
        model=model,
        tokenizer=file.tokenizer,
        template=file.template,
        ctx_cap=ctx_cap,
        weights_version=weights_version,
        created=int(time.time()),
    )
