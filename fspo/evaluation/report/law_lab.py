"""The length-law lab's report: every arm's sequence records judged with CIs and tests (fspo/diagnostics
law_*.py), and the sweep's targets. Groups follow ``--group-by`` (``method,bands`` for the length-law sweep);
a group's runs are pooled; the knock-out arm's name contains ``knock``, the measure-only arm's method is
``measure`` (every band judged on its sequences).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter, ScalarFormatter

from fspo.diagnostics import law_bands as lb
from fspo.diagnostics import law_stats as st
from fspo.diagnostics.law_summary import band_results
from fspo.diagnostics.ledger import read_csv
from fspo.evaluation.report.collect import read_artifact

ARTIFACT = "diagnostics/sequences.csv"


def download_records(tracking_uri: str, groups, folder: Path) -> Dict[str, Dict[str, np.ndarray]]:
    """{group: pooled records} of the runs that logged ``diagnostics/sequences.csv`` (others are skipped)."""
    out = {}
    for g, runs in groups.items():
        parts = [read_artifact(tracking_uri, r, ARTIFACT, read_csv, folder / r.run_id) for r in runs]
        parts = [p for p in parts if p is not None]
        if parts:
            rec = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
            keep = (rec["update"] >= 0) & (rec["length"] > 0)
            out[g] = {k: v[keep] for k, v in rec.items()}
    return out


def lab_rows(records: Dict[str, Dict[str, np.ndarray]], min_count: int = 50, n_boot: int = 400,
             seed: int = 0, own_bands: Optional[Dict[str, object]] = None) -> Dict[str, dict]:
    """Per group: std exponent with bootstrap CI, tau^2 / sigma^2 / L*, variance inflation, its own band's test
    (`law_bands.judge`); ``own_bands`` {group: band} adds the Gaussian prediction of c(L)."""
    allL = np.concatenate([r["length"] for r in records.values()])
    edges = st.geometric_edges(max(1.0, allL.min()), allL.max() + 1, 2)
    out = {}
    for g, rec in records.items():
        L, S = rec["length"], rec["s"]
        m = st.bin_moments(L, S, edges, rec["d2"])
        row = {"n_seq": len(L), "edges": edges, **{f"fit_{k}": v for k, v in st.std_exponent(m, min_count).items()}}
        row["exponent_ci"] = st.bootstrap_exponent(L, S, lb.cluster_ids(rec), edges, min_count,
                                                   n_boot, seed)
        row.update(st.affine_variance(m, min_count))
        row["var_inflation"] = st.variance_inflation(m, min_count)["pooled"]
        ok = m.populated(min_count)
        row["std_by_bin"] = [(float(m.mean_l[b]), float(math.sqrt(m.var_s[b])), int(m.n[b]))
                             for b in np.flatnonzero(ok)]
        band = (own_bands or {}).get(g)  # RLOO / GSPO: the Gaussian prediction of their own band per bin
        own = lb.judge(L, S, rec["out"] > 0.5, edges, min_count, band.limits(L) if band else None, seed,
                       lb.cluster_ids(rec))
        row["own"] = own
        if "measure" in g:
            row["panel"] = band_results(rec, edges, min_count, seed)
        out[g] = row
    return out


def own_band(run) -> Optional[object]:
    """The RLOO / GSPO band of a run from its logged params (``clip/clip_ratio_low`` / ``_high``), else None."""
    method, p = run.value("method"), run.params
    try:
        low, high = float(p["clip/clip_ratio_low"]), float(p["clip/clip_ratio_high"])
    except (KeyError, ValueError):
        return None
    return {"rloo": lb.RatioBand, "gspo": lb.TokenRatioBand}.get(method, lambda *a: None)(low, high)


def targets(rows: Dict[str, dict]) -> List[dict]:
    """The length-law sweep's targets, each with the measured value and whether it passes."""
    def find(word):
        return next((r for g, r in rows.items() if word in g and "knock" not in g), None)

    fspo, rloo, gspo = find("fspo"), find("rloo"), find("gspo")
    knock = next((r for g, r in rows.items() if "knock" in g), None)
    out = []

    def add(name, value, ok, ci=None):
        out.append({"target": name, "measured": value, "ci": ci, "pass": bool(ok) if value is not None else None})

    if fspo:
        g = fspo["fit_exponent"]
        add("FSPO std exponent in [0.4, 0.6]", g, g is not None and 0.4 <= g <= 0.6, fspo["exponent_ci"])
        p = fspo["own"].get("p_homogeneity_clustered", fspo["own"]["p_homogeneity"])
        add("FSPO c(L) homogeneous (p >= 0.05, chi-square / prompt-group design effect)", p, (p or 0) >= 0.05)
        add("FSPO c(L) homogeneous (p >= 0.05, sequences taken as independent)", fspo["own"]["p_homogeneity"],
            (fspo["own"]["p_homogeneity"] or 0) >= 0.05)
    for name, r in (("fspo", fspo), ("rloo", rloo), ("gspo", gspo)):
        if r:
            add(f"{name} bins with >= 50 sequences span >= 16x", r["own"]["span"], (r["own"]["span"] or 0) >= 16)
    if rloo:
        add("RLOO c(L) rises >= 3x", rloo["own"]["ratio_last_first"], (rloo["own"]["ratio_last_first"] or 0) >= 3)
    if gspo:
        add("GSPO c(L) falls >= 3x", gspo["own"]["ratio_first_last"], (gspo["own"]["ratio_first_last"] or 0) >= 3)
    if fspo and rloo and gspo:
        half = 0.5 * min(rloo["own"]["lre"], gspo["own"]["lre"])
        add("FSPO LRE <= half of min(RLOO, GSPO)", fspo["own"]["lre"], fspo["own"]["lre"] <= half)
    if knock:
        g = knock["fit_exponent"]
        add("knock-out std exponent <= 0.25", g, g is not None and g <= 0.25, knock["exponent_ci"])
    return out


def _f(x, nd=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{nd}g}" if isinstance(x, float) else str(x)


def lab_markdown(rows: Dict[str, dict], tgt: Sequence[dict]) -> str:
    lines = ["| target | measured | 95% CI | pass |", "|---|---|---|---|"]
    for t in tgt:
        ci = f"[{t['ci'][0]:.3f}, {t['ci'][1]:.3f}]" if t["ci"] else "-"
        lines.append(f"| {t['target']} | {_f(t['measured'])} | {ci} | {'yes' if t['pass'] else 'no'} |")
    lines += ["", "| group | seqs | exponent [95% CI] | tau^2 | sigma^2 | L* | Var(S)/E[sum d^2] | out rate | "
              "homogeneity p (clustered; iid) | design effect | LRE (flat-band floor) | span |", "|---" * 12 + "|"]
    for g, r in rows.items():
        ci = r["exponent_ci"]
        ex = f"{_f(r['fit_exponent'])} [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else _f(r["fit_exponent"])
        o = r["own"]
        floor = o.get("lre_floor", {}).get("mean")
        lines.append(f"| {g} | {r['n_seq']} | {ex} | {_f(r['tau2'])} | {_f(r['sigma2'])} | {_f(r['l_star'])} | "
                     f"{_f(r['var_inflation'])} | {_f(o.get('out_rate'))} | {_f(o.get('p_homogeneity_clustered'))}; "
                     f"{_f(o['p_homogeneity'])} | {_f(o.get('design_effect'))} | "
                     f"{_f(o['lre'])} ({_f(floor)}) | {_f(o['span'])} |")
    for g, r in rows.items():
        lines += ["", f"### {g}: c(L) per bin (own band; Wilson 95% CI)", "", "| bin | mean L | n | c(L) | CI |",
                  "|---|---|---|---|---|"]
        o = r["own"]
        for (lo, hi), ml, n, c, a, b in zip(o["bins"], o["mean_l"], o["n"], o["c"], o["ci_lo"], o["ci_hi"]):
            lines.append(f"| [{lo}, {hi}) | {ml:.0f} | {int(n)} | {c:.3f} | [{a:.3f}, {b:.3f}] |")
        for name, res in (r.get("panel") or {}).items():
            floor = res.get("lre_floor", {}).get("mean")
            lines.append(f"\n{g} panel band **{name}** on the same sequences: c(L) "
                         + ", ".join(f"{c:.3f}" for c in res["c"])
                         + f"; homogeneity p {_f(res.get('p_homogeneity_clustered'))} "
                         f"(clustered; iid {_f(res['p_homogeneity'])}, design effect {_f(res.get('design_effect'))}); "
                         f"LRE {_f(res['lre'])} (floor {_f(floor)}); last/first {_f(res['ratio_last_first'])}"
                         + ("; Gaussian prediction " + ", ".join(f"{c:.3f}" for c in res["c_gauss"])
                            if res.get("c_gauss") else ""))
    return "\n".join(lines) + "\n"


def _c_curve(ax, res: dict, label: str) -> None:
    c = np.array(res["c"])
    if len(c):
        err = np.maximum(0.0, np.array([c - np.array(res["ci_lo"]), np.array(res["ci_hi"]) - c]))  # float noise
        ax.errorbar(res["mean_l"], c, yerr=err, marker="o", ms=3, capsize=2, label=label)


def lab_figure(rows: Dict[str, dict], title: str = "Length law") -> Figure:
    """Left: each in-loop arm's own c(L) with Wilson CIs. Middle: every band on the measure-only arm's sequences.
    Right: std(S_L) by bin (log-log) with each arm's exponent and CI, and a slope-1/2 line."""
    fig = Figure(figsize=(17, 4.8))
    a, m, b = fig.subplots(1, 3)
    for g, r in rows.items():
        if "measure" not in g:
            _c_curve(a, r["own"], g)
        for name, res in (r.get("panel") or {}).items():
            _c_curve(m, res, name + (" (fit on earlier steps)" if name in ("affine", "quantile") else " (matched)"))
        if r["std_by_bin"]:
            x, y, _ = zip(*r["std_by_bin"])
            ci = r["exponent_ci"]
            lab = f"{g}: exponent {_f(r['fit_exponent'], 2)}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
            b.plot(x, y, marker="o", ms=3, label=lab)
    edges = rows[next(iter(rows))]["edges"]
    xs = np.array([min(e for e in edges if e > 0), max(edges)], float)
    ys = [v for r in rows.values() for _, v, _ in r["std_by_bin"]]
    if ys:
        b.plot(xs, np.median(ys) * np.sqrt(xs / np.sqrt(xs[0] * xs[1])), "k--", lw=1,
               label="slope 1/2 (the sqrt(L) law)")
    a.set(xscale="log", xlabel="response length L (tokens)", ylabel="out-of-band fraction c(L)",
          title="each arm's own band (flat = fair), 95% CIs")
    m.set(xscale="log", xlabel="response length L (tokens)", ylabel="out-of-band fraction c(L)",
          title="every band on the same sequences (measure-only arm)")
    b.set(xscale="log", yscale="log", xlabel="response length L (tokens)", ylabel="std of S_L",
          title="std(S_L) by length (the law: slope 1/2)")
    for ax in (a, m, b):
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())  # log axes: plain tick labels, no overlapping minors
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
