"""Per length bin detail of a length-law sweep: why std(S_L) does or does not grow like sqrt(L).

    python benchmarks/length_law_detail.py --tracking-uri sqlite:///mlflow.db --experiment length_law > detail.md

For every finished run (one table each): per 64-token bin the sequences counted, mean and std of S_L, the
per-token scale std / sqrt(L) (flat under the paper's law; here L is the bin's mean length when logged,
else its midpoint), the out-of-band fraction c(L); then the per-token log-ratio autocorrelation rho_k and the
std of d_t by position in the response (run-level ``run/logratio/*`` keys, fspo/diagnostics/autocorr.py).
"""
from __future__ import annotations

import argparse
import math
import os

from fspo.diagnostics.bins import label_edges
from fspo.evaluation.report.collect import load_runs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"))
    p.add_argument("--experiment", required=True)
    a = p.parse_args(argv)
    from mlflow.tracking import MlflowClient

    for r in load_runs(MlflowClient(tracking_uri=a.tracking_uri), [a.experiment]):
        m = r.metrics
        print(f"\n### {r.name}\n\n| bin | n | mean S | std S | std / sqrt(L) | c(L) |\n|---|---|---|---|---|---|")
        for k in sorted(k for k in m if k.startswith("run/logratio/std/len_")):
            b = k.rsplit("/", 1)[1]
            lo, hi = label_edges(b)
            mid = (lo + (hi if math.isfinite(hi) else lo + 64)) / 2
            c = m.get(f"run/band/out_frac/{b}")
            print(f"| {b} | {m.get(f'run/band/n_seq/{b}', 0):.0f} | {m.get(f'run/logratio/mean/{b}', 0):.3f} | "
                  f"{m[k]:.3f} | {m[k] / math.sqrt(mid):.4f} | {'-' if c is None else f'{c:.3f}'} |")
        acf = {k.rsplit("/", 1)[1]: v for k, v in m.items() if k.startswith("run/logratio/acf/")}
        pos = {k.rsplit("/", 1)[1]: v for k, v in m.items() if k.startswith("run/logratio/tok_std/")}
        print("\nrho_k: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(acf.items())))
        print("std(d_t) by position: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(pos.items())))


if __name__ == "__main__":
    main()
