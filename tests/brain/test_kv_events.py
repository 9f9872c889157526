"""One engine's KV event stream as the brain reads it (issue 45), against a publisher that speaks vLLM 0.32's wire
(PUB frames ``[topic, seq, payload]``, a ROUTER replay socket answering a start sequence with every buffered batch
then ``[b"", -1, b""]``): in order, a gap filled from the replay, a gap it cannot fill, a publisher that goes
away and comes back as a new engine."""

from __future__ import annotations

import asyncio
import time

import msgspec
import zmq
import zmq.asyncio

from extproc.brain.kv_events import END_SEQ, EngineEvents


class Publisher:
    """vLLM's ZmqEventPublisher in miniature: binds, numbers its batches, keeps them for replay."""

    def __init__(self, endpoint: str, replay: str, keep: int = 100):
        ctx = zmq.asyncio.Context.instance()
        self.pub, self.router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
        for s in (self.pub, self.router):
            s.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)
        self.router.bind(replay)
        self.buffer: list[tuple[int, bytes]] = []
        self.keep, self.seq = keep, 0
        self.task = asyncio.get_running_loop().create_task(self._serve())

    def batch(self, n: int) -> bytes:
        return msgspec.msgpack.encode([time.time(), [{"type": "BlockRemoved", "block_hashes": [n], "medium": "GPU"}],
                                       0])

    async def publish(self, send: bool = True) -> None:
        payload = self.batch(self.seq)
        self.buffer = (self.buffer + [(self.seq, payload)])[-self.keep:]
        if send:
            await self.pub.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            for seq, payload in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self.task.cancel()
        self.pub.close(0)
        self.router.close(0)


async def until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def test_batches_arrive_in_order_a_gap_is_replayed_and_one_the_replay_cannot_fill_is_lost(tmp_path):
    async def main():
        ep, rp = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
        pub = Publisher(ep, rp, keep=3)
        got: list[int] = []
        lost: list[str] = []
        r = EngineEvents("r0/0", ep, rp, lambda evs, now: got.append(evs[0].hashes[0]),
                         lambda why, now: lost.append(why), time.monotonic, silent_s=0.5)
        task = asyncio.create_task(r.run())
        try:
            await until(lambda: r.connected, "connected")
            for _ in range(2):
                await pub.publish()
            await until(lambda: got == [0, 1], f"two batches in order, got {got}")
            await pub.publish(send=False)  # batch 2 never reaches the subscriber
            await pub.publish()
            await until(lambda: got == [0, 1, 2, 3], f"the gap replayed, got {got}")
            assert lost == [] and r.replayed >= 1
            for _ in range(4):
                await pub.publish(send=False)  # 4-7: the buffer keeps the last 3 only
            await pub.publish()
            await until(lambda: lost, "a gap the replay cannot fill is a loss")
            assert lost == ["batches 4-5 no longer buffered"], lost  # 6 and 7 the replay still had
            await until(lambda: got[4:] == [6, 7, 8], f"what the replay still had, then the live batch: {got}")
        finally:
            task.cancel()
            pub.close()

    asyncio.run(main())


def test_a_publisher_gone_is_lost_within_its_silence_and_back_as_a_new_engine_it_is_read_again(tmp_path):
    async def main():
        ep, rp = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
        pub = Publisher(ep, rp)
        got: list[int] = []
        lost: list[tuple[float, str]] = []
        r = EngineEvents("r0/0", ep, rp, lambda evs, now: got.append(evs[0].hashes[0]),
                         lambda why, now: lost.append((now, why)), time.monotonic, silent_s=0.5)
        task = asyncio.create_task(r.run())
        try:
            await until(lambda: r.connected, "connected")
            for _ in range(3):
                await pub.publish()
            await until(lambda: len(got) == 3, "three batches")
            pub.close()
            gone = time.monotonic()
            await until(lambda: lost, "the publisher gone is a loss")
            assert "unreachable" in lost[0][1] and lost[0][0] - gone < 5.0, lost
            pub = Publisher(ep, rp)  # the engine restarted: a new sequence from 0, its buffer replayed at connect
            await pub.publish(send=False)
            await until(lambda: r.connected, "reconnected")
            await pub.publish()
            await until(lambda: got[3:] == [0, 1], f"the new engine's batches, its first from the replay: {got}")
        finally:
            task.cancel()
            pub.close()

    asyncio.run(main())
