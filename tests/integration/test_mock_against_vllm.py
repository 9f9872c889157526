"""The mock's vLLM dialect held against what a real vLLM 0.32 answered (``tests/fixtures/vllm-0.32/``, written by
``make fixtures-vllm`` from the engine running on this machine's CPU).

The mock is sent the history the capture sent the engine, then read the same way. For every family warmroute
reads: present, of the same type, with the same label keys; lora_requests_info with vLLM's semantics (every label
set kept, its value when it was last set, an adapter listed under running and waiting alike); /v1/models entries
with vLLM's fields; error bodies of the same shape; no route the engine lacks. Differences the mock keeps on
purpose are listed in docs/simulator.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extproc.brain.scraper import VLLM, parse_metrics
from bench.runs.capture_vllm import ADAPTERS, ERRORS, HISTORY, send
from extproc.tools.stack.local import http_get

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parents[1] / "fixtures" / "vllm-0.32"
MODEL = "mock-coder-30b"
# the mock's own routes, not vLLM's: its fault injection, and what other routers ask of a replica (vllm-router's
# /get_server_info and /get_model_info, SGLang's router's); each listed in docs/simulator.md
MOCK_ONLY_PATHS = {"/admin/fault", "/get_server_info", "/server_info", "/get_model_info", "/model_info",
                   "/v1/chat/completions/render"}


def families(text: str) -> dict[str, tuple[str, set[str]]]:
    """family -> (type, label keys of its samples); a histogram's and a counter's samples by their family."""
    types: dict[str, str] = {}
    keys: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split()
            if name.endswith("_created"):  # the client library's creation times, not vLLM's
                continue
            # vLLM's front end writes a counter's family with its _total (prometheus_client in multiprocess
            # mode), the mock's client without: the samples are named alike either way
            types[name[:-len("_total")] if typ == "counter" and name.endswith("_total") else name] = typ
        elif line and line[0] != "#":
            name = line.split("{")[0].split(" ")[0]
            base = next((name[:-len(s)] for s in ("_bucket", "_count", "_sum", "_total", "_created")
                         if name.endswith(s) and name[:-len(s)] in types), name)
            labels = set()
            if "{" in line:
                body = line[line.index("{") + 1:line.rindex("}")]
                labels = {part.split("=", 1)[0].strip(" ,") for part in body.split('",') if "=" in part}
            keys.setdefault(base, set()).update(labels - {"le"})
    return {n: (t, keys.get(n, set())) for n, t in types.items()}


def read_names() -> set[str]:
    """The families warmroute reads of a vLLM (extproc.brain.scraper.VLLM)."""
    names = {VLLM.running, VLLM.waiting, VLLM.kv[0], VLLM.cache_info, VLLM.lora_info,
             *(m for m, _, _ in VLLM.by_label), *VLLM.counters}
    out = set()
    for n in names:
        out.add(next((n[:-len(s)] for s in ("_count", "_sum", "_total") if n.endswith(s)), n))
    return out


# families only an offloading connector exports (vLLM's kv_connector/v1/offloading/metrics.py), which does not run
# on the captured CPU engine: checked against that source below
CONNECTOR_ONLY = {n.removesuffix("_total") for n in VLLM.optional}


def test_a_family_only_an_offloading_connector_exports_is_named_as_vllm_defines_it():
    from extproc.tools.stack.real_vllm import engine_dir

    src = next(engine_dir().glob("vllm-0.32/lib/python3*/site-packages/vllm/distributed/kv_transfer/kv_connector/v1/"
                                 "offloading/metrics.py"), None)
    if src is None:
        pytest.skip("no vLLM venv (make engines)")
    for name in CONNECTOR_ONLY:
        assert f'"{name}"' in src.read_text(), name


@pytest.fixture(scope="module")
def mock():
    """A mock replica sent the capture's history; its answers by name."""
    from extproc.tools.stack.local import Stack

    s = Stack(0)
    try:
        r = s.start_replica("m0", extra=["--lora-adapters", ",".join(ADAPTERS), "--max-loras", "2",
                                         "--max-model-len", "8192"])  # as the capture's engine (make engines)
        for path, doc in HISTORY:
            status, _ = send(r.url, path, doc, MODEL)
            assert status == 200, path
        errors = {}
        for name, (path, doc) in ERRORS.items():
            status, body = send(r.url, path, doc, MODEL)
            errors[name] = {"status": status, "body": json.loads(body)}
        yield {"metrics": http_get(r.url + "/metrics").decode(), "models": json.loads(http_get(r.url + "/v1/models")),
               "openapi": json.loads(http_get(r.url + "/openapi.json")), "errors": errors}
    finally:
        s.stop()


def test_every_family_warmroute_reads_has_vllms_type_and_label_keys(mock):
    real, ours = families((FIXTURES / "metrics.txt").read_text()), families(mock["metrics"])
    # metrics that only a multi-engine replica labels by engine, or that a model name labels, are the same keys
    for name in sorted(read_names() - CONNECTOR_ONLY):
        assert name in real, f"vLLM 0.32 has no {name}: the scraper reads a family the engine lacks"
        assert name in ours, f"the mock lacks {name}"
        assert ours[name][0] == real[name][0], (name, ours[name][0], real[name][0])
        assert ours[name][1] == real[name][1], (name, sorted(ours[name][1]), sorted(real[name][1]))


def test_lora_requests_info_keeps_every_label_set_as_vllm_does(mock):
    def sets(text):
        out = []
        for line in text.splitlines():
            if line.startswith(VLLM.lora_info + "{"):
                body = line[line.index("{") + 1:line.rindex("}")]
                lab = dict(p.split("=", 1) for p in body.replace('"', "").split(","))
                out.append((lab, float(line.rsplit(" ", 1)[1])))
        return out

    for text in ((FIXTURES / "metrics.txt").read_text(), mock["metrics"]):
        got = sets(text)
        assert len(got) >= 3, got  # idle, and each adapter's request: every set it ever had
        assert all(v > 1e9 for _, v in got), got  # the value is when it was set (a Unix time)
        ran = [lab for lab, _ in got if lab["running_lora_adapters"]]
        assert {lab["running_lora_adapters"] for lab in ran} == set(ADAPTERS)
        assert all(lab["waiting_lora_adapters"] == lab["running_lora_adapters"] for lab in ran), ran
        newest = max(got, key=lambda s: s[1])[0]
        assert newest["running_lora_adapters"] == "" and newest["max_lora"] == "2"
        r = parse_metrics(text, VLLM)
        assert r.ok and r.sample.lora_running == frozenset()


def test_models_list_entries_have_vllms_fields(mock):
    real = json.loads((FIXTURES / "models.json").read_text())["data"]
    ours = mock["models"]["data"]
    assert {tuple(sorted(m)) for m in ours} == {tuple(sorted(m)) for m in real}
    assert sorted(m["parent"] is None for m in ours) == sorted(m["parent"] is None for m in real)


def test_error_bodies_have_vllms_shape(mock):
    real = json.loads((FIXTURES / "errors.json").read_text())
    for name, want in real.items():
        got = mock["errors"][name]
        assert got["status"] == want["status"], name
        # OpenAI's shape ({"error": {...}}), or Anthropic's on /v1/messages ({"type": "error", "error": {...}})
        assert set(got["body"]) == set(want["body"]) and "error" in want["body"], name
        assert set(got["body"]["error"]) == set(want["body"]["error"]), name
        for field in ("type", "param", "code"):
            assert got["body"]["error"].get(field) == want["body"]["error"].get(field), (name, field)
    assert mock["errors"]["unknown-model"]["body"]["error"]["message"] == (
        f"The model `no-such-model` does not exist. Valid aliases: {MODEL}.")


def test_the_mock_serves_no_route_the_engine_lacks(mock):
    real = json.loads((FIXTURES / "openapi-paths.json").read_text())
    for path, ops in mock["openapi"]["paths"].items():
        if path in MOCK_ONLY_PATHS:
            continue
        assert path in real, f"the mock serves {path}, vLLM 0.32 does not"
        assert {m.upper() for m in ops} <= set(real[path]), path
