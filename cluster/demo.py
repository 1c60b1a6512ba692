"""The demo job of `make demo`: a decode worker reserves pages, a prefill worker pushes KV into them.

Two Ray actors share one symmetric heap (NVSHMEM when two GPUs are visible, the /dev/shm heap on
the CPU otherwise). For each prompt the decode worker reserves pages (`disagg_prepare_recv`) and
arms a doorbell; the prefill worker records the map (`disagg_mark_send`), runs a synthetic
prefill whose K/V per layer is a seeded function of (request, layer, position), and pushes each
layer straight into the decode worker's pages. The decode worker waits on the doorbells, checks
the landed K/V bit for bit, appends one decode token and runs `paged_decode` on the same page
tables, checked against dense attention. The model, engines and router replace the synthetic
prefill in later issues. Run: `python -m disagg.cluster.demo [CONFIG]`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

logger = logging.getLogger(__name__)
NO_MULTICAST_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0",
                    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TransferSection(_Strict):
    backend: Literal["auto", "shm", "nvshmem"] = Field("auto", description="heap backend; auto: nvshmem with 2+ GPUs, else shm")
    heap_bytes: int = Field(64 << 20, gt=0, description="symmetric heap per worker, bytes")
    timeout_s: float = Field(60.0, gt=0, description="bootstrap and doorbell waits, seconds")


class CacheSection(_Strict):
    num_pages: int = Field(gt=0, description="pages in each worker's cache")
    page_size: int = Field(gt=0, description="tokens per page")


class ModelSection(_Strict):
    num_layers: int = Field(gt=0, description="decoder layers")
    num_qo_heads: int = Field(gt=0, description="query heads")
    num_kv_heads: int = Field(gt=0, description="key/value heads; divides num_qo_heads")
    head_dim: int = Field(gt=0, description="features per head")

    @model_validator(mode="after")
    def _heads_group(self) -> ModelSection:
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(f"num_qo_heads ({self.num_qo_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        return self


class DemoConfig(_Strict):
    """The demo's YAML file (configs/demo.yaml); unknown keys are rejected."""

    transfer: TransferSection = TransferSection()
    cache: CacheSection
    model: ModelSection
    prompts: list[int] = Field(min_length=1, description="prompt lengths in tokens, one request each")
    resident: list[int] = Field(default_factory=list, description="lengths of requests already on the decode "
                                "worker; every other one finishes first, leaving holes the new maps reuse")
    seed: int = Field(0, description="seed of the synthetic K/V and queries")


def synthetic_kv(seed: int, request: int, layer: int, length: int, num_kv_heads: int, head_dim: int):
    """The synthetic prefill's K/V of one request and layer: ``[length, 2, H_kv, D]`` fp32 (CPU)."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + request * 7919 + layer)
    return torch.randn(length, 2, num_kv_heads, head_dim, generator=gen)


class DemoWorker:
    """One worker of the demo (wrapped with `ray.remote`): a heap, a KV tensor, a cache, a pusher."""

    def new_uid(self, backend: str, heap_bytes: int) -> bytes:
        from disagg.transfer import new_unique_id
        return new_unique_id(backend, size_bytes=heap_bytes)

    def setup(self, cfg_dict: dict, backend: str, uid: bytes, rank: int) -> str:
        import torch

        from disagg.cache import PagedKVCache
        from disagg.transfer import DoorbellTable, KVPusher, open_heap

        # The config travels as a plain dict: pydantic classes of a __main__ module don't unpickle.
        cfg = DemoConfig.model_validate(cfg_dict)
        self.cfg, m, c = cfg, cfg.model, cfg.cache
        device = "cuda" if backend == "nvshmem" else None
        self.heap = open_heap(backend, uid=uid, rank=rank, world_size=2, size_bytes=cfg.transfer.heap_bytes,
                              device=device, timeout_s=cfg.transfer.timeout_s)
        self.dtype = torch.bfloat16 if backend == "nvshmem" else torch.float32
        shape = (m.num_layers, c.num_pages, 2, m.num_kv_heads, c.page_size, m.head_dim)
        self.kv = self.heap.alloc(shape, self.dtype)
        self.cache = PagedKVCache(c.num_pages, c.page_size)
        self.doorbells = DoorbellTable(self.heap)
        self.pusher = KVPusher(self.heap, self.kv)
        self.tickets: dict[int, object] = {}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return f"{self.kv.device} (physical GPU {visible})" if device and visible else str(self.kv.device)

    def prepare_recv(self, prompts: list[int]) -> dict[int, dict]:
        """Decode side: reserve pages and arm a doorbell per request; return maps and tickets."""
        resident = [1_000_000 + i for i in range(len(self.cfg.resident))]
        for seq_id, length in zip(resident, self.cfg.resident):
            self.cache.add_sequence(seq_id)
            self.cache.begin_forward([seq_id], [length])
            self.cache.end_forward()
        for seq_id in resident[::2]:
            self.cache.remove_sequence(seq_id)
        out = {}
        for request, length in enumerate(prompts):
            self.cache.add_sequence(request)
            cmap = self.cache.disagg_prepare_recv(request, length)
            self.cache.end_forward()
            self.tickets[request] = ticket = self.doorbells.arm(request)
            out[request] = {"cmap": [int(x) for x in cmap], "ticket": ticket}
        return out

    def prefill_and_push(self, prompts: list[int], recv: dict[int, dict], dst_pe: int) -> dict:
        """Prefill side: mark each request for sending, run the synthetic prefill, push per layer."""
        import torch

        m, seed = self.cfg.model, self.cfg.seed
        for request in range(len(prompts)):
            self.cache.add_sequence(request)
            self.cache.disagg_mark_send(request, 0, recv[request]["cmap"], dst_pe)
            self.pusher.attach_doorbell(request, recv[request]["ticket"])
        start = time.perf_counter()
        plan = self.cache.begin_forward(list(range(len(prompts))), prompts)
        self.pusher.begin_forward(plan)
        for layer in range(m.num_layers):
            kv = torch.cat([synthetic_kv(seed, r, layer, n, m.num_kv_heads, m.head_dim)
                            for r, n in enumerate(prompts)]).to(self.kv.device, self.dtype)
            self.pusher.push_layer_async(layer, kv[:, 0].contiguous(), kv[:, 1].contiguous())
        self.pusher.end_forward()
        self.cache.end_forward()
        self.pusher.synchronize()
        elapsed = time.perf_counter() - start
        num_bytes = plan.num_tokens * m.num_layers * 2 * m.num_kv_heads * m.head_dim * self.kv.element_size()
        return {"tokens": plan.num_tokens, "bytes": num_bytes, "seconds": elapsed,
                "local_slots": {r: self.cache.slots(r).tolist() for r in range(len(prompts))}}

    def receive_and_decode(self, prompts: list[int]) -> dict:
        """Decode side: wait on the doorbells, check the landed K/V, run one paged decode step."""
        import torch

        from disagg.kernels import append_kv, paged_decode

        m, c, seed = self.cfg.model, self.cfg.cache, self.cfg.seed
        for ticket in self.tickets.values():
            self.doorbells.wait(ticket, self.cfg.transfer.timeout_s)
        mismatched = 0
        for request, length in enumerate(prompts):
            slots = torch.as_tensor(self.cache.slots(request), dtype=torch.long)
            pages, offsets = slots // c.page_size, slots % c.page_size
            for layer in range(m.num_layers):
                want = synthetic_kv(seed, request, layer, length, m.num_kv_heads, m.head_dim).to(self.dtype)
                got = self.kv[layer][pages, :, :, offsets].cpu()  # [length, 2, H, D]
                mismatched += int((got.view(torch.uint8) != want.view(torch.uint8)).sum())
        # One decode step: a new token per request, appended to the received pages, then attention.
        ids = list(range(len(prompts)))
        plan = self.cache.begin_forward(ids, [1] * len(ids))
        dev = self.kv.device
        idx = {name: torch.as_tensor(getattr(plan, name), device=dev)
               for name in ("page_indptr", "page_indices", "last_page_len", "append_slots")}
        gen = torch.Generator().manual_seed(seed + 1)
        new_kv = torch.randn(len(ids), 2, m.num_kv_heads, m.head_dim, generator=gen)
        q = torch.randn(len(ids), m.num_qo_heads, m.head_dim, generator=gen)
        layer = m.num_layers - 1
        append_kv(new_kv[:, 0].to(dev, self.dtype), new_kv[:, 1].to(dev, self.dtype), self.kv[layer], idx["append_slots"])
        scale = m.head_dim ** -0.5
        out = paged_decode(q.to(dev, self.dtype), self.kv[layer], idx["page_indptr"], idx["page_indices"],
                           idx["last_page_len"], scale).float().cpu()
        self.cache.end_forward()
        max_err = 0.0
        group = m.num_qo_heads // m.num_kv_heads
        for b, length in enumerate(prompts):
            kv = torch.cat([synthetic_kv(seed, b, layer, length, m.num_kv_heads, m.head_dim), new_kv[b:b + 1]])
            kv = kv.to(self.dtype).float()
            k = kv[:, 0].repeat_interleave(group, dim=1).transpose(0, 1)  # [H_q, L, D]
            v = kv[:, 1].repeat_interleave(group, dim=1).transpose(0, 1)
            ref = torch.softmax(q[b].to(self.dtype).float()[:, None, :] @ k.transpose(1, 2) * scale, -1) @ v
            max_err = max(max_err, float((ref[:, 0] - out[b]).abs().max()))
        return {"mismatched_bytes": mismatched, "decode_max_abs_err": max_err,
                "slots": {r: self.cache.slots(r).tolist() for r in ids}}

    def close(self) -> None:
        self.heap.close()


def choose_backend(requested: str) -> str:
    if requested != "auto":
        return requested
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return "nvshmem"
    logger.info("fewer than two GPUs visible: the demo runs on the CPU with the shm heap")
    return "shm"


def run(cfg: DemoConfig) -> dict:
    """Start Ray locally, run the demo, print what happened, and return the figures."""
    import ray

    backend = choose_backend(cfg.transfer.backend)
    num_gpus = 1 if backend == "nvshmem" else 0
    ray.init(include_dashboard=False, log_to_driver=True, runtime_env={"env_vars": NO_MULTICAST_ENV})
    try:
        actor = ray.remote(num_gpus=num_gpus, num_cpus=0)(DemoWorker)
        decode, prefill = actor.remote(), actor.remote()  # PE 0 decodes, PE 1 prefills
        uid = ray.get(decode.new_uid.remote(backend, cfg.transfer.heap_bytes))
        devices = ray.get([w.setup.remote(cfg.model_dump(), backend, uid, pe)
                           for pe, w in enumerate((decode, prefill))])
        print(f"backend {backend}: decode worker PE 0 on {devices[0]}, prefill worker PE 1 on {devices[1]}")
        recv = ray.get(decode.prepare_recv.remote(cfg.prompts))
        for request, info in recv.items():
            print(f"  request {request}: {cfg.prompts[request]:4d} tokens -> decode map {info['cmap']}")
        sent = ray.get(prefill.prefill_and_push.remote(cfg.prompts, recv, 0))
        for request, slots in sent["local_slots"].items():
            print(f"  request {request}: prefill slots {_runs(slots)}")
        print(f"pushed {sent['tokens']} tokens x {cfg.model.num_layers} layers "
              f"({sent['bytes'] / 1e6:.2f} MB) in {sent['seconds'] * 1e3:.1f} ms "
              "(a first forward: kernel compilation included)")
        got = ray.get(decode.receive_and_decode.remote(cfg.prompts))
        print(f"decode worker: K/V mismatched bytes {got['mismatched_bytes']}, "
              f"paged decode vs dense attention max abs err {got['decode_max_abs_err']:.2e}")
        ray.get([decode.close.remote(), prefill.close.remote()])
        return {"backend": backend, **sent, **got}
    finally:
        ray.shutdown()


def _runs(slots: list[int]) -> str:
    from disagg import posmap
    cmap = posmap.compress(slots)
    return ", ".join(f"{cmap[1 + 2 * i]}..{cmap[1 + 2 * i] + cmap[2 + 2 * i] - 1}" for i in range(cmap[0]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disagg.cluster.demo", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", type=Path, default=DEFAULT_CONFIG, help="demo YAML file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("DISAGG_LOG", "WARNING"))
    try:
        cfg = DemoConfig.model_validate(yaml.safe_load(args.config.read_text()))
    except ValidationError as err:
        print(f"{args.config}: invalid demo config:\n{err}", file=sys.stderr)
        return 2
    result = run(cfg)
    ok = result["mismatched_bytes"] == 0 and result["decode_max_abs_err"] < 5e-2
    print("demo OK" if ok else "demo FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    # Run through the importable module, so Ray pickles the actor class by reference, not by value.
    from disagg.cluster.demo import main as module_main
    sys.exit(module_main())
