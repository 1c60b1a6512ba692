"""SM partitions of one GPU for the phase-split spike (`spike_phase_split.py`, one process).

`make_partition` gives a decode stream on an N-SM green context and a prompt stream on another:
``torch`` through `torch.cuda.GreenContext` (two independent contexts of N and total-N SMs, which
the driver may place on overlapping SMs), ``driver`` through libcuda's green-context API via
ctypes (the SMs split once into a group of N and the remainder: disjoint). `partition_check` says
whether work launched to a partition's stream stays inside it: the SM ids a Triton kernel runs on
(eager and replayed from a CUDA graph), and how a cuBLAS matmul, a compute-bound Triton kernel and
the engine's decode-step graph slow down on N SMs against the whole GPU.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from bench_engine import timed

# CUdevResource is opaque here: 144 bytes in CUDA 12.4-12.9 (type, 92 bytes of padding, a 48-byte
# union whose first member is CUdevSmResource.smCount), a little more in CUDA 13. Buffers are
# oversized and only smCount (offset 96) is read.
_RESOURCE_BYTES = 512
_SM_COUNT_OFFSET = 96
_CU_DEV_RESOURCE_TYPE_SM = 1
_CU_GREEN_CTX_DEFAULT_STREAM = 1
_CU_STREAM_NON_BLOCKING = 1
_DRIVER_FUNCTIONS = ("cuDeviceGet", "cuDeviceGetDevResource", "cuDevSmResourceSplitByCount",
                     "cuDevResourceGenerateDesc", "cuGreenCtxCreate", "cuGreenCtxStreamCreate",
                     "cuGetErrorName")


class PartitionUnavailable(RuntimeError):
    """The SM-partition API is missing or refused (message: one line, what failed and why)."""


@dataclass
class Partition:
    """A decode stream on ``num_sms`` SMs and a prompt stream on (about) the rest.

    Attributes:
        decode_sms, prefill_sms: SM counts the driver reports for each side (None under torch,
            which does not say; the check's SM ids tell).
        handles: objects that must outlive the streams (green contexts).
    """

    method: str
    num_sms: int
    decode_stream: torch.cuda.Stream
    prefill_stream: torch.cuda.Stream
    decode_sms: int | None = None
    prefill_sms: int | None = None
    handles: tuple = field(default=(), repr=False)

    @property
    def name(self) -> str:
        return f"{self.method}_N{self.num_sms}"

    def describe(self) -> dict:
        return {"decode_sms_reported": self.decode_sms, "prefill_sms_reported": self.prefill_sms}


def make_partition(method: str, device: torch.device, num_sms: int) -> Partition:
    """Streams of an N-SM decode partition and a prompt partition (``method``: torch | driver).

    Raises:
        PartitionUnavailable: the API is missing, refused N, or failed.
    """
    if device.type != "cuda":
        raise PartitionUnavailable(f"SM partitions need a CUDA device, got {device}")
    total = torch.cuda.get_device_properties(device).multi_processor_count
    if not 0 < num_sms < total:
        raise PartitionUnavailable(f"--sms: expected 1..{total - 1} SMs (the device has {total}), got {num_sms}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if method == "torch":
        return _torch_partition(index, num_sms, total)
    return _driver_partition(index, num_sms)


def _torch_partition(index: int, num_sms: int, total: int) -> Partition:
    green = getattr(torch.cuda, "GreenContext", None)
    if green is None:
        raise PartitionUnavailable(f"torch {torch.__version__} has no torch.cuda.GreenContext")
    # The prompt side asks for the rest; if the driver refuses that count (SM granularity), fewer.
    contexts = [_create(green, [num_sms], index),
                _create(green, [total - num_sms, (total - num_sms) // 8 * 8], index)]
    try:
        streams = [ctx.Stream() for ctx in contexts]
    except Exception as exc:  # noqa: BLE001
        raise PartitionUnavailable(f"GreenContext.Stream(): {type(exc).__name__}: {exc}") from None
    return Partition("torch", num_sms, streams[0], streams[1], handles=tuple(contexts))


def _create(green, counts: list[int], index: int):
    """The first green context of ``counts`` SMs the driver grants."""
    error = ""
    for count in counts:
        try:
            return green.create(num_sms=count, device_id=index)
        except Exception as exc:  # noqa: BLE001 - any failure of the beta API: one line out
            first = str(exc).splitlines()[0] if str(exc) else ""
            error = f"torch.cuda.GreenContext.create(num_sms={count}, device_id={index}): {type(exc).__name__}: {first}"
    raise PartitionUnavailable(error)


def _libcuda():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise PartitionUnavailable(f"libcuda.so.1 cannot be loaded: {exc}") from None
    missing = [name for name in _DRIVER_FUNCTIONS if not hasattr(lib, name)]
    if missing:
        raise PartitionUnavailable(f"libcuda has no {', '.join(missing)} (green contexts need a CUDA 12.4+ driver)")
    return lib


def _check(lib, name: str, code: int) -> None:
    if code != 0:
        text = ctypes.c_char_p()
        lib.cuGetErrorName(code, ctypes.byref(text))
        raise PartitionUnavailable(f"{name} returned {code} ({(text.value or b'?').decode()})")


def _driver_partition(index: int, num_sms: int) -> Partition:
    lib = _libcuda()
    dev = ctypes.c_int()
    _check(lib, "cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), index))
    whole, group, rest = (ctypes.create_string_buffer(_RESOURCE_BYTES) for _ in range(3))
    _check(lib, "cuDeviceGetDevResource", lib.cuDeviceGetDevResource(dev, whole, _CU_DEV_RESOURCE_TYPE_SM))
    num_groups = ctypes.c_uint(1)
    _check(lib, f"cuDevSmResourceSplitByCount(minCount={num_sms})",
           lib.cuDevSmResourceSplitByCount(group, ctypes.byref(num_groups), whole, rest, 0, num_sms))
    if num_groups.value != 1:
        raise PartitionUnavailable(f"cuDevSmResourceSplitByCount(minCount={num_sms}) made {num_groups.value} groups")
    handles, streams, counts = [], [], []
    for resource in (group, rest):
        desc, green, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib, "cuDevResourceGenerateDesc", lib.cuDevResourceGenerateDesc(ctypes.byref(desc), resource, 1))
        _check(lib, "cuGreenCtxCreate",
               lib.cuGreenCtxCreate(ctypes.byref(green), desc, dev, _CU_GREEN_CTX_DEFAULT_STREAM))
        _check(lib, "cuGreenCtxStreamCreate",
               lib.cuGreenCtxStreamCreate(ctypes.byref(stream), green, _CU_STREAM_NON_BLOCKING, 0))
        handles.append(green)
        streams.append(torch.cuda.ExternalStream(stream.value, device=torch.device("cuda", index)))
        counts.append(int.from_bytes(resource.raw[_SM_COUNT_OFFSET:_SM_COUNT_OFFSET + 4], "little"))
    return Partition("driver", num_sms, streams[0], streams[1], counts[0], counts[1], tuple(handles))


# ---------------------------------------------------------------------------- the check
_KERNEL = None


def _sm_id_kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def sm_id_kernel(out_ptr, num_iters):
            # Program i writes the id of the SM it ran on to out[i], after num_iters dependent
            # FMAs, so that programs overlap in time and spread over every SM the launch may use.
            pid = tl.program_id(0)
            acc = pid.to(tl.float32)
            for _ in range(num_iters):
                acc = acc * 0.9999 + 1.0
            smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                             is_pure=False, pack=1)
            tl.store(out_ptr + pid, smid + (acc < 0.0).to(tl.int32))

        _KERNEL = sm_id_kernel
    return _KERNEL


def sm_ids(stream: torch.cuda.Stream, device: torch.device, graph: bool = False,
           num_iters: int = 20000) -> set[int]:
    """SM ids a Triton kernel of 16 programs per SM ran on when launched to ``stream`` (``graph``:
    captured in a CUDA graph on a stream of the primary context, replayed to ``stream``)."""
    kernel = _sm_id_kernel()
    programs = 16 * torch.cuda.get_device_properties(device).multi_processor_count
    out = torch.full((programs,), -1, dtype=torch.int32, device=device)
    launch = lambda: kernel[(programs,)](out, num_iters)  # noqa: E731
    launch()
    torch.cuda.synchronize(device)
    out.fill_(-1)
    torch.cuda.synchronize(device)
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            launch()
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            captured.replay()
    else:
        with torch.cuda.stream(stream):
            launch()
    stream.synchronize()
    return set(out.tolist()) - {-1}


def _seconds_on(stream: torch.cuda.Stream, fn, reps: int, device: torch.device) -> float:
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        return timed(fn, reps, device)


def partition_check(part: Partition, split, whole, prompt_tokens: int) -> dict:
    """Whether Triton kernels, cuBLAS and graph replay launched to ``part`` stay on its SMs.

    ``split``: the spike's `PhaseSplit` (the engine's decode graphs); ``whole``: plain streams of
    the primary context (the whole GPU). A partition holds if the Triton kernel's SM ids number at
    most the partition's SMs (eager and from a graph) and compute-bound work slows down about as
    total/N SMs (the ``*_ratio`` keys: time on N SMs / time on all; ``expected_ratio``: total/N).
    ``decode_graph``: the engine's decode step alone on N SMs; ``prompt_forward``: one eager
    forward of ``prompt_tokens`` prompt tokens alone on the other side.
    """
    device = split.engine.model.device
    row = {"name": f"check_{part.name}", "method": part.method, "num_sms": part.num_sms, **part.describe()}
    try:
        decode, prefill = sm_ids(part.decode_stream, device), sm_ids(part.prefill_stream, device)
        all_ids = sm_ids(whole.decode_stream, device)
        in_graph = sm_ids(part.decode_stream, device, graph=True)
    except Exception as exc:  # noqa: BLE001 - e.g. a Triton launch refused on a green stream
        raise PartitionUnavailable(f"Triton launch on the {part.name} streams: {type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    cap = part.decode_sms or -(-part.num_sms // 8) * 8
    row.update({"sms_all": len(all_ids), "sms_decode_triton": len(decode), "sms_decode_graph": len(in_graph),
                "sms_prefill_triton": len(prefill), "sms_overlap": len(decode & prefill),
                "triton_inside": len(decode) <= cap, "graph_inside": len(in_graph) <= cap,
                "expected_ratio": len(all_ids) / max(1, len(decode))})
    try:
        _time_work(row, part, split, whole, device, len(all_ids), prompt_tokens)
    finally:
        split.rollback(split.pop_scratch(), (part.decode_stream, part.prefill_stream, whole.decode_stream,
                                             whole.prefill_stream))
    for key in ("cublas_matmul", "cublaslt_matmul", "triton_spin"):  # compute-bound: ~ total/N slower
        row[f"{key}_scales"] = row[f"{key}_ratio"] >= 0.6 * row["expected_ratio"]
    row["decode_graph_slower"] = row["decode_graph_ratio"] > 1.2
    return row


def _time_work(row: dict, part: Partition, split, whole, device: torch.device, num_sms_all: int,
               prompt_tokens: int) -> None:
    """Time each piece of work on the partition's side and on the whole GPU (memoised on
    ``whole.seconds``); ``row`` gets ``{key}_ms``, ``{key}_all_ms`` and ``{key}_ratio``."""
    a = torch.randn(4096, 4096, dtype=split.engine.model.dtype, device=device)
    kernel, out = _sm_id_kernel(), torch.empty(16 * num_sms_all, dtype=torch.int32, device=device)
    plan = split.plan(split.seq_ids, [1] * len(split.seq_ids))
    split.decode_steps += 1  # the plan's slot, given back by the caller
    ids = torch.ones(len(split.seq_ids), dtype=torch.int64, device=device)
    prompt = split.scratch_prompt(prompt_tokens)
    work = {  # key: (function, repetitions, the side it runs on)
        "cublas_matmul": (lambda: a @ a, 10, "decode"),
        "cublaslt_matmul": (lambda: _lt(lambda: a @ a), 10, "decode"),
        "triton_spin": (lambda: kernel[(out.numel(),)](out, 200000), 5, "decode"),
        "decode_graph": (lambda: split.engine.runner.graphs.run(plan, ids), 10, "decode"),
        "prompt_forward": (prompt, 1, "prefill"),
    }
    for key, (fn, reps, side) in work.items():
        stream, whole_stream = getattr(part, f"{side}_stream"), getattr(whole, f"{side}_stream")
        on_part = _seconds_on(stream, fn, reps, device)
        if key not in whole.seconds:
            whole.seconds[key] = _seconds_on(whole_stream, fn, reps, device)
        row[f"{key}_ms"], row[f"{key}_all_ms"] = on_part * 1e3, whole.seconds[key] * 1e3
        row[f"{key}_ratio"] = on_part / whole.seconds[key]


def _lt(fn):
    """``fn()`` with cuBLASLt as torch's BLAS library."""
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return fn()
    finally:
        torch.backends.cuda.preferred_blas_library(previous)
