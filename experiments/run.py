"""Entry point: `python experiments/run.py [+method=fspo|grpo|...] [+model=tiny|qwen3_1_7b|...] [key=value ...]`.

With no arguments it runs the embedded default (FSPO, tiny warm-started Qwen3, built-in arithmetic
task, CPU, MLflow SQLite store ./mlflow.db). Hydra multirun works as usual (`-m`, sweeps/).
`method=grpo` and `+method=grpo` (any config group) both work (fspo/cli.py); `fspo-train` is this script.
A bad setting or input ends with one line naming the problem (exit code 2), not a traceback;
set HYDRA_FULL_ERROR=1 to see the traceback.
"""
from __future__ import annotations

import os
import sys

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, open_dict  # noqa: E402

from fspo.cli import early_error, normalize_group_overrides  # noqa: E402  (also the help template's resolver)
from fspo.runtime.checks.errors import user_error  # noqa: E402
from fspo.runtime.launch.run_folder import protect_run_folder  # noqa: E402


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig):
    if cfg.output_dir is None:
        hydra_cfg = HydraConfig.get()
        given_dir = any(o.startswith("hydra.run.dir=") for o in hydra_cfg.overrides.hydra)
        # a new timestamped folder holds nothing to continue
        if str(cfg.get("resume")) == "auto" and not given_dir and hydra_cfg.mode.name == "RUN":
            from fspo.runtime.checkpoints.continue_command import fresh_folder_resume_error

            print(f"error: {fresh_folder_resume_error(hydra_cfg.runtime.output_dir)}", file=sys.stderr)
            sys.exit(2)
        with open_dict(cfg):
            cfg.output_dir = hydra_cfg.runtime.output_dir
    from fspo.train import train

    try:
        final = train(cfg, overrides=list(HydraConfig.get().overrides.task))
    except Exception as e:  # noqa: BLE001 - user errors become one clear line
        msg = user_error(e)
        if msg is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)
    return final.get("val/accuracy")


if __name__ == "__main__":
    # a typo never runs the default; a value out of range is refused before torch loads
    if (bad := early_error(sys.argv[1:], "config")) is not None:
        print(f"error: {bad}", file=sys.stderr)
        sys.exit(2)
    sys.argv[1:] = normalize_group_overrides(sys.argv[1:], "config")  # group=x and +group=x both work
    sys.argv[1:] = protect_run_folder(sys.argv[1:])  # a dry run writes nothing; a run's own .hydra/ is kept
    main()
