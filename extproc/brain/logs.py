"""The brain's event log: one line per state change, rebind, drain, reload. Never prompt text or raw ids."""

from __future__ import annotations

import json
import logging
import sys
import time

log = logging.getLogger("warmroute")
_as_json = True


def event(name: str, **fields) -> None:
    """One line: JSON (default) or ``name key=value ...`` text."""
    if _as_json:
        log.info(json.dumps({"ts": round(time.time(), 3), "event": name, **fields}, separators=(",", ":")))
    else:
        log.info(" ".join([name, *(f"{k}={v}" for k, v in fields.items())]))


def setup_logging(fmt: str = "json") -> None:
    global _as_json
    _as_json = fmt == "json"
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")


class Summarised:
    """At most one line per key per window; the rest are counted and said in one summary line per window.

    A busy fleet moves pins many times a second (1,015 "unpin prefix spills" lines in 5 minutes once):
    the first of a kind shows at once, the volume shows as counts."""

    def __init__(self, name: str, window_s: float = 10.0):
        self.name = name
        self.window_s = window_s
        self._seen: dict[tuple, int] = {}
        self._window_end: float | None = None

    def add(self, now: float, key: tuple, **fields) -> None:
        self.flush(now)
        if self._window_end is None:
            self._window_end = now + self.window_s
        n = self._seen.get(key, 0)
        self._seen[key] = n + 1
        if n == 0:
            event(self.name, **fields)

    def flush(self, now: float) -> None:
        if self._window_end is None or now < self._window_end:
            return
        more = {"/".join(map(str, k)): n - 1 for k, n in self._seen.items() if n > 1}
        if more:
            event(self.name + "_summary", window_s=self.window_s, not_logged_one_by_one=more)
        self._seen.clear()
        self._window_end = None
