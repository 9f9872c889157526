"""``make bench-serve``: vLLM's own load generator (``vllm bench serve``, from the engine's venv) through Envoy and
warmroute, on mock replicas and on real vLLM replicas; its TTFT and TPOT beside what warmroute predicted for
the same requests.

A client we did not write: its prompts (vLLM's prefix-repetition dataset: a few shared prefixes, each followed
by a unique suffix, what a fleet with shared system prompts sees), its streaming parser, its own timing. The
prompts are made with the tiny model's tokenizer; the mocks are sent the same text under their model's name.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from extproc.tools.workload.generate import MOCK_MODEL
from extproc.tools.stack import real_vllm
from extproc.tools.stack.local import Stack



def vllm_bench_serve(url: str, model: str, out_dir: Path, prompts: int = 48, concurrency: int = 6, seed: int = 1,
                     prefix_len: int = 1024, suffix_len: int = 128, prefixes: int = 4, output_len: int = 32,
                     timeout_s: float = 900) -> dict:
    """Run ``vllm bench serve`` against ``url`` (an OpenAI chat endpoint), return its saved result."""
    why = real_vllm.available()
    if why:
        raise RuntimeError(why)
    tokenizer = str(real_vllm.model_dir())
    argv = [str(real_vllm.engine_python()), "-m", "vllm.entrypoints.cli.main", "bench", "serve",
            "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", url,
            "--model", tokenizer, "--served-model-name", model, "--tokenizer", tokenizer,
            "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(prefix_len),
            "--prefix-repetition-suffix-len", str(suffix_len), "--prefix-repetition-num-prefixes", str(prefixes),
            "--prefix-repetition-output-len", str(output_len), "--num-prompts", str(prompts),
            "--max-concurrency", str(concurrency), "--seed", str(seed), "--ignore-eos", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(out_dir), "--result-filename", "result.json"]
    env = real_vllm.vllm_env(real_vllm.VllmOptions())
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
    result = out_dir / "result.json"
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve exited {done.returncode}: {(done.stderr or done.stdout)[-2000:]}")
    return json.loads(result.read_text())


def predicted_ttft_ms(stack: Stack, last: int) -> float | None:
    """The median TTFT warmroute predicted for its last ``last`` decisions."""
    got = [d["predicted_ttft_s"] for d in json.loads(stack.admin_get(f"/decisions?last={last}"))["decisions"]
           if d["predicted_ttft_s"] is not None]
    return statistics.median(got) * 1000 if got else None


def row(name: str, r: dict, predicted: float | None) -> str:
    return (f"| {name} | {r['completed']} | {r['failed']} | {r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | "
            f"{'-' if predicted is None else f'{predicted:.0f}'} | {r['median_tpot_ms']:.1f} | "
            f"{r['output_throughput']:.0f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="mock,vllm", help="comma-separated: mock, vllm")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    lines = ["| replicas | completed | failed | TTFT p50 ms | TTFT p99 ms | warmroute's predicted TTFT p50 ms | "
             "TPOT p50 ms | output tok/s |", "|---|---|---|---|---|---|---|---|"]
    failed = 0
    for engine in args.engines.split(","):
        real = engine == "vllm"
        stack = Stack(args.replicas, real_vllm=real_vllm.VllmOptions() if real else None)
        with stack, tempfile.TemporaryDirectory() as out:
            stack.wait_all_live(120)
            model = real_vllm.model_info()["served_name"] if real else MOCK_MODEL
            print(f"vllm bench serve: {args.prompts} prompts, {args.concurrency} at a time, through warmroute on "
                  f"{args.replicas} {'real vLLM' if real else 'mock'} replicas ...", flush=True)
            r = vllm_bench_serve(stack.url, model, Path(out), args.prompts, args.concurrency, args.seed)
            failed += r["failed"]
            lines.append(row(f"{args.replicas} {'vLLM 0.32 (CPU)' if real else 'mock'}", r,
                             predicted_ttft_ms(stack, args.prompts)))
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
