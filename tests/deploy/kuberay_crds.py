"""KubeRay's own CRDs as a strict validator for the ray.io objects in deploy/.

The CRD files (KubeRay v1.7.0, copied verbatim, sha256 listed in SOURCE.md) live in
`../shared/kuberay-crds/` beside the repository; where that folder is absent (a user's
clone) the tests that need it skip and say so.

`validator(api_version, kind)` takes the served version's `openAPIV3Schema` and turns it
into a JSON Schema with the API server's structural-schema meaning, as `kubectl apply
--validate=strict` (server-side field validation) applies it:
- an object node refuses fields its `properties` do not name, unless the node sets
  `x-kubernetes-preserve-unknown-fields`; `additionalProperties` (maps) is kept;
- `nullable` admits null; `x-kubernetes-int-or-string` is its `anyOf`;
- the root `metadata` (`type: object` in every CRD) is the API server's ObjectMeta: it is
  checked here against Kubernetes' own strict ObjectMeta schema (kubernetes-validate).
Not evaluated: `format` (int32, ...) and the CEL rules (`x-kubernetes-validations`), which
`cel_rules()` lists so that a test can see which ones an object touches.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_DIR = REPO.parent / "shared" / "kuberay-crds"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml",
             "RayService": "ray.io_rayservices.yaml"}
K8S_VERSION = "1.30.0"
MISSING = (f"KubeRay CRDs not found at {CRD_DIR} (CI has shared/ beside the clone; see "
           f"shared/kuberay-crds/SOURCE.md for where the files come from)")

_KEPT = ("type", "required", "enum", "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
         "minLength", "maxLength", "minItems", "maxItems", "uniqueItems", "minProperties", "maxProperties",
         "multipleOf")


def available() -> bool:
    return all((CRD_DIR / name).is_file() for name in CRD_FILES.values())


def recorded_sha256() -> dict[str, str]:
    """The sha256 of each CRD file as SOURCE.md records it."""
    text = (CRD_DIR / "SOURCE.md").read_text()
    return {name: digest for digest, name in re.findall(r"^\s*([0-9a-f]{64})\s+(\S+)\s*$", text, re.M)}


def file_sha256(name: str) -> str:
    return hashlib.sha256((CRD_DIR / name).read_bytes()).hexdigest()


@functools.cache
def _crd(kind: str) -> dict:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # 1 MB files: the C loader where PyYAML has it
    return yaml.load((CRD_DIR / CRD_FILES[kind]).read_text(), Loader=loader)


def served_version(api_version: str, kind: str) -> dict:
    """The CRD's entry for `api_version` (e.g. "ray.io/v1"); raises when it is not served."""
    group, _, version = api_version.partition("/")
    crd = _crd(kind)
    assert crd["spec"]["group"] == group, (group, crd["spec"]["group"])
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            if not entry.get("served"):
                raise ValueError(f"{kind} {api_version} is not served by these CRDs")
            return entry
    raise ValueError(f"{kind} {api_version}: no such version in the CRD")


def to_json_schema(node: dict, strict: bool = True) -> dict:
    """One openAPIV3Schema node as JSON Schema; `strict`: unknown fields refused unless the node preserves them."""
    out: dict = {k: node[k] for k in _KEPT if k in node}
    if "properties" in node:
        out["properties"] = {name: to_json_schema(sub, strict) for name, sub in node["properties"].items()}
    if "items" in node:
        out["items"] = to_json_schema(node["items"], strict)
    for key in ("anyOf", "allOf", "oneOf"):
        if key in node:
            out[key] = [to_json_schema(sub, strict) for sub in node[key]]
    if "not" in node:
        out["not"] = to_json_schema(node["not"], strict)
    additional = node.get("additionalProperties")
    if isinstance(additional, dict):
        out["additionalProperties"] = to_json_schema(additional, strict)
    elif additional is not None:
        out["additionalProperties"] = additional
    if node.get("x-kubernetes-embedded-resource"):
        out.setdefault("properties", {}).update({"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                                 "metadata": {"type": "object"}})
    is_object = node.get("type") == "object" or "properties" in node
    if (strict and is_object and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


@functools.cache
def _validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    root = copy.deepcopy(served_version(api_version, kind)["schema"]["openAPIV3Schema"])
    root["properties"]["metadata"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return jsonschema.Draft7Validator(to_json_schema(root))


def errors(obj: dict) -> list[str]:
    """Every reason the API server (strict field validation) would refuse `obj`; [] when it is valid."""
    found = []
    for err in _validator(obj["apiVersion"], obj["kind"]).iter_errors(obj):
        path = ".".join(str(p) for p in err.absolute_path) or "<root>"
        found.append(f"{obj['kind']} {path}: {err.message}")
    metadata = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj.get("metadata", {})}
    try:
        kubernetes_validate.validate(metadata, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        found.append(f"{obj['kind']} metadata: {exc.message}")
    return found


def cel_rules(api_version: str, kind: str) -> dict[str, list[str]]:
    """The CEL rules of the served schema (not evaluated here), by field path."""
    rules: dict[str, list[str]] = {}

    def walk(node: dict, path: str) -> None:
        if "x-kubernetes-validations" in node:
            rules[path or "<root>"] = [r["rule"] for r in node["x-kubernetes-validations"]]
        for name, sub in node.get("properties", {}).items():
            walk(sub, f"{path}.{name}" if path else name)
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(served_version(api_version, kind)["schema"]["openAPIV3Schema"], "")
    return rules
