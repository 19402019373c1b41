"""CPU check of the verl recipe (docs/integrations.md): verl's own config and registry give FSPO.

    VERL_USE_EXTERNAL_MODULES=fspo.integrations.verl python benchmarks/verl_fspo_check.py

Without importing the plugin itself, it
1. imports verl, which imports fspo.integrations.verl from VERL_USE_EXTERNAL_MODULES, and checks that
   verl's ``get_policy_loss_fn("fspo")`` exists;
2. composes verl's own ppo_trainer.yaml with the recipe's overrides (``RECIPE``) and builds the
   actor config with verl's ``omega_conf_to_dataclass``, as verl's workers do;
3. calls verl's ``fspo`` on a random batch with that config and compares loss and gradient with
   fspo.clipping.registry's ``fspo`` given the same settings, in three aggregation modes;
4. prints the per-length metrics verl would log. Exit 0 and a last line "OK" when all hold.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

#: the overrides docs/integrations.md adds to verl's GSM8K command (here with c_upper 0.04, c_dual 0.05)
RECIPE = [
    "actor_rollout_ref.actor.policy_loss.loss_mode=fspo",
    "actor_rollout_ref.actor.policy_loss._target_=fspo.integrations.verl.FSPOPolicyLossConfig",
    "+actor_rollout_ref.actor.policy_loss.c_upper=0.04",
    "+actor_rollout_ref.actor.policy_loss.c_dual=0.05",
    "+actor_rollout_ref.actor.policy_loss.length_bin_max=64",
    "+actor_rollout_ref.actor.policy_loss.length_bin_width=16",
    "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
]


def batch(seed: int, B: int = 12, T: int = 48):
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    m = (torch.arange(T) < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 2
    seq_shift = torch.randn(B, 1, generator=g) * 0.1 / lengths[:, None].sqrt() * 2
    new = old + seq_shift + torch.randn(B, T, generator=g) * 0.01
    adv = torch.randn(B, generator=g)[:, None] * m
    return old, new, adv, m


def main() -> int:
    import torch
    import verl
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo import core_algos
    from verl.utils.config import omega_conf_to_dataclass

    if "fspo" not in core_algos.POLICY_LOSS_REGISTRY:
        print("verl has no 'fspo' policy loss: set VERL_USE_EXTERNAL_MODULES=fspo.integrations.verl "
              f"(got {os.environ.get('VERL_USE_EXTERNAL_MODULES')!r})", file=sys.stderr)
        return 1
    from fspo.clipping.registry import get_policy_loss_fn

    conf = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose("ppo_trainer", overrides=RECIPE)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    pl = actor.policy_loss
    print(f"verl {verl.__version__}: actor.policy_loss = {type(pl).__name__}(loss_mode={pl.loss_mode}, "
          f"c_upper={pl.c_upper}, c_lower={pl.c_lower}, c_dual={pl.c_dual})")
    theirs_fn = core_algos.get_policy_loss_fn(pl.loss_mode)
    ours_fn = get_policy_loss_fn("fspo")
    settings = {"c_upper": pl.c_upper, "c_lower": pl.c_lower, "c_dual": pl.c_dual}
    ok = True
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        old, new, adv, m = batch(0)
        x1, x2 = new.clone().requires_grad_(True), new.clone().requires_grad_(True)
        loss, metrics = theirs_fn(old, x1, adv, m, mode, actor)
        ref, _ = ours_fn(old, x2, adv, m, mode, settings)
        (g1,), (g2,) = torch.autograd.grad(loss, x1), torch.autograd.grad(ref, x2)
        same = torch.allclose(loss, ref, rtol=1e-6, atol=0) and torch.allclose(g1, g2, rtol=1e-6, atol=1e-12)
        ok &= same
        print(f"{mode:<24} loss verl {loss.item():+.6f} ours {ref.item():+.6f}  grad max|diff| "
              f"{(g1 - g2).abs().max().item():.1e}  pg_clipfrac {metrics['actor/pg_clipfrac']:.3f}  "
              f"{'same' if same else 'DIFFERENT'}")
    counts = {k: v for k, v in metrics.items() if k.startswith("actor/fspo/")}
    print(f"per-length metrics ({len(counts)} keys): "
          + ", ".join(f"{k.split('/', 2)[2]}={v:g}" for k, v in counts.items() if "n_seq" in k))
    ok &= sum(v for k, v in counts.items() if "/n_seq/" in k) == int((m.sum(-1) > 0).sum())
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
