"""Shared bench helpers: the default model, prompts of a given token length, result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from pantheon.config import read_env

RESULTS = Path(__file__).parent / "results"

FILLER = (
    "The history of the printing press begins with movable type in East Asia and continues through "
    "Gutenberg's workshop in Mainz, where metal type, oil-based ink and a screw press came together. "
    "Books became cheaper, literacy spread, and ideas travelled faster than ever before. "
)


def default_model() -> Path:
    path = read_env().default_model_path
    if not path.exists():
        raise SystemExit(f"default model missing at {path}: run `make model` first")
    return path


def prompt_tokens(tokenizer: Any, n: int) -> list[int]:
    text = FILLER
    while len(tokenizer.encode(text)) < n:
        text += FILLER
    return tokenizer.encode(text)[:n]


def median(values: list[float]) -> float:
    return statistics.median(values)


def machine() -> dict[str, Any]:
    # "AMD EPYC" names the Zen 3, Zen 4 and Zen 5 VMs here alike; the family (25: Zen 3 / 4, 26: Zen 5) and the
    # vector instructions tell them apart (and the latter decide which kernels run).
    from pantheon.kernels.cpu import HOST_CPU_FEATURES, cpuinfo_field
    from pantheon.kernels.cpu.int8dot import INT8_ISA, INT8_WIDE

    return {"cpu": cpuinfo_field("model name"), "cpu_family": cpuinfo_field("cpu family"),
            "cores_available": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), "machine": platform.machine(),
            "avx512": "+avx512f" in HOST_CPU_FEATURES, "int8_isa": INT8_ISA, "int8_wide": INT8_WIDE}


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{time.strftime('%Y-%m-%d')}-{name}.json"
    path.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), **payload},
                               indent=2))
    return path


def stat_cpu_s(stat: Path) -> float:
    """User + system CPU seconds so far from a /proc stat file: a process's (/proc/PID/stat) or a thread's
    (/proc/PID/task/TID/stat)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def replace_once(source: str, old: str, new: str, missing: str) -> str:
    """source with its one occurrence of `old` replaced by `new`, for the benches that time scratch copies of a
    module with a statement changed; stops with `missing` (and the statement) when `old` is not there exactly
    once: the copy would time something else."""
    if source.count(old) != 1:
        raise SystemExit(f"{missing}:\n{old}")
    return source.replace(old, new)
