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
