"""Band calibrators (fspo/clipping/calibration.py): a flat clip fraction where std(S_L) ~ L^0.8,
the sqrt law recovered on sqrt-law data, exact all-reduced updates (2 gloo processes), state_dict
round trip, edge lengths and bad settings.

Run with ``-s`` to see the clip fractions per length range.
"""
import math
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port
from fspo.clipping.calibration import CALIBRATORS, PerBinBand, PowerLawBand

CLASSES = [PowerLawBand, PerBinBand]
TARGET = math.erfc(1 / math.sqrt(2))  # 2 Phi(-1) = 0.3173
RANGES = [(10, 30), (100, 300), (1000, 3000), (10000, 20000)]


def _sample(n, gamma, sigma, g, lo=10, hi=20000):
    """L log-uniform on [lo, hi] (whole tokens), S ~ N(0, sigma^2 L^(2 gamma))."""
    L = torch.exp(torch.empty(n).uniform_(math.log(lo), math.log(hi), generator=g)).round()
    return torch.randn(n, generator=g) * sigma * L ** gamma, L.long()


def _feed(cals, gamma, sigma=0.03, batches=100, size=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    seen = []
    for _ in range(batches):
        s, L = _sample(size, gamma, sigma, g)
        for c in cals:
            c.observe(s, L, torch.zeros(size))
        seen.append((s, L))
    return g, seen


def test_clip_fraction_flat_in_length_where_sqrt_law_fails():
    cals = [PowerLawBand(alpha=0.02), PerBinBand(alpha=0.02)]
    g, seen = _feed(cals, gamma=0.8)
    s_all, l_all = (torch.cat(x) for x in zip(*seen))
    sigma_sqrt = float((s_all / l_all.float().sqrt()).std())  # the paper's fit: std of S / sqrt(L)
    rows = {}
    for lo, hi in RANGES:
        s, L = _sample(50_000, 0.8, 0.03, g, lo, hi)
        scales = [sigma_sqrt * L.float().sqrt()] + [c.scale(L) for c in cals]
        rows[(lo, hi)] = [float((s.abs() > b).float().mean()) for b in scales]
    print(f"\ntarget 2 Phi(-1) = {TARGET:.4f}; fitted gamma {float(cals[0].fit()[1]):.4f}")
    print(f"{'L range':>13} {'sqrt':>7} {'power':>7} {'per_bin':>7}")
    for (lo, hi), fr in rows.items():
        print(f"{lo:>6}-{hi:<6} " + " ".join(f"{f:7.4f}" for f in fr))
    for fr in rows.values():
        assert abs(fr[1] - TARGET) <= 0.02 and abs(fr[2] - TARGET) <= 0.02, fr
    sqrt_fr = [fr[0] for fr in rows.values()]
    assert max(abs(f - TARGET) for f in sqrt_fr) > 0.2 and max(sqrt_fr) - min(sqrt_fr) > 0.5
    assert float(cals[0].fit()[1]) == pytest.approx(0.8, abs=0.02)


def test_sqrt_law_recovered():
    cals = [PowerLawBand(), PerBinBand()]
    _feed(cals, gamma=0.5, batches=60)
    L = torch.tensor([10, 30, 100, 300, 1000, 3000, 10000, 20000])
    for c in cals:
        sigma, gamma = c.fit()
        assert float(gamma) == pytest.approx(0.5, abs=0.05) and float(sigma) == pytest.approx(0.03, rel=0.1)
        ratio = c.scale(L) / L.float().sqrt()
        assert torch.allclose(ratio, torch.full_like(ratio, 0.03), rtol=0.1), ratio
        assert c.metrics()["clip/band_sigma_sqrt"] == pytest.approx(0.03, rel=0.05)
    assert "clip/band_std/len_00016_00023" in cals[1].metrics()  # the populated bins' std


@pytest.mark.parametrize("cls", CLASSES)
def test_forgets_old_policy_and_subtracts_drift(cls):
    g = torch.Generator().manual_seed(1)
    cal, shifted = cls(alpha=0.1), cls(alpha=0.1)
    for step in range(80):
        s, L = _sample(512, 0.8, 0.03 if step < 20 else 0.06, g)
        s, mu = s.double(), -0.001 * L.double()  # float64: S + mu - mu is S again
        cal.observe(s, L)
        shifted.observe(s + mu, L, mu)
    L = torch.tensor([20, 200, 2000, 20000])
    torch.testing.assert_close(cal.scale(L), 0.06 * L.float() ** 0.8, rtol=0.08, atol=0)
    torch.testing.assert_close(shifted.moments, cal.moments, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("cls", CLASSES)
def test_warm_start_edges_and_empty_batches(cls):
    cal = cls(sigma0=0.04)
    L = torch.tensor([0, 1, 7, 100, 32768, 10**6])
    torch.testing.assert_close(cal.scale(L), 0.04 * L.float().sqrt())  # sqrt law, sigma0
    assert cal.metrics()["clip/band_gamma"] == 0.5
    before = cal.moments.clone()
    cal.observe(torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(0))
    nan = float("nan")
    cal.observe(torch.tensor([0.5, nan]), torch.tensor([0, 5]))  # L = 0 and NaN S ignored
    cal.observe(torch.tensor([0.5, 0.5, 0.1]), torch.tensor([nan, math.inf, 0.5]))  # bad lengths too
    assert torch.equal(cal.moments, before)
    for _ in range(3):  # one length bin only -> sqrt law through the data
        cal.observe(torch.randn(64) * 0.1 * 10, torch.full((64,), 100))
    assert cal.metrics()["clip/band_bins"] == 1 and cal.metrics()["clip/band_gamma"] == 0.5
    for _ in range(5):  # exact zeros (policy unchanged) in every bin
        cal.observe(torch.zeros(512), torch.randint(1, 40000, (512,)))
    out = cal.scale(L)
    assert out.dtype == torch.float32 and out[0] == 0 and torch.isfinite(out).all() and (out[1:] > 0).all()
    names = cal.metrics()
    assert all(re.fullmatch(r"[A-Za-z0-9_\-. /:]+", k) for k in names)
    assert all(map(math.isfinite, names.values()))


@pytest.mark.parametrize("cls", CLASSES)
def test_state_dict_round_trip_and_dtype(cls):
    cal = cls(alpha=0.2)
    _feed([cal], gamma=0.7, batches=20)
    L = torch.tensor([0, 12, 345, 6789, 32768])
    fresh = cls(alpha=0.2)
    state = cal.state_dict()
    assert list(state) == ["moments"] and state["moments"].dtype == torch.float64
    fresh.load_state_dict(state)
    assert torch.equal(fresh.scale(L), cal.scale(L)) and fresh.metrics() == cal.metrics()
    fresh.to(torch.bfloat16)  # Lightning's bf16-true casts the whole module: the sums stay float64
    assert fresh.moments.dtype == torch.float64 and torch.equal(fresh.scale(L), cal.scale(L))


@pytest.mark.parametrize("kw, name", [({"alpha": 0.0}, "alpha"), ({"alpha": 1.5}, "alpha"),
                                      ({"sigma0": -0.1}, "sigma0"), ({"sigma0": 0.0}, "sigma0"),
                                      ({"min_count": 0.5}, "min_count"), ({"max_len": 1}, "max_len"),
                                      ({"bins_per_octave": 0}, "bins_per_octave")])
@pytest.mark.parametrize("cls", CLASSES)
def test_bad_settings(cls, kw, name):
    with pytest.raises(ValueError, match=name):
        cls(**kw)


def test_bad_gamma_range_and_registry():
    with pytest.raises(ValueError, match="gamma_max"):
        PowerLawBand(gamma_max=0.3)
    assert CALIBRATORS == {"power": PowerLawBand, "per_bin": PerBinBand}


# --- exact across ranks: 2 gloo processes ---------------------------------------------------------
SPLITS = [230, 512, 0]  # rank 0 gets rows [0, split) of each batch: uneven, all, none


def _batches():
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in SPLITS:
        s, L = _sample(512, 0.8, 0.03, g)
        L[::17] = 0  # empty completions are ignored
        out.append((s, L, -0.002 * L.float()))
    return out


def _worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cals = [cls(alpha=0.3, min_count=4) for cls in CLASSES]
        for split, (s, L, mu) in zip(SPLITS, _batches()):
            rows = slice(0, split) if rank == 0 else slice(split, None)
            for c in cals:
                c.observe(s[rows], L[rows], mu[rows])
        torch.save([c.state_dict() for c in cals], f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_all_reduced_update_equals_single_process(tmp_path):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    synced = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    L = torch.tensor([0, 10, 100, 1000, 10000, 32768])
    for i, cls in enumerate(CLASSES):
        ref = cls(alpha=0.3, min_count=4)
        for s, Lb, mu in _batches():
            ref.observe(s, Lb, mu)
        assert torch.equal(synced[0][i]["moments"], synced[1][i]["moments"])  # identical on every rank
        torch.testing.assert_close(synced[0][i]["moments"], ref.moments, rtol=1e-12, atol=1e-15)
        got = cls(alpha=0.3, min_count=4)
        got.load_state_dict(synced[0][i])
        torch.testing.assert_close(got.scale(L), ref.scale(L), rtol=1e-6, atol=0)
