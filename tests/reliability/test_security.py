"""Security defaults: no pickle on any wire, secrets everywhere and never empty,
explicit bind addresses, authenticated worker API and KV side channel."""
from __future__ import annotations

import ast
import socket
import time
from pathlib import Path

import pytest
import requests

from connectors.zmq.consumer.consumer import Consumer, RemoteAddr
from connectors.zmq.consumer.consumer_config import ConsumerConfig
from connectors.zmq.control.handshake import CompatInfo
from pd.engine.kv.page_pool import PagePool
from connectors.zmq.producer.producer import ProducerConfig
from connectors.zmq.connector import KVRole, ZmqConnectorConfig
from pd.cluster.config import ConfigError, DeployConfig
from pd.worker.wiring import _model_id
from rel_deploy import SECRET, LocalDeployment, local_config

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("kvcache", "connectors", "pd")
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "jsonpickle"}
FORBIDDEN_METHODS = {"recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized"}
FORBIDDEN_BUILTINS = {"eval", "exec"}  # a bare call; `module.eval()` (torch train/eval mode) is fine


def _sources():
    for pkg in PACKAGES:
        yield from sorted((REPO / pkg).rglob("*.py"))


def test_no_pickle_or_eval_anywhere_in_the_packages(fault_record):
    problems = []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                problems += [f"{where} imports {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
                problems.append(f"{where} imports from {node.module}")
            elif isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                kwargs = {k.arg: k.value for k in node.keywords}
                is_method = isinstance(node.func, ast.Attribute)
                if name in (FORBIDDEN_METHODS if is_method else FORBIDDEN_BUILTINS):
                    problems.append(f"{where} calls {name}")
                if name == "load" and isinstance(node.func, ast.Attribute) and getattr(node.func.value, "id", "") in ("torch", "yaml"):
                    safe = kwargs.get("weights_only")
                    if not (isinstance(safe, ast.Constant) and safe.value is True):
                        problems.append(f"{where} calls {node.func.value.id}.load without a safe loader")
                if "allow_pickle" in kwargs and not (isinstance(kwargs["allow_pickle"], ast.Constant)
                                                     and kwargs["allow_pickle"].value is False):
                    problems.append(f"{where} allows pickle")
                if name in ("unpackb", "Unpacker") and "ext_hook" not in kwargs:
                    problems.append(f"{where} decodes msgpack without refusing extension types")
    assert not problems, "\n".join(problems)
    fault_record(fault="pickle / eval / unsafe loaders on the wire", where="kvcache, connectors, pd (AST scan)",
                 user_saw="-", pdkv_did="none found: msgpack (extension types refused) and JSON only", pools="-")


def test_ray_actor_calls_carry_only_plain_values():
    """Ray pickles call arguments: the worker actor's methods must take str/int/bool and return str/int only."""
    tree = ast.parse((REPO / "pd" / "worker" / "actor.py").read_text())
    actor = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "WorkerActor")
    methods = [n for n in actor.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(methods) >= 3
    for method in methods:
        for arg in method.args.args[1:] + method.args.kwonlyargs:
            assert arg.annotation is not None and ast.unparse(arg.annotation) in ("str", "int", "bool"), \
                (method.name, arg.arg)
        if method.name != "__init__":
            assert method.returns is not None and ast.unparse(method.returns) in ("str", "int", "None"), method.name


def test_secrets_are_required_and_never_empty(fault_record):
    from pd.deploy.launch import Deployment
    from pd.cluster.roles import Role
    from pd.worker.worker import WorkerSpec

    a, b = Deployment(local_config()), Deployment(local_config())
    assert a.secret != b.secret and len(a.secret) >= 32  # a fresh random secret per deployment by default
    for bad in ("", "short"):
        with pytest.raises(ValueError):
            WorkerSpec("w", Role.PREFILL, local_config(), bad)
        with pytest.raises(ValueError):
            ZmqConnectorConfig(engine_id="e", role=KVRole.PRODUCER, secret=bad.encode(), model_id="m")
        with pytest.raises(ValueError):
            ProducerConfig(engine_id="e", secret=bad.encode(), compat_hash="c")
        with pytest.raises(ValueError):
            ConsumerConfig(engine_id="e", secret=bad.encode(), compat_hash="c")
    fault_record(fault="missing or short shared secret", where="launch / worker / connector configs",
                 user_saw="-", pdkv_did="refused (>= 16 bytes); launch generates 64 hex chars per deployment",
                 pools="-")


def test_bind_addresses_are_explicit():
    config = DeployConfig()
    assert config.router.host == "127.0.0.1" and config.transfer.host == "127.0.0.1"
    for section in ("router", "transfer"):
        with pytest.raises(ConfigError, match=f"{section}.host"):
            DeployConfig.from_dict({section: {"host": ""}})
    for path in _sources():  # nothing binds the wildcard address on its own
        text = path.read_text()
        assert "bind(\"tcp://*" not in text and "bind('tcp://*" not in text, path
        assert "create_server((\"\"" not in text and "TCPSite(self._runner, None" not in text, path


def test_worker_api_and_side_channel_require_the_secret(fault_record):
    with LocalDeployment(local_config()) as dep:
        worker = dep.workers["prefill-0"]
        url = worker.url
        assert requests.get(f"{url}/internal/stats", timeout=10).status_code == 401
        for token in ("", "x" * 40, SECRET[:-1] + "!"):
            r = requests.post(f"{url}/internal/generate", json={}, headers={"Authorization": f"Bearer {token}"},
                              timeout=10)
            assert r.status_code == 401
        assert requests.get(f"{url}/internal/stats", headers={"Authorization": f"Bearer {SECRET}"},
                            timeout=10).status_code == 200
        producer = worker._connector.worker.producer
        engine = worker._engine
        compat = CompatInfo.from_groups(_model_id(dep.config), engine.layout.kv_cache_groups(),
                                        engine.page_pool.page_size_bytes).hash()  # right model: only the secret is wrong
        intruder = Consumer(ConsumerConfig(engine_id="intruder", secret=b"not-the-deployment-secret",
                                           compat_hash=compat), PagePool(4, engine.page_pool.page_size_bytes))
        intruder.start()
        try:
            job = intruder.load("x", RemoteAddr(worker._engine.config.engine_id, "127.0.0.1", producer.port),
                                "anything", [1], [1])
            assert job.done.wait(10) and not job.result.ok
            assert job.result.cause.value == "handshake_refused"
        finally:
            intruder.shutdown()
        time.sleep(0.2)
        refused = worker.stats()["transfer"]["handshakes_refused"]
        assert refused.get("auth", 0) >= 1, refused
    fault_record(fault="unauthenticated worker API / KV side channel", where="P worker",
                 user_saw="-", pdkv_did=f"HTTP 401; KV handshake refused ({refused})", pools="-")


def _raw_status(url: str, path: str, authorization: bytes) -> int:
    """The status code of a GET sent as raw bytes over a real socket (no client library re-encodes the header)."""
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.settimeout(10)
        s.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nAuthorization: " + authorization
                  + b"\r\nConnection: close\r\n\r\n")
        head = b""
        while b"\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
    return int(head.split(b" ", 2)[1])


def test_authorization_header_that_is_not_utf8_is_a_401_on_workers_and_router(fault_record):
    bad = (b"Bearer \xff\xfe", b"\xc3\x28", "Bearer cl\u00e9".encode("latin-1"),
           b"Bearer " + SECRET.encode() + b"\xff")
    with LocalDeployment(local_config(router__api_key="router-api-key-0123456789")) as dep:
        statuses = {}
        for wid, worker in dep.workers.items():
            for header in bad:
                statuses[(wid, header)] = _raw_status(worker.url, "/internal/stats", header)
            assert _raw_status(worker.url, "/internal/stats", b"Bearer " + SECRET.encode()) == 200
        for header in bad:
            statuses[("router", header)] = _raw_status(dep.url, "/v1/models", header)
        assert _raw_status(dep.url, "/v1/models", b"Bearer router-api-key-0123456789") == 200
        assert set(statuses.values()) == {401}, statuses
        dep.wait_all_free()
    fault_record(fault="non-UTF-8 Authorization header (raw bytes)", where="worker HTTP API / router",
                 user_saw=f"HTTP 401 ({len(statuses)} requests)", pdkv_did="refused before any body was read",
                 pools="all free")


def test_fault_report_renders_recorded_rows(tmp_path):
    import json

    from pd.tools.fault_report import main, render

    rows = [{"fault": "a|b", "where": "w", "user_saw": "u", "pdkv_did": "d", "pools": "all free"},
            {"fault": "a|b", "where": "w2", "user_saw": "u", "pdkv_did": "d", "pools": "all free"}]
    table = render(rows)
    assert table.count("\n") == 3 and "a\\|b" in table and "| w2 |" in table
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rows))
    assert main([str(path), "--out", str(tmp_path / "t.md")]) == 0
    assert (tmp_path / "t.md").read_text() == table
    (tmp_path / "bad.json").write_text("{")
    assert main([str(tmp_path / "bad.json")]) == 2
