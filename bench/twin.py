"""A weight twin of a GGUF model: the same metadata (tokenizer and chat template included), the same tensor names,
shapes and types, and random weights. It is how bench/gpu_check.py serves and times the default model's exact
shapes on a GPU machine that cannot download the model (nothing can be fetched there, and the 98 MB file is more
than one device call may carry).

    python bench/twin.py skeleton MODEL.gguf SKELETON.gguf   # here: the metadata and the tensor list, ~2 MB
    python bench/twin.py build SKELETON.gguf TWIN.gguf       # there: random blocks of the listed types

The random blocks give weights of std ~ 1/sqrt(cols), so activations stay finite; the text a twin writes is
noise, its speed is the model's.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

TWIN_KEY = "pantheon.twin.tensors"  # JSON: [[name, numpy shape, ggml type], ...] in file order
F32, F16 = 0, 1
# ggml type -> (values per block, bytes per block, offset of the fp16 scale d, offset of the fp16 minimum or -1)
BLOCKS = {2: (32, 18, 0, -1), 3: (32, 20, 0, 2), 8: (32, 34, 0, -1)}  # Q4_0, Q4_1, Q8_0


def write_skeleton(model: Path, skeleton: Path) -> None:
    reader = gguf.GGUFReader(str(model))
    writer = gguf.GGUFWriter(str(skeleton), _architecture(reader))
    _copy_metadata(reader, writer)
    plan = [[t.name, [int(n) for n in reversed(t.shape)], int(t.tensor_type)] for t in reader.tensors]
    writer.add_string(TWIN_KEY, json.dumps(plan))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def build_twin(skeleton: Path, out: Path, seed: int = 0) -> Path:
    reader = gguf.GGUFReader(str(skeleton))
    plan = json.loads(reader.fields[TWIN_KEY].contents())
    writer = gguf.GGUFWriter(str(out), _architecture(reader))
    _copy_metadata(reader, writer, skip=(TWIN_KEY,))
    rng = np.random.default_rng(seed)
    write_tensors(writer, plan, _block, lambda name, shape, qtype: _random_tensor(rng, shape, qtype, name))
    writer.close()
    return out


def write_tensors(writer: gguf.GGUFWriter, plan: list, block_of: Callable[[int, str], tuple[int, int]],
                  data_of: Callable[[str, list[int], int], np.ndarray]) -> None:
    """The tensors of `plan` ([name, numpy shape, ggml type], in file order) into a writer that holds the
    metadata: their infos, the header and metadata, then each tensor's data from `data_of`. F32 and F16 tensors
    are typed arrays; a quantized one is its blocks' bytes, `block_of(type, name)` = (values, bytes) a block."""
    for name, shape, qtype in plan:
        if qtype in (F32, F16):
            writer.add_tensor_info(name, shape, np.dtype(np.float32 if qtype == F32 else np.float16),
                                   (4 if qtype == F32 else 2) * int(np.prod(shape)))
        else:
            block, nbytes = block_of(qtype, name)
            byte_shape = (*shape[:-1], shape[-1] // block * nbytes)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                                   raw_dtype=gguf.GGMLQuantizationType(qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape, qtype in plan:
        writer.write_tensor_data(data_of(name, shape, qtype))


def _block(qtype: int, name: str) -> tuple[int, int]:
    if qtype not in BLOCKS:
        raise ValueError(f"{name}: ggml type {qtype} has no twin generator (Q4_0, Q4_1, Q8_0, F16, F32 do)")
    return BLOCKS[qtype][:2]


def _random_tensor(rng: np.random.Generator, shape: list[int], qtype: int, name: str) -> np.ndarray:
    cols = shape[-1]
    if qtype in (F32, F16):
        if len(shape) == 1:  # norm weights
            values = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            values = rng.standard_normal(shape) / np.sqrt(cols)
        return values.astype(np.float32 if qtype == F32 else np.float16)
    block, nbytes, d_at, m_at = BLOCKS[qtype]
    n_blocks = int(np.prod(shape)) // block
    raw = np.frombuffer(rng.bytes(n_blocks * nbytes), np.uint8).reshape(n_blocks, nbytes).copy()
    std = 1.0 / np.sqrt(cols)
    # Uniform quants: int8 has std ~74, a nibble (minus its offset) ~4.6.
    d = std / (74.0 if qtype == 8 else 4.6)
    raw[:, d_at : d_at + 2] = np.full((n_blocks, 1), d, np.float16).view(np.uint8)
    if m_at >= 0:  # Q4_1: value = d * q + m; m = -7.5 d centres it
        raw[:, m_at : m_at + 2] = np.full((n_blocks, 1), -7.5 * d, np.float16).view(np.uint8)
    return raw.reshape(*shape[:-1], cols // block * nbytes)


def _architecture(reader: gguf.GGUFReader) -> str:
    return str(reader.fields["general.architecture"].contents())


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, skip: tuple[str, ...] = ()) -> None:
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", *skip):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), value_type, sub_type=sub_type)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("skeleton", "build"):
        print(__doc__)
        return 2
    (write_skeleton if argv[0] == "skeleton" else build_twin)(Path(argv[1]), Path(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
