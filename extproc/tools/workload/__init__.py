"""Traffic: the agent workload (``generate``), its replay over HTTP (``http_replay``), the open loop of steady load
(``open_loop``), and the one rule by which a run is counted (``measure``), shared by simulator, benches and tests."""
