"""pd/ uses the connector only through the `KVConnector` seam and the engine only through its
public methods: no reaching into a connector's halves, producer or consumer, and no private
engine fields (e.g. `_step_lock`) outside the engine. Checked on the source (AST)."""
import ast
import typing
from pathlib import Path

from kvcache.audit import assert_all_free
from tests.helpers.engine_cases import FULL_MODEL, engine_config

from connectors.base import KVConnector
from connectors.noop import NoopConnector
from connectors.zmq.connector import ZmqConnector
from pd.engine.engine import Engine
from pd.engine.sample.params import SamplingParams

PD = Path(__file__).resolve().parents[2] / "pd"
INTERNALS = {"consumer", "producer"}  # ZMQ objects behind the connector: never named in pd/
HALVES = {"worker", "scheduler"}  # a connector's halves: pd/ calls the connector itself


def violations(source: str, filename: str = "<src>") -> list[str]:
    """Every place in `source` that goes around the seam, as 'file:line: why'."""
    found = []
    in_engine = filename.endswith("pd/engine/engine.py")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            owner = ast.unparse(node.value)
            if node.attr in INTERNALS:
                found.append(f"{filename}:{node.lineno}: .{node.attr} of {owner}")
            elif node.attr in HALVES and "connector" in owner.lower():
                found.append(f"{filename}:{node.lineno}: connector half {owner}.{node.attr}")
            elif node.attr.startswith("_") and owner.split(".")[-1].lstrip("_") in ("engine", "eng") \
                    and not in_engine:
                found.append(f"{filename}:{node.lineno}: private engine field {owner}.{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in INTERNALS | HALVES | {"_step_lock"}):
            found.append(f"{filename}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_pd_goes_through_the_connector_seam_only():
    files = sorted(PD.rglob("*.py"))
    assert len(files) > 20
    found = [v for path in files for v in violations(path.read_text(), str(path))]
    assert not found, "\n".join(found)


def test_the_check_catches_the_old_ways():
    # What pd/ did before the seam: each must be reported, or the test above proves nothing.
    old = '''
consumer = getattr(getattr(self._connector, "worker", None), "consumer", None)
self._connector.worker.producer.abort_lease(rid)
worker = getattr(connector, "worker", None)
lock = getattr(engine, "_step_lock", None)
with self._engine._step_lock: pass
sched = connector.scheduler
'''
    assert len(violations(old)) == 8, violations(old)
    assert violations("engine.audit(); connector.release_remote(p); self.scheduler.add_request(s)") == []


def test_engine_takes_a_kv_connector():
    assert typing.get_type_hints(Engine.__init__)["connector"] == KVConnector | None
    # every method of both halves is on the seam; a connector adds only the remote-block lifecycle
    assert KVConnector.__abstractmethods__ == {"release_remote", "abort_lease"}
    assert issubclass(NoopConnector, KVConnector) and issubclass(ZmqConnector, KVConnector)
    noop = NoopConnector()
    assert noop.release_remote({"do_remote_prefill": True}) is False and noop.abort_lease("r") is False
    assert noop.get_load_failures() == {} and noop.stats() == {} and noop.shares_page_pool is False


def test_engine_audit_reports_held_blocks_then_all_free():
    eng = Engine(engine_config(FULL_MODEL))
    eng.add_request("r", list(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    eng.step()  # the prompt's blocks are held now
    held = eng.audit()
    assert held.consistent and not held.all_free and held.detail
    while eng.has_unfinished_requests():
        eng.step()
    eng.kv_cache_manager.reset_prefix_cache()
    done = eng.audit()
    assert done.consistent and done.all_free and done.detail == ""
    assert_all_free(eng.kv_cache_manager)
