"""How far behind the brain reads the bodies Envoy sends it (a flood of new sessions).

One Python process reads every body it decides on: ~50-60 MB/s of 100 KB bodies on a busy core here. A flood of
2,000 new 25K-token sessions is 250 MB at once, four or five seconds of reading; Envoy's timer per message is
``envoy.ext_proc_timeout_s`` (1 s), so most of the flood timed out and failed open into the engines, ahead of the
turns of sessions under way, whose own bodies waited behind the flood's (HTTP/2 interleaves every stream's
frames, so each message is complete only when nearly all are). With flow control on, Envoy first sends the
headers of a large body (the look, ``warmroute.look``), before the client has uploaded it; this class says how long
that body would wait to be read, from what the brain sees:

- the calls Envoy opened whose message the brain has not read yet (the oldest one's age: measured, not predicted);
- how late the brain reads the look itself (Envoy's ``request.time`` and the upload's time, against the brain's
  clock: every delay on the way, gRPC's queue and the event loop's included);
- the bodies the looks let through in the last timer's length whose calls have not been read yet, at the rate one
  busy core reads them (measured here: ~50-60 MB/s; counted at 32 MiB/s, so the look sheds a little early rather
  than late). The rate is not learned: the brain cannot tell how long it spent reading a message (gRPC hands it
  over whole, a call is seen only once it is read), and a rate learned high would let a flood through.

A client's upload is not the brain's backlog: Envoy looks only once it holds the whole body (a size declared and
never sent is never looked at: 8 held-open 2 MiB declarations refused 60% of new sessions when the look came on
headers), a body the look let through counts for one timer's length at most, and the look's lateness starts at the
upload's last byte.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from datetime import datetime

READ_BYTES_PER_S = 32 << 20  # below what one busy core read here (50-60 MB/s): shed early, not late
# what a body's call costs the brain beside its bytes, in bytes read in that time: ~1 ms a call (grpcio's stream,
# the parse, the pricing; `make bench-overhead`'s CPU per first turn at 1 KB, 1.5-1.7 ms with its access-log entry)
# at READ_BYTES_PER_S. A small body announced at its header call counts this, never its declared size
CALL_BYTES = 32 * 1024
MAX_LOOKED = 100_000  # looks remembered at most (each a request id and a size)
_BASELINE_S = 60.0  # a look's lateness is measured above the least seen in the last minute or two: clock skew


class Intake:
    def __init__(self, horizon_s: float, clock, wall=time.time):
        self.horizon_s = horizon_s  # a look's body counts this long at most (Envoy's timer for its message)
        self.clock, self.wall = clock, wall
        # the least lateness seen, this minute and the last (Envoy's clock may be another host's)
        self._least: list[float] = [float("inf"), float("inf")]
        self._least_since = clock()
        self.unread: dict[object, float] = {}  # open calls whose message is not read yet -> when opened (in order)
        self.looked: OrderedDict[str, tuple[float, int]] = OrderedDict()  # request id -> (looked at, bytes)
        self.looked_bytes = 0

    # ------------------------------------------------------------------ the calls

    def opened(self, call: object) -> None:
        self.unread[call] = self.clock()

    def read(self, call: object, request_id: str | None) -> None:
        """The call's message is read."""
        self.unread.pop(call, None)
        self.forget(request_id)

    def forget(self, request_id: str | None) -> None:
        """A body let through or announced that will never be read (refused at its look)."""
        seen = self.looked.pop(request_id, None) if request_id is not None else None
        if seen is not None:
            self.looked_bytes -= seen[1]

    def closed(self, call: object) -> None:
        """The call ended (read or not)."""
        self.unread.pop(call, None)

    # ------------------------------------------------------------------ the look

    def _expire(self, now: float) -> None:
        while self.looked:
            rid, (t, n) = next(iter(self.looked.items()))
            if now - t <= self.horizon_s and len(self.looked) <= MAX_LOOKED:
                return
            self.looked.popitem(last=False)
            self.looked_bytes -= n

    def late_s(self, request_time: str | None, upload_ms: str | None = None) -> float:
        """How late the brain reads a look: since Envoy had the request whole (its ``request.time`` and the
        upload's milliseconds), above the least lateness of the last minute or two (what clock skew and an idle
        brain's own delay come to). 0 unknown."""
        if not request_time:
            return 0.0
        try:
            head, _, zone = request_time.replace("Z", "+00:00").partition("+")
            if "." in head:  # Envoy may print nanoseconds; Python reads microseconds
                whole, frac = head.split(".", 1)
                head = f"{whole}.{frac[:6]}"
            late = self.wall() - datetime.fromisoformat(f"{head}+{zone or '00:00'}").timestamp()
            uploaded = float(upload_ms) / 1000 if upload_ms and upload_ms.isascii() and upload_ms.isdigit() else 0.0
        except ValueError:
            return 0.0
        late -= uploaded
        now = self.clock()
        if now - self._least_since > _BASELINE_S:
            self._least = [float("inf"), self._least[0]]
            self._least_since = now
        self._least[0] = min(self._least[0], late)
        return max(0.0, late - min(self._least))

    def behind_s(self) -> float:
        """How long a body Envoy sent now would wait before the brain reads it."""
        now = self.clock()
        self._expire(now)
        oldest = now - next(iter(self.unread.values())) if self.unread else 0.0
        return max(oldest, self.looked_bytes / READ_BYTES_PER_S)

    @staticmethod
    def own_s(nbytes: int) -> float:
        """How long reading ``nbytes`` more takes."""
        return nbytes / READ_BYTES_PER_S

    def let_through(self, request_id: str | None, nbytes: int) -> None:
        """The look (or the header call) let this body through: it is on its way. Let through again (announced at its
        header call, then looked at once Envoy holds it), it counts the larger."""
        if request_id is None:
            return
        seen = self.looked.get(request_id)
        if seen is not None:
            if nbytes > seen[1]:
                self.looked[request_id] = (seen[0], nbytes)
                self.looked_bytes += nbytes - seen[1]
            return
        self.looked[request_id] = (self.clock(), nbytes)
        self.looked_bytes += nbytes
