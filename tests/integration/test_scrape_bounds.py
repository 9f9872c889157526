"""A replica's /metrics cannot grow the brain (issue 19, part 3): an endless page is cut at the cap, and the
brain's memory is back near its baseline once that replica is gone."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from extproc.tools.hostile import ENDLESS_METRICS, rss_mib
from extproc.tools.stack import Proc, Stack, http_get, wait_for

pytestmark = pytest.mark.integration

def test_an_endless_metrics_page_leaves_the_brain_s_memory_near_its_baseline():
    with Stack(1, config={"health": {"scrape_interval_s": 0.25, "probing_clean_window_s": 1.0}},
               mock_args=["--speedup", "20"]) as s:
        s.wait_all_live(30)
        pid = s.brain.popen.pid
        baseline = rss_mib(pid)
        endless = Proc("endless", [sys.executable, "-c", ENDLESS_METRICS], s.dir)
        s._started.append(endless)
        port = wait_for(lambda: json.loads(endless.log_path.read_text().splitlines()[0])["port"], 20, "the endless server")
        doc = yaml.safe_load((s.dir / "warmroute.yaml").read_text())
        doc["replicas"].append({"name": "endless", "url": f"http://127.0.0.1:{port}"})
        (s.dir / "warmroute.yaml").write_text(yaml.safe_dump(doc))
        s.admin_post("/reload")

        def errors_seen():
            st = {r["name"]: r for r in s.state()["replicas"]}
            return "larger than" in (st["endless"].get("scrape_error") or "")

        wait_for(errors_seen, 20, "the endless page refused at the cap")
        metrics = lambda: http_get(s.brain_metrics).decode()  # noqa: E731
        fails = lambda: sum(float(l.split()[-1]) for l in metrics().splitlines()  # noqa: E731,E741
                            if l.startswith('warmroute_scrapes_total{replica="endless",result="failed"}'))
        wait_for(lambda: fails() >= 20, 60, "20 scrapes of the endless page")  # ~80 MiB offered
        during = rss_mib(pid)
        doc["replicas"] = [r for r in doc["replicas"] if r["name"] != "endless"]
        (s.dir / "warmroute.yaml").write_text(yaml.safe_dump(doc))
        s.admin_post("/reload")
        after = rss_mib(pid)
        print(f"brain RSS: baseline {baseline:.1f} MiB, under the endless page {during:.1f}, after {after:.1f}")
        assert after <= 1.2 * baseline and during <= 1.2 * baseline + 8  # a cap's worth of buffer at most
