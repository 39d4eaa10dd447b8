"""Architecture name -> model class. An unknown architecture is a load error naming it."""

from __future__ import annotations

from typing import Any

from pantheon.errors import ModelLoadError
from pantheon.io.gguf_file import GGUFFile
from pantheon.models.llama import LlamaModel
from pantheon.models.qwen35 import Qwen35Model

ARCHITECTURES: dict[str, Any] = {
    "llama": LlamaModel,
    "qwen35": Qwen35Model,
    "qwen35moe": Qwen35Model,
    "qwen3next": Qwen35Model,
}

# The architectures whose layers can be split over several dies (their models place each layer on
# `models.base.layer_backend`); the others load on one die.
SEGMENTED_ARCHITECTURES = ("llama",)


def load_model(gguf: GGUFFile, backend: Any) -> Any:
    arch = gguf.architecture
    cls = ARCHITECTURES.get(arch)
    if cls is None:
        raise ModelLoadError(
            f"{gguf.path}: unsupported architecture {arch!r} (supported: {', '.join(sorted(ARCHITECTURES))})")
    return cls.from_gguf(gguf, backend)
