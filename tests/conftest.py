from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pantheon.config import read_env
from tests.server_process import ServerProcess


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    path = read_env().default_model_path
    if not path.exists():
        pytest.fail(f"default model missing at {path}: run `make test` (it runs `pantheon pull`) first")
    return path


@pytest.fixture(scope="session")
def smollm_server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One real server on the default model, shared by the end-to-end tests that don't restart it."""
    log = tmp_path_factory.mktemp("server") / "serve.log"
    server = ServerProcess(["--model", f"{default_model_path}:SmolLM2-135M-Instruct", "--max-sessions", "4"],
                           log_path=log).start()
    yield server
    server.stop()
