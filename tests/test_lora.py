"""LoRA (fspo/models/lora.py): what trains, the adapted layer's equation, the merged weights, the
checkpoint's share, the memory plan's LoRA terms and the one-line refusals of bad settings.

Hand-computed values: the tiny Qwen3 (H 128, 4 heads x 32 = q 128, 2 kv heads x 32 = kv 64, I 512,
4 layers) has per layer and per unit of rank r (in + out) = q 256 + k 192 + v 192 + o 256 +
gate 640 + up 640 + down 640 = 2,816, so r = 8 gives 4 x 8 x 2,816 = 90,112 adapter parameters.
Leaves out: training runs, resume and evaluation (tests/test_lora_train.py), FSDP (test_lora_fsdp.py)
and vLLM (test_vllm_lora.py).
"""
from __future__ import annotations

import pytest
import torch

from conftest import compose_config
from fspo.models.loading import load_policy
from fspo.models.lora import (
    LoRASettings,
    adapter_state,
    apply_lora,
    check_lora_targets,
    is_lora,
    merged_weights,
    param_counts,
    target_names,
)
from fspo.models.tiny import build_tiny_model
from fspo.runtime.checks.config_check import ConfigError, check_config
from fspo.runtime.launch.memory_components import GIB, Layout, ModelShape, lora_params, plan_memory

ALL = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def _tiny_lora(rank=8, alpha=16.0, dtype=torch.float32, targets=None, seed=0):
    torch.manual_seed(seed)
    return apply_lora(build_tiny_model(seed=0).to(dtype), LoRASettings(rank=rank, alpha=alpha, target_modules=targets))


def test_only_adapters_train_and_are_float32_over_a_bf16_base():
    assert target_names(build_tiny_model(seed=0)) == ALL  # every linear of attention and MLP, not lm_head
    m = _tiny_lora(dtype=torch.bfloat16)
    counts = param_counts(m)
    assert counts["model/trainable_params"] == 4 * 8 * 2816 == 90112
    base = param_counts(build_tiny_model(seed=0))
    assert base["model/trainable_params"] == base["model/total_params"]  # full fine-tuning: everything
    assert counts["model/total_params"] == base["model/total_params"] + 90112
    for n, p in m.named_parameters():
        assert p.requires_grad == ("lora_" in n), n
        assert p.dtype == (torch.float32 if "lora_" in n else torch.bfloat16), n
    # q_proj and v_proj only: r (256 + 192) per layer
    assert param_counts(_tiny_lora(rank=4, targets=("q_proj", "v_proj")))["model/trainable_params"] == 4 * 4 * 448


def test_adapted_layer_is_w0_plus_scaled_ba_and_gradients_reach_only_adapters():
    m = _tiny_lora(rank=4, alpha=12.0)
    layer = m.base_model.model.model.layers[1].mlp.up_proj
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()  # B = 0 at init: make the adapter do something
    x = torch.randn(3, 128)
    w0 = layer.base_layer.weight
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    want = x @ w0.T + (12.0 / 4) * (x @ a.T) @ b.T  # y = W0 x + (alpha / r) B A x
    assert torch.allclose(layer(x), want, atol=1e-5)
    # the policy's loss reaches the adapters only: the frozen base gets no gradient at all
    ids = torch.randint(4, 100, (2, 9))
    m(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
    for n, p in m.named_parameters():
        assert (p.grad is not None) == ("lora_" in n), n
    # dL/dB = (alpha/r) * sum_t g_t (A x_t)^T is nonzero; at B = 0 dL/dA = 0 (peft's init): checked fresh
    fresh = _tiny_lora(rank=4)
    fresh(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
    fl = fresh.base_model.model.model.layers[1].mlp.up_proj
    assert float(fl.lora_A["default"].weight.grad.abs().max()) == 0.0
    assert float(fl.lora_B["default"].weight.grad.abs().max()) > 0.0


def test_fresh_adapters_leave_the_base_model_unchanged():
    base, _ = load_policy()
    lora, _ = load_policy(lora={"rank": 8, "alpha": 16})
    ids = torch.randint(4, 100, (2, 11))
    with torch.no_grad():
        assert torch.equal(base(input_ids=ids).logits, lora(input_ids=ids).logits)


def test_merged_weights_give_a_plain_model_with_the_same_outputs():
    m = _tiny_lora(rank=4, alpha=8.0)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    merged = dict(merged_weights(m))
    plain = build_tiny_model(seed=0)
    assert set(merged) == set(plain.state_dict())  # HF names, adapters left out
    w0 = plain.state_dict()["model.layers.2.self_attn.k_proj.weight"]
    layer = m.base_model.model.model.layers[2].self_attn.k_proj
    by_hand = w0 + 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight  # alpha / r = 8 / 4
    assert torch.allclose(merged["model.layers.2.self_attn.k_proj.weight"], by_hand, atol=1e-6)
    plain.load_state_dict(merged)
    ids = torch.randint(4, 100, (2, 10))
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, m(input_ids=ids).logits, atol=1e-5)


def test_checkpoint_share_is_the_adapters_and_the_module_buffers():
    m = _tiny_lora()
    state = {f"policy.{k}": v for k, v in m.state_dict().items()} | {"rl_step": torch.tensor(3)}
    kept = adapter_state(state, m)
    assert "rl_step" in kept and all("lora_" in k for k in kept if k.startswith("policy."))
    assert sum(v.numel() for k, v in kept.items() if k.startswith("policy.")) == 90112
    assert is_lora(m) and not is_lora(build_tiny_model(seed=0))


def test_optimizer_holds_only_the_adapters(compose_cfg):
    from hydra.utils import instantiate

    from fspo.train import build_fairness
    from fspo.update.module import RLModule

    cfg = compose_cfg(["model.lora.rank=8"])
    policy, _ = load_policy(**cfg.model)
    module = RLModule(policy=policy, clip=instantiate(cfg.clip), aggregator=instantiate(cfg.aggregator),
                      ppo=instantiate(cfg.ppo), diagnostics=build_fairness(cfg, 0))
    [opt], _ = module.configure_optimizers()
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == 90112
    assert module.strict_loading is False  # LoRA checkpoints hold the adapters only


# ------------------------------------------------------------------ bad input: one line, before any work
@pytest.mark.parametrize("overrides, match", [
    (["model.lora.rank=-1"], r"model.lora.rank=-1: must be a whole number >= 0"),
    (["model.lora.rank=8", "model.lora.alpha=0"], r"model.lora.alpha=0: must be a number > 0"),
    (["model.lora.rank=8", "model.lora.dropout=1.0"], r"model.lora.dropout=1: must be a number in \[0, 1\)"),
    (["model.lora.target_modules=[q_proj]"], r"model.lora.rank=0: .*rank 0 turns LoRA off; set model.lora.rank=8"),
    (["model.lora.rank=8", "model.lora.target_modules=[]"], r"model.lora.target_modules=\[\]: no layer to adapt"),
    (["model.lora.rank=8", "rollout.overlap.enable=true", "ppo.old_log_probs=engine"],
     r"model.lora.rank=8: the pipelined engine process .* set rollout.overlap.enable=false"),
])
def test_bad_lora_settings_are_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        check_config(compose_config(overrides))
    assert "\n" not in str(e.value)


def test_unknown_target_modules_list_the_ones_that_exist():
    cfg = compose_config(["model.lora.rank=8", "model.lora.target_modules=[q_proj,qkv_proj]"])
    check_config(cfg)  # names need the model: checked from its config, before anything loads
    with pytest.raises(ValueError, match=r"\['qkv_proj'\] are not linear layers of this model; it has "
                                         r"\['down_proj', 'gate_proj', 'k_proj', 'o_proj', "
                                         r"'q_proj', 'up_proj', 'v_proj'\]"):
        check_lora_targets(cfg.model)
    check_lora_targets(compose_config(["model.lora.rank=8", "model.lora.target_modules=[q_proj,v_proj]"]).model)


def test_train_refuses_unknown_targets_before_any_run_is_opened(compose_cfg, tmp_path):
    from fspo.train import train

    cfg = compose_cfg(["model.lora.rank=8", "model.lora.target_modules=[attn]"])
    with pytest.raises(ValueError, match="are not linear layers of this model"):
        train(cfg)
    assert not (tmp_path / "out" / "checkpoints").exists() and not (tmp_path / "out" / "mlflow_run_id").exists()


# ------------------------------------------------------------------ the memory plan
QWEN3_8B = ModelShape(vocab=151936, hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288,
                      tied=False)


def test_lora_params_by_hand():
    tiny = ModelShape(vocab=100, hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, intermediate=512, tied=True)
    assert lora_params(tiny, Layout(lora_rank=8)) == 90112 == param_counts(_tiny_lora())["model/trainable_params"]
    assert lora_params(tiny, Layout(lora_rank=4, lora_targets=("q_proj", "v_proj"))) == 4 * 4 * 448
    assert lora_params(tiny, Layout()) == 0
    # Qwen3-8B, r 64, all seven: 36 x 64 x (8192 + 5120 + 5120 + 8192 + 3 x 16384) = 174,587,904
    assert lora_params(QWEN3_8B, Layout(lora_rank=64)) == 36 * 64 * 75776 == 174_587_904


def test_qwen3_8b_lora_r64_fits_80_gib_where_full_fine_tuning_does_not():
    """Per rank, bf16 base, micro-batch 8,192 tokens, chunked head (1,024 rows), 256 decode rows of 64 + 128
    tokens (the HF engine): full fine-tuning needs > 100 GiB; LoRA r 64 drops the base's gradients (15.26 GiB),
    AdamW moments (30.52 GiB) and update snapshot, and adds 0.65 GiB of float32 adapters, 0.65 of gradients,
    1.30 of moments. (With the dense head, 25.50 GiB of logits, it is 96.33 GiB: over 0.9 x 80.)"""
    base = Layout(dtype_bytes=2, compute_bytes=2, micro_tokens=8192, kv_rows=256, kv_len=192, kv_bytes=2,
                  head_chunk_rows=1024)
    full = plan_memory(QWEN3_8B, base)
    lora = plan_memory(QWEN3_8B, Layout(**{**base.__dict__, "lora_rank": 64}))
    n_a = 174_587_904
    assert lora.grads == n_a * 4 and lora.optimizer == 2 * n_a * 4 and lora.adapters == n_a * 4
    assert lora.update_snapshot == n_a * 4 and lora.weights == full.weights == QWEN3_8B.params * 2
    assert lora.lora_activations == 8192 * 4 * 64 * 7 * 36 and full.lora_activations == 0
    assert full.peak / GIB > 100
    assert lora.peak <= 0.9 * 80 * GIB < full.peak


def test_check_memory_plan_counts_lora(tmp_path):
    """`check_memory_plan` on a composed config: a Qwen3-8B config folder (no weights), 80 GiB available."""
    from transformers import Qwen3Config

    from fspo.runtime.launch.memory_plan import MemoryPlanError, check_memory_plan

    Qwen3Config(vocab_size=151936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                tie_word_embeddings=False).save_pretrained(tmp_path)
    over = ["+model=qwen3_8b", "model.source=pretrained", f"model.path={tmp_path}"]
    with pytest.raises(MemoryPlanError):
        check_memory_plan(compose_config(over), available=80 * GIB)
    with pytest.raises(MemoryPlanError, match=r"LoRA r 64 fine-tune .* would fit with .*model.dtype=bfloat16 "
                       r"ppo.lm_head_chunk_rows=1024 ppo.micro_batch_max_tokens=4096 \(4\d.\d\d GiB per rank"):
        # a float32 base: 131 GiB; the suggestion is what auto-fit picks (fspo/runtime/launch/auto_fit.py)
        check_memory_plan(compose_config(over + ["model.lora.rank=64"]), available=80 * GIB)
    plan = check_memory_plan(compose_config(over + ["model.lora.rank=64", "model.dtype=bfloat16",
                                                    "ppo.lm_head_chunk_rows=1024"]), available=80 * GIB)
    assert plan.grads == 174_587_904 * 4 and plan.peak <= 0.9 * 80 * GIB


def test_chunked_head_and_bf16_base_run_under_lora():
    """The update's log-prob paths on a LoRA policy: the chunked LM head (fspo/update/lm_head.py) equals the
    dense one, and over a bf16 base the log-probs are float32 and the gradients reach the float32 adapters."""
    from fspo.types import RolloutBatch
    from fspo.update.logprobs import response_log_probs

    m = _tiny_lora(rank=4, alpha=8.0)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    b, P, T = 4, 5, 7
    batch = RolloutBatch(prompt_ids=torch.randint(4, 100, (b, P)), prompt_mask=torch.ones(b, P, dtype=torch.long),
                         response_ids=torch.randint(4, 100, (b, T)), response_mask=torch.ones(b, T, dtype=torch.long),
                         group_ids=torch.arange(b) // 2, advantages=torch.zeros(b), rewards=torch.zeros(b),
                         overlong=torch.zeros(b, dtype=torch.bool))
    dense, _ = response_log_probs(m, batch)
    chunked, _ = response_log_probs(m, batch, head_chunk_rows=3)
    assert torch.allclose(dense, chunked, atol=1e-5)
    half = _tiny_lora(rank=4, dtype=torch.bfloat16)
    logp, _ = response_log_probs(half, batch)
    assert logp.dtype == torch.float32
    logp.sum().backward()
    assert {p.grad.dtype for p in half.parameters() if p.grad is not None} == {torch.float32}
