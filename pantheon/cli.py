"""Command line: `pantheon serve`, `pantheon pull`, `pantheon --backend`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pantheon.config import (
    DEFAULT_HOST,
    DEFAULT_MODEL_NAME,
    DEFAULT_PORT,
    ModelOptions,
    ServeOptions,
    read_env,
)


def _model_spec(spec: str) -> tuple[Path, str]:
    """PATH or PATH:NAME. A path that exists as given wins, so paths containing ':' still work."""
    path = Path(spec).expanduser()
    if path.exists() or ":" not in spec:
        return path, path.name.removesuffix(".gguf")
    raw_path, name = spec.rsplit(":", 1)
    return Path(raw_path).expanduser(), name or Path(raw_path).name.removesuffix(".gguf")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pantheon", description="OpenAI-compatible server for GGUF models")
    parser.add_argument("--backend", action="store_true", help="print the compiled backend (cpu or cuda) and exit")
    sub = parser.add_subparsers(dest="command")

    serve = sub.add_parser("serve", help="serve models over HTTP")
    serve.add_argument("--model", action="append", default=[], metavar="PATH[:NAME]",
                       help="a GGUF file to serve (repeatable); default: the embedded SmolLM2-135M-Instruct")
    serve.add_argument("--host", default=DEFAULT_HOST)
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    serve.add_argument("--ctx-cap", type=int, default=0, help="per-session context window in tokens")
    serve.add_argument("--max-sessions", type=int, default=0, help="sessions that may hold KV at once (default 4)")
    serve.add_argument("--max-concurrent", type=int, default=0, help="requests decoded at once (default: max-sessions)")
    serve.add_argument("--reasoning-budget", type=int, default=0, help="force </think> after N reasoning tokens")
    serve.add_argument("--threads", type=int, default=0, help="compute threads (default: the cores available)")
    serve.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight turns get at shutdown")
    serve.add_argument("--session-dir", type=Path, default=None,
                       help="save live sessions here at shutdown and restore them at start")
    serve.add_argument("--log-level", default="INFO")

    sub.add_parser("pull", help="download the default model into $PANTHEON_HOME")
    return parser


def _serve(args: argparse.Namespace) -> int:
    import trio

    from pantheon.http.server import serve
    from pantheon.pull import PullError, pull_default_model

    env = read_env()
    specs = [_model_spec(m) for m in args.model]
    if not specs:
        try:
            specs = [(pull_default_model(env), DEFAULT_MODEL_NAME)]
        except PullError as exc:
            print(f"pantheon: {exc}", file=sys.stderr)
            return 1
    models = tuple(
        ModelOptions(path=path, name=name, ctx_cap=args.ctx_cap, max_sessions=args.max_sessions,
                     max_concurrent=args.max_concurrent, reasoning_budget=args.reasoning_budget)
        for path, name in specs
    )
    for m in models:
        if not m.path.is_file():
            print(f"pantheon: model file not found: {m.path}", file=sys.stderr)
            return 1
    options = ServeOptions(host=args.host, port=args.port, models=models, threads=args.threads,
                           drain_timeout_s=args.drain_timeout, session_dir=args.session_dir, env=env)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pantheon.errors import ModelLoadError

    try:
        trio.run(serve, options)
    except ModelLoadError as exc:
        print(f"pantheon: cannot load model: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
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
        return _serve(args)
    _parser().print_help()
    return 2
