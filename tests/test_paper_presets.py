"""The paper presets (conf/experiment/paper_*.yaml) compose with every method, in either order, and
the composed values are the paper's (appendix "Configurations"), written out here independently.

Table 2 (training): prompt / response 2,000 / 18,000 tokens, global batch 128, mini-batch 32, n 16,
AdamW lr 1e-6, 144 steps, seed 42, vLLM GPU-util 0.5. The batch is read in verl's units (prompts;
the paper ran verl): 128 prompts x 16 = 2,048 sequences per step, mini-batches of 32 whole prompt
groups (512 sequences), 4 updates per step; 144 x 128 = 18,432 prompts ~ one epoch of the training
set and Figure 1's 217,454 log-ratios ~ 3/4 of 144 x 2,048 (conf/experiment/paper_qwen3_8b.yaml). FSPO: c_upper =
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


def updates_per_step(cfg) -> int:
    """Optimizer updates of one RL step as the training step plans them (RLModule.training_step:
    `PPOConfig.minibatch_plan` over the global batch, its rows answering prompts_per_step prompts n
    times each, group ids as the rollout engines lay them out); checks every mini-batch's shape."""
    import torch

    ppo = instantiate(cfg.ppo)
    prompts, n = int(cfg.prompts_per_step), int(cfg.rollout.sampling.n)
    group_ids = torch.arange(prompts).repeat_interleave(n)  # fspo/rollout/base.py: rows k*n .. k*n+n-1
    plan = ppo.minibatch_plan(prompts * n, torch.Generator().manual_seed(0), group_ids)
    assert ppo.updates_per_step == len(plan)
    for mb in plan:
        if ppo.mini_batch_unit == "prompts":  # whole groups: every prompt's n samples in one mini-batch
            assert len(mb) == ppo.mini_batch_size * n
            assert all(int((group_ids[mb] == g).sum()) == n for g in group_ids[mb].unique())
    assert sorted(torch.cat(plan).tolist()) == sorted(list(range(prompts * n)) * ppo.epochs)
    return len(plan)


def test_paper_batch_arithmetic():
    """The reading of Table 2's batch (prompts, as verl counts them) against the paper's own numbers."""
    cfg = compose_config(["+experiment=paper_qwen3_8b", "+method=fspo"])
    prompts, n, steps = int(cfg.prompts_per_step), int(cfg.rollout.sampling.n), int(cfg.steps)
    mini = int(cfg.ppo.mini_batch_size) * n
    assert (prompts, n, steps, prompts * n, mini) == (128, 16, 144, 2048, 512)
    assert steps * prompts == 18_432  # ~ one epoch of DAPO-Math-17k + AIME 1983-2023 (the paper: 1 epoch)
    # Figure 1: n = 217,454 log-ratios; the first of the 4 mini-batches of a step is on-policy (S = 0)
    off_policy = steps * (prompts * n - mini)
    assert off_policy == 221_184 and abs(217_454 / off_policy - 1) < 0.02
    assert steps * 8 * n < 217_454 / 10  # the old reading (8 prompts x 16) could not hold that many


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("override,match", [
    ("prompts_per_step=8", r"ppo.mini_batch_size=32 prompts .*prompts_per_step=8 .*ppo.mini_batch_unit=sequences"),
    ("prompts_per_step=48", r"prompts_per_step=48 does not split into whole mini-batches .*ppo.mini_batch_size=32"),
    ("ppo.mini_batch_unit=groups", r"ppo.mini_batch_unit must be one of sequences, prompts"),
])
def test_preset_bad_batch_is_one_clear_error(preset, override, match):
    from fspo.runtime.checks.errors import user_error

    with pytest.raises(Exception) as err:
        instantiate(compose_config([f"+experiment={preset}", override]).ppo)
    msg = user_error(err.value)
    assert msg is not None and "\n" not in msg and "ValueError" in msg
    assert __import__("re").search(match, msg), msg


def test_bad_batch_fails_before_the_model_loads(tmp_path, monkeypatch):
    """fspo.train.train checks the batch before it loads a model or creates the output folder."""
    from omegaconf import open_dict

    import fspo.train

    def no_load(**_):
        raise AssertionError("the model was loaded before the batch settings were checked")

    monkeypatch.setattr(fspo.train, "load_policy", no_load)
    cfg = compose_config(["+experiment=paper_qwen3_8b", "+method=fspo", "prompts_per_step=8"])
    with open_dict(cfg):
        cfg.output_dir = str(tmp_path / "run")
    with pytest.raises(Exception, match="ppo.mini_batch_unit=sequences"):
        fspo.train.train(cfg)
    assert not (tmp_path / "run").exists()


def test_default_run_has_whole_group_mini_batches():
    """The root default counts mini-batches in prompts, as verl and the paper: 16 prompts x 8 = 128 sequences,
    4 updates of 4 whole groups (32 sequences), so no mini-batch holds a sibling of a row trained before it."""
    cfg = compose_config([])
    assert (cfg.prompts_per_step, cfg.rollout.sampling.n, cfg.ppo.mini_batch_size) == (16, 8, 4)
    assert cfg.ppo.mini_batch_unit == "prompts" and updates_per_step(cfg) == 4
    from fspo.update.settings import PPOConfig

    assert (PPOConfig.mini_batch_unit, PPOConfig.mini_batch_size) == ("prompts", 4)  # the dataclass agrees


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
@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_preset_with_method_has_the_papers_values(preset, method):
    cfg = compose_config([f"+experiment={preset}", f"+method={method}"])
    c = OmegaConf.to_container(cfg, resolve=True)
    # either order of +experiment / +method gives the same config
    assert c == OmegaConf.to_container(compose_config([f"+method={method}", f"+experiment={preset}"]), resolve=True)
    assert c["method"] == method and c["run_name"].endswith(f"_{method}") and c["tags"]["preset"] == preset
    # Table 2 (every paper_* preset: the model presets and the hardware layouts built on them)
    assert c["model"]["hub_id"] == HUB.get(preset, c["model"]["hub_id"]) in HUB.values()
    if preset in HUB:
        assert c["run_name"] == f"{preset}_{method}" and c["ppo"]["autocast"] == "bf16"  # one device: autocast
    else:  # a sharded layout: FSDP2 computes in bf16
        assert c["trainer"]["strategy"]["mixed_precision"] == "bf16"
    assert c["model"]["dtype"] == "float32"  # master weights and AdamW state (bf16 ones round lr 1e-6 away)
    assert c["data"]["max_prompt_len"] == 2000 and c["rollout"]["sampling"]["max_new_tokens"] == 18000
    assert c["prompts_per_step"] == 128 and c["rollout"]["sampling"]["n"] == 16  # 2,048 sequences per step
    assert c["ppo"]["mini_batch_size"] == 32 and c["ppo"]["mini_batch_unit"] == "prompts" and c["ppo"]["epochs"] == 1
    assert updates_per_step(cfg) == 4
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
    from fspo.rollout.base import SamplingConfig
    from fspo.update.settings import PPOConfig

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


def test_8xh200_layout_fits_the_batch():
    """8 FSDP ranks, each with its own vLLM engine: 16 of the 128 prompts per rank (256 sequences, one
    vLLM batch), 64 of each 512-sequence mini-batch per rank (Table 2's per-GPU micro-batch 32 = 2 of
    them; here a token budget sets the micro-batches), a full-length sequence fits a micro-batch."""
    c = compose_config(["+experiment=paper_8xh200", "+method=fspo"])
    ranks = int(c.trainer.devices) * int(c.trainer.num_nodes)
    n = int(c.rollout.sampling.n)
    assert ranks == 8 and c.prompts_per_step % ranks == 0 and c.ppo.mini_batch_size % ranks == 0
    assert c.prompts_per_step // ranks * n == 256 == c.rollout.engine.batch_size
    assert c.ppo.mini_batch_size * n // ranks == 64 == 2 * 32
    assert c.rollout.engine.tensor_parallel_size == 1
    full = c.data.max_prompt_len + c.rollout.sampling.max_new_tokens
    assert c.ppo.micro_batch_max_tokens >= full and c.rollout.engine.max_model_len >= full
    assert updates_per_step(c) == 4
