"""Worker of tests/test_lora_fsdp.py: two RL steps of a LoRA policy under trainer=fsdp (run by torchrun on
2 gloo ranks) or on one process, on tests/fsdp_worker.py's fixed rollout.

Owns: `run_lora_step` (saves the merged weights as the vLLM sync streams them, the adapters, the
parameter counts and the step metrics to ``lora_w{world}.pt``). Leaves out: the assertions.
"""
from __future__ import annotations

import sys
from pathlib import Path

import fsdp_worker as fw  # noqa: E402
import torch

from conftest import compose_config  # noqa: E402
from fspo.models.lora import LoRASettings, apply_lora, param_counts  # noqa: E402
from fspo.models.tiny import build_tiny_model  # noqa: E402
from fspo.rollout.weights import engine_weights  # noqa: E402
from fspo.runtime.launch.distributed import is_sharded  # noqa: E402

LORA = LoRASettings(rank=4, alpha=8.0)


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def run_lora_step(world: int, out: Path) -> dict:
    """Two RL steps (2 updates each) of the tiny policy with LoRA r 4 on every linear of attention and MLP."""
    from hydra.utils import instantiate

    from fspo.train import build_fairness
    from fspo.update.module import RLModule

    out.mkdir(parents=True, exist_ok=True)
    cfg = compose_config(fw.OVERRIDES + ["trainer=fsdp", "model.lora.rank=4"], output_dir=out)
    torch.manual_seed(0)  # peft draws A from the global generator
    policy = apply_lora(build_tiny_model(seed=0), LORA)
    module = RLModule(policy=policy, clip=instantiate(cfg.clip), aggregator=instantiate(cfg.aggregator),
                      ppo=instantiate(cfg.ppo), diagnostics=build_fairness(cfg, 0),
                      run_diagnostics=build_fairness(cfg, 0), seed=int(cfg.seed))
    trainer = fw._trainer(cfg, world, out / f"lora{world}", [fw.InjectShare(fw.fixed_rollout())])
    trainer.fit(module, datamodule=fw._data(cfg, 2))
    res = {"metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
           "merged": {k: v.cpu().clone() for k, v in engine_weights(module.policy)},  # every rank drains it
           "adapters": {n: _full(p) for n, p in module.policy.named_parameters() if p.requires_grad},
           "counts": param_counts(module.policy), "sharded": is_sharded(module.policy)}
    if trainer.global_rank == 0:
        torch.save(res, out / f"lora_w{world}.pt")
    return res


if __name__ == "__main__":
    torch.set_num_threads(1)
    run_lora_step(int(__import__("os").environ.get("WORLD_SIZE", "1")), Path(sys.argv[1]))
    if torch.distributed.is_initialized():  # as tests/fsdp_worker.py: leave without the interpreter's teardown
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    __import__("os")._exit(0)
