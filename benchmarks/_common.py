"""What the benchmark scripts of benchmarks/ share: one home for each piece, imported as ``from _common import ...``.

Python puts a script's own folder first on ``sys.path``, so ``python benchmarks/<name>.py`` (from any
working directory, also under torchrun) finds this module without touching ``sys.path``; pytest finds it
through ``pythonpath = ["benchmarks"]`` in pyproject.toml. The ``fspo`` package itself comes from the
install (``pip install -e '.[dev]'``).

Owns:
- the random model shapes the benchmarks build (`MODELS`, `ENGINE_MODELS`, `QWEN3_100M_V32K`);
- `compose`: conf/config.yaml with overrides, as experiments/run.py composes it;
- `synthetic_rollout`: the fixed 16-sequence rollout of the memory and bf16 benchmarks;
- timing: `timed` (warm-up, then repeats), `median_after_warmup`;
- memory: `rss_mib` (current RSS / high-water mark from /proc), `maxrss_mib`, `reset_peak_rss`;
- processes: `torchrun` (the launcher command), `emit_row` / `child_row` (one JSON row from a child);
- MLflow read-back: `latest_run`, `metric_history`, and the phase names `PHASES` of the ``time/*`` metrics;
- `write_json` (the ``--out`` file of every script).
Leaves out: what each benchmark measures and prints (the scripts).
"""
from __future__ import annotations

import ctypes
import gc
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

#: the per-phase ``time/<phase>`` metrics a training run logs each step (fspo/rollout/callback.py, RLModule)
PHASES = ("generate", "weight_sync", "reward", "old_log_probs", "train", "metrics")

#: Qwen3 config overrides on top of fspo.models.tiny.tiny_qwen3_config, by the name the scripts' --models take.
#: qwen3_100m here: 16 layers on the tiny 100-token vocabulary (bench_memory.py, bench_bf16.py)
MODELS: Dict[str, Dict[str, Any]] = {
    "tiny": {},
    "qwen3_100m": dict(hidden_size=768, num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=4,
                       head_dim=64, intermediate_size=2048),
    "tiny_v152k": dict(vocab_size=151936),  # Qwen3's real vocabulary: the LM-head / log-prob memory
}
#: conf/model/qwen3_100m.yaml's shape (12 layers, 32k vocabulary), as the engine benchmarks build it
QWEN3_100M_V32K: Dict[str, Any] = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12,
                                       num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                                       intermediate_size=2048, max_position_embeddings=1024)
#: bench_engines.py and bench_lora_sync.py
ENGINE_MODELS: Dict[str, Dict[str, Any]] = {"tiny": {}, "qwen3_100m": QWEN3_100M_V32K}


# -- config and data ----------------------------------------------------------------------------
def compose(overrides: Sequence[str]):
    """The Hydra config of conf/config.yaml with ``overrides`` (as experiments/run.py composes it)."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    import fspo  # noqa: F401  (stores the config schemas that conf/ extends)

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hcompose("config", overrides=list(overrides))


def synthetic_rollout(b: int = 16, p: int = 32, t: int = 96, seed: int = 0):
    """A validated `RolloutBatch` of ``b`` sequences (groups of 4): random prompt ids (``p`` tokens) and
    responses of random length in [t/4, t], random advantages, old log-probs -4.6 per token."""
    import torch

    from fspo.types import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    return RolloutBatch(prompt_ids=torch.randint(4, 100, (b, p), generator=g),
                        prompt_mask=torch.ones(b, p, dtype=torch.long),
                        response_ids=torch.randint(4, 100, (b, t), generator=g) * mask, response_mask=mask,
                        group_ids=torch.arange(b) // 4, advantages=torch.randn(b, generator=g), rewards=torch.zeros(b),
                        overlong=lengths == t, old_log_probs=-4.6 * mask.float()).validate()


# -- timing -------------------------------------------------------------------------------------
def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1,
          before: Optional[Callable[[], None]] = None) -> Tuple[Any, List[float]]:
    """Call ``fn`` ``warmup`` times, then ``repeats`` times timed (``before``, if given, runs untimed ahead of
    every call); returns (the last call's result, the ``repeats`` wall-clock seconds)."""
    out, secs = None, []
    for i in range(warmup + repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        out = fn()
        if i >= warmup:
            secs.append(time.perf_counter() - t0)
    return out, secs


def median_after_warmup(xs: Sequence[float]) -> float:
    """Median of ``xs`` without its first value (the warm-up step, which pays one-off costs); NaN if none."""
    xs = list(xs)[1:]
    return statistics.median(xs) if xs else float("nan")


# -- memory -------------------------------------------------------------------------------------
def rss_mib(field: str = "VmRSS") -> float:
    """``field`` of /proc/self/status in MiB (VmRSS: current RSS, VmHWM: its high-water mark); where that
    file does not exist, the ``ru_maxrss`` high-water mark."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return maxrss_mib()


def maxrss_mib() -> float:
    """The process's peak RSS since it started (``ru_maxrss``; Linux reports KiB), MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def reset_peak_rss(trim: bool = False) -> bool:
    """Reset the RSS high-water mark (VmHWM) to the current RSS (Linux >= 4.0, ``/proc/self/clear_refs``), so
    setup temporaries do not hide the measured peak; with ``trim``, first collect garbage and return freed heap
    to the OS (``malloc_trim``). False where unsupported."""
    try:
        if trim:
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# -- processes ----------------------------------------------------------------------------------
def torchrun(nproc: int) -> List[str]:
    """The command prefix that runs a script on ``nproc`` local processes (torchrun, one node)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


ROW = "BENCH_ROW "


def emit_row(row: Dict) -> None:
    """Print ``row`` as the one result line a child process hands its parent (`child_row` reads it)."""
    print(ROW + json.dumps(row), flush=True)


def child_row(cmd: Sequence[str], **kw) -> Tuple[Optional[Dict], subprocess.CompletedProcess]:
    """Run ``cmd`` (keyword arguments go to subprocess.run); (the row it emitted or None when it failed or
    emitted none, the completed process)."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, **kw)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(ROW)]
    row = json.loads(lines[-1][len(ROW):]) if lines and proc.returncode == 0 else None
    return row, proc


# -- MLflow read-back and output ----------------------------------------------------------------
def latest_run(client, experiment: str, run_name: Optional[str] = None):
    """The most recently started run of ``experiment`` (named ``run_name`` when given)."""
    filt = f"attributes.run_name = '{run_name}'" if run_name else ""
    return client.search_runs([client.get_experiment_by_name(experiment).experiment_id], filter_string=filt,
                              order_by=["attributes.start_time DESC"], max_results=1)[0]


def metric_history(client, run_id: str, key: str) -> List[float]:
    """The values of metric ``key`` of run ``run_id``, in step order."""
    return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def write_json(path, obj, indent: int = 1, **kw) -> Path:
    """Write ``obj`` as JSON to ``path`` (parent folders made), print ``wrote <path>``; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(obj, indent=indent, **kw))
    print(f"wrote {out}")
    return out
