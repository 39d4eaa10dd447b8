"""Command line: `pantheon serve`, `pantheon pull`, `pantheon --backend`."""

from __future__ import annotations

import argparse
import errno
import logging
import math
import socket
import sys
from pathlib import Path
from typing import Any

from pantheon.config import (
    DEFAULT_HOST,
    DEFAULT_MODEL_NAME,
    DEFAULT_PORT,
    ModelOptions,
    ServeOptions,
    default_model_name,
    model_file_path,
    read_env,
)


def _model_spec(spec: str) -> tuple[Path, str]:
    """PATH or PATH:NAME. A path that exists as given wins, so paths containing ':' still work."""
    path = model_file_path(spec)
    if path.exists() or ":" not in spec:
        return path, default_model_name(path)
    raw_path, name = spec.rsplit(":", 1)
    path = model_file_path(raw_path)
    return path, name or default_model_name(path)


def _add_model_flags(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """The per-model options (the same set POST /admin/models/load takes)."""
    d = (lambda v: v) if defaults else (lambda v: argparse.SUPPRESS)
    count = _non_negative_int
    parser.add_argument("--ctx-cap", type=count, default=d(0), help="per-session context window in tokens")
    parser.add_argument("--max-sessions", type=count, default=d(0),
                        help="sessions that may hold KV at once (default 4)")
    parser.add_argument("--max-concurrent", type=count, default=d(0),
                        help="requests decoded at once (default: max-sessions)")
    parser.add_argument("--reasoning-budget", type=count, default=d(0),
                        help="force </think> after N reasoning tokens")
    parser.add_argument("--dies", type=_dies, default=d(()), help="accelerator dies for the model, e.g. 0,1")
    parser.add_argument("--quantize", action="store_true", default=d(False), help="INT8-quantize float weights at load")


# Values refused where they are given, as POST /admin/models/load refuses them, rather than read as the default.
def _non_negative_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants an integer, got {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value!r}")
    return number


def _port(value: str) -> int:
    number = _non_negative_int(value)
    if number > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0-65535, got {value!r}")
    return number


def _seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a number of seconds, got {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {value!r}")
    return number


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(value: str) -> str:
    level = {"WARN": "WARNING", "FATAL": "CRITICAL"}.get(value.upper(), value.upper())  # logging's own aliases
    if level not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"is one of {', '.join(_LOG_LEVELS)} (any case), got {value!r}")
    return level


def _dies(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--dies wants comma-separated integers, got {value!r}") from None


MODEL_FLAGS = {"--ctx-cap", "--max-sessions", "--max-concurrent", "--reasoning-budget", "--dies", "--quantize"}
GIL_SWITCH_INTERVAL_S = 0.00005  # see _serve


def _split_models(argv: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Per-model flags that follow a --model attach to that model; before the first --model they are defaults
    for every model. Returns (the other arguments, [(model spec, its flags)])."""
    rest: list[str] = []
    models: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, inline = arg.partition("=")
        if flag == "--model":
            if not eq and i + 1 >= len(argv):
                raise SystemExit("pantheon serve: --model needs PATH[:NAME]")
            models.append((inline if eq else argv[i + 1], []))
            i += 1 if eq else 2
            continue
        if models and flag in MODEL_FLAGS:
            takes_value = flag != "--quantize" and not eq
            models[-1][1].extend(argv[i : i + (2 if takes_value else 1)])
            i += 2 if takes_value else 1
            continue
        rest.append(arg)
        i += 1
    return rest, models


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pantheon", description="OpenAI-compatible server for GGUF models")
    parser.add_argument("--backend", action="store_true", help="print the compiled backend (cpu or cuda) and exit")
    sub = parser.add_subparsers(dest="command")

    serve = sub.add_parser("serve", help="serve models over HTTP",
                           epilog="Per-model flags after a --model apply to that model only; before the first "
                                  "--model they are defaults for every model.")
    serve.add_argument("--model", action="append", default=[], metavar="PATH[:NAME]",
                       help="a GGUF file to serve (repeatable); default: the embedded SmolLM2-135M-Instruct")
    serve.add_argument("--no-model", action="store_true",
                       help="start with no model (load them later with POST /admin/models/load)")
    serve.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    serve.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    _add_model_flags(serve, defaults=True)
    serve.add_argument("--threads", type=_non_negative_int, default=0,
                       help="compute threads (default: the cores available)")
    serve.add_argument("--drain-timeout", type=_seconds, default=30.0,
                       help="seconds in-flight turns get at shutdown (default 30)")
    serve.add_argument("--session-dir", type=Path, default=None,
                       help="save live sessions here at shutdown and restore them at start")
    serve.add_argument("--log-level", type=_log_level, default="INFO", help="DEBUG, INFO (default), WARNING, ...")

    sub.add_parser("pull", help="download the default model into $PANTHEON_HOME")
    return parser


def _model_options(args: argparse.Namespace, spec: str | None, flags: list[str], env: Any) -> ModelOptions:
    per_model = argparse.ArgumentParser(prog=f"pantheon serve --model {spec}")
    _add_model_flags(per_model, defaults=False)
    own = vars(per_model.parse_args(flags))
    if spec is None:
        path, name = pull_default(env), DEFAULT_MODEL_NAME
    else:
        path, name = _model_spec(spec)

    def pick(key: str) -> Any:
        return own.get(key, getattr(args, key))

    return ModelOptions(path=path, name=name, ctx_cap=pick("ctx_cap"), max_sessions=pick("max_sessions"),
                        max_concurrent=pick("max_concurrent"), reasoning_budget=pick("reasoning_budget"),
                        dies=pick("dies"), quantize=pick("quantize"))


def pull_default(env: Any) -> Path:
    from pantheon.pull import PullError, pull_default_model

    try:
        return pull_default_model(env)
    except PullError as exc:
        raise SystemExit(f"pantheon: {exc}") from None


def _serve(args: argparse.Namespace, model_specs: list[tuple[str, list[str]]]) -> int:
    import trio

    from pantheon.errors import ModelLoadError
    from pantheon.http.server import serve

    env = read_env()
    if args.no_model and model_specs:
        print("pantheon: --no-model and --model contradict each other: give one", file=sys.stderr)
        return 1
    problem = _cannot_listen(args.host, args.port)
    if problem:  # found before the model loads (and, on a first start, its kernels compile), not after
        print(f"pantheon: cannot listen on {args.host}:{args.port}: {problem}", file=sys.stderr)
        return 1
    if args.no_model:
        models: tuple[ModelOptions, ...] = ()
    elif not model_specs:
        models = (_model_options(args, None, [], env),)
    else:
        models = tuple(_model_options(args, spec, flags, env) for spec, flags in model_specs)
    for m in models:
        if not m.path.is_file():
            print(f"pantheon: model file not found: {m.path}", file=sys.stderr)
            return 1
    if args.session_dir is not None:
        from pantheon.sched.persistence import check_session_dir

        try:
            check_session_dir(Path(args.session_dir))
        except OSError as exc:  # found now, not as every session lost at the next shutdown
            print(f"pantheon: --session-dir {args.session_dir} cannot be written: {exc}", file=sys.stderr)
            return 1
    options = ServeOptions(host=args.host, port=args.port, models=models, threads=args.threads,
                           drain_timeout_s=args.drain_timeout, session_dir=args.session_dir, env=env)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The forward thread needs the GIL between its compiled steps (sampling, the next step's rows, handing
    # the results to the event loop) while the event loop formats and sends tokens; a thread that waits for
    # the GIL asks its holder to drop it only after the switch interval (Python's default: 5 ms). 0.2 ms
    # bounded that wait; 0.05 ms measured better again on the 2-core test VM: HTTP decode A/B against 0.2 ms
    # (both servers up, alternating rounds, 96 tokens a stream; medians of per-round ratios), 1 stream +4.7% /
    # +2.8% and 8 streams +4.4% / +2.3% in two runs of 6 and 8 rounds; 0.01 ms gave +3% / +3%.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    failed: list[BaseException] = []
    try:
        trio.run(serve, options)
    except* ModelLoadError as group:
        failed.extend(group.exceptions)
    except* KeyboardInterrupt:
        pass
    except* OSError as group:
        listen = [exc for exc in group.exceptions if isinstance(exc, socket.gaierror)
                  or getattr(exc, "errno", None) in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)]
        if len(listen) < len(group.exceptions):
            raise
        # The address was taken between the check above and the bind.
        failed.append(OSError(f"cannot listen on {args.host}:{args.port}: {listen[0]}"))
    for exc in failed:
        what = exc if isinstance(exc, OSError) else f"cannot load model: {exc}"
        print(f"pantheon: {what}", file=sys.stderr)
    return 1 if failed else 0


def _cannot_listen(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (an unknown host, a port in use), or None. A trial bind
    with the options hypercorn binds with, released at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        return str(exc)
    family, kind, proto, _, address = infos[0]
    try:
        with socket.socket(family, kind, proto) as trial:
            trial.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            trial.bind(address)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    model_specs: list[tuple[str, list[str]]] = []
    if "serve" in argv:
        at = argv.index("serve") + 1
        rest, model_specs = _split_models(argv[at:])
        argv = argv[:at] + rest
    args = _parser().parse_args(argv)
    if args.backend:
        from pantheon.buildinfo import compiled_backend

        print(compiled_backend())
        return 0
    if args.command == "pull":
        from pantheon.pull import PullError, pull_default_model

        try:
            print(pull_default_model(read_env()))
        except PullError as exc:
            print(f"pantheon: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.command == "serve":
        return _serve(args, model_specs)
    _parser().print_help()
    return 2
