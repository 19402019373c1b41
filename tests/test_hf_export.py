"""Full-model export (fspo/runtime/checkpoints/hf_export.py, ``fspo-export``): the checkpoint of a 2-step
training run becomes a Hugging Face folder (config, tokenizer, safetensors, no pickle) that
``transformers.AutoModelForCausalLM.from_pretrained`` loads and whose log-probs equal the trainer's
(rel 1e-5), by the trainer's own log-prob function and by a plain log-softmax of the logits. The 2-rank
sharded (FSDP) checkpoint is exported in tests/test_fsdp.py with `check_export`. Bad input: one line.
"""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from test_module_update import make_rollout

import fspo.cli
from conftest import REPO, SMALL, run_in_process
from fspo.runtime.checkpoints.hf_export import export_hf


def trainer_log_probs(state, model_cfg, seed, batch):
    """The trainer's log-probs: the run's model rebuilt from its config, ``state`` loaded, response_log_probs."""
    from fspo.models.loading import load_policy
    from fspo.runtime.checkpoints.files import load_into
    from fspo.update.logprobs import response_log_probs

    policy, _ = load_policy(**{**model_cfg, "meta": False}, seed=seed)
    policy = policy.to(next(iter(state.values())).dtype)
    load_into(policy, state)
    with torch.no_grad():
        return response_log_probs(policy.eval(), batch)[0]


def check_export(ckpt, out, state, model_cfg, seed):
    """Export ``ckpt`` to ``out`` with the command; assert the folder's contents and that its model's log-probs
    equal the trainer's with weights ``state`` (rel 1e-5). Returns the exported model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fspo.update.logprobs import response_log_probs

    p = run_in_process(fspo.cli.export, ["fspo-export", ckpt, out], cwd=REPO)  # the console script, in process
    assert p.returncode == 0, p.stderr[-2000:]
    files = {f.name for f in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files, files
    assert not any(f.endswith((".bin", ".pt", ".pkl")) for f in files), files  # weights as safetensors only
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.encode("1+2=") == tok.encode("1+2=") and tok.pad_token_id is not None
    batch = make_rollout()
    want = trainer_log_probs(state, model_cfg, seed, batch)
    with torch.no_grad():
        got = response_log_probs(hf, batch)[0]
    m = batch.response_mask.bool()
    torch.testing.assert_close(got[m], want[m], rtol=1e-5, atol=1e-6)
    # independent of our log-prob code: row 1's prompt + response through the plain HF forward
    i = 1
    prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()]
    resp = batch.response_ids[i][m[i]]
    ids = torch.cat([prompt, resp])[None]
    with torch.no_grad():
        logits = hf(ids).logits.float()
    lp = torch.log_softmax(logits[0, len(prompt) - 1:-1], -1).gather(-1, resp[:, None])[:, 0]
    torch.testing.assert_close(lp, want[i][m[i]], rtol=1e-5, atol=1e-6)
    return hf


@pytest.mark.slow
def test_two_step_checkpoint_exports_with_the_trainers_log_probs(compose_cfg, tmp_path):
    from fspo.models.loading import load_policy
    from fspo.runtime.checkpoints.files import list_checkpoints, load_checkpoint
    from fspo.train import train

    # the warm start (not SMALL's random model, whose rewards are all 0: no update) so the 2 steps move the weights
    cfg = compose_cfg([*(o for o in SMALL if not o.startswith("model.source")), "seed=5",
                       "logger.experiment_name=test_hf_export"])
    train(cfg)
    ckpt = list_checkpoints(cfg.output_dir + "/checkpoints")[-1]
    state, step = load_checkpoint(ckpt)
    assert step == 2
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    init, _ = load_policy(**model_cfg, seed=5)
    moved = max(float((state[k] - v).abs().max()) for k, v in init.state_dict().items())
    assert moved > 1e-6, "the run did not move the weights: the check would not tell the checkpoint from init"
    hf = check_export(ckpt, tmp_path / "hf", state, model_cfg, seed=5)
    assert next(hf.parameters()).dtype == torch.float32  # the trainer's master weights
    # the run folder works as well (its newest checkpoint), and --dtype casts
    assert export_hf(cfg.output_dir, tmp_path / "bf16", dtype="bfloat16").is_dir()
    from transformers import AutoModelForCausalLM
    assert next(AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="full fine-tuning checkpoint"):  # experiments/export_lora.py's refusal
        export_hf(ckpt, tmp_path / "merged", lora_only=True)


def test_bad_input_is_one_line(tmp_path):
    bad = tmp_path / "step_000001.ckpt"
    torch.save({"state_dict": {}}, bad)  # no resume metadata: not a training checkpoint
    for args, text in (([str(tmp_path / "none.ckpt"), str(tmp_path / "o")], "no checkpoint at"),
                       ([str(bad), str(tmp_path / "o")], "is not a checkpoint written by"),
                       ([str(bad), str(tmp_path / "o"), "--dtype", "int8"], "invalid choice")):
        p = run_in_process(fspo.cli.export, ["fspo-export", *args], cwd=REPO)
        assert p.returncode == 2 and text in p.stderr and "Traceback" not in p.stderr, p.stderr[-1500:]
    with pytest.raises(ValueError, match="dtype must be one of"):
        export_hf(bad, tmp_path / "o", dtype="int8")
