"""The side-by-side layout table of ``megatron-hsap plan-quality`` (issue 8 measures).

For every grid point: the contiguous (paper) and balanced layouts' imbalance before any work
moves (``owner``) and after the plan (``plan``), estimated time, kernel efficiency (docs/design.md §4:
every document whole at its own kernel rate, perfectly spread, no traffic / estimated time — the
bound does not depend on the layout), the share of batches that are compute-dominated under the
balanced layout and their kernel efficiency (target ≥ 0.9 on packed workloads), and the estimated-time ratios: forced balanced / contiguous (where it
loses: > 1) and kept / contiguous (what ``layout="balanced"`` ships: never > 1).
"""

from __future__ import annotations

from megatron_hsap.sim.results import size_label

__all__ = ["layout_markdown", "TARGET_COMPUTE_EFFICIENCY"]

TARGET_COMPUTE_EFFICIENCY = 0.9


def layout_markdown(summary: dict[tuple, dict[tuple[str, str], tuple[float, float]]], workloads: tuple[str, ...]) -> str:
    """Markdown of the layout comparison from ``plan_quality._summary`` (median (worst) cells)."""

    def cell(d: dict, method: str, metric: str, scale: float = 1.0, fmt: str = "{:.3g}") -> str:
        if (method, metric) not in d:
            return "-"
        med, worst = d[(method, metric)]
        return f"{fmt.format(med * scale)} ({fmt.format(worst * scale)})"

    head = ["workload", "T", "P", "link", "heads", "owner imb. contig.", "owner imb. bal.", "plan imb. contig.",
            "plan imb. bal.", "est. ms contig.", "est. ms bal.", "kernel eff. contig.", "kernel eff. bal.",
            "bal. compute-dominated", "kernel eff. bal. (dominated)", "bal. / contig.", "kept / contig.", "kept bal.", "target"]
    lines = ["### Layouts: contiguous (paper) vs balanced (document-aware), median (worst) over the seeds", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = {w: i for i, w in enumerate(workloads)}
    met = missed = 0
    losses = []
    for key in sorted(summary, key=lambda k: (order.get(k[0], 99), k[1], k[2], k[4])):
        d = summary[key]
        if ("hsap-balanced", "estimated_time") not in d:
            continue
        w, T, P, link, heads = key
        target = "-"
        if w != "full" and ("hsap-balanced", "dominated_kernel_efficiency") in d:
            ok = d[("hsap-balanced", "dominated_kernel_efficiency")][1] >= TARGET_COMPUTE_EFFICIENCY
            target = "met" if ok else "MISSED"
            met, missed = met + ok, missed + (not ok)
        if d[("hsap-kept", "balanced_over_contiguous")][0] > 1.005:  # beyond rounding
            losses.append(f"{w} {size_label(T)} P={P} {link} {heads} ({d[('hsap-kept', 'balanced_over_contiguous')][0]:.2f}×)")
        lines.append("| " + " | ".join([
            w, size_label(T), str(P), link, heads,
            cell(d, "hsap", "owner_imbalance", fmt="{:.2f}"), cell(d, "hsap-balanced", "owner_imbalance", fmt="{:.3f}"),
            cell(d, "hsap", "imbalance", fmt="{:.3f}"), cell(d, "hsap-balanced", "imbalance", fmt="{:.3f}"),
            cell(d, "hsap", "estimated_time", 1e3), cell(d, "hsap-balanced", "estimated_time", 1e3),
            cell(d, "hsap", "kernel_efficiency", fmt="{:.3f}"), cell(d, "hsap-balanced", "kernel_efficiency", fmt="{:.3f}"),
            f"{d[('hsap-balanced', 'compute_dominated')][0]:.0%}" if ("hsap-balanced", "compute_dominated") in d else "-",
            cell(d, "hsap-balanced", "dominated_kernel_efficiency", fmt="{:.3f}"),
            cell(d, "hsap-kept", "balanced_over_contiguous", fmt="{:.2f}"), cell(d, "hsap-kept", "kept_over_contiguous", fmt="{:.2f}"),
            f"{d[('hsap-kept', 'balanced_kept')][0]:.0%}", target]) + " |")
    lines += ["", f"Kernel efficiency ≥ {TARGET_COMPUTE_EFFICIENCY} on compute-dominated batches of the packed workloads "
              f"(balanced, worst batch): met at {met} of {met + missed} points.",
              "Median balanced / contiguous > 1.005 (the fallback keeps contiguous there): "
              + ("; ".join(losses) if losses else "none") + "."]
    return "\n".join(lines)
