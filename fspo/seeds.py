"""Every random stream of a run, seeded from the run's ``seed`` in one place: each seed is a fixed integer
function of the run seed and the counters that select the stream, kept as it is so a run seed reproduces the
same samples across versions. Step seeds are ``seed * STEP + step``: two run seeds meet only after ``STEP``
steps. Lightning's ``seed_everything`` (fspo/train.py) seeds the global RNGs.
"""
from __future__ import annotations

STEP = 1_000_003  # the run seed's stride (a prime): step seeds of different run seeds never meet below it
VAL = 999_999_937  # validation's offset from the step seeds (a prime beyond any step count)
RANK = 7919  # a data-parallel rank's offset
ROUND = 15_485_863  # a dynamic-sampling round's offset
REPLICA = 1_000_003  # an engine replica's offset (a call with more samples than this overlaps the next replica)
SPLITS = {"train": 0, "val": 1_000_003, "test": 2_000_003}


def step_seed(seed: int, step: int, rank: int = 0) -> int:
    """Step ``step``'s sampling (also its mini-batch order and the probe's directions) on data-parallel rank
    ``rank``: ``seed * STEP + step + RANK * rank``."""
    return int(seed) * STEP + int(step) + RANK * int(rank)


def val_seed(seed: int, batch: int, rank: int = 0) -> int:
    """Validation batch ``batch`` (the same at every validation): ``step_seed(seed, VAL + batch, rank)``."""
    return step_seed(seed, VAL + int(batch), rank)


def round_seed(step_seed: int, j: int) -> int:
    """Round ``j`` (0: the step's own) of dynamic sampling: ``step_seed + ROUND * j``."""
    return int(step_seed) + ROUND * int(j)


def request_seed(seed: int, prompt: int, n: int, replica: int = 0) -> int:
    """Prompt ``prompt``'s request (``n`` samples; sample i gets this + i) on engine replica ``replica``:
    ``seed + prompt * n + REPLICA * replica``."""
    return int(seed) + int(prompt) * int(n) + REPLICA * int(replica)


def split_seed(seed: int, split: str) -> int:
    """The seed of a generated data set's ``split`` (train, val or test): ``seed + SPLITS[split]``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    return int(seed) + SPLITS[split]
