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


@pytest.mark.parametrize("argv", [
    ["--ctx-cap", "-5"], ["--max-sessions", "-3"], ["--max-concurrent", "-1"], ["--reasoning-budget", "-1"],
    ["--threads", "-2"], ["--port", "99999"], ["--port", "x"], ["--drain-timeout", "-1"], ["--drain-timeout", "nan"],
    ["--drain-timeout", "inf"], ["--log-level", "bogus"], ["--model", "/m/a.gguf", "--ctx-cap", "-1"],
])
def test_bad_values_stop_the_start_with_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Refused where they are given (as POST /admin/models/load refuses them), not read as the default: a negative
    --drain-timeout got as far as the shutdown, which then failed without saving the sessions."""
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument" in err and "Traceback" not in err


def test_listen_problems_are_found_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli._cannot_listen("127.0.0.1", port)  # in use
        # --no-model: nothing to load, so the answer comes from the listen check alone, at once.
        assert cli.main(["serve", "--no-model", "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert cli._cannot_listen("nosuch.invalid", 8080)
    assert cli._cannot_listen("127.0.0.1", 0) is None
    assert cli.main(["serve", "--no-model", "--model", "/m/a.gguf"]) == 1
    assert "contradict" in capsys.readouterr().err


def test_log_level_takes_any_case() -> None:
    assert cli._parser().parse_args(["serve", "--log-level", "debug"]).log_level == "DEBUG"
    assert cli._parser().parse_args(["serve", "--log-level", "warn"]).log_level == "WARNING"
