"""The KubeRay manifests' processes, run here for real: the readiness probes against a real Ray node
(token auth on, as KubeRay's authOptions sets it), and the weights init container's script with
`sh` on temp directories standing in for the model volume and the weights image."""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
MANIFESTS = ("kuberay-rayjob.yaml", "kuberay-rayservice.yaml", "kuberay-rayservice-tp.yaml")
AGENT_PORT = 52365  # KubeRay's dashboard-agent-listen-port unless rayStartParams sets one
RAY_IMAGE_UID, RAY_IMAGE_GID = 1000, 100  # Ray's images run as `ray` (uid 1000) in group `users` (gid 100)
START_TIMEOUT_S = 180.0


def _cluster(name: str) -> dict:
    obj = next(d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d)
    return obj["spec"]["rayClusterSpec" if obj["kind"] == "RayJob" else "rayClusterConfig"]


def _groups(cluster: dict) -> list[dict]:
    return [cluster["headGroupSpec"]] + list(cluster.get("workerGroupSpecs", []))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=3)  # (a throwaway node in its own temp dir: no need to wait out Ray's slow stop)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _start_node(agent_port: int, temp_dir: str) -> subprocess.Popen | None:
    """`ray start --head --block` in its own process group; None when it exits before its agent answers."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--port", str(_free_port()),
           "--num-cpus", "1", "--include-dashboard", "false", "--dashboard-agent-listen-port", str(agent_port),
           "--node-ip-address", "127.0.0.1", "--disable-usage-stats", "--temp-dir", temp_dir]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            status, _ = _get(f"http://127.0.0.1:{agent_port}/api/healthz")
        except OSError:
            status = 0
        if status == 200:
            return proc
        if proc.poll() is not None or time.monotonic() > deadline:  # e.g. Ray's 30 s startup limit under load
            _stop(proc)
            return None
        time.sleep(1.0)


@pytest.fixture(scope="module")
def ray_node():
    """One Ray head with token auth, its dashboard agent on a free port; stopped by its own process group."""
    temp_dir = tempfile.mkdtemp(prefix="rayprobe", dir="/tmp")  # short: Ray's socket paths have a length limit
    try:
        for _ in range(3):
            agent_port = _free_port()
            proc = _start_node(agent_port, temp_dir)
            if proc is not None:
                break
        else:
            pytest.fail("ray start did not bring up the dashboard agent in 3 tries")
        try:
            yield {AGENT_PORT: agent_port}
        finally:
            _stop(proc)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_readiness_probe_is_answered_by_a_ray_node(ray_node, name):
    # the node enforces token auth: a route that is not public refuses a probe without the token
    status, _ = _get(f"http://127.0.0.1:{ray_node[AGENT_PORT]}/api/gcs_healthz")
    assert status == 401, status
    for group in _groups(_cluster(name)):
        container = group["template"]["spec"]["containers"][0]
        probe = container.get("readinessProbe")
        assert probe, f"{container['name']}: no readinessProbe of our own (KubeRay would inject its own)"
        http = probe["httpGet"]
        status, body = _get(f"http://127.0.0.1:{ray_node[http['port']]}{http['path']}")
        assert status == 200 and "success" in body, (container["name"], http, status, body)


def _init_script(name: str, root: Path) -> str:
    init = next(c for c in _cluster(name)["headGroupSpec"]["template"]["spec"]["initContainers"]
                if c["name"] == "place-weights")
    assert init["command"][:2] == ["sh", "-c"]
    script = init["command"][2].replace("/models", str(root / "models")).replace("/weights", str(root / "weights"))
    if os.geteuid() != 0:  # only root may give a directory away; the uid is checked below when root
        script = script.replace(f"chown {RAY_IMAGE_UID}:{RAY_IMAGE_GID}", f"chown {os.getuid()}:{os.getgid()}")
    return script


def _run(script: str, path: str) -> subprocess.CompletedProcess:
    env = {"PATH": path, "HOSTNAME": "pdkv-head-0", "HOME": "/tmp"}
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_weights_copy_is_atomic(tmp_path, name):
    weights = tmp_path / "weights" / "my-llama"
    weights.mkdir(parents=True)
    files = {"config.json": b'{"model_type": "llama"}', "model.safetensors": os.urandom(1 << 16),
             "tokenizer.json": b'{"version": "1.0"}'}
    for fname, data in files.items():
        (weights / fname).write_bytes(data)
    (tmp_path / "models").mkdir()
    # an interrupted copy: `cp -r` lands config.json first, then dies
    shim = tmp_path / "shim"
    shim.mkdir()
    real_cp = shutil.which("cp")
    (shim / "cp").write_text(f"""#!/bin/sh
src="$2"; dst="$3"
if [ -d "$dst" ]; then dst="$dst/$(basename "$src")"; fi
mkdir -p "$dst" && {real_cp} "$src/config.json" "$dst/config.json"
exit 1
""")
    (shim / "cp").chmod(0o755)
    script = _init_script(name, tmp_path)
    path = os.environ.get("PATH", "/usr/bin:/bin")

    interrupted = _run(script, f"{shim}:{path}")
    assert interrupted.returncode != 0  # the pod's init container fails and is restarted
    dst = tmp_path / "models" / "my-llama"
    assert not (dst / "config.json").exists(), "an interrupted copy sits where pdkv reads the checkpoint"
    for attempt in range(2):  # the restart copies it all; a further start finds it complete and skips
        done = _run(script, path)
        assert done.returncode == 0, done.stderr
        assert {p.name for p in dst.iterdir()} >= set(files), f"start {attempt + 1}: a truncated copy is kept"
        for fname, data in files.items():
            assert (dst / fname).read_bytes() == data
        assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".")], "a temp copy is left"
    results = tmp_path / "models" / "results"
    assert results.is_dir()
    if os.geteuid() == 0:
        assert (results.stat().st_uid, results.stat().st_gid) == (RAY_IMAGE_UID, RAY_IMAGE_GID)
