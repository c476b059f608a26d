"""The KubeRay manifests: schema validation, and the points a schema cannot see.

Schemas: KubeRay's CRDs do not install from PyPI here, so the RayJob and
RayService objects are validated against tests/deploy/kuberay_crd_subset.schema.json
(the subset of KubeRay's documented ray.io/v1 fields that pdkv uses, written by
hand, unknown fields refused); every pod template inside them, the Services and
the PVC are validated against the Kubernetes schemas shipped by the
`kubernetes-validate` package (strict: unknown fields refused).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pd.cluster.config import load_deploy_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SCHEMA = json.loads((Path(__file__).parent / "kuberay_crd_subset.schema.json").read_text())
K8S_VERSION = "1.30.0"
MANIFESTS = ("kuberay-rayjob.yaml", "kuberay-rayservice.yaml")


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def _cluster(ray_obj: dict) -> dict:
    return ray_obj["spec"]["rayClusterSpec" if ray_obj["kind"] == "RayJob" else "rayClusterConfig"]


def _templates(cluster: dict) -> list[dict]:
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster.get("workerGroupSpecs", [])]


def _k8s_validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_passes_the_schemas(name):
    docs = _docs(name)
    ray_obj = docs[0]
    jsonschema.validate(ray_obj, SCHEMA)
    for i, template in enumerate(_templates(_cluster(ray_obj))):
        _k8s_validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"t{i}"}, "template": template})
    for doc in docs[1:]:
        _k8s_validate(doc)
    for doc in _docs("kuberay-model-volume.yaml"):
        _k8s_validate(doc)


def test_the_schemas_catch_mistakes():
    ray_obj = _docs("kuberay-rayjob.yaml")[0]
    bad = json.loads(json.dumps(ray_obj))
    bad["spec"]["rayClusterSpec"]["authOptions"] = {"mode": "tokens"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCHEMA)
    bad = json.loads(json.dumps(ray_obj))
    bad["spec"]["rayClusterSpec"]["authOption"] = {"mode": "token"}  # a typo the API server would drop
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCHEMA)
    template = json.loads(json.dumps(_cluster(ray_obj)["headGroupSpec"]["template"]))
    template["spec"]["containers"][0]["volumeMount"] = []  # not a container field
    with pytest.raises(kubernetes_validate.ValidationError):
        _k8s_validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template})


def _config():
    return load_deploy_config(DEPLOY / "gpu-2p2d-k8s.yaml")


def _container(template: dict, prefix: str = "ray-") -> dict:
    return next(c for c in template["spec"]["containers"] if c["name"].startswith(prefix))


def _quantity_cpu(value: str) -> float:
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


@pytest.mark.parametrize("name", MANIFESTS)
def test_what_a_schema_cannot_see(name):
    docs = _docs(name)
    ray_obj, services = docs[0], [d for d in docs[1:] if d["kind"] == "Service"]
    cluster = _cluster(ray_obj)

    # token auth through KubeRay's own field, not hand-set environment variables
    assert cluster["authOptions"]["mode"] == "token"
    set_by_hand = {e["name"] for t in _templates(cluster) for c in t["spec"]["containers"] for e in c.get("env", [])}
    assert not set_by_hand & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"}
    assert int(cluster["rayVersion"].split(".")[1]) >= 52  # token auth needs Ray >= 2.52

    # no literal secrets: the API key comes from a Secret, the config file holds none
    config = _config()
    assert config.router.api_key is None
    head = _container(cluster["headGroupSpec"]["template"])
    env = {e["name"]: e for e in head.get("env", [])}
    assert env["PDKV_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "pdkv-api-key", "key": "api-key"}
    for template in _templates(cluster):
        for c in template["spec"]["containers"] + template["spec"].get("initContainers", []):
            for e in c.get("env", []):
                assert "value" not in e or not re.search(r"key|token|secret|password", e["name"], re.I), e

    # the model volume is mounted where model.path lives, in every Ray pod
    model_dir = Path(config.model.path)
    claims = {d["metadata"]["name"] for d in _docs("kuberay-model-volume.yaml") if d["kind"] == "PersistentVolumeClaim"}
    for template in _templates(cluster):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        mounts = _container(template)["volumeMounts"]
        assert any(model_dir.is_relative_to(m["mountPath"]) and volumes[m["name"]]["persistentVolumeClaim"]["claimName"]
                   in claims for m in mounts), mounts
    init = cluster["headGroupSpec"]["template"]["spec"]["initContainers"]
    assert any(str(model_dir) in " ".join(c["command"]) and not c["volumeMounts"][0].get("readOnly") for c in init)

    # resources match the topology: one GPU pod per worker actor, enough CPUs, none on the head
    topo = config.topology
    assert topo.device == "cuda"
    num_workers = topo.num_prefill + topo.num_decode
    groups = cluster["workerGroupSpecs"]
    assert sum(g["replicas"] for g in groups) == num_workers
    for g in groups:
        assert g["minReplicas"] == g["maxReplicas"] == g["replicas"]  # a fixed topology: no autoscaling away
        res = _container(g["template"])["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "1"
        assert g["rayStartParams"]["num-gpus"] == "1"
        assert _quantity_cpu(res["requests"]["cpu"]) >= topo.cpus_per_worker + 1  # the actor plus the raylet
        assert float(g["rayStartParams"]["num-cpus"]) >= topo.cpus_per_worker
    head_res = head["resources"]
    assert "nvidia.com/gpu" not in head_res["requests"] and cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"

    # the router: the head offers the resource the Serve replica / launch needs, and exposes router.port
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["router"] == config.router.port and config.router.host == "0.0.0.0"
    assert json.loads(json.loads(cluster["headGroupSpec"]["rayStartParams"]["resources"])) == {"pdkv_router": 1}

    # a precise Service selector: this manifest's head pod, nothing else
    head_labels = cluster["headGroupSpec"]["template"]["metadata"]["labels"]
    (service,) = services
    selector = service["spec"]["selector"]
    assert selector["ray.io/node-type"] == "head"
    own = {k: v for k, v in selector.items() if not k.startswith("ray.io/")}
    assert own and own.items() <= head_labels.items()
    assert own["app.kubernetes.io/instance"] == ray_obj["metadata"]["name"]
    for template in _templates(cluster)[1:]:  # no worker pod matches
        assert not own.items() <= template["metadata"]["labels"].items()
    other = _docs(MANIFESTS[1 - MANIFESTS.index(name)])[0]  # nor the other manifest's head
    assert not own.items() <= _cluster(other)["headGroupSpec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] == "router"


def test_rayjob_runs_the_benchmark_and_rayservice_the_serve_app():
    job = _docs("kuberay-rayjob.yaml")[0]
    assert job["spec"]["entrypoint"].startswith("bash deploy/bench-job.sh deploy/gpu-2p2d-k8s.yaml")
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert runtime_env["working_dir"] == "/opt/pdkv"  # where deploy/Dockerfile puts the repository
    assert (DEPLOY / "bench-job.sh").is_file() and "COPY --chown=ray:users deploy deploy" in (DEPLOY / "Dockerfile").read_text()
    service = _docs("kuberay-rayservice.yaml")[0]
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert app["import_path"] == "pd.deploy.serve_app:build"
    assert Path(app["args"]["config"]).relative_to("/opt/pdkv").as_posix() == "deploy/gpu-2p2d-k8s.yaml"
    from pd.deploy import serve_app

    assert callable(serve_app.build) and serve_app.ROUTER_RESOURCE == "pdkv_router"


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
