"""Turning user errors into one clear line (bad input or storage); None for a real bug, which keeps its traceback."""
from __future__ import annotations

from typing import Optional

USER_ERRORS = (ValueError, FileNotFoundError, ImportError)


def user_error(exc: BaseException) -> Optional[str]:
    """A one-line message for a user-caused exception, else None."""
    from hydra.errors import InstantiationException
    from omegaconf.errors import OmegaConfBaseException

    from fspo.runtime.checks.store_check import storage_error

    storage = storage_error(exc)
    if storage is not None:
        return storage
    cause = exc
    while isinstance(cause, InstantiationException) and cause.__cause__ is not None:
        cause = cause.__cause__
    if isinstance(exc, InstantiationException):
        return f"{str(exc).splitlines()[0]} {type(cause).__name__}: {cause}"
    if isinstance(cause, OmegaConfBaseException):
        return f"config error: {cause}"
    if isinstance(cause, USER_ERRORS):
        return f"{type(cause).__name__}: {cause}"
    return None
