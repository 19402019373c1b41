"""The private Lightning attributes fspo/ relies on, where Lightning has no public hook, exist on the installed
Lightning, and the installed Lightning is inside pyproject's pin: a Lightning release that renames one fails
here (raise the pin's upper bound only after this file passes on it).

Each entry names the file that uses the attribute; an entry whose file no longer uses it fails too, so the list
stays the list of what the code touches."""
import re
from pathlib import Path

import lightning
import pytest
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import MLFlowLogger
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]

# (file that uses it, the text it uses, why no public hook serves)
USES = [
    ("fspo/runtime/checkpoints/stop_signal.py", "._batches_that_stepped",
     "rewinding an abandoned step's loop counters: the counter has no setter"),
    ("fspo/runtime/checkpoints/stop_signal.py", '"_signal_connector"',
     "setting received_sigterm from fspo's own SIGTERM handler: Trainer.received_sigterm is read-only"),
    ("fspo/runtime/checkpoints/checkpointing.py", "._should_check_val_fx(",
     "whether Lightning validates after this batch: its own rule, not exposed"),
    ("fspo/runtime/checkpoints/checkpointing.py", "._data_fetcher", "the argument of _should_check_val_fx"),
    ("fspo/runtime/checkpoints/files.py", '"_batches_that_stepped"', "the RL step of a checkpoint without rl_step"),
    ("fspo/runtime/checkpoints/files.py", "_METADATA_FILENAME", "the non-tensor file of a sharded checkpoint"),
    ("fspo/tracking/outage_buffer.py", "._mlflow_client",
     "buffering the MLflow logger's writes: MLFlowLogger takes no client"),
    ("fspo/tracking/outage_buffer.py", '"_tracking_uri"', "the logger's tracking URI: no public property"),
    ("fspo/tracking/logger.py", "._experiment_name", "the experiment's name before the run exists"),
    ("fspo/train.py", '"_run_name"', "the run name to print before the run exists"),
]


def test_the_installed_lightning_is_inside_the_pin():
    text = (ROOT / "pyproject.toml").read_text()
    spec = re.search(r'"lightning([<>=!~][^"]*)"', text).group(1)
    assert "<" in spec, f"pyproject pins lightning{spec} without an upper bound: the private attributes below need one"
    assert lightning.__version__ in SpecifierSet(spec), (
        f"lightning {lightning.__version__} is outside pyproject's pin {spec}")


@pytest.mark.parametrize("path,text,why", USES, ids=[p.rsplit("/", 1)[1] + ":" + t.strip('.("') for p, t, _ in USES])
def test_the_code_still_uses_what_this_file_lists(path, text, why):
    assert text in (ROOT / path).read_text(), f"{path} no longer uses {text}: drop its entry from USES"


def test_each_private_attribute_exists_on_the_installed_lightning(tmp_path):
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path)
    epoch_loop = trainer.fit_loop.epoch_loop
    assert isinstance(epoch_loop._batches_that_stepped, int)
    # the key files.py reads from a checkpoint's loops["fit_loop"]
    assert "_batches_that_stepped" in trainer.fit_loop.state_dict()["epoch_loop.state_dict"]
    assert callable(epoch_loop._should_check_val_fx) and hasattr(trainer.fit_loop, "_data_fetcher")
    assert trainer._signal_connector.received_sigterm is False
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    assert _METADATA_FILENAME == "meta.pt"
    assert LightningModule().device_mesh is None  # public: fspo/runtime/launch/distributed.py
    from fspo.runtime.launch.distributed import attached_trainer

    assert attached_trainer(LightningModule()) is None and attached_trainer(object()) is None  # .trainer raises
    logger = MLFlowLogger(experiment_name="e", run_name="r", tracking_uri=f"sqlite:///{tmp_path / 'm.db'}")
    assert (logger._tracking_uri, logger._experiment_name, logger._run_name) == (
        f"sqlite:///{tmp_path / 'm.db'}", "e", "r")
    assert hasattr(logger, "_experiment_id") and hasattr(logger, "_mlflow_client")
    import inspect

    assert "return self._mlflow_client" in inspect.getsource(MLFlowLogger.experiment.fget)  # a swap takes effect
