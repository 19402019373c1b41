"""``model.activation_checkpointing=true`` on one device (fspo/models/loading.py `enable_activation_checkpointing`,
applied by fspo/train.py; auto-fit's last step): each decoder layer is recomputed in backward, and the
log-probs and gradients equal those without it, for a full and a LoRA policy (frozen embeddings: the
non-reentrant form needs no input gradient)."""
from __future__ import annotations

import fsdp_head_worker as hw
import pytest
import torch

from fspo.models.loading import enable_activation_checkpointing
from fspo.update.logprobs import response_log_probs


def _grads(model, checkpointing: bool):
    if checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    device = next(model.parameters()).device
    batch = hw.fsdp_worker.fixed_rollout()
    weights = hw.loss_weights(batch, torch.arange(batch.batch_size)).to(device)
    lp, _ = response_log_probs(model, batch.to(device), pack_width=None)
    (lp * weights).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True])
def test_checkpointed_gradients_equal_the_plain_ones(lora):
    from fspo.models.lora import apply_lora, lora_settings

    def build():
        m = hw.build_model(False)
        torch.manual_seed(1)  # the same adapters' A in both builds
        return apply_lora(m, lora_settings({"lora": {"rank": 4}})) if lora else m

    ref_lp, ref = _grads(build(), False)
    model = build()
    lp, got = _grads(model, True)
    base = model.get_base_model() if lora else model
    assert base.is_gradient_checkpointing and ref
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=0)
    assert got.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-6, rtol=1e-5, msg=n)


def test_a_model_without_it_is_one_line():
    with pytest.raises(ValueError, match="model.activation_checkpointing=true: Linear does not support it"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))
