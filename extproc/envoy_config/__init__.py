"""Envoy's side of warmroute: the bootstrap, paste-in snippets and CDS file, rendered from the brain's config.

The names Envoy and the brain share live in ``extproc.contract``; this package only renders. ``render`` is
the default shape, ``picker`` the endpoint-picker shape, ``shapes`` chooses between them.
"""

from .render import (
    access_log,
    brain_cluster,
    brain_headers,
    clusters,
    dump,
    ext_proc_off_for_route,
    fallback_cluster,
    http_filters,
    replica_cluster,
    replica_clusters,
    routes,
    snippets,
)
from .filters import extension_of
from .shapes import SHIPPED, SNIPPETS_DIR, SNIPPETS_FROM, CdsFile, bootstrap, cds_document, shipped_files

__all__ = [
    "SHIPPED", "SNIPPETS_DIR", "SNIPPETS_FROM", "CdsFile", "access_log", "bootstrap", "brain_cluster",
    "brain_headers", "cds_document", "clusters", "dump", "extension_of", "ext_proc_off_for_route", "fallback_cluster",
    "http_filters", "replica_cluster", "replica_clusters", "routes", "shipped_files", "snippets",
]
