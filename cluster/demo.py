"""The main job (`make demo`): one prefill + one decode instance from a YAML, then vs colocated.

Picks the deployment by what the machine has: `configs/llama3-8b-1p1d.yaml` when two GPUs are
visible; with one GPU, `configs/llama3-8b-1gpu-1p1d.yaml` (both instances share it over NVSHMEM)
against one colocated instance on that GPU, labelled as a check of both paths, not a comparison
of deployments; else `configs/smollm2-1p1d.yaml` on the CPU (real weights and tokenizer) when the
SmolLM2 conversion is cached or can be built; else `configs/tiny-1p1d.yaml`. It launches the
fleet, streams a few prompts (text as it arrives, or token ids for random weights), then compares
the disaggregated fleet with its colocated twin on the same devices through `disagg bench`'s
comparison (`disagg.cluster.bench.compare.quick_compare`: goodput, TTFT/TPOT, PNG plots), and
prints where the results went (`results/`, git-ignored). Runs in the launching process.

    python -m disagg.cluster.demo [--config A.yaml --compare B.yaml] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CHAT_PROMPTS = ["What is the capital of France? Answer in one sentence.",
                "Write a haiku about a GPU waiting for its memory.",
                "Explain in two sentences why splitting prefill from decode helps latency."]
# Per machine kind: (disaggregated config, colocated config, streamed tokens, comparison workload).
WORKLOADS = {
    "gpu": dict(max_tokens=64, num_prompts=64, rates=(4.0, 16.0), input_len=1024, output_len=128),
    "gpu-shared": dict(max_tokens=64, num_prompts=32, rates=(4.0,), input_len=1024, output_len=128),
    "smollm2": dict(max_tokens=40, num_prompts=6, rates=(0.5,), input_len=64, output_len=12),
    "tiny": dict(max_tokens=24, num_prompts=8, rates=(8.0,), input_len=64, output_len=16),
}


SHARED_GPU_CAVEAT = ("one GPU: the 1P1D side's two instances time-slice it, so the figures below show both "
                     "paths working; they are not a comparison of deployments (that needs two GPUs)")


def choose(num_gpus: int) -> tuple[str, Path, Path]:
    """(kind, disaggregated config, colocated config) for this machine; see the module docstring."""
    if num_gpus >= 2:
        return "gpu", CONFIGS / "llama3-8b-1p1d.yaml", CONFIGS / "llama3-8b-colocated.yaml"
    if num_gpus == 1:
        return "gpu-shared", CONFIGS / "llama3-8b-1gpu-1p1d.yaml", CONFIGS / "llama3-8b-1gpu-colocated.yaml"
    try:
        from disagg.model.smollm2 import ensure_smollm2
        print(f"SmolLM2-135M-Instruct: {ensure_smollm2()}")
        return "smollm2", CONFIGS / "smollm2-1p1d.yaml", CONFIGS / "smollm2-colocated.yaml"
    except Exception as err:  # package missing or conversion impossible: the tiny random model
        print(f"SmolLM2 weights unavailable ({type(err).__name__}: {err}); using the tiny dummy model")
        return "tiny", CONFIGS / "tiny-1p1d.yaml", CONFIGS / "tiny-colocated.yaml"


def prompts_for(cluster) -> list[tuple[str, object]]:
    """(label, prompt) pairs: chat prompts through the model's template when it has a tokenizer,
    else token ids."""
    tokenizer = cluster.tokenizer
    if tokenizer is None:
        ids = [[(7 * i + 3 * j) % 200 + 3 for j in range(16 + 24 * i)] for i in range(3)]
        return [(f"{len(p)} token ids {p[:6]}...", p) for p in ids]
    prompts = []
    for text in CHAT_PROMPTS:
        try:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        except Exception:  # no chat template: the plain text
            prompt = text
        prompts.append((text, prompt))
    return prompts


def stream_prompts(cluster, max_tokens: int) -> list[dict]:
    """Stream each prompt to stdout in turn; return how each ended and how long it took."""
    from disagg.cluster.cli import stream_to_stdout
    from disagg.sampling import SamplingParams

    shown = []
    for label, prompt in prompts_for(cluster):
        print(f"\n>>> {label}")
        start = time.time()
        last = asyncio.run(stream_to_stdout(cluster, prompt, SamplingParams(max_tokens=max_tokens)))
        shown.append({"prompt": label, "finish_reason": last.finish_reason, "error": last.error,
                      "seconds": time.time() - start})
    return shown


def compare(kind: str, config_a: Path, config_b: Path, out_dir: Path) -> dict:
    """The disaggregated vs colocated comparison, through the bench package's quick_compare."""
    from disagg.cluster.bench.compare import quick_compare

    work = WORKLOADS[kind]
    return quick_compare(str(config_a), str(config_b), str(out_dir), num_prompts=work["num_prompts"],
                         rates=work["rates"], input_len=work["input_len"], output_len=work["output_len"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disagg.cluster.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, help="the disaggregated YAML (default: by machine)")
    parser.add_argument("--compare", type=Path, help="the colocated YAML it is compared with")
    parser.add_argument("--out", type=Path, help="results folder (default: results/demo-<time>)")
    parser.add_argument("--no-compare", action="store_true", help="skip the comparison")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("DISAGG_LOG", "WARNING"))
    os.environ.setdefault("DISAGG_LOG", "WARNING")
    import ray

    from disagg.cluster import Cluster
    from disagg.cluster.cli import describe
    from disagg.cluster.connect import enable_token_auth, start_embedded_head

    start = time.time()
    enable_token_auth()  # and on loopback, as every embedded head (README "Security")
    start_embedded_head("127.0.0.1", include_dashboard=False, log_to_driver=True, namespace="disagg-demo",
                        num_cpus=max(4, os.cpu_count() or 1))
    try:
        if args.config is None:
            kind, config_a, config_b = choose(int(ray.cluster_resources().get("GPU", 0)))
        else:
            name = args.config.name
            kind = ("gpu-shared" if "1gpu" in name else "gpu" if "llama3" in name
                    else "smollm2" if "smollm2" in name else "tiny")
            config_a = args.config
            config_b = args.compare or args.config.with_name(name.replace("1p1d", "colocated"))
        out_dir = args.out or Path("results") / time.strftime("demo-%Y%m%d-%H%M%S")
        out_dir.mkdir(parents=True, exist_ok=True)
        print(f"launching {config_a} ...")
        with Cluster.launch(config_a) as cluster:
            print(describe(cluster))
            shown = stream_prompts(cluster, WORKLOADS[kind]["max_tokens"])
        summary = None
        if not args.no_compare:
            print(f"\ncomparing {config_a.name} with {config_b.name} on the same devices ...")
            if kind == "gpu-shared":
                print(SHARED_GPU_CAVEAT)
            summary = compare(kind, config_a, config_b, out_dir)
        (out_dir / "demo.json").write_text(json.dumps(
            {"kind": kind, "config": str(config_a), "compare": str(config_b), "streamed": shown,
             "seconds": time.time() - start, "comparison": summary}, indent=2, default=str))
    finally:
        ray.shutdown()
    print(f"\ndemo finished in {time.time() - start:.0f} s; results in {out_dir.resolve()}/")
    return 0


if __name__ == "__main__":
    # Run through the importable module, so Ray pickles by reference, not by value.
    from disagg.cluster.demo import main as module_main
    sys.exit(module_main())
