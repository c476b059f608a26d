"""The house rules of the import graph, read from the source (TYPE_CHECKING imports included):

    pd.tools -> pd.deploy -> pd.router | pd.worker -> pd.cluster -> pd.engine -> connectors -> kvcache

A module may import its own room and any room below it, never one above or beside it
(router and worker do not import each other), and no set of modules imports itself in a loop.

Inside `pd.engine`: its rooms point down too (`ENGINE_RANKS`: the model never imports attention,
runner or scheduler; attention imports neither the scheduler nor the CPU kernels (`pd.engine.cpu`,
whose step executor builds on attention); the runner builds on them all); the rooms above it import
only its public parts (`ENGINE_PUBLIC`); what the router reaches
of it imports no torch, and `sample/params.py` (the router builds sampling params too) none at all.
`parallel/` (tensor parallelism) imports only the standard library, torch, msgpack and the KV, model and
config rooms (its follower, a gang's rank r > 0, the runner too).

Inside `connectors`: the contract at the top (`CONTRACT`) imports no implementation; the ZMQ
implementation lives in `connectors.zmq` (its rooms import each other only as `ZMQ_ROOM_IMPORTS`
says); the rigs (emulated and faulty links, fault plans) in `connectors.links`, which the runtime
reaches only through the doors in `LINK_DOORS`, each the place where a config (the fault plan,
`transfer.emulated_link`) selects a rig.
"""
from __future__ import annotations

import ast
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kvcache", "connectors", "pd")

# Rank of each room: a module may import rooms of strictly lower rank, or its own room.
RANKS = {
    "kvcache": 0,
    "connectors": 1,
    "pd.engine": 2,
    "pd.cluster": 3,
    "pd.router": 4,
    "pd.worker": 4,
    "pd.deploy": 5,
    "pd.tools": 6,
    "pd": 7,  # the entry points at pd/ top level (pd/launch.py, pd/loadgen.py)
}

# The connector contract: what the engine and any implementation share. It imports nothing else of connectors.
CONTRACT = frozenset({"connectors.base", "connectors.pages", "connectors.params", "connectors.metrics"})
# connectors/ top level: the contract, and the connector that moves nothing (built on the contract alone).
CONNECTORS_TOP = CONTRACT | {"connectors", "connectors.noop"}
LINKS = "connectors.links"
# The only runtime modules that import the rigs, and what each may import from them (kept exact).
LINK_DOORS = {
    # the fault plan: its grammar and point names (checked at config time, no sockets loaded) ...
    "pd.cluster.fault_rules": {"connectors.links.faults", "connectors.links.fault_points"},
    "pd.cluster.config": {"connectors.links.faults", "connectors.links.link_shape"},
    # ... and where it selects a FaultLink in front of a producer a decode worker pulls from
    "pd.worker.faults": {"connectors.links.faults", "connectors.links.fault_link"},
    # `transfer.emulated_link`: its shape, and the producer that starts the EmulatedLink it names
    "connectors.zmq.transfer_settings": {"connectors.links.link_shape"},
    "connectors.zmq.connector": {"connectors.links.emulated_link", "connectors.links.link_shape"},
}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _room(module: str) -> str:
    for room in sorted(RANKS, key=len, reverse=True):
        if module == room or module.startswith(room + "."):
            return room
    raise AssertionError(f"{module} is in no room")


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                targets.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
    return {t for t in targets if t in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _against_layering(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in graph.items():
        room = _room(module)
        for target in targets:
            other = _room(target)
            if other != room and RANKS[other] >= RANKS[room]:
                wrong.append(f"{module} -> {target}")
    return wrong


def test_rooms_point_down_only():
    wrong = _against_layering(_graph())
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _against_contract(graph: dict[str, set[str]]) -> list[str]:
    """Imports of connectors' top level (the contract, the no-op connector) into an implementation."""
    return [f"{m} -> {t}" for m, targets in graph.items() if m in CONNECTORS_TOP
            for t in targets if _in(t, "connectors") and t not in (CONTRACT if m in CONTRACT else CONNECTORS_TOP)]


def _against_link_doors(graph: dict[str, set[str]]) -> list[str]:
    """Runtime imports of the rigs outside `LINK_DOORS`, and doors that no longer import what they list."""
    wrong = []
    for module, targets in graph.items():
        if _in(module, LINKS) or _in(module, "pd.tools"):
            continue
        rigs = {t for t in targets if _in(t, LINKS)}
        allowed = LINK_DOORS.get(module, set())
        wrong += [f"{module} -> {t}" for t in sorted(rigs - allowed)]
        wrong += [f"{module} no longer imports {t} (stale door)" for t in sorted(allowed - rigs)]
    wrong += [f"{door} is not a module" for door in LINK_DOORS if door not in graph]
    return wrong


def test_contract_imports_no_implementation():
    wrong = _against_contract(_graph())
    assert not wrong, "connectors' top level imports an implementation:\n" + "\n".join(sorted(wrong))


def test_runtime_reaches_the_rigs_only_through_the_config_doors():
    wrong = _against_link_doors(_graph())
    assert not wrong, "imports of connectors.links outside LINK_DOORS:\n" + "\n".join(wrong)


def test_the_connector_checks_see_wrong_imports():
    """Both connector checks on a made-up graph: a contract module importing the ZMQ implementation,
    the no-op connector importing a link, an engine module importing a rig, a door that went stale."""
    graph = {"connectors.base": {"connectors.metrics", "connectors.zmq.control.wire"},
             "connectors.params": {"connectors.noop"},
             "connectors.noop": {"connectors.base", "connectors.links.faults"},
             "connectors.zmq.control.wire": {"connectors.base"},
             "pd.engine.engine": {"connectors.links.fault_link"},
             "pd.tools.planner_bench": {"connectors.links.emulated_link"},
             "connectors.links.fault_link": {"connectors.zmq.control.wire"},
             **{door: set(rigs) for door, rigs in LINK_DOORS.items()}}
    graph["pd.worker.faults"] = {"connectors.links.faults"}
    assert sorted(_against_contract(graph)) == ["connectors.base -> connectors.zmq.control.wire",
                                                "connectors.noop -> connectors.links.faults",
                                                "connectors.params -> connectors.noop"]
    assert _against_link_doors(graph) == ["connectors.noop -> connectors.links.faults",
                                          "pd.engine.engine -> connectors.links.fault_link",
                                          "pd.worker.faults no longer imports connectors.links.fault_link (stale door)"]


# Inside `connectors.zmq`: what each room may import of the others. Control (wire, framing, handshake,
# sessions) is shared by both sides and imports no other room; the data paths build on control alone,
# so a path never reaches into the producer's or the consumer's state; the producer and the consumer
# do not import each other. The gang room (KV between TP gangs, each rank its heads) builds on control
# and the paths, and both sides use it.
ZMQ_ROOM_IMPORTS = {
    "connectors.zmq.control": set(),
    "connectors.zmq.paths": {"connectors.zmq.control"},
    "connectors.zmq.producer": {"connectors.zmq.control", "connectors.zmq.paths", "connectors.zmq.streaming",
                                "connectors.zmq.gang"},
    "connectors.zmq.consumer": {"connectors.zmq.control", "connectors.zmq.paths", "connectors.zmq.streaming",
                                "connectors.zmq.gang"},
    "connectors.zmq.gang": {"connectors.zmq.control", "connectors.zmq.paths"},
}


def _zmq_room(module: str) -> str | None:
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) > 3 and parts[:2] == ["connectors", "zmq"] else None


def _against_zmq_rooms(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in graph.items():
        room = _zmq_room(module)
        if room not in ZMQ_ROOM_IMPORTS:
            continue
        for target in targets:
            other = _zmq_room(target) or (target if _in(target, "connectors.zmq") else None)
            if other is not None and other != room and other not in ZMQ_ROOM_IMPORTS[room]:
                wrong.append(f"{module} -> {target}")
    return wrong


def test_zmq_rooms_import_only_what_they_may():
    rooms = {_zmq_room(m) for m in _graph()} - {None}
    assert set(ZMQ_ROOM_IMPORTS) <= rooms and "connectors.zmq.streaming" in rooms
    wrong = _against_zmq_rooms(_graph())
    assert not wrong, "imports against connectors.zmq's rooms:\n" + "\n".join(sorted(wrong))


def test_the_zmq_room_check_sees_wrong_imports():
    graph = {"connectors.zmq.paths.tcp": {"connectors.zmq.control.wire", "connectors.zmq.consumer.loads"},
             "connectors.zmq.control.wire": {"connectors.zmq.connector"},
             "connectors.zmq.producer.producer": {"connectors.zmq.consumer.consumer", "connectors.zmq.paths.tcp"},
             "connectors.zmq.connector": {"connectors.zmq.producer.producer"}}
    assert sorted(_against_zmq_rooms(graph)) == ["connectors.zmq.control.wire -> connectors.zmq.connector",
                                                 "connectors.zmq.paths.tcp -> connectors.zmq.consumer.loads",
                                                 "connectors.zmq.producer.producer -> connectors.zmq.consumer.consumer"]


def test_no_import_loops():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not loops, f"import loops: {loops}"


def test_pd_top_level_holds_only_entry_points():
    top = sorted(p.name for p in (REPO / "pd").glob("*.py") if p.name != "__init__.py")
    assert top == ["launch.py", "loadgen.py"], top
    for name in top:
        tree = ast.parse((REPO / "pd" / name).read_text())
        defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        assert not defs, f"pd/{name} is an entry point and defines nothing itself"


# Inside pd.engine: a module may import its own room and rooms of strictly lower rank.
# Attention and the scheduler share a rank: neither imports the other. The backends' declarations
# (attention/capabilities.py, no torch) sit at the bottom: the engine's and the deploy config read them.
ENGINE_RANKS = {
    "pd.engine.outputs": 0, "pd.engine.sample.params": 0, "pd.engine.text": 0, "pd.engine.attention.capabilities": 0,
    "pd.engine.model": 1,
    "pd.engine.inputs": 1,
    "pd.engine.config": 2, "pd.engine.kv": 2, "pd.engine.sample": 2,
    "pd.engine.sched": 3, "pd.engine.attention": 3, "pd.engine.parallel": 3,
    "pd.engine.cpu": 4, "pd.engine.step_isolation": 4,
    "pd.engine.runner": 5,
    "pd.engine.engine": 6, "pd.engine.parallel.follower": 6,  # (a follower builds on the runner, as the engine)
    "pd.engine": 7,  # the package itself
}
# parallel/ (tensor parallelism's building blocks) imports the KV, model and config rooms and, beyond the standard
# library, only torch and msgpack: never ray (a gang's data plane runs without it), zmq or the connectors. The
# follower (a gang's rank r > 0) runs steps with the runner, as the engine does.
PARALLEL = "pd.engine.parallel"
PARALLEL_MAY_IMPORT = frozenset({"torch", "msgpack", "pd.engine.kv", "pd.engine.model", "pd.engine.config", PARALLEL})
PARALLEL_ALSO = {f"{PARALLEL}.follower": frozenset({"pd.engine.runner"})}
# text/ finds and converts a checkpoint's tokenizer where the checkpoint is found (model/files.py,
# model/gguf.py), lazily; nothing else of the engine.
TEXT_MAY_IMPORT = frozenset({"pd.engine.model.files", "pd.engine.model.gguf"})
# What the rooms above the engine (cluster, router, worker, deploy, pd's entry points) may import of it:
# the engine, its config, inputs and outputs, tokenizers, sampling params, and the model's config and files (a
# worker sizes its KV pool from the model's shape before it builds an engine), step isolation (a
# worker reads its device-fault latch and tells device errors apart) and the attention backends'
# declarations (the deploy config validates `model.attention_backend` against them). pd.tools may reach further
# (benchmarks of the kernels).
ENGINE_PUBLIC = frozenset({
    "pd.engine.engine", "pd.engine.config", "pd.engine.outputs", "pd.engine.sample.params", "pd.engine.step_isolation",
    "pd.engine.model.config", "pd.engine.model.checkpoint", "pd.engine.model.gguf", "pd.engine.kv.layout",
    "pd.engine.inputs",
    "pd.engine.attention.capabilities",
    # a TP gang: the group and its rendezvous, the mapping rule (config checks), the ranks r > 0
    "pd.engine.parallel.group", "pd.engine.parallel.tp", "pd.engine.parallel.follower",
})


def _engine_room(module: str) -> str:
    for room in sorted(ENGINE_RANKS, key=len, reverse=True):
        if module == room or module.startswith(room + "."):
            return room
    raise AssertionError(f"{module} is in no room of pd.engine")


def _against_engine_rooms(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in graph.items():
        if not _in(module, "pd.engine"):
            if not _in(module, "pd.tools"):
                wrong += [f"{module} -> {t} (not public)" for t in sorted(targets)
                          if _in(t, "pd.engine") and t not in ENGINE_PUBLIC and not _in(t, "pd.engine.text")]
            continue
        room = _engine_room(module)
        for target in sorted(t for t in targets if _in(t, "pd.engine")):
            other = _engine_room(target)
            if room == "pd.engine.text" and other != room:
                if target not in TEXT_MAY_IMPORT:
                    wrong.append(f"{module} -> {target}")
            elif other != room and ENGINE_RANKS[other] >= ENGINE_RANKS[room]:
                wrong.append(f"{module} -> {target}")
    return wrong


def test_engine_rooms_point_down_and_expose_only_their_public_parts():
    wrong = _against_engine_rooms(_graph())
    assert not wrong, "imports against the engine's rooms:\n" + "\n".join(wrong)


def test_attention_imports_neither_the_scheduler_nor_the_cpu_kernels():
    graph = _graph()
    attention = [m for m in graph if _in(m, "pd.engine.attention")]
    assert "pd.engine.attention.backend" in attention and "pd.engine.attention.metadata" in attention
    wrong = [f"{m} -> {t}" for m in attention for t in sorted(graph[m])
             if _in(t, "pd.engine.sched") or _in(t, "pd.engine.cpu") or _in(t, "pd.engine.runner")]
    assert not wrong, "\n".join(wrong)
    assert not [m for m in graph["pd.engine.attention.capabilities"] if _in(m, "pd")]
    assert not _imports_torch(_modules()["pd.engine.attention.capabilities"])


def _imports_torch(path: pathlib.Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
        if any(n == "torch" or n.startswith("torch.") for n in names):
            return True
    return False


def test_what_the_router_reaches_of_the_engine_imports_no_torch():
    """The router process never loads torch: every engine module its imports reach (tokenizers,
    sampling params) imports none, at any depth, and sample/params.py imports nothing else of pdkv."""
    modules, graph = _modules(), _graph()
    reached, todo = set(), [m for m in graph if _in(m, "pd.router")]
    while todo:
        module = todo.pop()
        for target in graph[module]:
            if target not in reached and (_in(target, "pd.engine") or _in(target, "pd.router")):
                reached.add(target)
                todo.append(target)
    engine_side = sorted(m for m in reached if _in(m, "pd.engine"))
    assert "pd.engine.text.tokenizer" in engine_side
    assert [m for m in engine_side if _imports_torch(modules[m])] == []
    assert not _imports_torch(modules["pd.engine.sample.params"])
    assert graph["pd.engine.sample.params"] == set()


def _top_level_imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _against_parallel_room(imports: dict[str, set[str]]) -> list[str]:
    """What a module of pd/engine/parallel imports beyond the standard library and PARALLEL_MAY_IMPORT."""
    wrong = []
    for module, names in sorted(imports.items()):
        for name in sorted(names):
            allowed = PARALLEL_MAY_IMPORT | PARALLEL_ALSO.get(module, frozenset())
            if name.split(".")[0] in sys.stdlib_module_names or any(_in(name, ok) for ok in allowed):
                continue
            wrong.append(f"{module} -> {name}")
    return wrong


def test_the_parallel_room_imports_torch_msgpack_and_the_kv_room_only():
    modules = _modules()
    room = {m: _top_level_imports(p) for m, p in modules.items() if _in(m, PARALLEL)}
    assert f"{PARALLEL}.tp" in room  # the room exists: a check over nothing checks nothing
    wrong = _against_parallel_room(room)
    assert not wrong, "pd/engine/parallel imports outside its rule:\n" + "\n".join(wrong)
    made_up = {f"{PARALLEL}.group": {"ray", "torch.distributed", "datetime", "pd.engine.kv.layout"},
               f"{PARALLEL}.step_channel": {"msgpack", "zmq", "connectors.zmq.wire", "pd.engine.runner.model_runner"}}
    assert _against_parallel_room(made_up) == [f"{PARALLEL}.group -> ray",
                                               f"{PARALLEL}.step_channel -> connectors.zmq.wire",
                                               f"{PARALLEL}.step_channel -> pd.engine.runner.model_runner",
                                               f"{PARALLEL}.step_channel -> zmq"]


def test_the_engine_room_check_sees_wrong_imports():
    graph = {"pd.engine.model.llama": {"pd.engine.attention.backend", "pd.engine.model.config"},
             "pd.engine.text.tokenizer": {"pd.engine.model.files", "pd.engine.sample.params"},
             "pd.engine.runner.model_runner": {"pd.engine.attention.backend", "pd.engine.engine"},
             "pd.engine.attention.metadata": {"pd.engine.sched.output", "pd.engine.kv.layout"},
             "pd.engine.attention.torch_paged": {"pd.engine.cpu.kernels", "pd.engine.attention.capabilities"},
             "pd.router.server": {"pd.engine.text.tokenizer", "pd.engine.cpu.kernels"},
             "pd.worker.wiring": {"pd.engine.engine", "pd.engine.config"},
             "pd.tools.gemm_bench": {"pd.engine.cpu.gemm_tuning"}}
    assert _against_engine_rooms(graph) == ["pd.engine.model.llama -> pd.engine.attention.backend",
                                            "pd.engine.text.tokenizer -> pd.engine.sample.params",
                                            "pd.engine.runner.model_runner -> pd.engine.engine",
                                            "pd.engine.attention.metadata -> pd.engine.sched.output",
                                            "pd.engine.attention.torch_paged -> pd.engine.cpu.kernels",
                                            "pd.router.server -> pd.engine.cpu.kernels (not public)"]


def test_the_checker_sees_wrong_imports():
    """The rank check itself, on a made-up graph: upward and sideways imports are flagged."""
    graph = {"pd.engine.engine": {"pd.router.server", "kvcache.manager"}, "pd.router.server": {"pd.worker.worker"},
             "pd.worker.worker": {"pd.cluster.config"}, "connectors.base": {"pd.engine.kv.page_pool"}}
    assert sorted(_against_layering(graph)) == ["connectors.base -> pd.engine.kv.page_pool",
                                                "pd.engine.engine -> pd.router.server",
                                                "pd.router.server -> pd.worker.worker"]
