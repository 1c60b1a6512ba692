"""Plot the two-H200 headline at one serving tree: SLO attainment vs request rate per GPU.

Reads the per-run summaries of the three records that make the table (28e: prefill-heavy, chat,
decode-heavy; 28f: long-prompt; 28g: shared-prefix) and writes `headline.png` beside this file:
one column per workload, the strict SLOs (1x, calibrated on 1P1D) on top, the relaxed ones (2x)
below, one line per deployment, the 90% attainment that defines goodput dashed.

    .venv/bin/python benchmarks/records/headline-h200x2-2026-11-28g/plot_headline.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
RECORDS = HERE.parent
WORKLOADS = [
    ("prefill-heavy", RECORDS / "headline-h200x2-2026-11-28e" / "prefill-heavy-runs.json"),
    ("chat", RECORDS / "headline-h200x2-2026-11-28e" / "chat-runs.json"),
    ("decode-heavy", RECORDS / "headline-h200x2-2026-11-28e" / "decode-heavy-runs.json"),
    ("long-prompt", RECORDS / "headline-h200x2-2026-11-28f" / "long-prompt-runs.json"),
    ("shared-prefix", HERE / "shared-prefix-runs.json"),
]
STYLES = {
    "1p1d": ("1P1D", dict(color="tab:red", marker="s")),
    "adaptive": ("1P1D-adaptive", dict(color="tab:blue", marker="o")),
    "colocated-8192": ("colocated, chunk 8192", dict(color="tab:green", marker="^")),
    "colocated-2048": ("colocated, chunk 2048", dict(color="tab:olive", marker="v", linestyle=":")),
    "colocated-512": ("colocated, chunk 512", dict(color="tab:purple", marker="v", linestyle=":")),
}
GPUS = 2


def main() -> Path:
    fig, axes = plt.subplots(2, len(WORKLOADS), figsize=(16, 6.4), sharey=True)
    for col, (workload, path) in enumerate(WORKLOADS):
        runs = json.loads(path.read_text())
        for row, key in enumerate(("attainment_1x", "attainment_2x")):
            ax = axes[row][col]
            for deployment, (label, style) in STYLES.items():
                points = sorted((r["rate"] / GPUS, 100 * r[key]) for r in runs if r["deployment"] == deployment)
                if points:
                    ax.plot(*zip(*points), label=label, **style)
            ax.axhline(90, color="gray", linestyle="--", linewidth=0.8)
            ax.set_ylim(0, 103)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(workload)
            else:
                ax.set_xlabel("req/s per GPU")
        axes[0][0].set_ylabel("SLO attainment %, strict (1x)")
        axes[1][0].set_ylabel("SLO attainment %, relaxed (2x)")
    handles, labels = [], []
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.suptitle("Two H200s, llama3-8b shape (long-prompt: llama3.1-8b, 32k), dummy bf16 weights: "
                 "goodput per GPU = the rate where a line crosses 90%")
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    out = HERE / "headline.png"
    fig.savefig(out, dpi=80)
    return out


if __name__ == "__main__":
    print(main())
