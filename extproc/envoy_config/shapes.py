"""Which shape of Envoy a config gets, and the files rendered from it: the default shape (``render``) for a
brain with ``brain.protocol: envoy``, the endpoint-picker shape (``picker``) for ``endpoint-picker``."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from ..config import AppConfig, ConfigError, load_config
from .picker import picker_bootstrap, picker_clusters
from .render import dump, envoy_bootstrap, replica_clusters, snippets


def bootstrap(cfg: AppConfig, mode: str | None = None) -> dict[str, Any]:
    """Envoy's bootstrap for ``cfg``; ``mode`` (default: ``brain.protocol``) "endpoint-picker" renders the
    shape of a Gateway API Inference Extension gateway."""
    if (mode or cfg.brain.protocol) == "endpoint-picker":
        return picker_bootstrap(cfg)
    if cfg.brain.protocol == "endpoint-picker":
        raise ConfigError("brain.protocol: this brain speaks endpoint-picker; render --mode endpoint-picker (or "
                          "point a Gateway API Inference Extension gateway at it)")
    return envoy_bootstrap(cfg)


def cds_document(cfg: AppConfig) -> dict:
    """The file Envoy's filesystem CDS reads: every cluster but the brain's (in the endpoint-picker shape, the
    one pool cluster)."""
    found = picker_clusters(cfg) if cfg.brain.protocol == "endpoint-picker" else replica_clusters(cfg)
    return {"resources": [{"@type": "type.googleapis.com/envoy.config.cluster.v3.Cluster", **c} for c in found]}


class CdsFile:
    """The replica clusters Envoy reads through filesystem CDS (``envoy.cds_path``).

    ``write`` replaces the file atomically: Envoy reloads on a move into the watched directory,
    so it learns added and removed replicas without a restart. Without a path it does nothing.
    """

    def __init__(self, path: str | None):
        self.path = os.path.abspath(path) if path else None

    def write(self, cfg: AppConfig) -> bool:
        if not self.path:
            return False
        directory = os.path.dirname(self.path)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".cds-", suffix=".yaml", dir=directory)
        with os.fdopen(fd, "w") as f:
            f.write(dump(cds_document(cfg)))
        os.replace(tmp, self.path)
        return True


SHIPPED = {
    # config file -> the bootstrap rendered from it (checked by tests/envoy_config/test_envoy_config.py)
    "envoy/warmroute.yaml": "envoy/envoy.yaml",
    "envoy/compose.warmroute.yaml": "envoy/compose.envoy.yaml",
    "envoy/compose.brains-0.warmroute.yaml": "envoy/compose.brains-0.envoy.yaml",
    "envoy/compose.brains-1.warmroute.yaml": "envoy/compose.brains-1.envoy.yaml",
}
SNIPPETS_FROM = "envoy/warmroute.yaml"
SNIPPETS_DIR = "envoy/snippets"
HEADER = "# Rendered by `warmroute envoy-config --config {src}` (make envoy-files). Do not edit: edit {src}.\n"


def shipped_files(root) -> dict[str, str]:
    """Every file under envoy/ that is rendered from a config, with its expected text."""
    root = Path(root)
    out = {}
    for src, dst in SHIPPED.items():
        out[dst] = HEADER.format(src=src) + dump(bootstrap(load_config(root / src)))
    for name, piece in snippets(load_config(root / SNIPPETS_FROM)).items():
        out[f"{SNIPPETS_DIR}/{name}.yaml"] = HEADER.format(src=SNIPPETS_FROM) + dump(piece)
    return out
