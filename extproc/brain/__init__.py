"""The brain: the imperative shell around the routing core (gRPC ext_proc + access log, scraper, admin)."""
