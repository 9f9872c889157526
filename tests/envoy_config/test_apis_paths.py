"""Every path a real vLLM 0.32 serves is decided on purpose: docs/apis.md's table names each one routed or private,
and Envoy's allowed paths agree with it. A new engine version's paths (``make fixtures-vllm``) fail here until
they are decided."""

from __future__ import annotations

import json
import re
from pathlib import Path

from extproc.config import EnvoyConfig
from extproc.envoy_config.render import allowed_path_regex

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm-0.32"
ROW = re.compile(r"^\| `(/[^`]*)` \| ([A-Z, ]*) \| (routed|private) \| (.+) \|$")


def table() -> dict[str, tuple[str, str]]:
    rows = {}
    for line in (ROOT / "docs" / "apis.md").read_text().splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} is twice in docs/apis.md"
            rows[m.group(1)] = (m.group(3), m.group(4))
    return rows


def engine_paths() -> set[str]:
    published = json.loads((FIXTURES / "openapi-paths.json").read_text())
    logged = json.loads((FIXTURES / "routes.json").read_text())
    return set(published) | set(logged)


def allowed(path: str) -> bool:
    """Whether Envoy's rendered rule for ``envoy.allowed_paths`` lets the path through (an id for a template)."""
    sample = re.sub(r"\{[^}]+\}", "resp_1", path)
    return any(re.match(allowed_path_regex(p), sample) for p in EnvoyConfig().allowed_paths)


def test_every_path_of_the_engine_is_in_the_table_and_nothing_else():
    rows, paths = table(), engine_paths()
    assert len(paths) > 20
    assert sorted(paths - set(rows)) == [], "vLLM serves paths docs/apis.md does not decide"
    assert sorted(set(rows) - paths) == [], "docs/apis.md decides paths vLLM 0.32 does not serve"
    assert all(len(why) > 10 for _, why in rows.values())


def test_envoy_lets_through_exactly_the_paths_the_table_routes():
    for path, (decision, _) in table().items():
        assert allowed(path) == (decision == "routed"), (path, decision)


def test_the_agents_apis_are_routed():
    rows = table()
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
                 "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel"):
        assert rows[path][0] == "routed", path
