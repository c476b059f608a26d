"""The KubeRay manifests: KubeRay's real CRDs, Kubernetes' strict schemas, and what a schema cannot see.

Schemas: every RayJob / RayService in deploy/ is validated against the served version's
openAPIV3Schema of KubeRay's own CRDs (v1.7.0, in ../shared/kuberay-crds/, see
kuberay_crds.py), unknown fields refused as `kubectl apply --validate=strict` refuses them;
Services, the PVC and every pod template also against the strict Kubernetes schemas of
`kubernetes-validate`. The rest reads the manifests for the rules KubeRay applies at run
time (what the operator injects, which Service follows which cluster, how it parses fields);
tests/deploy/test_manifest_processes.py runs the probes and the init container for real.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import kubernetes_validate
import kuberay_crds
import pytest
import yaml

from pd.cluster.config import load_deploy_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
MANIFESTS = ("kuberay-rayjob.yaml", "kuberay-rayservice.yaml", "kuberay-rayservice-tp.yaml")
needs_crds = pytest.mark.skipif(not kuberay_crds.available(), reason=kuberay_crds.MISSING)

# KubeRay's defaults on every Ray container: ray start's ports, the metrics port it adds
# (metrics-export-port 8080) and the dashboard agent's listen port, which its probes use
KUBERAY_PORTS = {6379, 8265, 10001, 8000, 8080, 52365}
AGENT_PORT = 52365
PUBLIC_HEALTH_PATHS = {"/api/healthz", "/api/local_raylet_healthz"}  # the agent's routes open under token auth
RAY_START_RESOURCE_PARAMS = {"num-cpus", "num-gpus", "memory", "resources"}


def _docs(name: str, deploy: Path = DEPLOY) -> list[dict]:
    return [d for d in yaml.safe_load_all((deploy / name).read_text()) if d]


def _cluster(ray_obj: dict) -> dict:
    return ray_obj["spec"]["rayClusterSpec" if ray_obj["kind"] == "RayJob" else "rayClusterConfig"]


def _groups(cluster: dict) -> list[dict]:
    return [cluster["headGroupSpec"]] + list(cluster.get("workerGroupSpecs", []))


def _ray_container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]  # KubeRay's rule: the Ray container comes first


def _k8s_validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, kuberay_crds.K8S_VERSION, strict=True)


def _config(name: str | None = None):
    """The deploy config a manifest runs (its RayJob entrypoint's or its Serve app's); the 2P2D one by default."""
    if name is None:
        return load_deploy_config(DEPLOY / "gpu-2p2d-k8s.yaml")
    ray_obj = _docs(name)[0]
    if ray_obj["kind"] == "RayJob":
        path = ray_obj["spec"]["entrypoint"].split()[2]
    else:
        (app,) = yaml.safe_load(ray_obj["spec"]["serveConfigV2"])["applications"]
        path = Path(app["args"]["config"]).relative_to("/opt/pdkv").as_posix()
    return load_deploy_config(REPO / path)


def _gang_sizes(config) -> list[int]:
    """The ranks (GPUs) of each worker the config starts."""
    from pd.deploy.placement import worker_roles, worker_tp

    return [worker_tp(config, role) for _, role in worker_roles(config)]


# -- KubeRay's CRDs ---------------------------------------------------------------------------
@needs_crds
def test_the_crd_files_are_the_recorded_ones():
    recorded = kuberay_crds.recorded_sha256()
    assert set(recorded) == set(kuberay_crds.CRD_FILES.values())
    for name, digest in recorded.items():
        assert kuberay_crds.file_sha256(name) == digest, f"{name} differs from SOURCE.md's sha256"


@needs_crds
@pytest.mark.parametrize("name", MANIFESTS)
def test_ray_objects_pass_the_served_crd_schema(name):
    ray_objects = [d for d in _docs(name) if d["apiVersion"].startswith("ray.io/")]
    assert ray_objects
    for obj in ray_objects:
        entry = kuberay_crds.served_version(obj["apiVersion"], obj["kind"])
        assert entry["storage"] and not entry.get("deprecated"), entry["name"]
        assert kuberay_crds.errors(obj) == []
        # the CRDs' CEL rules are not evaluated here: none of them concerns a field these objects set
        for path in kuberay_crds.cel_rules(obj["apiVersion"], obj["kind"]):
            node: object = obj
            for part in path.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            assert node is None, f"{path} is set, and its CEL rule is not checked here"


@needs_crds
def test_the_crd_validator_refuses_what_the_api_server_refuses():
    job = _docs("kuberay-rayjob.yaml")[0]
    seeded = {  # one mistake each, and the words its error must contain
        "spec.rayClusterSpec.authOption": ("authOption", "unexpected"),  # a typo strict validation refuses
        "spec.rayClusterSpec.headGroupSpec.template.spec.containers.0.volumeMount": ("volumeMount", "unexpected"),
        "spec.rayClusterSpec.workerGroupSpecs.0.replica": ("replica", "unexpected"),
        "spec.rayClusterSpec.headGroupSpec.template.spec.containers.0.resources.limit": ("limit", "unexpected"),
        "metadata.label": ("label", "unexpected"),
    }
    for dotted, words in seeded.items():
        bad = json.loads(json.dumps(job))
        *parents, leaf = dotted.split(".")
        node = bad
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[leaf] = {"x": 1}
        found = kuberay_crds.errors(bad)
        assert len(found) == 1 and all(w in found[0] for w in words), (dotted, found)
    bad = json.loads(json.dumps(job))
    bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "four"
    assert any("replicas" in e and "integer" in e for e in kuberay_crds.errors(bad))
    # the schema's own escape hatch is honoured: a node that preserves unknown fields takes them
    node = {"type": "object", "properties": {"a": {"type": "string"}}}
    import jsonschema

    assert not jsonschema.Draft7Validator(kuberay_crds.to_json_schema(node)).is_valid({"b": 1})
    node["x-kubernetes-preserve-unknown-fields"] = True
    assert jsonschema.Draft7Validator(kuberay_crds.to_json_schema(node)).is_valid({"b": 1})


@pytest.mark.parametrize("name", MANIFESTS + ("kuberay-model-volume.yaml",))
def test_core_objects_and_pod_templates_pass_the_strict_kubernetes_schemas(name):
    for doc in _docs(name):
        if doc["apiVersion"].startswith("ray.io/"):
            for i, group in enumerate(_groups(_cluster(doc))):
                _k8s_validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"t{i}"},
                               "template": group["template"]})
        else:
            _k8s_validate(doc)
    template = json.loads(json.dumps(_groups(_cluster(_docs(MANIFESTS[0])[0]))[0]["template"]))
    template["spec"]["containers"][0]["volumeMount"] = []  # not a container field
    with pytest.raises(kubernetes_validate.ValidationError):
        _k8s_validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template})


# -- what KubeRay does at run time ------------------------------------------------------------
def test_rayservice_traffic_reaches_only_the_active_clusters_serving_head():
    """KubeRay points <name>-head-svc at a cluster only once its Serve app is RUNNING (the replica
    returns from its constructor after the router listens); a Service of our own cannot name the
    active cluster (its name is generated), so it would match every head, serving or not."""
    service, *others = _docs("kuberay-rayservice.yaml")
    cluster = _cluster(service)
    for doc in others:
        selector = doc.get("spec", {}).get("selector") or {}
        own = {k: v for k, v in selector.items() if not k.startswith("ray.io/")}  # ray.io/*: KubeRay's labels
        matches_a_pod = any(own.items() <= g["template"]["metadata"].get("labels", {}).items()
                            for g in _groups(cluster))
        assert not (doc["kind"] == "Service" and matches_a_pod and "ray.io/cluster" not in selector), (
            f"Service {doc['metadata']['name']} selects RayService pods without pinning the active cluster")
    head = _ray_container(cluster["headGroupSpec"])
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["router"] == _config().router.port  # KubeRay's head-svc carries every named head port
    assert "serveService" not in service["spec"]  # KubeRay forces its port to the Serve proxy's
    # a second full cluster (NewCluster, the default) needs twice the GPUs; with exactly those no upgrade completes
    assert service["spec"]["upgradeStrategy"]["type"] == "None"
    assert "pdkv-head-svc" in (DEPLOY / "kuberay-rayservice.yaml").read_text()  # where the comments send clients


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_ray_container_has_a_readiness_probe_its_process_answers(name):
    """KubeRay injects a probe only where none is set; for RayService workers its probe also
    wants a Serve proxy on :8000, which Ray 2.60 runs only on nodes with replicas."""
    cluster = _cluster(_docs(name)[0])
    for group in _groups(cluster):
        probe = _ray_container(group).get("readinessProbe")
        assert probe, f"{group.get('groupName', 'head')}: no readinessProbe of our own"
        agent_port = int(group.get("rayStartParams", {}).get("dashboard-agent-listen-port", AGENT_PORT))
        assert probe["httpGet"]["port"] == agent_port and probe["httpGet"]["path"] in PUBLIC_HEALTH_PATHS, probe
        assert probe["periodSeconds"] * probe["failureThreshold"] >= 30  # a busy raylet is not dropped at once


@pytest.mark.parametrize("name", MANIFESTS)
def test_ray_start_resources_follow_the_operators_rule(name):
    """KubeRay refuses resources both in rayStartParams and the group's `resources`, and trims the
    quotes of a quoted rayStartParams value, so JSON there fails its own parse."""
    cluster = _cluster(_docs(name)[0])
    for group in _groups(cluster):
        params, resources = group.get("rayStartParams", {}), group.get("resources", {})
        assert not (RAY_START_RESOURCE_PARAMS & set(params) and resources), params
        for key, value in params.items():
            assert not re.search(r"[\"'{}]", value), f"rayStartParams[{key}] = {value!r}: quoting or JSON"
        for value in resources.values():
            assert re.fullmatch(r"\d+(\.\d+)?[mkMGTPE]?i?", value), value  # a Kubernetes quantity
    head = cluster["headGroupSpec"]
    from pd.deploy import serve_app

    assert head["resources"][serve_app.ROUTER_RESOURCE] == "1" and head["resources"]["GPU"] == "0"
    largest_gang = max(_gang_sizes(_config(name)))  # a gang's ranks share a node: a pod holds the largest
    for group in cluster["workerGroupSpecs"]:
        limits = _ray_container(group)["resources"]["limits"]
        assert group["resources"]["GPU"] == limits["nvidia.com/gpu"] == str(largest_gang)
        assert float(group["resources"]["CPU"]) <= float(limits["cpu"])


def test_the_router_port_is_free_on_a_kuberay_head():
    config = _config()
    assert config.router.host == "0.0.0.0"
    assert config.router.port not in KUBERAY_PORTS and not 10002 <= config.router.port <= 19999  # Ray's worker ports
    for name in MANIFESTS:
        head = _ray_container(_cluster(_docs(name)[0])["headGroupSpec"])
        ports = [p["containerPort"] for p in head["ports"]]
        assert len(ports) == len(set(ports)) and {"metrics"}.isdisjoint(p["name"] for p in head["ports"])


def test_serve_gets_room_for_slow_gpu_pods():
    head = _ray_container(_cluster(_docs("kuberay-rayservice.yaml")[0])["headGroupSpec"])
    env = {e["name"]: e.get("value") for e in head.get("env", [])}
    assert int(env["RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT"]) >= 10  # Serve's default gives up after 3 starts


def test_the_benchmark_counts_tokens_with_the_models_tokenizer():
    job = _docs("kuberay-rayjob.yaml")[0]
    args = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]["PDKV_BENCH_ARGS"].split()
    assert args[args.index("--tokenizer") + 1] == _config().model.path


def test_the_model_volume_names_a_rwx_storage_class():
    (pvc,) = [d for d in _docs("kuberay-model-volume.yaml") if d["kind"] == "PersistentVolumeClaim"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"].get("storageClassName")


@pytest.mark.parametrize("name", MANIFESTS)
def test_what_a_schema_cannot_see(name):
    docs = _docs(name)
    ray_obj = docs[0]
    cluster = _cluster(ray_obj)

    # token auth through KubeRay's own field, not hand-set environment variables
    assert cluster["authOptions"]["mode"] == "token"
    set_by_hand = {e["name"] for g in _groups(cluster) for c in g["template"]["spec"]["containers"]
                   for e in c.get("env", [])}
    assert not set_by_hand & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"}
    assert int(cluster["rayVersion"].split(".")[1]) >= 52  # token auth needs Ray >= 2.52

    # no literal secrets: the API key comes from a Secret, the config file holds none
    config = _config(name)
    assert config.router.api_key is None
    head = _ray_container(cluster["headGroupSpec"])
    env = {e["name"]: e for e in head.get("env", [])}
    assert env["PDKV_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "pdkv-api-key", "key": "api-key"}
    for group in _groups(cluster):
        spec = group["template"]["spec"]
        for c in spec["containers"] + spec.get("initContainers", []):
            for e in c.get("env", []):
                assert "value" not in e or not re.search(r"key|token|secret|password", e["name"], re.I), e

    # the model volume is mounted where model.path lives, in every Ray pod
    model_dir = Path(config.model.path)
    claims = {d["metadata"]["name"] for d in _docs("kuberay-model-volume.yaml") if d["kind"] == "PersistentVolumeClaim"}
    for group in _groups(cluster):
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        mounts = _ray_container(group)["volumeMounts"]
        assert any(model_dir.is_relative_to(m["mountPath"]) and volumes[m["name"]]["persistentVolumeClaim"]["claimName"]
                   in claims for m in mounts), mounts

    # GPU pods holding every rank of every worker (each gang whole on one pod, the largest placed
    # first: pods of the largest TP, filled by first fit), enough CPUs, none on the head; a fixed topology
    topo = config.topology
    assert topo.device == "cuda"
    groups = cluster["workerGroupSpecs"]
    pods = [int(g["resources"]["GPU"]) for g in groups for _ in range(g["replicas"])]
    free = sorted(pods, reverse=True)
    for size in sorted(_gang_sizes(config), reverse=True):
        fits = [i for i, gpus in enumerate(free) if gpus >= size]
        assert fits, f"no pod left for a gang of {size} GPUs: {free}"
        free[fits[0]] -= size
    assert sum(free) == 0, f"GPUs no rank uses: {free}"
    for g in groups:
        assert g["minReplicas"] == g["maxReplicas"] == g["replicas"]
        per_pod = int(g["resources"]["GPU"])  # the actors of as many ranks, plus the raylet
        assert float(g["resources"]["CPU"]) >= per_pod * topo.cpus_per_worker + 1
    assert "nvidia.com/gpu" not in head["resources"]["requests"]

    # the RayJob's own Service: this job's head pod only, on the router's port
    if ray_obj["kind"] == "RayJob":
        (service,) = [d for d in docs[1:] if d["kind"] == "Service"]
        selector = service["spec"]["selector"]
        head_labels = cluster["headGroupSpec"]["template"]["metadata"]["labels"]
        own = {k: v for k, v in selector.items() if not k.startswith("ray.io/")}
        assert selector["ray.io/node-type"] == "head" and own and own.items() <= head_labels.items()
        assert own["app.kubernetes.io/instance"] == ray_obj["metadata"]["name"]
        for g in groups:
            assert not own.items() <= g["template"]["metadata"]["labels"].items()
        assert service["spec"]["ports"][0]["targetPort"] == "router"


def test_rayjob_runs_the_benchmark_and_rayservice_the_serve_app():
    job = _docs("kuberay-rayjob.yaml")[0]
    assert job["spec"]["entrypoint"].startswith("bash deploy/bench-job.sh deploy/gpu-2p2d-k8s.yaml")
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert runtime_env["working_dir"] == "/opt/pdkv"  # where deploy/Dockerfile puts the repository
    assert "COPY --chown=ray:users deploy deploy" in (DEPLOY / "Dockerfile").read_text()
    service = _docs("kuberay-rayservice.yaml")[0]
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert app["import_path"] == "pd.deploy.serve_app:build"
    assert Path(app["args"]["config"]).relative_to("/opt/pdkv").as_posix() == "deploy/gpu-2p2d-k8s.yaml"
    from pd.deploy import serve_app

    assert callable(serve_app.build)


def test_render_config_takes_the_key_from_the_environment(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_config", DEPLOY / "render_config.py")
    render_config = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render_config)
    out = tmp_path / "pdkv.yaml"
    monkeypatch.setenv("PDKV_API_KEY", "from-a-secret-" + "x" * 20)
    assert render_config.main([str(DEPLOY / "gpu-2p2d-k8s.yaml"), str(out)]) == 0
    assert load_deploy_config(out).router.api_key == "from-a-secret-" + "x" * 20
    assert out.stat().st_mode & 0o077 == 0
    literal = tmp_path / "literal.yaml"
    literal.write_text("router: {api_key: change-me}\n")
    monkeypatch.delenv("PDKV_API_KEY")
    assert render_config.main([str(literal), str(tmp_path / "x.yaml")]) == 2
    from pd.deploy.serve_app import config_from_file

    monkeypatch.setenv("PDKV_API_KEY", "k" * 24)
    assert config_from_file(str(DEPLOY / "gpu-2p2d-k8s.yaml")).router.api_key == "k" * 24
