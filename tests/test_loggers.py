"""Loggers other than MLflow, alone and several at once (conf/logger/, conf/extra_loggers/,
fspo/tracking/logger.py `build_logger`, fspo/tracking/sinks.py, fspo/tracking/artifacts.py).

Owns: the composed configs of ``logger=csv|tensorboard|wandb`` and ``+extra_loggers=[...]``; the
arguments each logger gets (save_dir defaults to the output folder, tags only for MLflow / W&B);
the bad-input errors; and real tiny training runs (conftest's SMALL, in-process, CPU) that read back
what each logger wrote: CSV's metrics.csv and PNG figures, TensorBoard's event file (scalars, images,
the config text), MLflow and CSV together, W&B offline (its run folder). No mocks.
"""
from __future__ import annotations

import csv
import json

import pytest
from omegaconf import open_dict

from conftest import SMALL, compose_config
from fspo.runtime.checkpoints.resume import ResumePlan
from fspo.tracking.logger import build_logger, mlflow_logger

FIGURES = ("clip_fraction_by_length", "logratio_std_vs_len", "logratio_qq")
TAGS = {"method": "fspo", "seed": "42"}


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# -- composition and construction (fast) --------------------------------------------------------
def test_logger_choices_compose_and_build(tmp_path, mlflow_uri):
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger

    cfg = compose_config(["logger=csv", "+extra_loggers=[tensorboard]"], output_dir=tmp_path)
    loggers = build_logger(cfg, TAGS, tmp_path, ResumePlan())
    assert [type(lg) for lg in loggers] == [CSVLogger, TensorBoardLogger]
    assert loggers[0].log_dir == str(tmp_path / "csv" / "version_0")  # save_dir null -> output_dir
    assert loggers[1].log_dir == str(tmp_path / "tensorboard" / "version_0")
    assert mlflow_logger(loggers) is None

    cfg = compose_config(["+extra_loggers=[csv,tensorboard]"], output_dir=tmp_path, tracking_uri=mlflow_uri)
    assert list(cfg.extra_loggers) == ["csv", "tensorboard"] and cfg.logger.experiment_name == "fspo"
    loggers = build_logger(cfg, TAGS, tmp_path, ResumePlan())
    assert [type(lg) for lg in loggers] == [MLFlowLogger, CSVLogger, TensorBoardLogger]
    assert mlflow_logger(loggers) is loggers[0] and loggers[0]._run_name.startswith("fspo-")  # tracking/naming.py


def test_normalized_command_line_form():
    from fspo.cli import normalize_group_overrides

    assert normalize_group_overrides(["extra_loggers=[csv,tensorboard]", "logger=csv"]) == \
        ["+extra_loggers=[csv,tensorboard]", "logger=csv"]


def test_wandb_gets_tags_as_strings_and_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb not installed (pip install wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose_config(["logger=wandb", "logger.offline=true", "run_name=r1"], output_dir=tmp_path)
    [lg] = build_logger(cfg, TAGS, tmp_path, ResumePlan())
    assert lg._wandb_init["tags"] == ["method=fspo", "seed=42"] and lg._wandb_init["name"] == "r1"
    assert lg._wandb_init["project"] == "fspo" and lg._offline is True
    assert lg.save_dir == str(tmp_path)


def test_bad_logger_settings_fail_with_the_fix(tmp_path):
    cfg = compose_config(["+extra_loggers=[mlflow]"], output_dir=tmp_path, tracking_uri=f"sqlite:///{tmp_path}/m.db")
    with pytest.raises(ValueError, match="more than one MLflow logger.*drop mlflow from \\+extra_loggers"):
        build_logger(cfg, TAGS, tmp_path, ResumePlan())
    cfg = compose_config([], output_dir=tmp_path)
    with open_dict(cfg):
        cfg.extra_loggers = ["csv"]  # a list of names, not the group's composed configs
    with pytest.raises(ValueError, match=r"extra_loggers must name configs .*\+extra_loggers=\[csv,tensorboard\]"):
        build_logger(cfg, TAGS, tmp_path, ResumePlan())


def test_sinks_write_where_each_logger_keeps_files(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from lightning.pytorch.loggers import CSVLogger

    from fspo.runtime.launch.rank_zero import RankZeroStub
    from fspo.tracking import sinks

    fig = plt.figure()
    plt.plot([0, 1], [1, 0])
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text("steps: 2\n")
    lg = CSVLogger(str(tmp_path / "save"), name="csv")
    sinks.log_figure(lg, "plots/a.png", fig, 3)
    sinks.log_file(lg, cfg_file, 3)
    sinks.finish(lg)
    d = tmp_path / "save" / "csv" / "version_0"
    assert (d / "plots" / "a.png").read_bytes()[:4] == b"\x89PNG" and (d / "config.yaml").read_text() == "steps: 2\n"
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    stub = RankZeroStub()  # ranks other than 0: nothing is written
    sinks.log_figure(stub, "plots/b.png", fig, 3)
    sinks.log_file(stub, cfg_file, 3)
    sinks.finish(stub)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    plt.close(fig)


# -- real tiny runs --------------------------------------------------------------------------------
def _train(overrides, out, tracking_uri=None):
    from fspo.train import train

    cfg = compose_config([*SMALL, *overrides], output_dir=out, tracking_uri=tracking_uri,
                         artifact_location=out / "mlartifacts" if tracking_uri else None)
    return train(cfg)


def _check_csv(log_dir, steps=2):
    rows = _rows(log_dir / "metrics.csv")
    cols = set(rows[0])
    assert {"train/loss", "val/accuracy", "run/logratio.sigma_hat", "step"} <= cols
    train_steps = sorted(int(r["step"]) for r in rows if r["train/loss"] != "")
    val_steps = sorted(int(r["step"]) for r in rows if r["val/accuracy"] != "")
    assert train_steps == list(range(steps)) and val_steps == [0, steps]  # val before training and at the end
    assert [int(r["step"]) for r in rows if r["run/logratio.sigma_hat"] != ""] == [steps]
    for name in FIGURES:
        png = log_dir / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "steps: 2" in (log_dir / "config.yaml").read_text().splitlines()
    return rows


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_csv_run(tmp_path):
    out = tmp_path / "out"
    final = _train(["logger=csv"], out)
    rows = _check_csv(out / "csv" / "version_0")
    last_val = [r for r in rows if r["val/accuracy"] != ""][-1]
    assert float(last_val["val/accuracy"]) == pytest.approx(final["val/accuracy"])
    assert not (out / "mlflow_run_id").exists()  # no MLflow logger, no run id file


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_tensorboard_run(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    _train(["logger=tensorboard"], out)
    ea = EventAccumulator(str(out / "tensorboard" / "version_0"), size_guidance={"images": 0, "scalars": 0})
    ea.Reload()
    tags = ea.Tags()
    assert {"train/loss", "val/accuracy", "run/logratio.sigma_hat"} <= set(tags["scalars"])
    assert [e.step for e in ea.Scalars("train/loss")] == [0, 1]
    assert [e.step for e in ea.Scalars("val/accuracy")] == [0, 2]
    assert {f"plots/{n}" for n in FIGURES} <= set(tags["images"])
    img = ea.Images("plots/clip_fraction_by_length")[0]
    assert img.step == 2 and img.encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(t.startswith("config.yaml") for t in tags["tensors"])  # add_text is stored as a tensor summary


@pytest.mark.slow
def test_mlflow_and_csv_at_once(tmp_path):
    from mlflow.tracking import MlflowClient

    out, uri = tmp_path / "out", f"sqlite:///{tmp_path / 'mlflow.db'}"
    _train(["+extra_loggers=[csv]"], out, tracking_uri=uri)
    rows = _check_csv(out / "csv" / "version_0")
    client = MlflowClient(uri)
    run_id = (out / "mlflow_run_id").read_text().strip()
    hist = client.get_metric_history(run_id, "train/loss")
    assert [m.step for m in hist] == [0, 1]
    csv_loss = [float(r["train/loss"]) for r in rows if r["train/loss"] != ""]
    assert [m.value for m in hist] == pytest.approx(csv_loss)  # the same values in both
    assert "run/logratio.sigma_hat" in client.get_run(run_id).data.metrics
    arts = {a.path for a in client.list_artifacts(run_id, "plots")} | {a.path for a in client.list_artifacts(run_id)}
    assert {f"plots/{n}.png" for n in FIGURES} | {"config.yaml"} <= arts


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_wandb_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb not installed (pip install wandb)")
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "out"
    try:
        _train(["logger=wandb", "logger.offline=true", "run_name=tiny"], out)
    finally:
        wandb.finish()
        wandb.teardown()  # stops the wandb-core service, which writes the run file's last records when it exits
    [run_dir] = list((out / "wandb").glob("offline-run-*"))
    hist = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in _wandb_records(next(run_dir.glob("run-*.wandb"))) if r.WhichOneof("record_type") == "history"]
    at = lambda key: [h["trainer/global_step"] for h in hist if key in h]  # noqa: E731
    assert at("train/loss") == [0, 1] and at("val/accuracy") == [0, 2] and at("run/logratio.sigma_hat") == [2]
    for name in FIGURES:
        assert at(f"plots/{name}/_type") == [2]
        [png] = (run_dir / "files" / "media" / "images" / "plots").glob(f"{name}_*.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "steps: 2" in (run_dir / "files" / "fspo" / "config.yaml").read_text().splitlines()


def _wandb_records(path):
    """The protobuf records of an offline W&B run file (``run-<id>.wandb``): a 7-byte header (``:W&B``, magic,
    version), then LevelDB-log records (crc32 u32, length u16, type u8; FULL 1 / FIRST 2 / MIDDLE 3 / LAST 4)
    in 32 KiB blocks. wandb 0.31's Python package has no reader of its own (its Go core writes the file)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:  # zero padding up to the end of the block
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out
