"""The length-law probe (`+probe=law`, conf/probe/law.yaml) end to end: a real 2-step run with the
random-direction gate (fspo/update/direction_probe.py), its records and its run/law/* metrics in MLflow."""
from __future__ import annotations

import mlflow
import numpy as np
import pytest
import torch

from conftest import SMALL
from fspo.diagnostics.ledger import read_csv


def _train(compose_cfg, extra, tmp_path, name):
    from fspo.train import train

    cfg = compose_cfg([*SMALL, "steps=2", "seed=11", *extra])
    cfg.output_dir = str(tmp_path / name)
    cfg.logger.experiment_name = f"probe-{name}"
    train(cfg)
    return tmp_path / name


def _final_weights(out):
    ckpt = sorted((out / "checkpoints").glob("step_*.ckpt"))[-1]
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("policy.")}


@pytest.mark.slow
def test_probe_gate_records_and_restores_the_weights_exactly(compose_cfg, mlflow_uri, tmp_path):
    probed = _train(compose_cfg, ["+probe=law", "steps=2", "diagnostics.law.min_count=2"], tmp_path, "probe")
    plain = _train(compose_cfg, ["checkpoint.every_n_steps=0"], tmp_path, "plain")
    # the gate moves the weights and puts them back exactly: training is unchanged
    a, b = _final_weights(probed), _final_weights(plain)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rec = read_csv(probed / "diagnostics" / "sequences.csv")
    gate, real = rec["update"] == -1, rec["update"] >= 1
    assert gate.sum() == 2 * 16 and real.sum() == 2 * 8  # SMALL: every rollout row (4 x 4); 1 of 2 mini-batches
    assert np.abs(rec["s"][gate]).max() > 0 and np.all(rec["d2"] >= 0)
    client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
    run = client.search_runs([client.get_experiment_by_name("probe-probe").experiment_id])[0]
    m = run.data.metrics
    for key in ("run/law.gate.std_exponent", "zz counts/run.law.n_seq", "run/law.bands.fspo.p_homogeneity",
                "run/law.var_inflation"):
        assert key in m, sorted(k for k in m if "law" in k)
    assert "diagnostics" in [x.path for x in client.list_artifacts(run.info.run_id)]
    assert run.data.tags["probe"] == "law"
