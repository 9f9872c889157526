"""The YAML config: defaults are SPEC numbers; a broken file gives one line naming the field."""

from __future__ import annotations

import subprocess
import sys

import pytest

from extproc.config import ConfigError, load_config, parse_config

GOOD = """
replicas:
  - {name: r0, url: "http://127.0.0.1:8001"}
  - {name: r1, url: "http://127.0.0.1:8002/"}
pins: {session_ttl_s: 1800}
profile: {session_headers: [X-Agent-Session, x-session-id]}
routing: {token_weight_unit: 2000}
"""


def test_a_good_file_loads_and_keeps_spec_defaults_elsewhere(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(GOOD)
    cfg = load_config(f)
    assert [r.name for r in cfg.replicas] == ["r0", "r1"]
    assert cfg.replicas[1].url == "http://127.0.0.1:8002" and cfg.replicas[1].port == 8002
    assert cfg.router.pins.session_ttl_s == 1800 and cfg.router.pins.prefix_ttl_s == 300
    assert cfg.router.profile.session_headers == ("x-agent-session", "x-session-id")  # lower-cased
    assert cfg.router.token_weight_unit == 2000
    assert cfg.router.health.scrape_interval_s == 3


@pytest.mark.parametrize(
    "text,field",
    [
        ("pins: {session_ttl_s: soon}", "pins.session_ttl_s"),
        ("pins: {session_ttl_s: -5}", "pins.session_ttl_s"),
        ("pins: {sesion_ttl_s: 5}", "pins.sesion_ttl_s"),
        ("health: {scrape_interval_s: 0}", "health.scrape_interval_s"),
        ("health: {good_scrapes_to_probe: 2.5}", "health.good_scrapes_to_probe"),
        ("profile: {session_headers: x-session-id}", "profile.session_headers"),
        ("routing: {policy: fastest}", "routing.policy"),
        ("routing: {policy: 3}", "routing.policy"),
        ("warm: {balance_factor: 0.5}", "warm.balance_factor"),
        ("warm: {kv_pressure: 1.5}", "warm.kv_pressure"),
        ("warm: {prefill_tokens_per_s: 0}", "warm.prefill_tokens_per_s"),
        ("warm: {busy_wait_s: 0}", "warm.busy_wait_s"),  # divides the candidates' mean wait
        ("warm: {arrival_window_s: 0}", "warm.arrival_window_s"),
        ("warm: {restore_cost_prior: 0}", "warm.restore_cost_prior"),
        ("warm: {restore_cost_prior: 1.5}", "warm.restore_cost_prior"),
        ("warm: {offload_tiers: [GPU]}", "warm.offload_tiers"),
        ("warm: {offload_tiers: CPU}", "warm.offload_tiers"),
        ("envoy: {fail_open_hash_balance_factor: 50}", "envoy.fail_open_hash_balance_factor"),
        ("allow_no_replicas: maybe", "allow_no_replicas"),
        ("routing: {token_weight_unit: 0}", "routing.token_weight_unit"),
        ("routing: {health: 1}", "routing.health"),
        ("replicas: {r0: x}", "replicas"),
        ("replicas: [{name: r0}]", "replicas[0].url"),
        ("replicas: [{name: r0, url: 'ftp://x'}]", "replicas[0].url"),
        ("replicas: [{name: r0, url: 'http://h:99999'}]", "replicas[0].url"),
        ("replicas: [{name: 'bad name', url: 'http://h:1'}]", "replicas[0].name"),
        ("replicas: [{name: r0, url: 'http://h:1'}, {name: r0, url: 'http://h:2'}]", "replicas[1].name"),
        ("replicas: [{name: r0, url: 'http://h:1', weight: 2}]", "replicas[0].weight"),
        ("replicas: [{name: r0, url: 'http://h:1', kv_events: 'tcp://h:5557'}]", "replicas[0].kv_events"),
        ("replicas: [{name: r0, url: 'http://h:1', kv_events: {endpoint: 'udp://h:5557'}}]",
         "replicas[0].kv_events.endpoint"),
        ("replicas: [{name: r0, url: 'http://h:1', kv_events: {endpoint: 'tcp://h:5²'}}]",
         "replicas[0].kv_events.endpoint"),  # a Unicode digit passes isdigit() and breaks int()
        ("replicas: [{name: r0, url: 'http://h:1', kv_events: {endpoint: 'tcp://h:5557', replay: 'tcp://h:1'}}]",
         "replicas[0].kv_events.replay"),
        ("replicas: [{name: r0, url: 'http://h:1', kv_events: {endpoint: 'ipc:///tmp/p', data_parallel_size: 2}}]",
         "replicas[0].kv_events.endpoint"),
        ("replicas: [{name: r0, url: 'http://h:1', kv_events: {endpoint: 'tcp://h:1', data_parallel_size: 0}}]",
         "replicas[0].kv_events.data_parallel_size"),
        ("discovery: {kv_events_replay_port: 5558}", "discovery.kv_events_replay_port"),
        ("discovery: {kv_events_port: 70000}", "discovery.kv_events_port"),
        ("brain: {grpc_socket: ''}", "brain.grpc_socket"),
        (f"brain: {{grpc_socket: /tmp/{'d' * 120}/brain.sock}}", "brain.grpc_socket"),
        ("bogus: 1", "bogus"),
        ("pins: [1, 2]", "pins"),
        ("pins: {session_ttl_s: [1", "line 1"),
        ("- a list", "top level"),
    ],
)
def test_a_broken_config_gives_one_line_naming_the_field(tmp_path, text, field):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    assert field in msg and "\n" not in msg


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


def test_empty_file_is_all_defaults():
    cfg = parse_config(None)
    assert cfg.replicas == () and cfg.router.pins.prefix_ttl_s == 300


def test_check_config_cli_prints_one_line_and_exits_2(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("pins: {prefix_ttl_s: never}\n")
    p = subprocess.run([sys.executable, "-m", "extproc.cli", "check-config", str(f)], capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "pins.prefix_ttl_s" in p.stderr and "Traceback" not in p.stderr


def test_the_default_policy_is_warm_and_seed_and_the_ablations_can_be_named():
    from extproc.core import POLICIES

    assert parse_config({}).router.policy == "warm"
    for name in POLICIES:
        assert parse_config({"routing": {"policy": name}}).router.policy == name


def test_each_replica_names_its_engine():
    from extproc.config import ConfigError, parse_config

    cfg = parse_config({"replicas": [{"name": "a", "url": "http://h:1"}, {"name": "b", "url": "http://h:2",
                                                                          "engine": "sglang"},
                                     {"name": "c", "url": "http://h:3", "engine": "none"}]})
    assert [r.engine for r in cfg.replicas] == ["vllm", "sglang", "none"]
    with pytest.raises(ConfigError,
                       match=r"^replicas\[0\]\.engine: expected one of vllm, sglang, none, auto, got 'tgi'$"):
        parse_config({"replicas": [{"name": "a", "url": "http://h:1", "engine": "tgi"}]})


# ---- bounded config (issue 19, part 4)

BOMB = ("replicas: [{name: r0, url: 'http://127.0.0.1:9'}]\npins:\n  session_ttl_s: [" + ", ".join(
    ["&a [x, x, x, x, x, x, x, x, x]"] + [f"&{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]" for i in range(8)])
    + "]\n")  # nine levels of nine: 9^9 values wherever the value is walked (an error message's repr)


def test_a_yaml_alias_bomb_is_refused_in_one_line_naming_the_line(tmp_path):
    from extproc.config import load_config

    p = tmp_path / "bomb.yaml"
    p.write_text(BOMB)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "more than 64 YAML aliases" in msg and "line " in msg and "\n" not in msg and len(msg) < 200


def test_a_config_file_over_the_size_bound_is_refused_unread(tmp_path):
    from extproc.config import MAX_CONFIG_BYTES, load_config

    p = tmp_path / "big.yaml"
    p.write_text("# " + "x" * MAX_CONFIG_BYTES + "\n")
    with pytest.raises(ConfigError, match="larger than"):
        load_config(p)


@pytest.mark.parametrize("doc", [
    {"pins": {"session_ttl_s": "x" * 100_000}},
    {"replicas": [{"name": "r" * 100_000, "url": "http://a:1"}]},
    {"profile": {"session_headers": [["deep"] * 10_000]}},
    {"envoy": {"allowed_paths": ["v1" * 50_000]}},
])
def test_an_error_shows_a_short_excerpt_of_the_value_never_all_of_it(doc):
    with pytest.raises(ConfigError) as e:
        parse_config(doc)
    assert len(str(e.value)) < 250, str(e.value)[:300]


def test_a_reload_reads_and_parses_the_file_off_the_event_loop(tmp_path):
    import asyncio
    import threading

    from extproc.brain.brain import Brain
    from extproc.config import load_config

    p = tmp_path / "w.yaml"
    p.write_text("replicas: [{name: r0, url: 'http://127.0.0.1:9'}]\n")
    brain = Brain(load_config(p), config_path=str(p))
    seen = []
    real = brain.read_config

    def recording():
        seen.append(threading.get_ident())
        return real()

    brain.read_config = recording

    async def main():
        await brain.reload_async()
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert seen and seen[0] != loop_thread


# ---- replica URLs mean what they say (issue 19, part 6)

@pytest.mark.parametrize("url, said", [
    ("http://10.0.0.5:8000/v1", "a path, query or fragment is not supported"),
    ("http://10.0.0.5:8000/?x=1", "a path, query or fragment is not supported"),
    ("http://admin:hunter2@10.0.0.5:8000", "credentials in the URL are not supported"),
])
def test_a_replica_url_that_would_not_be_honoured_is_refused(url, said):
    with pytest.raises(ConfigError) as e:
        parse_config({"replicas": [{"name": "r0", "url": url}]})
    assert said in str(e.value) and "hunter2" not in str(e.value)


def test_tls_settings_on_a_plain_http_replica_are_refused():
    with pytest.raises(ConfigError, match=r"replicas\[0\]\.tls_ca_file: TLS settings need an https:// URL"):
        parse_config({"replicas": [{"name": "r0", "url": "http://a:1", "tls_ca_file": "/ca.pem"}]})


def test_an_https_replica_gets_tls_in_envoy_with_its_own_name_and_ca():
    from extproc.envoy_config import bootstrap

    cfg = parse_config({"replicas": [{"name": "r0", "url": "http://10.0.0.1:8000"},
                                     {"name": "r1", "url": "https://vllm-1.internal:8443",
                                      "tls_ca_file": "/etc/ca.pem"}]})
    clusters = {c["name"]: c for c in bootstrap(cfg)["static_resources"]["clusters"]}
    for name in ("r0", "r1", "warmroute_fallback"):
        (match,) = clusters[name]["transport_socket_matches"]  # only r1's endpoints speak TLS
        tls = match["transport_socket"]["typed_config"]
        assert match["match"] == {"warmroute_replica": "r1"} and tls["sni"] == "vllm-1.internal"
        v = tls["common_tls_context"]["validation_context"]
        assert v["trusted_ca"]["filename"] == "/etc/ca.pem"
        assert v["match_typed_subject_alt_names"][0]["matcher"]["exact"] == "vllm-1.internal"


def test_an_engine_s_kv_event_publishers_can_be_named_as_vllm_s_flag_names_them():
    """Issue 63: for engines without GET /kv_event_sources. vLLM's bind address pasted (tcp://*:5557) is the
    replica's own host; data-parallel ranks at the ports after, as vLLM offsets them; an ipc:// path as given."""
    cfg = parse_config({"replicas": [
        {"name": "a", "url": "http://10.0.0.5:8000",
         "kv_events": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600", "data_parallel_size": 2}},
        {"name": "b", "url": "http://[fd00::7]:8000", "kv_events": {"endpoint": "tcp://0.0.0.0:5557"}},
        {"name": "c", "url": "http://127.0.0.1:8000", "kv_events": {"endpoint": "ipc:///run/vllm/kv.pub"}},
        {"name": "d", "url": "http://10.0.0.6:8000", "kv_events": {"endpoint": "tcp://events.svc:7000"}},
        {"name": "e", "url": "http://10.0.0.7:8000"}]})
    got = {r.name: r.kv_events for r in cfg.replicas}
    assert got == {"a": (("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5600"), ("tcp://10.0.0.5:5558", "tcp://10.0.0.5:5601")),
                   "b": (("tcp://[fd00::7]:5557", None),), "c": (("ipc:///run/vllm/kv.pub", None),),
                   "d": (("tcp://events.svc:7000", None),), "e": ()}


def test_the_brain_follows_configured_publishers_and_asks_the_others_at_kv_event_sources():
    """A replica whose publishers the config names is not asked at /kv_event_sources (an older vLLM has no such
    route): its readers follow the config, and /state says where they came from; once the config names none, it
    is asked again."""
    from ..helpers import live_brain

    doc = {"replicas": [{"name": "r0", "url": "http://127.0.0.1:8001", "kv_events": {"endpoint": "tcp://*:5557"}},
                        {"name": "r1", "url": "http://127.0.0.1:8002"}],
           "exact_cache": {"enabled": True}}
    b = live_brain(parse_config(doc))
    assert b.exact.kv.sources["r0"] == {0: ("tcp://127.0.0.1:5557", None)}
    assert b.scraper.kv_wanted == {"r1"} and "r0" not in b.scraper.kv_due
    assert b.exact.replica_view("r0")["events_from"] == "configured"
    assert b.exact.replica_view("r1")["events_from"] is None  # not listed yet
    b.exact.kv.on_sources("r1", "http://127.0.0.1:8002", {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                                                               "endpoint": "tcp://*:5560"}})
    assert b.exact.replica_view("r1")["events_from"] == "listed"
    doc["replicas"][0].pop("kv_events")
    b.reload(parse_config(doc))
    assert b.scraper.kv_wanted == {"r0", "r1"} and "r0" in b.scraper.kv_due
    doc["exact_cache"]["enabled"] = False
    b.reload(parse_config(doc))
    assert not b.exact.kv.sources and not b.scraper.kv_wanted
