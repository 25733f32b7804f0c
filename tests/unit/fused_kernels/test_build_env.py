"""Extension builds run with this environment's ninja and cache (megatron/fused_kernels/build_env.py), and the
DeepSpeed shm comm op's build announces itself before and after."""
import logging
import os
import subprocess

import pytest

from megatron.fused_kernels import build_env


def test_pin_ninja_puts_the_environments_ninja_first(monkeypatch, tmp_path):
    folder = build_env.environment_ninja_dir()
    assert folder is not None  # pip's ninja package is a dependency (requirements.txt)
    other = tmp_path / "bin"
    other.mkdir()
    (other / "ninja").write_text("#!/bin/sh\necho 1.0.0-other\n")
    (other / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", f"{other}{os.pathsep}/usr/bin")
    assert build_env.pin_ninja() == os.path.join(folder, "ninja")
    assert build_env.pin_ninja() == os.path.join(folder, "ninja")  # idempotent
    assert os.environ["PATH"].split(os.pathsep) == [folder, str(other), "/usr/bin"]
    version = subprocess.run(["ninja", "--version"], capture_output=True, text=True, env=os.environ).stdout
    expected = subprocess.run([os.path.join(folder, "ninja"), "--version"], capture_output=True, text=True).stdout
    assert version == expected and "other" not in version


def test_extensions_dir_defaults_to_the_clone_cache(monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere/else")
    assert build_env.pin_extensions_dir() == "/somewhere/else"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert build_env.pin_extensions_dir() == build_env.REPO_CACHE
    assert os.environ["TORCH_EXTENSIONS_DIR"] == build_env.REPO_CACHE
    assert build_env.REPO_CACHE.endswith(os.path.join(".cache", "torch_extensions"))


@pytest.mark.parametrize("built_before", [False, True])
def test_shm_op_build_announces_itself(monkeypatch, tmp_path, caplog, built_before):
    library = tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    library.parent.mkdir()
    if built_before:
        library.write_bytes(b"old")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(build_env, "shm_op_library", lambda: str(library))
    with caplog.at_level(logging.INFO, logger="megatron"):
        with build_env.announce_shm_op_build():
            if built_before:
                os.utime(library, ns=(1, 1))  # a rebuild replaces the library
            else:
                library.write_bytes(b"new")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == (1 if built_before else 2)
    if not built_before:
        assert messages[0].startswith(f"building DeepSpeed's CPU communication op deepspeed_shm_comm into "
                                      f"{library.parent} with ")
        assert messages[0].endswith(" (once per environment; about a minute)")
    assert messages[-1].startswith("built DeepSpeed's CPU communication op deepspeed_shm_comm in ")
    assert messages[-1].endswith(f" s: {library}")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron"):
        with build_env.announce_shm_op_build():  # cached: not a word
            pass
    assert caplog.records == []


def test_shm_op_library_is_where_torch_builds_it(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert build_env.shm_op_library() == str(tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so")
