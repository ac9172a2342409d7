"""gpulab's own bytecode cache is used exactly where an install has no bytecode and cannot get any."""

from __future__ import annotations

import os
import py_compile
import subprocess
import sys
import textwrap

import pytest

from gpulab import bytecode


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A package standing in for torch's install (its source, no bytecode yet), found on sys.path;
    the cache under tmp_path; sys.pycache_prefix and the environment restored afterwards."""
    package = tmp_path / "site" / "probe_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(bytecode, "PROBE", "probe_pkg")
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    return package


def read_only(monkeypatch, folder) -> None:
    """As a read-only file system answers access(W_OK), root included (EROFS)."""
    real = os.access
    monkeypatch.setattr(bytecode.os, "access", lambda path, mode: False if str(path) == str(folder) else real(path, mode))


def test_a_read_only_install_without_bytecode_gets_gpulab_s_cache(probe, tmp_path, monkeypatch):
    read_only(monkeypatch, probe)
    prefix = bytecode.use_own_cache_where_needed()
    assert prefix == tmp_path / "cache" / "gpulab" / "pycache" and prefix.is_dir()
    assert sys.pycache_prefix == str(prefix)
    assert os.environ["PYTHONPYCACHEPREFIX"] == str(prefix)  # for the ranks and workers gpulab starts


@pytest.mark.parametrize("install", ["has bytecode", "writable"])
def test_an_install_that_has_or_can_write_bytecode_is_left_alone(probe, monkeypatch, install):
    if install == "has bytecode":
        py_compile.compile(str(probe / "__init__.py"), doraise=True)
        read_only(monkeypatch, probe)
    assert bytecode.use_own_cache_where_needed() is None
    assert sys.pycache_prefix is None and "PYTHONPYCACHEPREFIX" not in os.environ


def test_a_prefix_the_user_chose_is_kept(probe, monkeypatch, tmp_path):
    read_only(monkeypatch, probe)
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "mine"))
    assert bytecode.use_own_cache_where_needed() is None
    assert sys.pycache_prefix == str(tmp_path / "mine")


def test_the_cache_is_written_once_and_read_after(tmp_path):
    """Python's side of it, as gpulab uses it: a module imported under the prefix is compiled into
    it on the first run and read from it on the next (no source compiled then)."""
    site = tmp_path / "site"
    (site / "probe_pkg").mkdir(parents=True)
    (site / "probe_pkg" / "__init__.py").write_text("VALUE = 1\n")
    check = textwrap.dedent("""
        import builtins, sys
        compiled = []
        real = builtins.compile
        builtins.compile = lambda *a, **k: (compiled.append(a[1]), real(*a, **k))[1]
        import probe_pkg
        print(sum("probe_pkg" in str(name) for name in compiled))
    """)
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "PYTHONPATH": str(site),
           "PYTHONPYCACHEPREFIX": str(tmp_path / "prefix")}
    runs = [subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert [int(r) for r in runs] == [1, 0]
    assert not (site / "probe_pkg" / "__pycache__").exists()
    assert list((tmp_path / "prefix").rglob("__init__*.pyc"))
