"""Writes a deployment config with the secrets a manifest must not hold.

    python deploy/render_config.py deploy/gpu-2p2d-k8s.yaml /tmp/pdkv.yaml

`router.api_key` is taken from the environment variable PDKV_API_KEY, and
`router.admin_key` (for /pd/* and a protected /metrics) from PDKV_ADMIN_KEY (each set in a
pod from a Kubernetes Secret with `valueFrom.secretKeyRef`), so the YAML in the
repository and in the cluster's objects carries no key. The result is validated
with pdkv's config schema before it is written (mode 0600); the key is never printed.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from pd.cluster.config import ConfigError, DeployConfig

API_KEY_ENV = "PDKV_API_KEY"
ADMIN_KEY_ENV = "PDKV_ADMIN_KEY"


def render(source: Path, target: Path) -> DeployConfig:
    data = yaml.safe_load(source.read_text()) or {}
    for field, env in (("api_key", API_KEY_ENV), ("admin_key", ADMIN_KEY_ENV)):
        key = os.environ.get(env, "")
        if key:
            data.setdefault("router", {})[field] = key
        elif (data.get("router") or {}).get(field):
            raise ConfigError(f"{source}: router.{field} is a literal; leave it out and set {env}")
    config = DeployConfig.from_dict(data)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        yaml.safe_dump(data, out, sort_keys=False)
    return config


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python deploy/render_config.py SOURCE.yaml TARGET.yaml", file=sys.stderr)
        return 2
    try:
        config = render(Path(argv[0]), Path(argv[1]))
    except (ConfigError, OSError, yaml.YAMLError) as exc:
        print(f"render_config: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {argv[1]} (api key: {'set' if config.router.api_key else 'none'})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
