"""Command line parsing: per-model flags attach to the --model they follow; environment defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from pantheon import cli
from pantheon.config import EnvKnobs, read_env


def test_per_model_flags_attach_to_the_preceding_model() -> None:
    rest, models = cli._split_models(
        ["--ctx-cap", "512", "--model", "/m/a.gguf:a", "--max-sessions", "2", "--port", "9000",
         "--model=/m/b.gguf", "--quantize", "--dies", "0,1", "--threads", "2"])
    assert rest == ["--ctx-cap", "512", "--port", "9000", "--threads", "2"]
    assert models == [("/m/a.gguf:a", ["--max-sessions", "2"]), ("/m/b.gguf", ["--quantize", "--dies", "0,1"])]


def test_model_options_merge_defaults_and_own_flags(tmp_path: Path) -> None:
    argv = ["serve", "--ctx-cap", "512", "--model", f"{tmp_path}/a.gguf:a", "--max-sessions", "2",
            "--model", f"{tmp_path}/b.gguf", "--ctx-cap", "128", "--quantize"]
    rest, specs = cli._split_models(argv[1:])
    args = cli._parser().parse_args(["serve", *rest])
    a = cli._model_options(args, *specs[0], env=None)
    b = cli._model_options(args, *specs[1], env=None)
    assert (a.name, a.ctx_cap, a.max_sessions, a.quantize) == ("a", 512, 2, False)
    assert (b.name, b.ctx_cap, b.max_sessions, b.quantize) == ("b.gguf", 128, 0, True)


def test_model_spec_with_and_without_name(tmp_path: Path) -> None:
    f = tmp_path / "x:y.gguf"
    f.write_bytes(b"")
    assert cli._model_spec(str(f)) == (f, "x:y.gguf")  # an existing path with ":" is a path
    assert cli._model_spec("/no/such.gguf:name") == (Path("/no/such.gguf"), "name")
    assert cli._model_spec("/no/such.gguf") == (Path("/no/such.gguf"), "such.gguf")  # the basename, as the load route
    # A ~user the system does not know is no exception: the path as written, a file not found at load.
    assert cli._model_spec("~no_such_user_zq/a.gguf") == (Path("~no_such_user_zq/a.gguf"), "a.gguf")


def test_cpu_int8_is_the_default_and_zero_selects_float() -> None:
    assert EnvKnobs(home=Path("/h")).cpu_int8 is True
    assert read_env({}).cpu_int8 is True
    assert read_env({"PANTHEON_CPU_INT8": ""}).cpu_int8 is True
    assert read_env({"PANTHEON_CPU_INT8": "1"}).cpu_int8 is True
    for off in ("0", "false", "no", "off", " OFF "):
        assert read_env({"PANTHEON_CPU_INT8": off}).cpu_int8 is False, off


def test_stream_interval_defaults_to_30_ms_and_reads_the_env() -> None:
    assert read_env({}).stream_interval_ms == 30.0
    assert read_env({"PANTHEON_STREAM_INTERVAL_MS": "0"}).stream_interval_ms == 0.0
    assert read_env({"PANTHEON_STREAM_INTERVAL_MS": "2.5"}).stream_interval_ms == 2.5
    assert read_env({"PANTHEON_STREAM_INTERVAL_MS": "-3"}).stream_interval_ms == 0.0
    with pytest.raises(SystemExit, match="PANTHEON_STREAM_INTERVAL_MS"):
        read_env({"PANTHEON_STREAM_INTERVAL_MS": "soon"})
