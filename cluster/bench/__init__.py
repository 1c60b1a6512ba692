"""disagg.cluster.bench: `disagg bench`, serving measured at the client as `vllm bench serve` does.

Rooms: `workloads` (seeded synthetic requests), `arrivals` (Poisson/gamma send times), `runner`
(drives a backend at one rate and times every token), `backends` (a launched Cluster, or an
OpenAI-compatible server), `metrics` (vLLM's metric names and rules), `report` (result JSON that
recomputes from its own per-request lists), `compare` (SLO attainment, DistServe's per-GPU
goodput, SLO-scale sweeps, the same-model check, `quick_compare`), `sweep` (launch, sweep,
compare), `stored` (compare sweeps run one deployment at a time), `tables` (80-column console
tables), `markdown` (summary.md), `plots` (PNG figures), `flags` (flag values), `session` (one
invocation: print, save, exit status) and `command` (the typer command, vLLM's option names).
The measured recipes' runbooks are in benchmarks/records/runbooks/. These modules import no
torch; ray comes only with the parent package (disagg.cluster) and the Cluster they drive.
"""

from disagg.cluster.bench.compare import per_gpu_goodput, quick_compare
from disagg.cluster.bench.metrics import RequestOutput, compute_metrics, parse_goodput

__all__ = ["RequestOutput", "compute_metrics", "parse_goodput", "per_gpu_goodput", "quick_compare"]
