"""The paper presets (conf/experiment/paper_*.yaml) compose with every method, in either order, and
the composed values are the paper's (appendix "Configurations"), written out here independently.

Table 2 (training): prompt / response 2,000 / 18,000 tokens, 128 sequences per step (8 prompts x
n = 16), mini-batch 32, AdamW lr 1e-6, 144 steps, seed 42, vLLM GPU-util 0.5. FSPO: c_upper =
c_lower = c_dual = 0.03, token-mean, no KL, entropy coefficient 0, GRPO-style advantage. Baselines
(ratio space): GRPO 0.2 / 0.28 / dual 3.0, RLOO 0.4 / 0.667 / dual 3.0, GSPO 3e-4 / 4e-4 / no dual.
Validation: MATH500 subset with the test-time decoding (temperature 0.6, top-p 0.95, top-k 200).
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from fspo.data.math_io import resolve_data_dir

CONF = Path(__file__).resolve().parents[1] / "conf"


def compose_config(overrides):
    """The root config (conf/config.yaml) composed with ``overrides``, as on the command line."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="test_presets"):
        return compose(config_name="config", overrides=list(overrides))


PRESETS = sorted(p.stem for p in (CONF / "experiment").glob("paper_*.yaml"))  # model presets + hardware layouts
METHODS = sorted(p.stem for p in (CONF / "method").glob("*.yaml"))
HUB = {"paper_qwen3_1_7b": "Qwen/Qwen3-1.7B-Base", "paper_qwen3_8b": "Qwen/Qwen3-8B-Base"}
CLIP = {"fspo": ("fspo.clipping.fspo.FSPOClip", {"c_upper": 0.03, "c_lower": 0.03, "c_dual": 0.03,
                                                 "band": "fixed", "drift": "zero"}),
        "grpo": ("fspo.clipping.grpo.GRPOClip", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                                                 "clip_ratio_c": 3.0}),
        "rloo": ("fspo.clipping.rloo.RLOOClip", {"clip_ratio_low": 0.4, "clip_ratio_high": 0.667,
                                                 "clip_ratio_c": 3.0}),
        "gspo": ("fspo.clipping.gspo.GSPOClip", {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4})}
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def test_both_presets_exist():
    assert set(PRESETS) >= set(HUB)
    for preset in PRESETS:  # a hardware layout (e.g. paper_8xh200) builds on a model preset
        assert compose_config([f"+experiment={preset}"]).model.hub_id in HUB.values(), preset


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}/{k}" if prefix else str(k))
    else:
        yield prefix, tree


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("preset", PRESETS)
def test_preset_with_method_has_the_papers_values(preset, method):
    cfg = compose_config([f"+experiment={preset}", f"+method={method}"])
    c = OmegaConf.to_container(cfg, resolve=True)
    # either order of +experiment / +method gives the same config
    assert c == OmegaConf.to_container(compose_config([f"+method={method}", f"+experiment={preset}"]), resolve=True)
    assert c["method"] == method and c["run_name"].endswith(f"_{method}") and c["tags"]["preset"] == preset
    # Table 2 (every paper_* preset: the model presets and the hardware layouts built on them)
    assert c["model"]["hub_id"] == HUB.get(preset, c["model"]["hub_id"]) in HUB.values()
    if preset in HUB:
        assert c["run_name"] == f"{preset}_{method}" and c["model"]["dtype"] == "bfloat16"
    assert c["data"]["max_prompt_len"] == 2000 and c["rollout"]["sampling"]["max_new_tokens"] == 18000
    assert c["prompts_per_step"] * c["rollout"]["sampling"]["n"] == 128 and c["rollout"]["sampling"]["n"] == 16
    assert c["ppo"]["mini_batch_size"] == 32 and c["ppo"]["epochs"] == 1
    assert c["ppo"]["lr"] == 1e-6 and c["steps"] == 144 and c["seed"] == 42
    assert c["rollout"]["engine"]["_target_"] == "fspo.rollout.vllm.VLLMEngine"
    assert c["rollout"]["engine"]["gpu_memory_utilization"] == 0.5
    # data, reward, validation on a MATH500 subset with the paper's decoding
    assert c["data"]["train"]["name"] == "dapo_aime_train"
    assert c["data"]["val"]["name"] == "math500" and c["data"]["val"]["limit"] == c["val"]["size"] > 0
    assert c["reward"]["_target_"] == "fspo.rewards.math_verify_reward.MathVerifyReward"
    vs = c["val"]["sampling"]
    assert (vs["temperature"], vs["top_p"], vs["top_k"]) == (0.6, 0.95, 200)
    assert c["steps"] % c["val"]["every_n_steps"] == 0  # the last step is validated
    # clip rule of the method with the paper's numbers; GRPO-style advantage for every method
    target, values = CLIP[method] if method in CLIP else (c["clip"]["_target_"], {})
    assert c["clip"]["_target_"] == target
    for k, v in values.items():
        assert c["clip"][k] == v, (method, k)
    assert c["advantage"]["_target_"] == "fspo.advantages.grpo"
    method_yaml = OmegaConf.load(CONF / "method" / f"{method}.yaml")
    assert c["loss_agg_mode"] == method_yaml.loss_agg_mode  # the preset leaves aggregation to the method
    if method == "fspo":
        assert c["loss_agg_mode"] == "token-mean"
    # no KL loss and no entropy bonus: no such coefficient anywhere, or a zero one
    for key, v in _leaves(c):
        if any(s in key.lower() for s in ("kl_coef", "kl_loss", "use_kl", "entropy_coef", "entropy_coeff")):
            assert not v, f"{key} = {v}"


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_components_instantiate(preset):
    """The pieces train.py builds from the preset (vLLM only where it is installed)."""
    from fspo.module import PPOConfig
    from fspo.rollout.base import SamplingConfig

    cfg = compose_config([f"+experiment={preset}"])
    ppo = instantiate(cfg.ppo)
    assert isinstance(ppo, PPOConfig) and math.isclose(ppo.lr, 1e-6)
    assert instantiate(cfg.rollout.sampling) == SamplingConfig(n=16, temperature=1.0, top_p=1.0, top_k=0,
                                                               max_new_tokens=18000)
    assert isinstance(instantiate(cfg.val.sampling), SamplingConfig)
    instantiate(cfg.clip), instantiate(cfg.aggregator), instantiate(cfg.advantage)
    reward = instantiate(cfg.reward)
    reward.close()
    if HAVE_VLLM:
        instantiate(cfg.rollout.engine)
    if preset not in HUB:
        return
    # on a CPU the engine of a model preset can be swapped on the command line; the rest stays the paper's
    cpu = compose_config([f"+experiment={preset}", "rollout=hf"])
    assert type(instantiate(cpu.rollout.engine)).__name__ == "HFEngine"
    assert cpu.rollout.sampling.n == 16 and cpu.ppo.lr == 1e-6


@pytest.mark.skipif(not (resolve_data_dir(None) / "math500_test.jsonl").exists(), reason="no MATH500 file here")
def test_preset_validation_set_is_a_math500_subset():
    cfg = compose_config(["+experiment=paper_qwen3_8b", "val.size=16"])
    val = instantiate(cfg.data.val)
    assert len(val) == 16 and {s.meta["source"] for s in val.samples} == {"math500"}
    first = [s.meta["id"] for s in val.samples[:4]]
    assert first == [s.meta["id"] for s in instantiate(cfg.data.val).samples[:4]]  # a fixed (seeded) subset
    assert all("\\boxed{}" in s.prompt for s in val.samples)
