"""Envoy's side of warmroute: the bootstrap, paste-in snippets and CDS file, rendered from the brain's config.

The names Envoy and the brain share live in ``extproc.contract``; this package only renders.
"""

from .render import (
    SHIPPED,
    SNIPPETS_DIR,
    SNIPPETS_FROM,
    CdsFile,
    access_log,
    bootstrap,
    brain_cluster,
    brain_headers,
    cds_document,
    clusters,
    dump,
    ext_proc_off_for_route,
    fallback_cluster,
    http_filters,
    replica_cluster,
    replica_clusters,
    routes,
    shipped_files,
    snippets,
)

__all__ = [
    "SHIPPED", "SNIPPETS_DIR", "SNIPPETS_FROM", "CdsFile", "access_log", "bootstrap", "brain_cluster",
    "brain_headers", "cds_document", "clusters", "dump", "ext_proc_off_for_route", "fallback_cluster",
    "http_filters", "replica_cluster", "replica_clusters", "routes", "shipped_files", "snippets",
]
