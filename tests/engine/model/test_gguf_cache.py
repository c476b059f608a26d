"""The converted GGUF cache is verified before it is served: a zeroed chunk or a truncated file
is noticed (a warning naming the file) and converted again; scratch directories of dead
conversions are removed; a full disk is one `error:` line naming the cache; XDG_CACHE_HOME
moves the cache. (Beside gguf_cases.py, which writes the tiny GGUF files.)"""
from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="the gguf package reads GGUF files")
pytest.importorskip("transformers", reason="gguf_cases builds its models with transformers")

from gguf_cases import hf_model, train_tokenizer, write_gguf

from pd.cluster.config import ConfigError
from pd.deploy.config_check import error_line, load_checked_config
from pd.engine.model.gguf import resolve_checkpoint
from pd.engine.model.model_cache import MANIFEST, manifest_problem, sweep_dead_scratch

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    tokens, merges = train_tokenizer()
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", hf_model("llama", len(tokens)), tokens, merges)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PDKV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _reconverted(path, caplog, damage) -> None:
    first = resolve_checkpoint(path)
    weights = first / "model.safetensors"
    good = weights.read_bytes()
    damage(weights)
    assert weights.read_bytes() != good
    with caplog.at_level(logging.WARNING, logger="pd.engine.model.gguf"):
        again = resolve_checkpoint(path)
    assert again == first and manifest_problem(again) is None
    from safetensors.numpy import load, load_file

    served, converted = load_file(str(weights)), load(good)  # converted again: the same tensors
    assert served.keys() == converted.keys() and all((served[k] == converted[k]).all() for k in served)
    assert any(str(weights) in record.getMessage() and "converting it again" in record.getMessage()
               for record in caplog.records)


def _zero_a_chunk(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2)
        handle.write(b"\0" * 4096)


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1000)


def test_a_cache_with_a_zeroed_chunk_is_converted_again(tiny_gguf, cache_dir, caplog):
    _reconverted(tiny_gguf, caplog, _zero_a_chunk)


def test_a_truncated_cache_file_is_converted_again(tiny_gguf, cache_dir, caplog):
    _reconverted(tiny_gguf, caplog, _truncate)


def test_an_entry_without_a_manifest_is_not_served(tiny_gguf, cache_dir):
    first = resolve_checkpoint(tiny_gguf)
    (first / MANIFEST).unlink()
    assert "missing" in manifest_problem(first)
    assert manifest_problem(resolve_checkpoint(tiny_gguf)) is None


def test_scratch_directories_of_dead_conversions_are_removed(tiny_gguf, cache_dir):
    """A conversion killed mid-way leaves its scratch directory; the next resolve (of any model) removes it,
    and leaves a live conversion's alone."""
    code = ("import os, sys; from pathlib import Path; from pd.engine.model import gguf\n"
            "def killed(src, out):\n    Path(out).mkdir(parents=True); (Path(out) / 'part').write_bytes(b'x' * 4096)\n"
            "    os._exit(9)\n"
            "gguf.convert_gguf = killed\ngguf.resolve_checkpoint(sys.argv[1])\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code, str(tiny_gguf)], env=env, timeout=120, capture_output=True)
    assert done.returncode == 9, done.stderr
    root = cache_dir / "gguf"
    left = [p for p in root.iterdir() if p.is_dir()]
    assert len(left) == 1 and ".tmp-" in left[0].name  # what a killed conversion leaves
    live = root / f".other.tmp-{os.getpid()}-0123abcd"  # this process is alive: not swept
    live.mkdir()
    final = resolve_checkpoint(tiny_gguf)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == sorted([final.name, live.name])
    assert sweep_dead_scratch(root) == []


def test_a_full_disk_is_one_error_line_naming_the_cache(tiny_gguf, cache_dir, tmp_path, monkeypatch):
    import safetensors.numpy

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    config = tmp_path / "deploy.yaml"
    config.write_text(f"model:\n  path: {tiny_gguf}\n")
    with pytest.raises(ConfigError) as info:
        load_checked_config(config)
    line = error_line(info.value)
    assert "\n" not in line and str(cache_dir / "gguf") in line and "No space left" in line, line
    assert not any(p.is_dir() for p in (cache_dir / "gguf").iterdir())  # the scratch directory went too


def test_the_gguf_cache_honours_xdg_cache_home(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.delenv("PDKV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_checkpoint(tiny_gguf).parent == tmp_path / "xdg" / "pdkv" / "gguf"
