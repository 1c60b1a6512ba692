"""The YAML schema of a deployment: one file describes the model, the fleet and every knob.

`Config.from_yaml(path)` reads a file of `configs/` (top-level sections `model`, `cache`,
`instances`, `transfer`, `scheduler`, `router`, `cluster`, `serve`, `bench`, and `kernels`: the
kernel switches of `disagg.settings`), validates it with pydantic v2 (unknown keys rejected, with
the closest known key suggested; types strict: "1" is not an int, 1 is not a bool, though an int
is a fine float; a key given twice in one mapping is an error, not "the last one wins") and raises
`ConfigError` naming the file, the field path, what was expected and what it got. Cross-field
rules that need only the file live here; the ones that need the model (heads divide, pages fit,
geometry equal on every instance) run in the cluster's preflight. Pure Python: imported by the
CLI, the cluster and tests, never imports torch or ray.
"""

from __future__ import annotations

import copy
import ipaddress
import logging
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (BaseModel, Field, PrivateAttr, ValidationError, field_validator,
                      model_validator)

from disagg.config_instances import InstancesSection
from disagg.config_yaml import DuplicateKey, Section, format_errors, load_yaml, suggest, yaml_problem
from disagg.errors import ConfigError
from disagg.settings import Settings

logger = logging.getLogger(__name__)

SMOLLM2_SOURCE = "smollm2"
DUMMY_PREFIX = "dummy:"
MAX_PAGE_SIZE = 256
RAY_GCS_PORT, RAY_CLIENT_PORT = 6379, 10001  # `ray start --head` defaults
# Fields no actor needs and no result shows (`Config.model_dump(exclude=SECRET_FIELDS)`).
SECRET_FIELDS = {"serve": {"api_key"}}


class ModelSection(Section):
    """Which weights every instance loads."""

    source: str = Field(
        description=f"an HF directory (config.json + *.safetensors), '{DUMMY_PREFIX}<preset>' (random "
                    f"weights: tiny, smollm2-135m, llama3-8b, llama3.1-8b, qwen2.5-32b, llama3-70b), or '{SMOLLM2_SOURCE}' (the cached "
                    "conversion of the SmolLM2-135M-Instruct GGUF, built on first use)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weight and activation dtype; auto: the checkpoint's (dummy: bfloat16 on "
                            "GPU, float32 on CPU)")
    max_model_len: int | None = Field(
        None, gt=0, description="longest prompt + output accepted, tokens; default: the model's "
                                "max_position_embeddings")
    num_layers: int | None = Field(
        None, gt=0, description=f"'{DUMMY_PREFIX}<preset>' only: decoder layers (default: the preset's); "
                                "fewer layers keep every layer's shapes (tests, quick GPU runs)")

    @field_validator("source")
    @classmethod
    def _source_given(cls, source: str) -> str:
        if not source.strip():
            raise ValueError(f"expected an HF directory, '{DUMMY_PREFIX}<preset>' or '{SMOLLM2_SOURCE}', "
                             "not an empty or blank string")
        return source

    @model_validator(mode="after")
    def _layers_for_dummies_only(self) -> ModelSection:
        if self.num_layers is not None and not self.is_dummy:
            raise ValueError(f"num_layers ({self.num_layers}) applies to '{DUMMY_PREFIX}<preset>' sources "
                             f"only, got source {self.source!r}")
        return self

    @property
    def is_dummy(self) -> bool:
        return self.source.startswith(DUMMY_PREFIX)


class CacheSection(Section):
    """The paged KV cache of each instance (every instance of one heap has the same geometry)."""

    page_size: int = Field(16, gt=0, description=f"tokens per page; a power of two <= {MAX_PAGE_SIZE}")
    num_pages: int | None = Field(
        None, gt=0, description="pages per instance; default: sized from memory (gpu_memory_fraction "
                                "on GPU, kv_bytes on CPU). With prefill and decode at different "
                                "tensor parallelism: pages of the side with more KV heads per rank; "
                                "a rank of the other side views the same bytes as proportionally "
                                "more pages")
    kv_bytes: int | None = Field(
        None, gt=0, description="KV memory per instance, bytes (alternative to num_pages); on the "
                                "CPU the default is 256 MiB")
    gpu_memory_fraction: float = Field(
        0.85, gt=0.0, le=1.0, description="fraction of a GPU's total memory this instance may use "
                                          "for weights + KV + activations, when num_pages is not given")
    kv_dtype: Literal["auto", "fp8_e4m3"] = Field(
        "auto", description="KV storage dtype; auto: the model dtype; fp8_e4m3 halves the pages' "
                            "bytes (GPU only, per-layer scales)")
    prefix_caching: bool = Field(
        True, description="automatic prefix caching on every instance: full pages of computed prompts "
                          "and finished requests stay cached (evicted least recently used when pages "
                          "run short); a prompt computes only what follows its longest cached prefix, "
                          "and a decode instance receives only what follows its own")

    @model_validator(mode="after")
    def _page_size_sane(self) -> CacheSection:
        if self.page_size & (self.page_size - 1) or self.page_size > MAX_PAGE_SIZE:
            raise ValueError(f"page_size must be a power of two in [1, {MAX_PAGE_SIZE}] tokens, "
                             f"got {self.page_size}")
        if self.num_pages is not None and self.kv_bytes is not None:
            raise ValueError(f"give num_pages ({self.num_pages}) or kv_bytes ({self.kv_bytes}), not both")
        return self


class TransferSection(Section):
    """The symmetric heap shared by every prefill and decode instance."""

    backend: Literal["auto", "nvshmem", "shm"] = Field(
        "auto", description="auto: nvshmem when the instances run on GPUs, shm (/dev/shm) on the CPU")
    heap_headroom_bytes: int = Field(
        64 << 20, ge=0, description="symmetric heap bytes beyond the KV pages (doorbells, records), bytes")
    bootstrap_timeout_s: float = Field(120.0, gt=0.0, description="heap bootstrap and collective "
                                                                  "allocation timeout, seconds")
    force_segment_puts: bool = Field(
        False, description="push with host-initiated segment puts even to load/store-reachable peers "
                           "(the inter-node path, testable on one node)")
    push_after: Literal["graphs", "never", "always"] = Field(
        "graphs", description="when a prefill forward pushes its K/V: graphs = after the forward, every layer "
                              "at once, where a whole-forward CUDA graph runs it (short prompts, mixed steps), "
                              "layer by layer in the others; never = always layer by layer (eager); always = "
                              "after every forward")
    verify: bool = Field(
        False, description="debug: the sender writes a digest of each request's pushed KV (per layer) beside "
                           "its doorbell and the receiver checks it before admitting the request, failing it "
                           "with a TransferError naming both PEs on a mismatch; costs a read of the pushed KV "
                           "on both sides")


class SchedulerSection(Section):
    """Batching limits of every engine."""

    max_num_seqs: int = Field(64, gt=0, description="sequences per forward (and running on decode), count")
    max_num_batched_tokens: int = Field(2048, gt=0, description="new tokens per forward (prefill "
                                                                "chunk budget), tokens")
    async_scheduling: bool = Field(True, description="every instance that decodes launches the next "
                                                     "decode-only step before reading this step's tokens "
                                                     "(hides the host's bookkeeping, which otherwise "
                                                     "leaves the GPU idle between steps); false: read "
                                                     "every step's tokens first")
    async_prompts: bool = Field(True, description="with async_scheduling: the step that starts waiting "
                                                  "prompts is launched before the tokens of the step in "
                                                  "flight are read, its decodes fed those tokens on the "
                                                  "GPU (a new request waits one step less); false: it "
                                                  "waits for the tokens of the step in flight")
    overlap_reservations: bool = Field(True, description="decode instances answer the router's page "
                                                         "reservations while a forward runs on the GPU "
                                                         "(polled every 0.1 ms) instead of between steps, so "
                                                         "a remote request's TTFT does not wait for the "
                                                         "decode step in flight "
                                                         "(benchmarks/records/headline-h100x2-2026-11-27b); "
                                                         "false: between steps")
    cuda_graphs: Literal["full", "full_and_piecewise", "full_decode_only", "none"] = Field(
        "full", description="CUDA graphs on GPUs (vLLM's cudagraph_mode names): "
                                          "full: as full_and_piecewise, and prompt and mixed steps of "
                                          "<= 512 tokens replay whole-forward graphs (pushing after them: transfer.push_after), "
                                          "attention included; full_and_piecewise: pure-decode steps "
                                          "replay whole-forward graphs, prompt and mixed steps of <= "
                                          "2048 tokens piecewise graphs between their attentions; "
                                          "full_decode_only: prompt steps run eagerly; none: everything eager")
    phase_split: Literal["off", "sm", "auto"] = Field(
        "off", description="off: prompt chunks and decodes share each step (chunked prefill); sm and "
                           "auto (prefill and decode on separate SM partitions of one GPU) are refused: "
                           "the partitions measured no gain (benchmarks/records/phase-split-2026-11-27)")

    @field_validator("phase_split", mode="before")
    @classmethod
    def _phase_split_off_only(cls, value: object) -> object:
        if value is False:  # YAML 1.1 reads a bare `off` as false
            return "off"
        if value in ("sm", "auto"):
            raise ValueError(f"expected 'off', got {value!r}: SM partitions of one GPU are not built "
                             "(a prompt on a partition still takes the decodes' memory bandwidth: 1.16x "
                             "decode tokens/s at best, benchmarks/records/phase-split-2026-11-27); use "
                             "scheduler.max_num_batched_tokens (a smaller chunk) or router.placement")
        return value


class RouterSection(Section):
    """The router in the launching process: placement, leases, timeouts, queueing."""

    policy: Literal["least_loaded", "round_robin"] = Field(
        "least_loaded", description="least_loaded: prefill by queued prompt tokens, decode by reserved "
                                    "+ running tokens, equal loads in turn; round_robin: in turn")
    lease_s: float = Field(30.0, gt=0.0, description="a decode reservation whose KV has not landed "
                                                     "(first token from prefill) within this is failed "
                                                     "and its pages released, seconds")
    request_timeout_s: float | None = Field(
        600.0, gt=0.0, description="a request not finished within this is aborted, seconds; null: never")
    max_queue: int = Field(4096, gt=0, description="requests waiting in the router (for a prefill slot or "
                                                   "decode pages) before new ones are refused, count")
    prefill_queue_tokens: int | None = Field(
        None, gt=0, description="prompt tokens queued on a prefill instance before the router holds the next "
                                "request back (so decode pages are reserved just in time); default: 4 x "
                                "scheduler.max_num_batched_tokens")
    placement: Literal["disaggregated", "local", "adaptive"] = Field(
        "disaggregated", description="where a prompt is prefilled (prefill + decode fleets only): "
                                     "disaggregated: on a prefill instance, its KV pushed to a decode "
                                     "instance; local: by the decode instance itself, in chunks beside "
                                     "its decodes; adaptive: per request, remote / local / kept (prefilled "
                                     "and decoded by a prefill instance) by the instances' predicted step "
                                     "times and load (docs/ARCHITECTURE.md §7)")
    adaptive_prefer: Literal["fastest", "remote", "balanced"] = Field(
        "balanced", description="among the paths predicted to hold the SLOs, the adaptive placement takes: "
                               "fastest: the lowest predicted TTFT (near-ties: local, remote, kept); remote: "
                               "the push whenever it holds them (with a TTFT target; spares the decode "
                               "instances: better where decoding is the bottleneck, worse where "
                               "prefilling is); balanced: "
                               "fastest, but a request whose decode would go to a decode instance decodes on "
                               "the prefill instance instead while the decode instance's TPOT is past half "
                               "its target, the prefill instance's is lower and the TTFT target has room "
                               "(the default; the rule and its record: docs/placement-notes.md)")
    adaptive_overload: Literal["least_violation", "no_push"] = Field(
        "least_violation", description="where the adaptive placement puts a prompt when no path is predicted "
                                       "to hold the SLOs: least_violation: the path predicted to miss them "
                                       "least (a push among them); no_push: the least of the paths that push "
                                       "nothing (local, kept), as a colocated fleet serves past its knee, a "
                                       "push only where neither fits (docs/ARCHITECTURE.md §7)")
    slo_ttft_ms: float | None = Field(None, gt=0.0, description="time-to-first-token target the adaptive "
                                                                "placement predicts against, ms; null: none "
                                                                "(then it minimises the predicted TTFT)")
    slo_tpot_ms: float | None = Field(None, gt=0.0, description="time-per-output-token target of the "
                                                                "adaptive placement, ms; null: keep every "
                                                                "decode step under 1.1 x its length without "
                                                                "the new request's prefill")
    step_profile: str | None = Field(None, description="a `disagg profile` JSON (read by the launching process) "
                                                       "whose fit seeds every instance's step-time model: the "
                                                       "adaptive placement's predictions before an instance's "
                                                       "own steps refine them; null: built-in defaults of the "
                                                       "order of an 8B model on one H100")
    measured_hops: bool = Field(True, description="the adaptive placement prices what it times itself: each "
                                                  "decode instance's reservation round trip beyond its step "
                                                  "in flight and each instance's first-token relay to the "
                                                  "router (medians of the recent ones); false: neither "
                                                  "(the A/B: benchmarks/records/headline-h200x2-2026-11-28d/)")
    poll_wait_s: float = Field(0.25, gt=0.0, le=5.0, description="how long an actor's next_outputs() waits "
                                                                 "when it has no output (it returns at once "
                                                                 "when it has some), seconds")


class ClusterSection(Section):
    """Where the Ray cluster is, and how the launching process reaches or starts it."""

    address: str | None = Field(
        None, description="Ray address to join ('auto': the cluster `ray start` left on this host, "
                          "'host:6379': its GCS, 'ray://host:10001': a Ray Client server); null: start an "
                          "embedded local head in this process, whatever RAY_ADDRESS says (it is ignored, "
                          "with a warning)")
    connect_timeout_s: float = Field(
        60.0, gt=0.0, description="address only: seconds to reach the head (TCP connect and its gRPC "
                                  "greeting) and join it; past them the launch fails naming the address")
    bind_host: str | None = Field(
        "127.0.0.1", description="embedded head only: the IP its GCS, raylet and workers advertise and "
                                 "listen on; 127.0.0.1 keeps them on this machine (nothing else can join "
                                 "or reach them); another IP of this host, or null (Ray picks a routable "
                                 "one), lets other hosts join, and Ray then listens on every interface, "
                                 "guarded by its token authentication")
    dashboard: bool = Field(False, description="start Ray's dashboard with the embedded head (on 127.0.0.1)")
    num_cpus: int | None = Field(
        None, gt=0, description="logical CPUs of the embedded head; default: enough for the instances")
    log_to_driver: bool = Field(True, description="forward the actors' logs to this process")
    startup_timeout_s: float = Field(600.0, gt=0.0, description="actor placement, weight loading and "
                                                                "preflight, seconds (reaching "
                                                                "cluster.address: connect_timeout_s)")
    warmup: bool = Field(True, description="before accepting requests, run a short request through every "
                                           "instance (compiles the kernels, proves each KV path end to end)")
    restart: bool = Field(True, description="replace a dead instance: the survivors serve at once (degraded), "
                                            "and a new actor in its GPU share loads, warms up and serves "
                                            "beside them. It is no PE of the symmetric heap (its members are "
                                            "fixed when it is made): it computes and decodes its own "
                                            "requests, like a colocated instance, so its compute is back "
                                            "but the fleet's KV transfer to or from it is not until the "
                                            "fleet is rebuilt (rebuild); false: nothing restarts and the "
                                            "fleet stays degraded")
    restart_backoff_s: float = Field(1.0, ge=0.0, description="seconds from a death to its replacement's "
                                                              "start, doubled for each next replacement "
                                                              "of the same instance")
    restart_limit: int = Field(3, ge=0, description="replacements of one instance over the fleet's life "
                                                    "(a start that failed counts); past it that instance "
                                                    "stays dead")
    rebuild: bool = Field(True, description="with restart, a prefill + decode fleet returns to full strength: "
                                            "rebuild_after_s after a death its data plane is rebuilt (new "
                                            "requests queue in the router, those in flight drain, the old "
                                            "actors are killed, a fresh fleet of the config opens one new heap "
                                            "over every rank and serves the queue); false: replacements "
                                            "serve outside the heap for good")
    rebuild_after_s: float = Field(60.0, ge=0.0, description="seconds from a death to the start of the rebuild; "
                                                            "the survivors (and a replacement) serve degraded "
                                                            "meanwhile, and later deaths fold into one rebuild")
    rebuild_drain_s: float = Field(10.0, ge=0.0, description="seconds the rebuild lets in-flight requests finish "
                                                            "on the old fleet (new ones queue meanwhile); those "
                                                            "still running then migrate to the new fleet with "
                                                            "the tokens they streamed")

    @field_validator("address")
    @classmethod
    def _address_parses(cls, address: str | None) -> str | None:
        if address is not None:
            parse_ray_address(address)
        return address

    @field_validator("bind_host")
    @classmethod
    def _bind_host_is_an_ip(cls, host: str | None) -> str | None:
        if host is not None:
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise ValueError("expected an IP address of this host such as 127.0.0.1, or null (Ray "
                                 "advertises it to every process, so no host name)") from None
        return host


def parse_ray_address(address: str) -> tuple[str, int] | None:
    """The (host, port) that ``cluster.address`` reaches first, or None when Ray finds it ('auto')
    or a scheme other than ray:// names it.

    'host' and 'host:port' name a GCS (port 6379 by default), 'ray://host[:port]' a Ray Client
    server (port 10001 by default); an IPv6 host goes in brackets: '[::1]:6379'.

    Raises:
        ValueError: a blank address, an empty host, or a port that is not an integer in 1-65535.
    """
    text = address.strip()
    if not text:
        raise ValueError("expected a Ray address ('auto', 'host:6379', 'ray://host:10001') or null, not a blank "
                         "string")
    scheme, sep, rest = text.rpartition("://")
    if text == "auto" or (sep and scheme != "ray"):
        return None
    default_port = RAY_CLIENT_PORT if sep else RAY_GCS_PORT
    try:
        parts = urlsplit(f"//{rest}")
        host, port = parts.hostname, parts.port
    except ValueError as err:
        raise ValueError(f"expected host:port with a port in 1-65535 ({err})") from None
    if not host or parts.path or parts.query or parts.fragment or parts.username:
        raise ValueError("expected host:port (e.g. 10.0.0.5:6379) or ray://host:port")
    if port == 0:
        raise ValueError("expected a port in 1-65535, not 0")
    return host, port or default_port


class ServeSection(Section):
    """The OpenAI-compatible HTTP front end (`disagg serve`)."""

    host: str = Field("127.0.0.1", description="bind address; 127.0.0.1 keeps it local")
    port: int = Field(8000, ge=0, le=65535, description="TCP port; 0 picks a free one")
    api_key: str | None = Field(None, description="bearer token required on every request; null: none")
    served_model_name: str | None = Field(None, description="model id reported by /v1/models; "
                                                            "default: the model's name")
    max_tokens_default: int = Field(256, gt=0, description="max_tokens when a request gives none, tokens")
    max_concurrent_requests: int = Field(4096, gt=0, description="requests in flight before new ones get "
                                                                 "HTTP 429, count")
    max_body_bytes: int = Field(4 << 20, gt=0, description="largest request body, bytes")


class BenchSection(Section):
    """Defaults of `disagg bench` (its own options may override each); free-form extras in `options`."""

    num_prompts: int = Field(200, gt=0, description="requests per run, count")
    input_len: int = Field(512, gt=0, description="prompt length of synthetic requests, tokens")
    output_len: int = Field(128, gt=0, description="output length of synthetic requests, tokens")
    request_rates: list[float] = Field(default_factory=lambda: [1.0, 2.0, 4.0, 8.0],
                                       description="Poisson arrival rates swept, requests/s")
    burstiness: float = Field(1.0, gt=0.0, description="gamma arrival shape; 1.0 is Poisson")
    goodput: dict[str, float] = Field(default_factory=lambda: {"ttft": 2000.0, "tpot": 100.0},
                                      description="SLOs for goodput: metric name -> limit, milliseconds")
    compare_with: str | None = Field(None, description="the other config of a disaggregated vs "
                                                       "colocated comparison (path, relative to this file)")
    results_dir: str = Field("results", description="where JSON and PNG results go (git-ignored)")
    seed: int = Field(0, description="seed of prompts and arrivals")
    options: dict[str, Any] = Field(default_factory=dict, description="further bench options, free-form")

    @field_validator("compare_with")
    @classmethod
    def _compare_with_given(cls, path: str | None) -> str | None:
        if path is not None and not path.strip():
            raise ValueError("expected the path of another config, or null, not an empty or blank string")
        return path


class Config(Section):
    """A whole deployment; see `configs/*.yaml`. Build with `Config.from_yaml` or `model_validate`."""

    model: ModelSection
    cache: CacheSection = CacheSection()
    instances: InstancesSection
    transfer: TransferSection = TransferSection()
    scheduler: SchedulerSection = SchedulerSection()
    router: RouterSection = RouterSection()
    cluster: ClusterSection = ClusterSection()
    serve: ServeSection = ServeSection()
    bench: BenchSection = BenchSection()
    kernels: Settings = Settings()
    _path: str | None = PrivateAttr(None)  # the file this was read from (set by from_yaml)

    @model_validator(mode="after")
    def _fits(self) -> Config:
        sched, cache = self.scheduler, self.cache
        if self.model.max_model_len is not None and cache.num_pages is not None:
            pages_needed = -(-self.model.max_model_len // cache.page_size)
            if pages_needed > cache.num_pages:
                raise ValueError(f"cache.num_pages ({cache.num_pages}) holds fewer than one sequence of "
                                 f"model.max_model_len ({self.model.max_model_len} tokens = {pages_needed} "
                                 f"pages of {cache.page_size}); raise num_pages or lower max_model_len")
        if self.router.placement != "disaggregated" and self.instances.mode == "colocated":
            raise ValueError(f"router.placement {self.router.placement} chooses between prefill and decode "
                             "instances, but instances.colocated is set; use placement: disaggregated (the "
                             "default) with a colocated fleet")
        if cache.kv_dtype == "fp8_e4m3" and self.instances.device == "cpu":
            raise ValueError("cache.kv_dtype fp8_e4m3 needs GPUs, but instances.device is cpu")
        if self.transfer.backend == "nvshmem" and self.instances.device == "cpu":
            raise ValueError("transfer.backend nvshmem needs GPUs, but instances.device is cpu")
        if sched.max_num_batched_tokens < sched.max_num_seqs and self.instances.mode == "colocated":
            raise ValueError(f"scheduler.max_num_batched_tokens ({sched.max_num_batched_tokens}) must be "
                             f">= max_num_seqs ({sched.max_num_seqs}): a colocated step decodes one "
                             "token per running sequence within the same budget")
        return self

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_yaml(cls, path: str | Path) -> Config:
        """Read and validate a YAML file.

        Relative `model.source` and `bench.compare_with` paths are resolved against the file's
        folder when they exist there.

        Raises:
            ConfigError: the file is missing, is not YAML, names a key twice in one mapping, or
                fails validation; the message names the file, each failing field path (and line,
                for a repeated key), what was expected and what it got.
        """
        path = Path(path)
        try:
            raw = load_yaml(path.read_text())
        except DuplicateKey as err:
            raise ConfigError(f"{path}: {err}") from None
        except OSError as err:
            raise ConfigError(f"{path}: cannot read the config: {err.strerror or err}") from err
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path}: cannot read the config: not UTF-8 text ({err.reason} at byte "
                              f"{err.start})") from None
        except yaml.MarkedYAMLError as err:
            raise ConfigError(yaml_problem(path, err)) from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from err
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections (model, instances, ...), "
                              f"got {type(raw).__name__}")
        config = cls.from_dict(_resolve_paths(raw, path.parent), origin=str(path))
        config._path = str(path)
        return config

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, origin: str = "<config>") -> Config:
        """Validate a dict of sections; errors are `ConfigError` as in `from_yaml`."""
        try:
            return cls.model_validate(raw)
        except ValidationError as err:
            raise ConfigError(format_errors(err, origin, cls)) from None

    def override(self, updates: dict[str, Any]) -> Config:
        """A copy with dotted keys replaced, e.g. ``{"router.lease_s": 2, "instances.decode": 2}``.

        Fields the file did not give stay unset in the copy (``model_fields_set`` says which
        were given: the file's and the overridden ones), so "was this given" survives ``--set``.

        Raises:
            ConfigError: a key names no field (closest suggested) or a value fails validation.
        """
        raw = self.model_dump(exclude_unset=True)
        for dotted, value in updates.items():
            node, current, keys = raw, self, dotted.split(".")
            for key in keys[:-1]:
                parent, current = current, _child(current, key)
                if not isinstance(current, (BaseModel, dict)):
                    known = type(parent).model_fields if isinstance(parent, BaseModel) else parent
                    raise ConfigError(f"override {dotted!r}: {key!r} is not a section{suggest(key, known)}")
                if not isinstance(node.get(key), dict):  # a section left unset: only this key is given
                    node[key] = {} if isinstance(current, BaseModel) else copy.deepcopy(current)
                node = node[key]
            node[keys[-1]] = value
        config = Config.from_dict(raw, origin=self.path or "<config>")
        config._path = self._path
        return config

    def with_environment(self) -> Config:
        """A copy whose `kernels` switches are overridden by the DISAGG_* environment variables
        set now (`Settings.from_env`): the launcher calls it once, before the config goes to the
        actors, so every actor, on this host or another, runs with this process's switches.

        Raises:
            ConfigError: a variable holds a value its switch does not have.
        """
        settings = Settings.from_env(self.kernels)
        changed = settings.differences(self.kernels)
        if not changed:
            return self
        logger.info("kernels: %s from the environment (the config says %s)",
                    ", ".join(f"{name}={value!r}" for name, value in changed.items()),
                    ", ".join(f"{name}={getattr(self.kernels, name)!r}" for name in changed))
        return self.model_copy(update={"kernels": settings})

    # ------------------------------------------------------------------ conveniences
    @property
    def path(self) -> str | None:
        """The YAML file this config was read from, or None."""
        return self._path

    @property
    def mode(self) -> Literal["disaggregated", "colocated"]:
        return self.instances.mode

    @property
    def name(self) -> str:
        return Path(self.path).stem if self.path else f"{self.model.source}-{self.mode}"


def _child(value: Any, key: str) -> Any:
    """``value``'s field or entry ``key`` (None when it has none)."""
    if isinstance(value, BaseModel):
        return getattr(value, key) if key in type(value).model_fields else None
    return value.get(key) if isinstance(value, dict) else None


def _resolve_paths(raw: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Make relative model.source / bench.compare_with absolute when they exist next to the file."""
    raw = dict(raw)
    for section, key in (("model", "source"), ("bench", "compare_with")):
        part = raw.get(section)
        if isinstance(part, dict) and isinstance(part.get(key), str):
            value = part[key]
            if not value.strip():  # "" is refused by validation, never turned into the folder
                continue
            if not value.startswith(DUMMY_PREFIX) and value != SMOLLM2_SOURCE and not Path(value).is_absolute():
                candidate = folder / value
                if candidate.exists():
                    raw[section] = dict(part, **{key: str(candidate.resolve())})
    return raw
