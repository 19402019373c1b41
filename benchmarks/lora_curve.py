"""The LoRA learning curve beside the full fine-tune's (docs/lora.md): runs the default tiny run for
``--steps`` RL steps once per arm and prints val/accuracy at each validation, read back from MLflow.

Usage: python benchmarks/lora_curve.py --out /tmp/lora_curve [--steps 30] [--val-every 10]
       [--arm full: --arm 'lora_r8_lr2e-4:model.lora.rank=8 ppo.lr=2e-4' ...]
Each arm is ``name:overrides`` (space-separated Hydra overrides); the default arms are the full
fine-tune and LoRA r 8 with its defaults. Results: <out>/curves.json and a table on stdout.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ARMS = ["full:", "lora_r8:model.lora.rank=8"]


def run_arm(name: str, overrides: str, out: Path, steps: int, val_every: int) -> dict:
    uri = f"sqlite:///{out / 'mlflow.db'}"
    cmd = [sys.executable, str(ROOT / "experiments" / "run.py"), f"steps={steps}", f"val.every_n_steps={val_every}",
           f"output_dir={out / name}", f"logger.tracking_uri={uri}", "logger.experiment_name=lora_curve",
           f"run_name={name}", "progress.mode=lines", *overrides.split()]
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT)
    wall = time.time() - t0
    import mlflow

    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("lora_curve")
    run = client.search_runs([exp.experiment_id], f"attributes.run_name = '{name}'",
                             order_by=["attributes.start_time DESC"], max_results=1)[0]
    curve = {int(m.step): m.value for m in client.get_metric_history(run.info.run_id, "val/accuracy")}
    upd = [m.value for m in client.get_metric_history(run.info.run_id, "train/update_ratio")] \
        if "train/update_ratio" in run.data.metrics else []
    return {"overrides": overrides, "wall_s": wall, "val_accuracy": curve,
            "trainable_params": run.data.metrics.get("model/trainable_params"),
            "total_params": run.data.metrics.get("model/total_params"),
            "min_update_ratio": min(upd) if upd else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--val-every", type=int, default=10)
    ap.add_argument("--arm", action="append", help="name:overrides (repeatable)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for arm in a.arm or DEFAULT_ARMS:
        name, _, ov = arm.partition(":")
        results[name] = run_arm(name, ov, a.out, a.steps, a.val_every)
        (a.out / "curves.json").write_text(json.dumps(results, indent=1))
    for name, r in results.items():
        pts = " ".join(f"{s}:{v:.3f}" for s, v in sorted(r["val_accuracy"].items()))
        print(f"{name:24s} trainable {r['trainable_params']:.0f}/{r['total_params']:.0f}  {pts}  ({r['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
