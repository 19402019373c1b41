"""FSDP2 with bf16 compute and float32 master weights moves the weights at the paper's lr 1e-6
(also the gpu lane's master-weights check).

One process, a real process group (gloo on CPU, NCCL on CUDA) and torch's ``fully_shard`` through
`fspo.runtime.launch.distributed.shard_model` with ``mixed_precision=bf16`` (MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)): the layers compute in bf16 (a forward hook sees bf16 weights and outputs), the
parameters, their gradients and AdamW's state stay float32, and one AdamW step at lr 1e-6 moves every
weight of a dense layer by 1e-6 (Adam's first step is lr x sign(g)) with ``train/update_ratio`` > 0.
The CPU variant checks the same logic here; the ``gpu`` one runs it on CUDA where a GPU exists.
"""
from __future__ import annotations

import pytest
import torch

from conftest import free_port


def bf16_compute_fp32_master_step(device_type: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fspo.models.tiny import build_tiny_model
    from fspo.runtime.launch.distributed import ShardingConfig, shard_model
    from fspo.update.update_ratio import UpdateRatio

    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
        if device_type == "cuda":
            torch.cuda.set_device(device)
        model = build_tiny_model(seed=0).to(device)  # float32
        shard_model(model, init_device_mesh(device_type, (1,)),
                    ShardingConfig(layer_class="Qwen3DecoderLayer", mixed_precision="bf16"))
        dense = model.model.layers[0].mlp.down_proj
        seen = []
        hook = dense.register_forward_hook(lambda m, i, o: seen.append((m.weight.dtype, o.dtype)))
        before = dense.weight.to_local().detach().clone()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
        ratio = UpdateRatio()
        ratio.snapshot(model.parameters())
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(4, 100, (4, 24), generator=g).to(device)
        model(input_ids=ids, labels=ids).loss.backward()
        grad_dtypes = {p.grad.dtype for p in model.parameters() if p.grad is not None}
        opt.step()
        hook.remove()
        step = (dense.weight.to_local().detach() - before).abs().double()
        state_dtypes = {t.dtype for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()}
        return {"seen": seen, "param_dtypes": {p.dtype for p in model.parameters()}, "grad_dtypes": grad_dtypes,
                "state_dtypes": state_dtypes, "moved_frac": float((step > 0).double().mean()),
                "mean_step": float(step.mean()), "ratio": ratio.compute(model.parameters(), device)}
    finally:
        dist.destroy_process_group()


def _check(res: dict) -> None:
    assert res["seen"] and all(w == o == torch.bfloat16 for w, o in res["seen"])  # bf16 compute
    assert res["param_dtypes"] == res["grad_dtypes"] == res["state_dtypes"] == {torch.float32}  # fp32 masters
    assert res["moved_frac"] > 0.99  # lr 1e-6 moved (nearly) every weight of the dense layer ...
    assert res["mean_step"] == pytest.approx(1e-6, rel=0.05)  # ... by lr (Adam's first step: lr x sign(g))
    assert res["ratio"] > 0  # train/update_ratio sees it


@pytest.mark.distributed
def test_fsdp2_bf16_compute_fp32_master_moves_weights_at_lr_1e6_cpu():
    _check(bf16_compute_fp32_master_step("cpu"))


@pytest.mark.gpu
def test_fsdp2_bf16_compute_fp32_master_moves_weights_at_lr_1e6_cuda():
    _check(bf16_compute_fp32_master_step("cuda"))
