"""The C++ extension loader (kernels/cpu_ext.py): a real compile of a one-line kernel into the build cache, its keys,
its lock (a killed build never stalls the next start), the wheel's prebuilt modules and their checks, and a clear
reason whenever it falls back to torch's ops."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from quantkit.kernels import cpu_build, cpu_ext

SMOKE = ("smoke.cpp",)


@pytest.fixture
def toolchain():
    if (missing := cpu_ext.toolchain_missing()) is not None:
        pytest.skip(missing)
    if cpu_ext.active_level() is None:
        pytest.skip(f"no CPU level here: {cpu_ext.level_reason()}")


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A build cache of the test's own, and no cached answers from earlier loads."""
    monkeypatch.setenv("QUANTKIT_EXT_DIR", str(tmp_path / "cache"))
    cpu_ext._resolved.clear()
    cpu_ext._load.cache_clear()
    yield tmp_path / "cache"
    cpu_ext._resolved.clear()
    cpu_ext._load.cache_clear()


def child(code: str, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


LOAD_SMOKE = ("from quantkit.kernels import cpu_ext; import torch; m = cpu_ext.load_cpu_extension('quantkit_smoke', "
              "('smoke.cpp',)); print('loaded' if m is not None and m.affine(torch.ones(2)).tolist() == [3.0, 3.0] "
              "else 'none: ' + str(cpu_ext.cpu_extension_unavailable('quantkit_smoke')))")


@pytest.mark.slow
def test_builds_runs_and_is_loaded_from_the_cache_next_time(toolchain, private_cache):
    mod = cpu_ext.load_cpu_extension("quantkit_smoke", SMOKE)
    assert mod is not None, cpu_ext.cpu_extension_unavailable("quantkit_smoke")
    torch.testing.assert_close(mod.affine(torch.arange(4.0)), torch.arange(4.0) * 2 + 1)
    assert cpu_ext.loaded_from("quantkit_smoke").origin == "built now"
    built = list(private_cache.glob("quantkit_smoke_*/*.so"))
    assert len(built) == 1 and not list(private_cache.glob("*.tmp-*"))  # renamed into place, nothing left over
    again = child(LOAD_SMOKE + "; print(cpu_ext.loaded_from('quantkit_smoke').origin)",
                  {"QUANTKIT_EXT_DIR": str(private_cache)}, timeout=120)
    assert again.stdout.split() == ["loaded", "build", "cache"], again.stderr[-2000:]
    assert "Compiling" not in again.stderr


@pytest.mark.slow
def test_a_build_killed_half_way_does_not_stall_the_next_start(toolchain, private_cache):
    """SIGKILL while the compiler runs (a Ctrl-C, an OOM kill, a pod restarted mid-start); the next start takes the
    lock at once, clears the dead build's folder, builds, and loads."""
    env = {**os.environ, "QUANTKIT_EXT_DIR": str(private_cache)}
    first = subprocess.Popen([sys.executable, "-c", LOAD_SMOKE], env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(private_cache.glob("*.tmp-*/*.o")) and not list(private_cache.glob("*.tmp-*/build.ninja")):
        assert time.monotonic() < deadline and first.poll() is None, "the first build never started"
        time.sleep(0.1)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert list(private_cache.glob("*.tmp-*"))  # the dead build's folder is still there
    start = time.monotonic()
    second = child(LOAD_SMOKE, {"QUANTKIT_EXT_DIR": str(private_cache), "QUANTKIT_BUILD_WAIT": "60"}, timeout=300)
    assert second.stdout.strip() == "loaded", second.stdout + second.stderr[-2000:]
    assert "waiting for another process" not in second.stderr and time.monotonic() - start < 240
    assert not list(private_cache.glob("*.tmp-*"))


def test_waiting_for_another_build_is_said_and_bounded(toolchain, private_cache):
    """A live process holding the build lock: the next one says it waits, and gives up after QUANTKIT_BUILD_WAIT,
    keeping torch's ops with the reason."""
    level = cpu_ext.active_level()
    private_cache.mkdir(parents=True)
    lock = private_cache / f"{cpu_ext.cache_key('quantkit_smoke', SMOKE, level)}.lock"
    with open(lock, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        waited = child(LOAD_SMOKE, {"QUANTKIT_EXT_DIR": str(private_cache), "QUANTKIT_BUILD_WAIT": "1"}, timeout=120)
    assert "quantkit: waiting for another process building quantkit_smoke" in waited.stderr
    assert waited.stdout.startswith("none: ") and "held the lock" in waited.stdout


def test_a_failed_build_returns_none_with_the_reason(toolchain, private_cache, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_ext, "CSRC", tmp_path)
    (tmp_path / "broken.cpp").write_text("this is not C++\n")
    assert cpu_ext.load_cpu_extension("quantkit_broken_test", ("broken.cpp",)) is None
    why = cpu_ext.cpu_extension_unavailable("quantkit_broken_test")
    assert why.startswith(f"{cpu_ext.active_level().name}: build failed: ") and "broken.cpp" in why and "error" in why
    assert "\n" not in why


def test_a_build_says_so_while_it_compiles(toolchain, private_cache, tmp_path, monkeypatch, capsys):
    """A first start compiles for tens of seconds: the user sees which kernel and for how long, on stderr."""
    monkeypatch.setattr(cpu_ext, "CSRC", tmp_path)
    (tmp_path / "broken.cpp").write_text("this is not C++\n")
    cpu_ext.load_cpu_extension("quantkit_said_test", ("broken.cpp",))
    level = cpu_ext.active_level().name
    assert f"Compiling quantkit_said_test_{level} for this CPU" in capsys.readouterr().err


def test_a_cache_that_cannot_be_written_is_one_line_and_torch(toolchain, tmp_path, monkeypatch):
    """(As root a read-only folder is still writable: a path under a file cannot be created by anyone.)"""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("QUANTKIT_EXT_DIR", str(blocker / "cache"))
    monkeypatch.setattr(cpu_ext, "_resolved", {})
    cpu_ext._load.cache_clear()
    try:
        assert cpu_ext.load_cpu_extension("quantkit_smoke", SMOKE) is None
        why = cpu_ext.cpu_extension_unavailable("quantkit_smoke")
        assert "is not writable" in why and "\n" not in why
    finally:
        cpu_ext._load.cache_clear()


def test_the_cache_key_follows_everything_that_changes_a_build(monkeypatch, tmp_path):
    levels = cpu_build.LEVELS
    keys = {cpu_ext.cache_key("quantkit_attn", ("paged_attention_cpu.cpp", "fused_ops_cpu.cpp"), lv) for lv in levels}
    assert len(keys) == len(levels)  # one build per level: a shared home serves every CPU
    amx = cpu_build.level_named("amx")
    key = cpu_ext.cache_key("quantkit_smoke", SMOKE, amx)
    assert key == cpu_ext.cache_key("quantkit_smoke", SMOKE, amx) and key.startswith("quantkit_smoke_amx-")
    monkeypatch.setattr(cpu_ext, "torch_version", lambda: "9.9.9")  # another torch
    assert cpu_ext.cache_key("quantkit_smoke", SMOKE, amx) != key
    monkeypatch.undo()
    monkeypatch.setattr(sys, "prefix", "/another/venv")  # another Python environment
    assert cpu_ext.cache_key("quantkit_smoke", SMOKE, amx) != key
    monkeypatch.undo()
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "smoke.cpp").write_bytes((cpu_build.CSRC / "smoke.cpp").read_bytes())
    monkeypatch.setattr(cpu_ext, "CSRC", csrc)
    assert cpu_ext.cache_key("quantkit_smoke", SMOKE, amx) != key  # the headers differ (none here)


def fake_wheel(tmp_path: Path, monkeypatch, info: dict | None, so_bytes: bytes = b"\x7fELF broken") -> str:
    """A wheel's _ext folder holding a module for the smoke kernel at the active level."""
    level = cpu_ext.active_level()
    name = cpu_build.module_name("quantkit_smoke", level.name)
    wheel = tmp_path / "_ext"
    wheel.mkdir()
    (wheel / f"{name}{cpu_ext.SUFFIX}").write_bytes(so_bytes)
    if info is not None:
        (wheel / cpu_ext.BUILD_INFO).write_text(json.dumps({"modules": {name: info}}))
    monkeypatch.setattr(cpu_ext, "WHEEL_DIR", wheel)
    return name


def test_a_wheel_module_for_another_torch_or_other_sources_is_not_loaded(toolchain, tmp_path, monkeypatch):
    fake_wheel(tmp_path, monkeypatch, {"torch": "1.0.0", "sources": cpu_build.source_digest(SMOKE)})
    level = cpu_ext.active_level()
    assert cpu_ext.wheel_module("quantkit_smoke", SMOKE, level) == \
        (None, f"built for torch 1.0.0, this is torch {cpu_ext.torch_version()}")
    (tmp_path / "_ext" / cpu_ext.BUILD_INFO).write_text(json.dumps({"modules": {
        cpu_build.module_name("quantkit_smoke", level.name): {"torch": cpu_ext.torch_version(), "sources": "0" * 16}}}))
    assert cpu_ext.wheel_module("quantkit_smoke", SMOKE, level) == (None, "built from other sources than these")
    (tmp_path / "_ext" / cpu_ext.BUILD_INFO).unlink()
    assert "has no entry" in cpu_ext.wheel_module("quantkit_smoke", SMOKE, level)[1]


def test_a_damaged_wheel_module_falls_back_with_the_reason(toolchain, private_cache, tmp_path, monkeypatch):
    """A corrupt .so that claims the right torch and sources: the import fails, the cache is tried (here it cannot
    build: no compiler), and the reason names both."""
    fake_wheel(tmp_path, monkeypatch, {"torch": cpu_ext.torch_version(), "sources": cpu_build.source_digest(SMOKE)})
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    assert cpu_ext.load_cpu_extension("quantkit_smoke", SMOKE) is None
    why = cpu_ext.cpu_extension_unavailable("quantkit_smoke")
    assert "no C++ compiler" in why and "does not import" in why and "\n" not in why


@pytest.mark.slow
def test_a_wheel_module_is_loaded_without_a_compiler(toolchain, private_cache, tmp_path, monkeypatch):
    """What a user of the wheel gets: the prebuilt module, no compiler needed."""
    built = cpu_ext.load_cpu_extension("quantkit_smoke", SMOKE)
    assert built is not None
    so = Path(cpu_ext.loaded_from("quantkit_smoke").path)
    fake_wheel(tmp_path, monkeypatch, {"torch": cpu_ext.torch_version(), "sources": cpu_build.source_digest(SMOKE)},
               so.read_bytes())
    code = ("import torch; from pathlib import Path; from quantkit.kernels import cpu_ext; "
            f"cpu_ext.WHEEL_DIR = Path({str(tmp_path / '_ext')!r}); "
            "m = cpu_ext.load_cpu_extension('quantkit_smoke', ('smoke.cpp',)); "
            "print(m.affine(torch.ones(1)).item(), cpu_ext.loaded_from('quantkit_smoke').origin)")
    got = child(code, {"CXX": "no-such-compiler-xyz", "QUANTKIT_EXT_DIR": str(tmp_path / "empty")}, timeout=120)
    assert got.stdout.split() == ["3.0", "wheel"], got.stdout + got.stderr[-2000:]


def test_no_compiler_is_said(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    assert "no C++ compiler" in cpu_ext.toolchain_missing()


def test_at_level_switches_and_restores():
    before = cpu_ext.active_level()
    with cpu_ext.at_level("avx2"):
        assert cpu_ext.active_level().name == "avx2"
        with cpu_ext.at_level(None):
            assert cpu_ext.active_level() is None
            assert cpu_ext.load_cpu_extension("quantkit_smoke", SMOKE) is None
            assert "no CPU level" in cpu_ext.cpu_extension_unavailable("quantkit_smoke")
    assert cpu_ext.active_level() == before
