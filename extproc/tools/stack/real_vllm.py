"""Start a real vLLM replica (0.32, CPU) on this machine: one helper for the tests, the benchmarks and
``warmroute up --engine vllm``.

The engine is a test dependency, never a product one: ``make engines`` installs it into a venv of its own
(``.engines/vllm-0.32``) and builds the tiny random-weight model with two LoRA adapters
(``engines/build_model.py``). Nothing here imports vLLM; it runs that venv's Python as a child process.
``WARMROUTE_ENGINE_DIR`` points elsewhere than ``.engines`` (the repository's).

The flags are what makes vLLM run on two shared cores: eager mode (no compile), a small KV cache given in bytes,
one OpenMP thread unbound (vLLM binds threads to cores by default, and several replicas would share them).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

from extproc.tools.stack.procs import Proc, StackError, free_port, http_get, wait_for

REPO = Path(__file__).resolve().parents[3]
VERSION = "0.32.0"
READY_TIMEOUT_S = 300.0  # ~35 s alone; four at once on two shared cores ~2 min


def engine_dir() -> Path:
    return Path(os.environ.get("WARMROUTE_ENGINE_DIR", REPO / ".engines"))


def engine_python() -> Path:
    return engine_dir() / "vllm-0.32" / "bin" / "python"


def model_dir() -> Path:
    return (engine_dir() / "models" / "current").resolve()


def model_info() -> dict:
    """The built model's served name and adapters (``warmroute-model.json``)."""
    return json.loads((model_dir() / "warmroute-model.json").read_text())


def available() -> str | None:
    """Why a real vLLM cannot start here (None: it can)."""
    if not engine_python().exists():
        return f"no vLLM venv at {engine_python().parent.parent} (make engines)"
    if not (model_dir() / "warmroute-model.json").exists():
        return f"no tiny model under {engine_dir() / 'models'} (make engines)"
    return None



@dataclasses.dataclass
class VllmOptions:
    served_name: str | None = None  # --served-model-name (default: the model's)
    kv_bytes: int = 64 << 20  # --kv-cache-memory-bytes: 64 MiB is 32K tokens of the tiny model
    max_model_len: int = 8192
    max_num_seqs: int | None = None
    lora: tuple[str, ...] | None = None  # adapters served from the start (None: the model's two; (): LoRA off)
    max_loras: int = 2
    data_parallel: int = 1
    log_stats: bool = True  # False: --disable-log-stats (no vllm:* engine metrics)
    runtime_lora: bool = False  # VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter and unload
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE: POST /reset_prefix_cache (benchmarks start each run cold)
    # VLLM_ENABLE_RESPONSES_API_STORE: Responses kept in this process's memory (previous_response_id, GET, cancel)
    responses_store: bool = False
    # the model runs inside the engine core's process (vLLM's "uni" executor, VLLM_ENABLE_V1_MULTIPROCESSING=0)
    # rather than in a worker process of its own, which vLLM's CPU platform picks by default: one process and
    # one torch import less, ~50 s -> ~30 s to start here. The API server, the engine core and everything
    # warmroute reads (routes, metrics, cache) are the same; data-parallel engines keep their own processes.
    uniproc: bool = True
    # KV events (issue 45): published on an ipc:// socket in the engine's work directory (local only; vLLM binds
    # it), with a replay socket beside it; GET /kv_event_sources names both
    kv_events: bool = False
    hash_seed: str | None = None  # PYTHONHASHSEED for the engine: another seed for its block hashes
    # each request's id in the engine's log ("Received request chatcmpl-...", no prompt: --max-log-len 0): a
    # benchmark tells which replica served a router that does not say (``served_ids``)
    log_requests: bool = False
    extra: tuple[str, ...] = ()


def kv_events_config(workdir: Path, port: int) -> str:
    base = f"ipc://{workdir / f'kv-{port}'}"
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": base + ".pub",
                       "replay_endpoint": base + ".replay"})


def vllm_argv(port: int, o: VllmOptions, workdir: Path | None = None) -> list[str]:
    model = model_dir()
    info = model_info()
    argv = [str(engine_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", o.served_name or info["served_name"], "--host", "127.0.0.1", "--port", str(port),
            "--enforce-eager", "--kv-cache-memory-bytes", str(o.kv_bytes), "--max-model-len", str(o.max_model_len),
            "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
    if o.max_num_seqs:
        argv += ["--max-num-seqs", str(o.max_num_seqs)]
    adapters = info["adapters"] if o.lora is None else list(o.lora)
    if adapters or o.runtime_lora:
        argv += ["--enable-lora", "--max-lora-rank", "8", "--max-loras", str(o.max_loras)]
        if adapters:
            argv += ["--lora-modules", *[f"{a}={model / 'adapters' / a}" for a in adapters]]
    if o.data_parallel > 1:
        argv += ["--data-parallel-size", str(o.data_parallel), "--data-parallel-rpc-port", str(free_port())]
    if not o.log_stats:
        argv += ["--disable-log-stats"]
    if o.kv_events:
        argv += ["--kv-events-config", kv_events_config(workdir or Path("/tmp"), port)]
    if o.log_requests:
        argv += ["--enable-log-requests", "--max-log-len", "0"]
    return argv + list(o.extra)


RECEIVED = re.compile(rb"Received request ([\w.-]+):")


def served_ids(log: bytes) -> list[str]:
    """The request ids an engine logged receiving (``VllmOptions.log_requests``), in order: its answers' ``id``."""
    return [m.decode() for m in RECEIVED.findall(log)]


def pd_extra(storage: Path, max_model_len: int = 8192) -> tuple[str, ...]:
    """vLLM 0.32's file-based KV connector, both roles (the one that runs on this CPU; NIXL's wheels are CUDA
    builds): a prefill leg's KV is written under ``storage``, and a replica given the same prompt loads it. Its
    chunked prefill must take any prompt whole: with 2,048-token chunks a longer load killed the decode engine
    (start_load_kv: shape mismatch, EngineDeadError), so the batch is the whole context
    (disaggregation.max_transfer_tokens says the same to the brain)."""
    cfg = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    return ("--kv-transfer-config", json.dumps(cfg), "--max-num-batched-tokens", str(max_model_len))


def vllm_env(o: VllmOptions) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO" if o.log_requests else "WARNING")}
    if o.runtime_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if o.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if o.uniproc:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if o.responses_store:
        env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
    env.pop("PYTHONHASHSEED", None)  # the engine's block hashes take their seed from it: only when asked
    if o.hash_seed is not None:
        env["PYTHONHASHSEED"] = o.hash_seed
    env.pop("PYTHONPATH", None)  # the engine's venv alone: our package must not shadow its dependencies
    # the engine's venv is a cache we own: the modules make engines' import did not compile are written on the first
    # start rather than compiled again by every start of every replica
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def start_vllm(name: str, workdir: Path, options: VllmOptions | None = None, port: int = 0,
               wait: bool = True) -> tuple[Proc, int]:
    """A real vLLM replica on 127.0.0.1 (``port`` 0: a free one), ready when this returns (``wait``)."""
    why = available()
    if why:
        raise StackError(why)
    o = options or VllmOptions()
    port = port or free_port()
    proc = Proc(name, vllm_argv(port, o, workdir), workdir, env=vllm_env(o))
    if wait:
        wait_ready(proc, port)
    return proc, port


def wait_ready(proc: Proc, port: int, timeout: float = READY_TIMEOUT_S) -> None:
    try:
        wait_for(lambda: http_get(f"http://127.0.0.1:{port}/health", 2.0) is not None, timeout,
                 f"vLLM {proc.name} on port {port}", proc, every=0.5)
    except BaseException:
        proc.stop()
        raise


if __name__ == "__main__":  # python -m extproc.tools.stack.real_vllm: is the engine here?
    print(available() or f"vLLM {VERSION}: {engine_python()}; model {model_dir()}")
    sys.exit(1 if available() else 0)
