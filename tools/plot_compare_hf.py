"""Draw a ``moeserve bench compare-hf --json`` report: step times of moeserve, transformers and
the roofline, one group of bars per cell.

    python tools/plot_compare_hf.py REPORT.json OUT.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(report_path: str, out_path: str) -> None:
    with open(report_path) as f:
        report = json.load(f)
    cells = report["cells"]
    labels = [f"{c['kind']}\n{c['batch']} x {c['length']}" for c in cells]
    series = [("moeserve", "moeserve_s", "tab:blue"), ("transformers", "hf_s", "tab:gray"),
              ("roofline", "roofline_s", "tab:green")]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.27
    for i, (name, key, color) in enumerate(series):
        values = [1e3 * c[key] if c.get(key) else 0.0 for c in cells]
        bars = ax.bar([x + (i - 1) * width for x in range(len(cells))], values, width, label=name, color=color)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(cells)), labels)
    ax.set_ylabel("ms per step (decode) / per batch (prefill)")
    ax.set_title(f"{report['describe']}\n{report['device']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
