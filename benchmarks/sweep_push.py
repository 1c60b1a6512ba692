"""Tuning sweep of the fused append+push kernel over NVLink, in one process with two GPUs; JSON out.

    source .whl/gpu-env.sh && python3 benchmarks/sweep_push.py --out results/sweep_push.json

The workload of `bench_transfer.py` (an 8B model's KV, 32 layers, 8 KV heads, head_dim 128,
16-token pages, bf16; 8192 tokens = 1 GiB scattered over random pages on both sides), but the
receiver is GPU 1's memory reached through CUDA peer access from this process rather than an
NVSHMEM peer view in another process: the same NVLink stores, without Ray in the loop, so many
launch configurations can be timed in one run. Every variant is 32 launches replayed as one CUDA
graph; each row gives GB/s and its ratio to a contiguous 1 GiB peer `copy_` timed in the same run.
Rows: the default launch on one stream and alternating between two streams (as `KVPusher` does);
the kernel's tile size (elements of K per program) x warps, for the fused write (local + remote),
the remote write alone (local slots -1) and the local write alone; `copy_slots` page to page.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch

LAYERS, HEADS, DIM, PAGE, PAGES, TOKENS = 32, 8, 128, 16, 1024, 8192
GiB = 1 << 30


def _graph_seconds(launch, iters: int, graph: bool = True) -> float:
    """Median seconds of one replay of a CUDA graph holding ``launch()`` (or of ``launch()``)."""
    launch()
    torch.cuda.synchronize()
    run = launch
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            launch()
        run = captured.replay
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _scattered_slots(rng: np.random.Generator) -> torch.Tensor:
    pages = rng.permutation(PAGES)[:TOKENS // PAGE]
    slots = np.repeat(pages, PAGE) * PAGE + np.arange(TOKENS) % PAGE
    return torch.from_numpy(slots.astype(np.int32)).cuda(0)


def run(iters: int) -> dict:
    from disagg.kernels import append, append_push_kv, build_dst_table, copy_slots

    torch.cuda.set_device(0)
    kv = torch.zeros(LAYERS, PAGES, 2, HEADS, PAGE, DIM, dtype=torch.bfloat16, device="cuda:0")
    peer = torch.zeros_like(kv, device="cuda:1")
    peer[0, 0].copy_(kv[0, 0])  # makes torch enable peer access between the two GPUs
    ks = [torch.randn(TOKENS, HEADS, DIM, dtype=torch.bfloat16, device="cuda:0") for _ in range(LAYERS)]
    vs = [torch.randn_like(k) for k in ks]
    rng = np.random.default_rng(0)
    slots, dst_slots = _scattered_slots(rng), _scattered_slots(rng)
    dst_index = torch.zeros_like(dst_slots)
    no_slots = torch.full_like(slots, -1)
    table = build_dst_table(kv[0], [peer[0]])
    src = torch.randint(0, 255, (GiB,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(GiB, dtype=torch.uint8, device="cuda:1")
    # A cross-device copy_ cannot be captured (it syncs with GPU 1's stream): timed eagerly.
    anchor = _graph_seconds(lambda: dst.copy_(src), iters, graph=False)

    def layers(local_slots, remote_index) -> None:
        for layer in range(LAYERS):
            append_push_kv(ks[layer], vs[layer], kv[layer], local_slots, [peer[layer]], dst_slots,
                           remote_index, dst_table=table, check_indices=False)

    side = [torch.cuda.Stream(), torch.cuda.Stream()]

    def layers_two_streams(local_slots, remote_index) -> None:
        """As KVPusher issues them: layers alternate between two streams (fork/join)."""
        main = torch.cuda.current_stream()
        for stream in side:
            stream.wait_stream(main)
        for layer in range(LAYERS):
            with torch.cuda.stream(side[layer % 2]):
                append_push_kv(ks[layer], vs[layer], kv[layer], local_slots, [peer[layer]], dst_slots,
                               remote_index, dst_table=table, check_indices=False)
        for stream in side:
            main.wait_stream(stream)

    rows = [{"variant": "peer copy_ 1 GiB (anchor)", "seconds": anchor}]
    rows.append({"variant": f"fused, default {append.LAUNCH['push']}, one stream",
                 "seconds": _graph_seconds(lambda: layers(slots, dst_index), iters)})
    rows.append({"variant": f"fused, default {append.LAUNCH['push']}, two streams",
                 "seconds": _graph_seconds(lambda: layers_two_streams(slots, dst_index), iters)})
    rows.append({"variant": "copy_slots page to page, all layers",
                 "seconds": _graph_seconds(lambda: copy_slots(kv, slots, peer, dst_slots, check_indices=False), iters)})
    defaults = append.LAUNCH["push"]
    try:
        for tile in (2048, 4096, 8192, 16384):
            for warps in (4, 8, 16):
                append.LAUNCH["push"] = (tile, warps)
                for name, local, remote in (("fused", slots, dst_index), ("remote only", no_slots, dst_index),
                                            ("local only", slots, torch.full_like(dst_index, -1))):
                    seconds = _graph_seconds(lambda: layers(local, remote), iters)
                    rows.append({"variant": f"{name} tile={tile} warps={warps}", "seconds": seconds})
    finally:
        append.LAUNCH["push"] = defaults
    for row in rows:
        row["GB/s"] = GiB / row["seconds"] / 1e9
        row["ratio_to_anchor"] = anchor / row["seconds"]
    return {"workload": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM, "page_size": PAGE,
                         "tokens": TOKENS, "bytes": GiB, "dtype": "bfloat16"},
            "defaults": {"tile_elements": defaults[0], "num_warps": defaults[1]}, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/sweep_push.json"))
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("sweep_push needs two GPUs with peer access")
    result = run(args.iters)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    for row in result["rows"]:
        print(f"{row['variant']:40s} {row['GB/s']:8.1f} GB/s  {row['ratio_to_anchor']:.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
