"""Console hygiene: each line once, third-party noise filtered at its source, warnings that matter kept.

Every filter names one logger or one warning by its message (no blanket ``simplefilter("ignore")``):
Lightning's extra ``INFO:`` stderr handler (its records also reach the root logger, so under Hydra each line
printed twice), its LitLogger tip, torch's FutureWarning on Lightning's ``LeafSpec()`` call, MLflow's
schema-creation lines and its logged traceback of a full or read-only store (raised on, reported once), and
the transformers / MLflow download bars when stderr is not a terminal.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import warnings

LITLOGGER_TIP = "💡 Tip: For seamless cloud logging"
_RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"  # where rank_zero_info records are created
_MLFLOW_SCHEMA_LOGGER = "mlflow.store.db.utils"


class _DropMessages(logging.Filter):
    """Drops records whose message starts with one of ``prefixes``."""

    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


class _DropStorageErrors(logging.Filter):
    """Drops a logged copy of a storage error (the exception itself is raised on and reported once)."""

    prefixes = ("<storage errors>",)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return True
        from fspo.runtime.checks.store_check import storage_error

        return storage_error(exc) is None


def _add_once(logger: logging.Logger, flt: logging.Filter) -> None:
    if not any(type(f) is type(flt) and getattr(f, "prefixes", None) == getattr(flt, "prefixes", None)
               for f in logger.filters):
        logger.addFilter(flt)


def quiet_artifact_downloads() -> None:
    """No MLflow artifact-download progress bars unless stderr is a terminal (an explicit env setting wins)."""
    if not sys.stderr.isatty():
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def quiet_mlflow() -> None:
    """MLflow's schema-creation INFO lines and download bars; also called before a sweep's parent run opens."""
    _add_once(logging.getLogger(_MLFLOW_SCHEMA_LOGGER),
              _DropMessages("Creating initial MLflow database tables", "Updating database tables"))
    _add_once(logging.getLogger(_MLFLOW_SCHEMA_LOGGER), _DropStorageErrors())  # its traceback of a full store
    quiet_artifact_downloads()


def quiet_third_party() -> None:
    """Apply every filter of the module docstring; idempotent (a sweep calls it once per job)."""
    import lightning  # noqa: F401 - importing it is what adds the handler removed below

    lightning_logger = logging.getLogger("lightning")
    if logging.getLogger().handlers:  # Hydra (or the caller) configured the root: it prints Lightning's records
        for handler in list(lightning_logger.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                lightning_logger.removeHandler(handler)
    _add_once(logging.getLogger(_RANK_ZERO_LOGGER), _DropMessages(LITLOGGER_TIP))
    warnings.filterwarnings("ignore", message=re.escape("`isinstance(treespec, LeafSpec)` is deprecated"),
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
    quiet_mlflow()
    if not sys.stderr.isatty():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
