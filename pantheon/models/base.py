"""What every architecture module provides, and the forward batch it consumes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from pantheon.errors import ModelLoadError


@dataclass(frozen=True)
class BatchRow:
    """One sequence's share of a forward step: a prefill chunk or a single decode token.

    `slot` indexes the sequence state pool the caller passes alongside the batch; `start_pos` is the number
    of tokens that slot already holds. `logits` says which of this row's positions need output logits:
    "last" (the next token is sampled), "all" (scoring / golden tests) or "none" (a prefill chunk that is not
    the end of the prompt).
    """

    slot: int
    tokens: np.ndarray  # int32 (n,)
    start_pos: int
    logits: str = "last"


class ArchMetadata:
    """The `<arch>.*` keys of a GGUF's metadata, read the way every architecture's config needs them."""

    def __init__(self, meta: dict[str, Any], arch: str) -> None:
        self.meta, self.arch = meta, arch

    def get(self, key: str, default: Any = None) -> Any:
        """`<arch>.<key>`, else `default`; neither -> a load error naming the key."""
        value = self.meta.get(f"{self.arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {self.arch}.{key}")
        return value

    def vocab_size(self) -> int:
        """`<arch>.vocab_size`, else the length of the tokenizer's token list."""
        return int(self.meta.get(f"{self.arch}.vocab_size") or len(self.meta.get("tokenizer.ggml.tokens", [])))


def begin_forward(backend: Any, k_pools: list[Any], v_pools: list[Any]) -> None:
    """What every forward pass does first: the backend's per-step set-up (the die current on this thread), and
    on the cuda backend the retry of KV rings that had to live in host memory."""
    backend.begin_step()
    heal_rings = getattr(backend, "heal_rings", None)
    if heal_rings is not None:
        heal_rings(k_pools, v_pools)


def layer_backend(backend: Any, layer: int, n_layers: int) -> Any:
    """The backend that holds layer `layer`: `backend`, or on several dies the one of the layer's die."""
    for_layer = getattr(backend, "for_layer", None)
    return backend if for_layer is None else for_layer(layer, n_layers)


def last_backend(backend: Any) -> Any:
    """The backend that holds the output norm and matrix: `backend`, or on several dies the last one's."""
    return getattr(backend, "last", backend)


def output_logits(backend: Any, output: Any, h: Any, batch: list[BatchRow], offsets: Any, vocab_size: int) -> np.ndarray:
    """The logits of the positions the batch asks for. `h` holds the final-normed hidden state of every
    token of the step (rows in batch order, `offsets` the row boundaries); only the wanted rows go through
    the output matrix."""
    wanted: list[int] = []
    for row, a, b in zip(batch, offsets[:-1], offsets[1:]):
        if row.logits == "all":
            wanted.extend(range(a, b))
        elif row.logits == "last":
            wanted.append(b - 1)
    if not wanted:
        return np.empty((0, vocab_size), dtype=np.float32)
    rows = h if len(wanted) == int(offsets[-1]) else backend.gather_rows(h, backend.upload(np.array(wanted, np.int64)))
    return backend.to_host(backend.matmul(output, rows))[:, :vocab_size]


class Model(Protocol):
    architecture: str
    vocab_size: int
    context_length: int

    def new_state(self, n_slots: int, ctx_cap: int) -> Any:
        """Allocate the per-slot sequence state (KV rings, SSM state) for n_slots sequences of ctx_cap tokens."""

    def forward(self, state: Any, batch: list[BatchRow]) -> np.ndarray:
        """Run one step; return float32 logits, one row per requested position, in batch order."""
