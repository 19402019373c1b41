"""Sum states are exact under distribution: 2 gloo processes, each with part of the data, give
the same compute() as one process on the concatenation.

The reservoir (Q-Q statistics) is sampled, not exact: with per-rank reservoirs larger than each
rank's data, the concatenated reservoirs hold every sequence and the Q-Q numbers match exactly; with
small reservoirs they are compared loosely and their synced size is world_size * reservoir_size.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port, once_per_session
from fspo.clipping.base import ClipResult
from fspo.diagnostics import FairnessMetrics, LengthBins

BINS = LengthBins(edges=[0, 8, 16, 32, 48])
SPLIT = 230  # rank 0 gets rows [0, 230), rank 1 the other 370 (uneven on purpose)


def _data(n=600, T=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = torch.randint(0, T + 1, (n,), generator=g)
    mask = (torch.arange(T)[None] < L[:, None]).long()
    up, lo, du, cap = (mask.bool() & (torch.rand(n, T, generator=g) < p) for p in (0.15, 0.1, 0.03, 0.02))
    in_band = mask.bool() & (torch.rand(n, 1, generator=g) < 0.6)  # per sequence, broadcast
    s = torch.randn(n, generator=g) * 0.05 * L.float().sqrt()
    adv = torch.randn(n, generator=g)
    overlong = L == T
    on_policy = torch.arange(n) % 4 == 0  # a quarter of the rows come in on-policy batches
    return L, mask, up, lo, du, cap, in_band, s, adv, overlong, on_policy


def _feed(fm, rows, micro=50):
    L, mask, up, lo, du, cap, ib, s, adv, overlong, onp = (x[rows] for x in _data())
    for sl in torch.arange(len(rows)).split(micro):
        for pol in (True, False):
            k = sl[onp[sl] == pol]
            res = ClipResult(torch.zeros(1), s[k], up[k], lo[k], du[k], ib[k], cap[k])
            fm.update_clip(res, L[k], mask[k], adv[k], log_ratio=not pol)
        fm.update_rollout(L[sl], overlong[sl])


def _snapshot(fm):
    return {"metrics": fm.compute(), "clip_bins": fm.clip.last_per_bin, "lr_bins": fm.log_ratio.last_per_bin}


def _worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rows = torch.arange(0, SPLIT) if rank == 0 else torch.arange(SPLIT, 600)
        big, small = FairnessMetrics(BINS, reservoir_size=512), FairnessMetrics(BINS, reservoir_size=64)
        _feed(big, rows)
        _feed(small, rows, micro=97)
        snap = {"big": _snapshot(big), "small": _snapshot(small)}
        snap["local_reservoir_shape"] = tuple(big.log_ratio.res_s.shape)  # unsynced again after compute
        torch.save(snap, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    out = once_per_session(tmp_path_factory, "diag_distributed",  # once also when xdist splits this module
                           lambda d: mp.spawn(_worker, args=(2, free_port(), str(d)), nprocs=2, join=True))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.distributed
def test_synced_compute_equals_single_process(synced):
    ref = FairnessMetrics(BINS, reservoir_size=1024)  # holds all 600 sequences
    _feed(ref, torch.arange(600), micro=600)
    want = _snapshot(ref)
    for r in range(2):
        got = synced[r]["big"]
        assert set(got["metrics"]) == set(want["metrics"])
        # sum states: exact up to float64 summation order; reservoir holds everything -> exact Q-Q too
        assert got["metrics"] == pytest.approx(want["metrics"], rel=1e-12, abs=1e-15)
        for key in ("clip_bins", "lr_bins"):
            for name, arr in want[key].items():
                torch.testing.assert_close(torch.as_tensor(got[key][name]), torch.as_tensor(arr),
                                           rtol=1e-12, atol=1e-15, equal_nan=True)
        assert synced[r]["local_reservoir_shape"] == (512,)
    m = want["metrics"]
    assert 0 < m["band/n_seq"] < m["rollout/n_responses"] and m["clip/seq_frac_cap"] > 0
    assert m["fairness/lre"] != m["fairness/binding_lre"]


@pytest.mark.distributed
def test_small_reservoirs_concatenate_and_sum_states_stay_exact(synced):
    ref = FairnessMetrics(BINS, reservoir_size=64)
    _feed(ref, torch.arange(600), micro=600)
    want = ref.compute()
    for r in range(2):
        got = synced[r]["small"]["metrics"]
        assert got["logratio/qq_n"] == 128  # world_size * reservoir_size
        exact = {k: v for k, v in want.items() if not k.startswith("logratio/qq")}
        assert {k: got[k] for k in exact} == pytest.approx(exact, rel=1e-12, abs=1e-15)
        assert got["logratio/qq_r2"] > 0.9 and want["logratio/qq_r2"] > 0.9
        assert got["logratio/qq_slope"] == pytest.approx(want["logratio/qq_slope"], abs=0.25)
    assert synced[0]["small"]["metrics"] == synced[1]["small"]["metrics"]
