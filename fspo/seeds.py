"""Every random stream of a run, seeded from the run's ``seed`` in one place.

Owns: the seed of each stream a run draws, named by its purpose and the counters that select it:

- `step_seed(seed, step, rank)`: training step ``step``'s sampling on data-parallel rank ``rank``, also the
  update's mini-batch order and the direction probe's random directions (``rank`` 0);
- `val_seed(seed, batch, rank)`: validation batch ``batch`` (the same at every validation, so successive
  validations differ only by the policy);
- `round_seed(step_seed, j)`: round ``j`` of dynamic sampling within a step;
- `request_seed(seed, prompt, n, replica)`: prompt ``prompt``'s request on engine replica ``replica`` (the engine
  gives sample ``i`` of it that + ``i``);
- `split_seed(seed, split)`: a generated data set's train / val / test split.

Contract: each is a fixed integer function of its arguments, kept as it is so that a run seed reproduces the same
samples (and the same numbers) across versions. A step seed is ``seed * STEP + step``: two run seeds meet only
after ``STEP`` steps. Leaves out: seeding the global RNGs (Lightning's ``seed_everything``, fspo/train.py).
"""
from __future__ import annotations

STEP = 1_000_003  # the run seed's stride (a prime): step seeds of different run seeds never meet below it
VAL = 999_999_937  # validation's offset from the step seeds (a prime beyond any step count)
RANK = 7919  # a data-parallel rank's offset
ROUND = 15_485_863  # a dynamic-sampling round's offset
REPLICA = 1_000_003  # an engine replica's offset (a call with more samples than this overlaps the next replica)
SPLITS = {"train": 0, "val": 1_000_003, "test": 2_000_003}


def step_seed(seed: int, step: int, rank: int = 0) -> int:
    """Step ``step``'s seed on data-parallel rank ``rank``: ``seed * STEP + step + RANK * rank``."""
    return int(seed) * STEP + int(step) + RANK * int(rank)


def val_seed(seed: int, batch: int, rank: int = 0) -> int:
    """Validation batch ``batch``'s seed on rank ``rank``: ``step_seed(seed, VAL + batch, rank)``."""
    return step_seed(seed, VAL + int(batch), rank)


def round_seed(step_seed: int, j: int) -> int:
    """Round ``j`` (0: the step's own) of dynamic sampling: ``step_seed + ROUND * j``."""
    return int(step_seed) + ROUND * int(j)


def request_seed(seed: int, prompt: int, n: int, replica: int = 0) -> int:
    """The request of prompt ``prompt`` (``n`` samples each) on engine replica ``replica``:
    ``seed + prompt * n + REPLICA * replica``, so no two samples of one call, nor of two replicas, share one."""
    return int(seed) + int(prompt) * int(n) + REPLICA * int(replica)


def split_seed(seed: int, split: str) -> int:
    """The seed of a generated data set's ``split`` (train, val or test): ``seed + SPLITS[split]``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    return int(seed) + SPLITS[split]
