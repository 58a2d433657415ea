"""The C++ extension builder: a real compile of a one-line kernel, and a clear reason when a build fails."""

import pytest
import torch

from quantkit.kernels import cpu_ext


@pytest.mark.slow
def test_builds_and_runs_a_kernel(tmp_path, monkeypatch):
    if (missing := cpu_ext.toolchain_missing()) is not None:
        pytest.skip(missing)
    mod = cpu_ext.load_cpu_extension("quantkit_smoke", ("smoke.cpp",))
    assert mod is not None, cpu_ext.cpu_extension_unavailable("quantkit_smoke")
    torch.testing.assert_close(mod.affine(torch.arange(4.0)), torch.arange(4.0) * 2 + 1)


def test_a_failed_build_returns_none_with_the_reason(tmp_path, monkeypatch):
    if (missing := cpu_ext.toolchain_missing()) is not None:
        pytest.skip(missing)
    monkeypatch.setattr(cpu_ext, "CSRC", tmp_path)
    monkeypatch.setenv("QUANTKIT_EXT_DIR", str(tmp_path / "build"))
    (tmp_path / "broken.cpp").write_text("this is not C++\n")
    assert cpu_ext.load_cpu_extension("quantkit_broken_test", ("broken.cpp",)) is None
    assert cpu_ext.cpu_extension_unavailable("quantkit_broken_test").startswith("build failed")


def test_a_build_says_so_while_it_compiles(tmp_path, monkeypatch, capsys):
    """A first start compiles for tens of seconds: the user sees which kernel and for how long, on stderr."""
    if (missing := cpu_ext.toolchain_missing()) is not None:
        pytest.skip(missing)
    monkeypatch.setattr(cpu_ext, "CSRC", tmp_path)
    monkeypatch.setenv("QUANTKIT_EXT_DIR", str(tmp_path / "build"))
    (tmp_path / "broken.cpp").write_text("this is not C++\n")
    cpu_ext.load_cpu_extension("quantkit_said_test", ("broken.cpp",))
    assert "Compiling quantkit_said_test for this CPU (once per checkout)" in capsys.readouterr().err


def test_built_means_a_module_no_older_than_its_sources_and_headers(tmp_path, monkeypatch):
    import os

    monkeypatch.setattr(cpu_ext, "CSRC", tmp_path)
    monkeypatch.setenv("QUANTKIT_EXT_DIR", str(tmp_path / "build"))
    (tmp_path / "k.cpp").write_text("")
    (tmp_path / "k.h").write_text("")
    assert not cpu_ext.is_built("quantkit_k", ("k.cpp",))  # never built
    so = cpu_ext.extension_dir("quantkit_k") / "quantkit_k.so"
    so.parent.mkdir(parents=True)
    so.write_bytes(b"")
    os.utime(tmp_path / "k.cpp", (1000, 1000))
    os.utime(tmp_path / "k.h", (1000, 1000))
    os.utime(so, (2000, 2000))
    assert cpu_ext.is_built("quantkit_k", ("k.cpp",))
    os.utime(tmp_path / "k.h", (3000, 3000))  # a header changed since: torch's builder will compile again
    assert not cpu_ext.is_built("quantkit_k", ("k.cpp",))


def test_each_checkout_builds_in_a_folder_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_EXT_DIR", str(tmp_path))
    here = cpu_ext.extension_dir("quantkit_attn")
    monkeypatch.setattr(cpu_ext, "CSRC", tmp_path / "other-clone" / "kernels" / "csrc")
    there = cpu_ext.extension_dir("quantkit_attn")
    assert here.parent == there.parent == tmp_path and here != there
    assert here.name.startswith("quantkit_attn-") and there.name.startswith("quantkit_attn-")


def test_no_compiler_is_said(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    assert "no C++ compiler" in cpu_ext.toolchain_missing()
