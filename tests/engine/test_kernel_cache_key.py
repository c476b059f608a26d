"""The fused CPU kernels' build directory is keyed by everything the build depends on, so two
environments (two virtualenvs with the same torch, another torch build, another compiler, edited
sources) never share, and rebuild over, one directory; the same environment finds its build again."""
from __future__ import annotations

import sys

import pytest
import torch

from pd.engine.cpu import kernels as cpu_kernels


@pytest.fixture
def fresh_name():
    """kernel_name() computed anew (it is cached per process) after the test changed its inputs."""
    def name() -> str:
        cpu_kernels.kernel_name.cache_clear()
        return cpu_kernels.kernel_name()

    yield name
    cpu_kernels.kernel_name.cache_clear()


def test_the_same_environment_gets_the_same_directory(fresh_name, monkeypatch, tmp_path):
    monkeypatch.setenv("PDKV_KERNEL_CACHE", str(tmp_path))
    first = fresh_name()
    assert fresh_name() == first and cpu_kernels.build_directory() == tmp_path / first


@pytest.mark.parametrize("change", ["virtualenv", "torch_path", "torch_version", "cxx11_abi", "compiler", "flags",
                                    "python", "sources"])
def test_another_environment_gets_another_directory(fresh_name, monkeypatch, tmp_path, change):
    monkeypatch.setenv("PDKV_KERNEL_CACHE", str(tmp_path))
    before = fresh_name()
    if change == "virtualenv":
        monkeypatch.setattr(sys, "prefix", sys.prefix + "-other-venv")
    elif change == "torch_path":
        monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    elif change == "torch_version":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + ".post1")
    elif change == "cxx11_abi":
        abi = torch.compiled_with_cxx11_abi()
        monkeypatch.setattr(torch, "compiled_with_cxx11_abi", lambda: not abi)
    elif change == "compiler":
        monkeypatch.setattr(cpu_kernels, "_compiler_version", lambda: "clang++ 99.0")
    elif change == "flags":
        monkeypatch.setattr(cpu_kernels, "_CFLAGS", cpu_kernels._CFLAGS + ["-DPDKV_OTHER"])
    elif change == "python":
        monkeypatch.setattr(sys, "version", "3.99.0 (other)")
    else:
        source = tmp_path / "extra.cpp"
        source.write_text("// another translation unit\n")
        monkeypatch.setattr(cpu_kernels, "_SOURCE_PATHS", cpu_kernels._SOURCE_PATHS + [source])
    after = fresh_name()
    assert after != before and cpu_kernels.build_directory() != tmp_path / before
    monkeypatch.undo()
    assert fresh_name() == before
