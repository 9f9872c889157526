"""Writes ``tests/fixtures/vllm-0.32/kv-events-offload.bin``: what vLLM 0.32's offloading connector publishes, built
from vLLM's own event classes, block hash and encoder (run with the engine venv's Python: ``make engines`` has it).

vLLM's CPU offloading does not run on this CPU build (``CPUOffloadingSpec.get_worker`` raises "CPU Offloading is
currently only supported on CUDA-alike and XPU GPUs"; the simple CPU connector needs CUDA streams), so the fixture is
the wire a GPU replica's ``OffloadingConnector`` with ``self_describing_kv_events`` sends, event by event as its
``OffloadingEventsTracker`` forms them (``distributed/kv_transfer/kv_connector/v1/offloading/events.py``): a prompt of
8 blocks computed on the GPU; offloaded to CPU in chunks of 3 blocks whose last chunk overlaps the one before (a block
announced twice); a chunk the tracker had no metadata for (its placeholder: the hash alone, block size 0); a REMOTE
tier's copy; the GPU evicting the prompt's second half; one CPU chunk evicted.

Each payload follows its 4-byte big-endian length, as ``kv-events.bin``; ``kv-events-offload.json`` holds the tokens.
"""

import json
import sys
from pathlib import Path

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as kcu

BS = 16
out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "tests/fixtures/vllm-0.32"
kcu.init_none_hash(sha256)
tokens = [(7919 * i) % 32000 for i in range(8 * BS + 5)]
digests, prev = [], None
for k in range(8):
    prev = kcu.hash_block_tokens(sha256, prev, tokens[k * BS:(k + 1) * BS], None)
    digests.append(prev)
ext = [kcu.maybe_convert_block_hash(d) for d in digests]


def stored(lo, hi, medium, locality=None, spec=True):
    return BlockStored(block_hashes=ext[lo:hi], parent_block_hash=ext[lo - 1] if lo else None,
                       token_ids=tokens[lo * BS:hi * BS], block_size=BS, lora_id=None, medium=medium, lora_name=None,
                       group_idx=0, kv_cache_spec_kind="full_attention" if spec else None,
                       locality=locality)


batches = [
    [stored(0, 8, "GPU")],
    [stored(0, 3, "CPU", "LOCAL"), stored(3, 6, "CPU", "LOCAL"), stored(5, 8, "CPU", "LOCAL")],
    [BlockStored(block_hashes=[ext[7] ^ 1], parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                 medium="CPU", lora_name=None, group_idx=0, locality="LOCAL")],
    [stored(0, 8, "CPU", "REMOTE")],
    [BlockRemoved(block_hashes=ext[4:8], medium="GPU", group_idx=0)],
    [BlockRemoved(block_hashes=ext[5:8], medium="CPU", group_idx=0, locality="LOCAL")],
]
enc = msgspec.msgpack.Encoder()
data = b""
for k, events in enumerate(batches):
    payload = enc.encode(KVEventBatch(ts=1000.0 + k, events=events))
    data += len(payload).to_bytes(4, "big") + payload
(out / "kv-events-offload.bin").write_bytes(data)
(out / "kv-events-offload.json").write_text(json.dumps({"block_size": BS, "tokens": tokens}) + "\n")
print(f"{len(batches)} batches, {len(data)} bytes -> {out}")
