"""``megatron-hsap simulate <table2|table3|table4|magi|validate|scale|layouts|gantt|all> [--quick]``.

Each command writes ``<out>/<name>.csv`` (docs/design.md §4 columns), ``<name>.md`` and its PNG plot,
and prints the markdown. ``--quick`` runs a reduced grid with one seed (seconds; used by tests).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from megatron_hsap.argtypes import (DeprecatedAlias, HelpFormatter, add_topology_args, given_options, link_line, output_dir,
                                   positive_int)
from megatron_hsap.errors import HSAPError
from megatron_hsap.plan.workloads import WORKLOADS

__all__ = ["main", "COMMANDS"]

COMMANDS = ("table2", "table3", "table4", "magi", "calibrate", "validate", "scale", "layouts", "gantt")
# the commands that read each option (one given to a command that ignores it is refused)
READS = {"workload": ("table2", "table3", "magi", "scale", "layouts", "gantt"),
         "seeds": ("table2", "table3", "table4", "magi", "calibrate", "layouts"),
         "jobs": ("layouts",), "refit": ("calibrate",)}


def _validate(out_dir: Path, **_: object) -> "object":
    from megatron_hsap.plan.hardware import link_class_for
    from megatron_hsap.sim.results import Report, Row, markdown_table
    from megatron_hsap.sim.validate import (RFA_SOURCE, TOLERANCE, column_shape_checks, distflashattn_column,
                                            distflashattn_table3, ring_flash_attention_check)

    rows: list[Row] = []
    checks = ring_flash_attention_check()
    tab = []
    for c in checks:
        tab.append([c.method, c.fwd_pct, c.published_fwd, c.fwd_bwd_pct, c.published_fwd_bwd, "yes" if c.ok else "NO"])
        for metric, sim, pub in (("fwd_pct_of_ideal", c.fwd_pct, c.published_fwd), ("fwd_bwd_pct_of_ideal", c.fwd_bwd_pct, c.published_fwd_bwd)):
            rows.append(Row("sim", "ring-flash-attention-varlen", 65536, 1, 8, "nvlink", "32/8", "-", c.method, metric, sim, "%"))
            rows.append(Row("paper:ring-flash-attention", "ring-flash-attention-varlen", 65536, 1, 8, "nvlink", "32/8", "-", c.method, metric, pub, "%"))
    col = distflashattn_column()
    for p in col:
        link = link_class_for(p.sp).value  # docs/design.md §4: the CP group (TP 1 × SP) in one 8-GPU node?
        rows.append(Row("sim", "any (document-blind)", p.T, 1, p.sp, link, "16/16", "-", "distflashattn", "time", p.simulated_ms, "ms"))
        rows.append(Row("paper:hsap-table2", "unknown", p.T, 1, p.sp, link, "16/16", "-", "distflashattn", "time", p.paper_ms, "ms"))
    shape = column_shape_checks(col)
    t3 = distflashattn_table3()
    for per_gpu, P, sim, pub in t3:
        link = link_class_for(P).value
        rows.append(Row("sim", "any (document-blind)", per_gpu * P, 1, P, link, "16/16", "-", "distflashattn", "time", sim, "ms"))
        rows.append(Row("paper:hsap-table3", "unknown", per_gpu * P, 1, P, link, "16/16", "-", "distflashattn", "time", pub, "ms"))
    ratios = [sim / pub for _, _, sim, pub in t3]
    md = [f"### Validation 1 — ring-flash-attention varlen on 8×A100 (% of single-GPU FlashAttention; published: {RFA_SOURCE})", "",
          markdown_table(["method", "fwd % (sim)", "fwd % (published)", "fwd+bwd % (sim)", "fwd+bwd % (published)", f"within {TOLERANCE:.0%}"], tab), "",
          "### Validation 2 — shape of the paper's Table 2 DistFlashAttn column (A100, 16 heads × 128)", "",
          markdown_table(["SP", "T", "simulated ms", "paper ms"], [[p.sp, f"{p.T // 1024}K", p.simulated_ms, p.paper_ms] for p in col]), "",
          markdown_table(["check", "holds", "detail"], [[n, "yes" if ok else "NO", d] for n, ok, d in shape]), "",
          "### Validation 3 — the paper's Table 3 DistFlashAttn column (document-blind, so packing-independent)", "",
          markdown_table(["per GPU", "GPUs", "simulated ms", "paper ms", "simulated / paper"],
                         [[f"{g // 1024}K", P, sim, pub, sim / pub] for g, P, sim, pub in t3]), "",
          f"simulated / paper: {min(ratios):.2f}–{max(ratios):.2f} (median {sorted(ratios)[len(ratios) // 2]:.2f}); "
          "the model has no framework overhead, so it is expected at or below 1 and closest where compute dominates."]
    return Report("validate", rows, "\n".join(md), []).write(out_dir)


def _runner(name: str):  # noqa: ANN202
    if name in ("table2", "table3"):
        from megatron_hsap.sim import reproduce

        return getattr(reproduce, name)
    if name == "table4":
        from megatron_hsap.sim.table4 import table4

        return table4
    if name == "magi":
        from megatron_hsap.sim.magi import magi

        return magi
    if name == "calibrate":
        from megatron_hsap.sim.calibrate import calibrate

        return calibrate
    if name == "scale":
        from megatron_hsap.sim.scale import scale

        return scale
    if name == "layouts":
        from megatron_hsap.sim.layouts import layouts

        return layouts
    if name == "gantt":
        from megatron_hsap.sim.gantt import gantt

        return gantt
    return _validate


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-hsap simulate", formatter_class=HelpFormatter,
        description="Simulate HSAP and the baselines (TE THD ring, TE a2a+p2p, all-gather KV, Ulysses, USP, "
        "DistFlashAttn) on modelled A100/H100 clusters: the paper's Tables 2-4, MagiAttention's protocol, "
        "validation against published numbers, a 1024-GPU scale run, contiguous vs balanced token layouts "
        "over InfiniBand and a per-rank Gantt chart; `calibrate` prints the simulator's constants and its "
        "errors against MagiAttention's published figures. Duration on one shared CPU core: --quick takes seconds per "
        "command; full runs take minutes each (calibrate ~20 s, magi a few minutes, table3 the longest) and `all` tens of "
        "minutes; `all` into results/ also rewrites the README's generated regions (`megatron-hsap report`). Progress "
        "goes to stderr. Each writes <out>/<name>.csv/.md (and .png) and prints "
        "its markdown.")
    p.add_argument("what", choices=COMMANDS + ("all",), help="which reproduction to run")
    p.add_argument("--quick", action="store_true", help="reduced grid, one seed (seconds)")
    p.add_argument("--refit", action="store_true", help="calibrate: re-run the fit of the efficiencies on the 8-GPU points")
    p.add_argument("--out", type=output_dir, default=Path("results"), metavar="DIR",
                   help="output folder (<name>.csv, <name>.md, <name>.png)")
    p.add_argument("--seeds", type=positive_int, default=None,
                   help="seeded batches per point (default: 10; table3 5, layouts 2; docs/design.md §4 asks 10)")
    p.add_argument("--workload", default=None, choices=("magiattention", *WORKLOADS),
                   help="length distribution for tables 2/3, magi, scale, gantt (default: slimpajama; magi: magiattention, "
                   "MagiAttention's own, which only magi takes); layouts: only this one (default there: fineweb, "
                   "slimpajama, ultrachat, sharegpt, full)")
    p.add_argument("--jobs", type=positive_int, default=1, help="layouts: worker processes")
    add_topology_args(p, intra=None, inter=None, old=False)
    for action in p._actions:  # the topology only enters gantt
        if action.dest in ("intra_size", "inter_size"):
            action.help = f"gantt: HSAP {action.help} (default: {1 if action.dest == 'intra_size' else 8})"
    p.add_argument("--topology", dest="topology", type=_topology, default=None, action=DeprecatedAlias,
                   new="--intra-size I --inter-size J", help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help="YAML overrides of the simulator constants (see sim/config.py; default: none)")
    return p


def _topology(text: str) -> str:
    """argparse type: ``intra x inter`` with both sizes ≥ 1, e.g. ``2x4``."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a topology intra x inter with sizes >= 1, e.g. 2x4")
    return f"{int(parts[0])}x{int(parts[1])}"


def _gantt_topology(ap: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """``intra x inter`` of gantt from ``--intra-size``/``--inter-size`` (or the old ``--topology``);
    refused on the commands that take no topology, so a flag is never silently ignored."""
    given = args.intra_size is not None or args.inter_size is not None
    if given and args.topology is not None:
        ap.error("give either --intra-size/--inter-size or the deprecated --topology, not both")
    if (given or args.topology is not None) and args.what != "gantt":
        ap.error(f"--intra-size/--inter-size choose gantt's topology; {args.what} simulates its own grid of topologies")
    if args.topology is not None:
        return args.topology
    return f"{args.intra_size or 1}x{args.inter_size or 8}"


def _check_reads(ap: argparse.ArgumentParser, args: argparse.Namespace, given: set[str]) -> None:
    """Refuse an option ``given`` that the command does not read (``READS``; under ``all`` some
    command reads each), so a flag is never silently ignored."""
    for opt, readers in READS.items():
        if opt in given and args.what != "all" and args.what not in readers:
            ap.error(f"--{opt} is read by {', '.join(readers)} only; {args.what} does not use it")
    if args.workload == "magiattention" and args.what != "magi":
        ap.error(f"--workload magiattention (MagiAttention's protocol) is magi's own; {args.what} packs one of "
                 f"{', '.join(WORKLOADS)}")


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    args.topology = _gantt_topology(ap, args)
    _check_reads(ap, args, given_options(_parser(), argv))
    try:
        if args.config:
            from megatron_hsap.sim.config import load_overrides

            import yaml

            try:
                load_overrides(args.config)
            except (yaml.YAMLError, ValueError, TypeError, AttributeError) as exc:  # YAML syntax, a wrong type
                raise HSAPError(f"simulator config {args.config} is invalid: {str(exc).splitlines()[0]}") from None
        names = COMMANDS if args.what == "all" else (args.what,)
        for name in names:
            kwargs: dict[str, object] = {"quick": args.quick, "seeds": args.seeds}
            if args.workload and name in READS["workload"]:
                kwargs["workload"] = args.workload
            if name == "layouts":
                kwargs["jobs"] = args.jobs
            if name == "gantt":
                kwargs["topology"] = args.topology
                intra, inter = (int(x) for x in args.topology.split("x"))
                print(f"[gantt: HSAP {args.topology}; {link_line(intra=intra, inter=inter)}]", flush=True)
            if name == "calibrate":
                kwargs["refit"] = args.refit
            t0 = time.perf_counter()
            report = _runner(name)(args.out, **kwargs)
            print(report.markdown)
            print(f"\n[{name}: {time.perf_counter() - t0:.1f} s; wrote {', '.join(str(f) for f in report.files)}]\n", flush=True)
        if args.what == "all" and Path(args.out) == Path("results") and Path("README.md").exists():
            from megatron_hsap.sim.report import main as report_main

            report_main(["--results", str(args.out)])  # the README's generated regions and plots: one command regenerates all
    except HSAPError as exc:
        print(f"megatron-hsap simulate: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
