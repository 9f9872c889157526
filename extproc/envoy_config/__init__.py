"""Envoy's side of warmroute: the bootstrap, paste-in snippets and CDS file, rendered from the brain's config."""

from .render import *  # noqa: F401,F403
