"""The quantile band (fspo/clipping/quantile_band.py, ``clip.band=quantile``): on heavy-tailed S_L
(Laplace) whose scale grows like L^0.8, its out-of-band fraction stays at 2 Phi(-z) from L = 10 to
20,000 while the per-bin std band (exact only for Gaussian S) misses it; the quantile by hand on a
small histogram; exact all-reduced updates (2 gloo processes); state_dict; wiring into FSPOClip.

Run with ``-s`` to see the fractions per length range.
"""
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port
from fspo.clipping.calibration import PerBinBand
from fspo.clipping.fspo import FSPOClip
from fspo.clipping.quantile_band import QuantileBand

RANGES = [(10, 30), (100, 300), (1000, 3000), (10000, 20000)]


def _laplace(n, g, lo=10, hi=20000, gamma=0.8, sigma=0.03):
    """L log-uniform on [lo, hi], S Laplace with std sigma L^gamma (scale b = std / sqrt 2)."""
    L = torch.exp(torch.empty(n).uniform_(math.log(lo), math.log(hi), generator=g)).round()
    e = -torch.log(torch.rand(n, generator=g)) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return e * sigma * L ** gamma / math.sqrt(2.0), L.long()


@pytest.mark.parametrize("z", [1.0, 1.5])
def test_out_of_band_fraction_on_target_for_heavy_tails(z):
    target = math.erfc(z / math.sqrt(2))  # 2 Phi(-z)
    g = torch.Generator().manual_seed(0)
    qb, pb = QuantileBand(alpha=0.02, z=z), PerBinBand(alpha=0.02)
    for _ in range(100):
        s, L = _laplace(512, g)
        qb.observe(s, L)
        pb.observe(s, L)
    print(f"\nz = {z}: target {target:.4f}\n{'L range':>13} {'quantile':>9} {'per_bin std':>11}")
    for lo, hi in RANGES:
        s, L = _laplace(50_000, g, lo, hi)
        fq = float((s.abs() > z * qb.scale(L)).float().mean())
        fp = float((s.abs() > z * pb.scale(L)).float().mean())
        print(f"{lo:>6}-{hi:<6} {fq:9.4f} {fp:11.4f}")
        assert abs(fq - target) <= 0.02, (lo, hi, fq)
        # the std band is off for Laplace tails: P(|X| > z std) = exp(-z sqrt 2) = 0.243 (z 1), 0.120 (z 1.5)
        assert abs(fp - math.exp(-z * math.sqrt(2))) <= 0.03, (lo, hi, fp)
    assert qb.metrics()["clip/band_coverage"] == pytest.approx(1 - target)


def test_quantile_by_hand():
    # u-grid with n_u = 8: edges 0, 1e-3, 1e-2.5, ..., 1 (7 log-spaced from 1e-3 to 1), cells 0..7
    qb = QuantileBand(z=1.0, u_min=1e-3, u_max=1.0, n_u=8, min_count=1, alpha=1.0)
    e = qb.u_edges.tolist()
    assert e[0] == 0.0 and e[1] == pytest.approx(1e-3)
    assert e[2] == pytest.approx(10 ** -2.5) and e[7] == pytest.approx(1.0)
    # one length bin (L = 16: bin [16, 23)), u = |S| / 4: 10 sequences, 4 in cell 1, 6 in cell 5 ([1e-1, 10^-0.5))
    u = torch.tensor([0.002] * 4 + [0.2] * 6, dtype=torch.float64)
    qb.observe(u * 4.0, torch.full((10,), 16))
    k = qb.labels.index("len_00016_00023")
    assert qb.hist[k, 1] == 4 and qb.hist[k, 5] == 6 and qb.hist.sum() == 10
    # coverage erf(1 / sqrt 2) = 0.6827: target 6.827 counts; cum = 4 after cell 1, 10 after cell 5
    # -> cell 5, t = (6.827 - 4) / 6 = 0.4711, q = 0.1 * (10^0.5)^t (log-linear inside the cell)
    cov = math.erf(1 / math.sqrt(2))
    t = (10 * cov - 4) / 6
    q = 0.1 * (10 ** 0.5) ** t
    assert float(qb.quantiles()[k]) == pytest.approx(q, rel=1e-9)
    # scale at the bin's mean length (16): b / z = q sqrt(16); by the sqrt law from it elsewhere
    assert float(qb.scale(torch.tensor([16]))) == pytest.approx(q * 4.0, rel=1e-6)
    assert float(qb.scale(torch.tensor([64]))) == pytest.approx(q * 8.0, rel=1e-6)
    # z = 2 reads the same histogram at coverage erf(sqrt 2) = 0.9545 and divides by 2
    q2 = QuantileBand(z=2.0, u_min=1e-3, u_max=1.0, n_u=8, min_count=1, alpha=1.0)
    q2.observe(u * 4.0, torch.full((10,), 16))
    t2 = (10 * math.erf(2 / math.sqrt(2)) - 4) / 6
    assert float(q2.scale(torch.tensor([16]))) == pytest.approx(0.1 * (10 ** 0.5) ** t2 * 4.0 / 2.0, rel=1e-6)


def test_fspo_clip_wiring_state_and_bad_settings():
    clip = FSPOClip(band="quantile", z=1.5, calibration={"alpha": 0.1, "min_count": 8})
    assert isinstance(clip.calibrator, QuantileBand) and clip.calibrator.z == 1.5
    g = torch.Generator().manual_seed(1)
    s, L = _laplace(256, g, 10, 200)
    clip.calibrator.observe(s, L)
    sd = clip.state_dict()
    assert "calibrator.hist" in sd and "calibrator.u_edges" not in sd and sd["calibrator.hist"].dtype == torch.float64
    again = FSPOClip(band="quantile", z=1.5, calibration={"alpha": 0.1, "min_count": 8})
    again.load_state_dict(sd)
    torch.testing.assert_close(again.calibrator.scale(L), clip.calibrator.scale(L))
    clip.to(torch.bfloat16)
    assert clip.calibrator.hist.dtype == torch.float64
    for kw, name in (({"u_min": 1.0, "u_max": 0.5}, "u_min"), ({"n_u": 4}, "n_u"), ({"z": 0.0}, "z")):
        with pytest.raises(ValueError, match=name):
            QuantileBand(**kw)


SPLITS = [3, 0, 7]


def _batches():
    g = torch.Generator().manual_seed(3)
    return [(*_laplace(8, g, 10, 400), torch.randn(8, generator=g) * 0.01) for _ in SPLITS]


def _worker(rank, world, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        qb = QuantileBand(alpha=0.3, min_count=4, z=1.0)
        for split, (s, L, mu) in zip(SPLITS, _batches()):
            rows = slice(0, split) if rank == 0 else slice(split, None)
            qb.observe(s[rows], L[rows], mu[rows])
        torch.save(qb.state_dict(), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_all_reduced_update_equals_single_process(tmp_path):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    synced = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ref = QuantileBand(alpha=0.3, min_count=4, z=1.0)
    for s, L, mu in _batches():
        ref.observe(s, L, mu)
    assert torch.equal(synced[0]["hist"], synced[1]["hist"])
    torch.testing.assert_close(synced[0]["hist"], ref.hist, rtol=1e-12, atol=1e-15)
    got = QuantileBand(alpha=0.3, min_count=4, z=1.0)
    got.load_state_dict(synced[0])
    L = torch.tensor([10, 100, 400, 5000])
    torch.testing.assert_close(got.scale(L), ref.scale(L), rtol=1e-6, atol=0)
