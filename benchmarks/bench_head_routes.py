"""The fused append+push across tensor parallelism: does the head split cost bandwidth? JSON out.

    source .whl/gpu-env.sh && python3 benchmarks/bench_head_routes.py --out results/head_routes.json

One process. The sender's pages are on ``cuda:0``, the receivers' on ``--dst-device`` (default
``cuda:1`` when two GPUs are visible: NVLink stores through CUDA peer access, as `sweep_push.py`;
else ``cuda:0``: the same kernel's stores into local HBM, which times the kernel's own cost of the
head routes, not the link). Workload of `bench_transfer.py`: an 8B model's KV (32 layers, 8 KV
heads, head_dim 128, 16-token pages, bf16), 8192 tokens scattered over random pages on both sides
(1 GiB pushed per TP1 forward). Every row is the 32 per-layer launches of one `PreparedAppend`
replayed as one CUDA graph; each is checked bit-exact against the K/V it pushed before it is
timed. Rows (GB/s of receiver bytes; ratio to the same-TP row of the same bytes per sender):

    tp1->tp1   one receiver of the sender's 8 heads (no head routes: the baseline of tp1->tp2)
    tp1->tp2   two receivers of 4 heads each, every token to both (one launch)
    tp2->tp2   4 heads into 4 heads (the baseline of tp2->tp1)
    tp2->tp1   rank 0's 4 heads into a receiver of 8 heads, at head 0
    tp1->tp1-routed   the baseline's push through the head-route path (one route of all 8 heads)

``--device cpu`` runs a small shape in Triton's interpreter (TRITON_INTERPRET=1): the checks and
the JSON, no meaningful times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

# (row, sender heads, receivers' heads, per receiver (first, count, dst_first) or None, baseline row)
ROWS = [
    ("tp1->tp1", 8, 8, None, None),
    ("tp1->tp2", 8, 4, [(0, 4, 0), (4, 4, 0)], "tp1->tp1"),
    ("tp2->tp2", 4, 4, None, None),
    ("tp2->tp1", 4, 8, [(0, 4, 0)], "tp2->tp2"),
    ("tp1->tp1-routed", 8, 8, [(0, 8, 0)], "tp1->tp1"),
]
GPU_SHAPE = dict(layers=32, dim=128, page=16, tokens=8192)
CPU_SHAPE = dict(layers=2, dim=16, page=4, tokens=24)


def _seconds(launch, iters: int, cuda: bool) -> float:
    """Median seconds of one replay of a CUDA graph of ``launch()`` (CPU: of ``launch()``)."""
    launch()
    if not cuda:
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            launch()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _scattered(rng: np.random.Generator, pages: int, tokens: int, page: int) -> np.ndarray:
    chosen = rng.permutation(pages)[:tokens // page]
    return (np.repeat(chosen, page) * page + np.arange(tokens) % page).astype(np.int32)


def run_row(name: str, src_heads: int, dst_heads: int, heads, *, src: torch.device, dst: torch.device,
            layers: int, dim: int, page: int, tokens: int, iters: int, dtype: torch.dtype) -> dict:
    from disagg.kernels.append import prepare_append_push

    rng = np.random.default_rng(0)
    src_pages, receivers = 2 * tokens // page, len(heads) if heads else 1
    # Receivers view the sender's bytes per layer as pages of their head count (`HeadLayout.num_pages_of`).
    dst_pages = src_pages * src_heads // dst_heads
    kv = torch.zeros(layers, src_pages, 2, src_heads, page, dim, dtype=dtype, device=src)
    dsts = [torch.zeros(layers, dst_pages, 2, dst_heads, page, dim, dtype=dtype, device=dst) for _ in range(receivers)]
    slots = _scattered(rng, src_pages, tokens, page)
    dst_slots = _scattered(rng, dst_pages, tokens, page)
    dst_index = np.stack([np.full(tokens, r, np.int32) for r in range(receivers)]) if heads else \
        np.zeros(tokens, np.int32)
    prepared = prepare_append_push(kv, slots, dsts, dst_slots, dst_index, heads=heads)
    k = torch.randn(layers, tokens, src_heads, dim, device=src).to(dtype)
    v = torch.randn(layers, tokens, src_heads, dim, device=src).to(dtype)

    def forward() -> None:
        for layer in range(layers):
            prepared(layer, k[layer], v[layer])

    forward()
    _check(kv, dsts, k, v, slots, dst_slots, heads or [(0, src_heads, 0)])
    seconds = _seconds(forward, iters, src.type == "cuda")
    pushed = sum(d.element_size() * layers * 2 * tokens * dim * (h[1] if heads else src_heads)
                 for d, h in zip(dsts, heads or [None]))
    return {"name": name, "sender_heads": src_heads, "receiver_heads": dst_heads, "receivers": receivers,
            "bytes_pushed": pushed, "seconds": seconds, "gb_per_s": pushed / seconds / 1e9}


def _check(kv, dsts, k, v, slots, dst_slots, heads) -> None:
    """Bit-exact: every receiver holds its head range of every token, the local pages all heads."""
    page = kv.shape[-2]
    s = torch.from_numpy(slots.astype(np.int64)).to(kv.device)
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [T, L, H, D]: as the slot-indexed pages read
    if not torch.equal(kv[:, s // page, 0, :, s % page], k) or not torch.equal(kv[:, s // page, 1, :, s % page], v):
        raise AssertionError("local pages differ from the K/V appended")
    for dst, (first, count, dst_first) in zip(dsts, heads):
        d = torch.from_numpy(dst_slots.astype(np.int64)).to(dst.device)
        for i, x in enumerate((k, v)):
            got = dst[:, d // page, i, dst_first:dst_first + count, d % page]
            if not torch.equal(got.to(x.device), x[..., first:first + count, :]):
                raise AssertionError(f"receiver pages differ from heads {first}..{first + count} pushed")


def run(device: str, dst_device: str | None, iters: int) -> dict:
    cuda = device == "cuda"
    if cuda:
        src = torch.device("cuda:0")
        dst = torch.device(dst_device or ("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"))
        shape, dtype = GPU_SHAPE, torch.bfloat16
        if dst != src:
            torch.cuda.set_device(0)
            if not torch.cuda.can_device_access_peer(0, dst.index):
                raise SystemExit(f"cuda:0 cannot reach {dst} by peer access")
    else:
        src = dst = torch.device("cpu")
        shape, dtype = CPU_SHAPE, torch.float32
    rows = [run_row(name, sh, dh, heads, src=src, dst=dst, iters=iters, dtype=dtype, **shape)
            for name, sh, dh, heads, _ in ROWS]
    by_name = {row["name"]: row for row in rows}
    for row, (_, _, _, _, baseline) in zip(rows, ROWS):
        if baseline is not None:
            row["baseline"] = baseline
            row["ratio"] = row["gb_per_s"] / by_name[baseline]["gb_per_s"]
    return {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "sender": str(src), "receivers": str(dst),
            "link": "NVLink (peer access)" if src != dst else "one device: local HBM stores (the kernel's cost)",
            "shape": {**shape, "dtype": str(dtype)}, "iters": iters, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/head_routes.json"))
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dst-device", default=None, help="the receivers' device (default: cuda:1 when visible)")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    result = run(args.device, args.dst_device, args.iters)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for row in result["rows"]:
        ratio = f"  {row['ratio']:.3f}x of {row['baseline']}" if "ratio" in row else ""
        print(f"{row['name']:<18} {row['gb_per_s']:8.1f} GB/s{ratio}")


if __name__ == "__main__":
    main()
