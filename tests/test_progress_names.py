"""The console's progress line names quantities as MLflow does and shows the step's own validation.

Owns: `StepLines` waits for the validation that follows a step (the last step's line shows the final
held-out accuracy, the one the end block prints), logs at once when none follows, never loses a line (a stop);
the console's name for ``clip/seq_frac`` is the Headline chart's ("binding clip"). Leaves out: the line's
format by hand (test_console.py).
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

from fspo.diagnostics.metric_keys import HEADLINE_KEYS
from fspo.tracking.progress import FIELDS, StepLines


def _trainer(**metrics):
    return SimpleNamespace(callback_metrics=dict(metrics), limit_val_batches=1.0, global_step=0)


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]


def test_the_last_line_shows_the_final_validation(caplog):
    bar, module = StepLines(total=10, every_n_steps=5), SimpleNamespace(rl_step=0)
    trainer = _trainer(**{"val/accuracy": 0.459})
    with caplog.at_level(logging.INFO, logger="fspo.tracking.progress"):
        bar.on_train_start(trainer, module)
        module.rl_step = 5
        bar.on_train_batch_end(trainer, module, None, None, 4)
        bar.on_train_batch_start(trainer, module, None, 5)  # no validation after step 5: logged now
        module.rl_step = 10
        bar.on_train_batch_end(trainer, module, None, None, 9)
        assert len(_lines(caplog)) == 1  # step 10 waits for its validation
        trainer.callback_metrics["val/accuracy"] = 0.607
        bar.on_validation_end(trainer, module)
    lines = _lines(caplog)
    assert len(lines) == 2 and "val acc 0.459" in lines[0] and lines[1].startswith("step 10/10")
    assert "val acc 0.607" in lines[1]


def test_a_pending_line_is_never_lost(caplog):
    bar, module = StepLines(total=10, every_n_steps=5), SimpleNamespace(rl_step=0)
    trainer = _trainer()
    with caplog.at_level(logging.INFO, logger="fspo.tracking.progress"):
        bar.on_train_start(trainer, module)
        module.rl_step = 5
        bar.on_train_batch_end(trainer, module, None, None, 4)
        bar.on_exception(trainer, module, KeyboardInterrupt())
    assert [x.split(" |")[0] for x in _lines(caplog)] == ["step 5/10"]


def test_one_name_for_the_binding_clip_fraction():
    console = {key: name for key, name, _ in FIELDS}
    assert console["clip/seq_frac"] == "binding clip"
    assert HEADLINE_KEYS["clip/seq_frac"].endswith("binding clip fraction")
