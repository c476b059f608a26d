"""The converted-model cache's integrity: where it lives, what a complete entry holds, and
what a dead conversion leaves behind.

Guarantees:
- `cache_root()`: `$PDKV_CACHE_DIR`, else `$XDG_CACHE_HOME/pdkv`, else `~/.cache/pdkv` (the
  same rule as the fused kernels' cache);
- `write_manifest(directory)` records every file's size and xxh3-64 digest in
  `MANIFEST`; `manifest_problem(directory)` re-reads them and names the first file that is
  missing, of another size (truncated) or of another digest (a zeroed chunk, bit rot), or says
  that there is no manifest: such an entry is not served, it is converted again;
- a scratch directory is named after its converting process (pid and host,
  `scratch_dir`); `sweep_dead_scratch(root)` removes those of this host whose process is gone,
  so a killed conversion's leftovers live at most until the next resolve of any model.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import uuid
from pathlib import Path

logger = logging.getLogger(__name__)

MANIFEST = "pdkv-manifest.json"
_CHUNK = 8 << 20
_SCRATCH = re.compile(r"\.tmp-(?P<pid>\d+)-[0-9a-f]{8}(?:-(?P<host>[0-9a-f]{8}))?$")
OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def cache_root() -> Path:
    """The root of pdkv's converted-model cache (see the module docstring)."""
    explicit = os.environ.get("PDKV_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdkv"


def file_digest(path: Path) -> str:
    """xxh3-64 of the file's bytes, read in chunks (hex)."""
    import xxhash

    digest = xxhash.xxh3_64()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path) -> None:
    """Record the size and digest of every file in `directory` (called on a complete conversion)."""
    files = {p.name: {"size": p.stat().st_size, "xxh3_64": file_digest(p)}
             for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def manifest_problem(directory: Path) -> str | None:
    """Why `directory` is not the complete conversion its manifest recorded (None when it is)."""
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
        expected = {str(name): (int(entry["size"]), str(entry["xxh3_64"])) for name, entry in files.items()}
    except FileNotFoundError:
        return f"{directory / MANIFEST}: missing (a conversion by an older pdkv, or an incomplete one)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{directory / MANIFEST}: unreadable ({type(exc).__name__})"
    for name, (size, digest) in sorted(expected.items()):
        path = directory / name
        try:
            actual = path.stat().st_size
        except OSError:
            return f"{path}: missing"
        if actual != size:
            return f"{path}: {actual} bytes, {size} when converted (truncated or overwritten)"
        if file_digest(path) != digest:
            return f"{path}: its content changed since it was converted (digest mismatch)"
    return None


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def scratch_dir(final: Path) -> Path:
    """A sibling of `final` to convert into, named after this process (pid and host)."""
    return final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{_host_tag()}"


def sweep_dead_scratch(root: Path) -> list[Path]:
    """Removes the scratch directories under `root` of conversions of this host whose process is
    gone; returns them. (Another host's, on a shared cache, are left to that host.)"""
    removed: list[Path] = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    host = _host_tag()
    for entry in entries:
        match = _SCRATCH.search(entry.name)
        if match is None or not entry.name.startswith(".") or (match["host"] or host) != host:
            continue
        if _alive(int(match["pid"])):
            continue
        with contextlib.suppress(OSError):
            shutil.rmtree(entry)
            removed.append(entry)
            logger.warning("removed %s, left by a conversion whose process (pid %s) is gone", entry, match["pid"])
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True
