"""Supervised warm start of the embedded tiny policy on the built-in arithmetic task.

It makes `fspo/assets/tiny_warmstart/` (config, safetensors, tokenizer), the start of the default RL run: a
policy that is partly right (as the paper starts from base models). The committed one came from the defaults:

    python experiments/warmstart.py --steps 400 --slip 0.5 --out fspo/assets/tiny_warmstart

The long-chain warm start (``fspo/assets/tiny_warmstart_long``, the length-law task conf/data/arithmetic_law.yaml)
continues that one on 4..64-operand chains (responses ~30-600 tokens); its command is in its warmstart.json.

Training: next-token cross-entropy on the response tokens (the worked solution + EOS) only, AdamW,
cosine schedule. The demonstrations carry a realistic, learnable flaw, like the answer-reporting
habits RL fixes first in base models: in a fraction ``--slip`` (default 0.5) of them the worked
steps are right but the "Answer:" line reports the running total from before the last step. The
warm-started policy therefore computes well but reports the final answer correctly only about half
the time, a partly-right policy whose improvement under RL is measurable in minutes on a CPU. Prints greedy and
sampled (temperature 1) accuracy on held-out problems, and writes them to ``warmstart.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from fspo.data.arithmetic import ArithmeticTask, worked_solution
from fspo.data.mod_chain import ModChainTask, demonstration
from fspo.models.tiny import build_tiny_model, build_tokenizer
from fspo.rewards.arithmetic import ArithmeticReward
from fspo.rewards.mod_chain import ChainConsistencyReward


def arithmetic_demo(sample, slip: float, rng) -> str:
    """The worked solution; a fraction ``slip`` of them report the total before the last step."""
    nums = sample.meta["nums"]
    sol = worked_solution(nums, sample.meta["ops"])[0]
    if not (slip > 0 and rng.random() < slip):
        return sol
    lines = sol.split("\n")
    before_last = lines[-3].split("=")[-1] if len(lines) >= 3 else str(nums[0])
    return "\n".join(lines[:-1] + [f"Answer: {before_last}"])


def mod_chain_demo(sample, slip: float, rng) -> str:
    """The chain with a fraction ``slip`` of its lines slipped (fspo/data/mod_chain.py)."""
    return demonstration(sample.meta["v0"], sample.meta["n"], slip, rng, sample.meta["step"])


def make_batch(samples, tok, device="cpu", slip: float = 0.0, rng=None, demo=arithmetic_demo):
    """Left-pad prompt+solution+EOS; labels are -100 outside the response. ``demo(sample, slip, rng)``
    writes each solution (the arithmetic task's by default)."""
    seqs, labels = [], []
    for s in samples:
        sol = demo(s, slip, rng)
        p = tok(s.prompt, add_special_tokens=False)["input_ids"]
        r = tok(sol, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(p + r)
        labels.append([-100] * len(p) + r)
    def pad(rows, value):  # left-padded
        return pad_sequence([torch.tensor(r) for r in rows], batch_first=True, padding_value=value,
                            padding_side="left").to(device)

    return pad(seqs, tok.pad_token_id), pad([[1] * len(s) for s in seqs], 0), pad(labels, -100)


@torch.no_grad()
def accuracy(model, tok, samples, temperature: float, max_new_tokens: int = 128, seed: int = 0,
             reward=None, by_length=None) -> float:
    """Mean ``correct`` credit of ``samples`` (greedy when temperature == 0; ``reward`` the task's,
    ArithmeticReward by default). ``by_length`` (a dict) receives the mean credit per response-length bin
    [2^k, 2^(k+1)) keyed ``len_<lo>_<hi>``, with the bin's count."""
    from fspo.rollout.base import SamplingConfig
    from fspo.rollout.hf import HFEngine

    eng = HFEngine(batch_size=128)
    eng.setup(model, tok, workdir="")
    ids = [tok(s.prompt, add_special_tokens=False)["input_ids"] for s in samples]
    out = eng.generate(ids, SamplingConfig(n=1, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed))
    texts = tok.batch_decode(out.response_ids, skip_special_tokens=True)
    reward = reward or ArithmeticReward()
    r = reward(texts, [s.answer for s in samples], out.lengths.tolist(), out.overlong.tolist(), max_new_tokens)
    if by_length is not None:
        for c, n in zip(r.components["correct"], out.lengths.tolist()):
            lo = 2 ** max(0, int(n).bit_length() - 1)
            cell = by_length.setdefault(f"len_{lo:05d}_{2 * lo:05d}", [0.0, 0])
            cell[0], cell[1] = cell[0] + c, cell[1] + 1
        for k, (tot, cnt) in by_length.items():
            by_length[k] = [round(tot / cnt, 4) if isinstance(cnt, int) and cnt else tot, cnt]
    return sum(r.components["correct"]) / len(samples)


def _save(model, tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-size", type=int, default=20000)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--slip", type=float, default=0.5)
    ap.add_argument("--max-operand", type=int, default=9)
    ap.add_argument("--max-ops", type=int, default=9)
    ap.add_argument("--min-ops", type=int, default=2)
    ap.add_argument("--task", choices=("arithmetic", "mod_chain"), default="arithmetic",
                    help="mod_chain: the length-law task (--slip is then the per-line slip rate)")
    ap.add_argument("--bucket", type=int, default=1, help="> 1: each batch is a random window of a pool of "
                    "bucket x batch-size problems sorted by length (less padding); 1: uniform batches")
    ap.add_argument("--min-lines", type=int, default=4, help="mod_chain: shortest chain")
    ap.add_argument("--max-lines", type=int, default=100, help="mod_chain: longest chain")
    ap.add_argument("--init", default=None, help="start from this checkpoint (e.g. fspo/assets/tiny_warmstart) "
                    "instead of a fresh model: the long-chain warm start continues the default one")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="of the accuracy evaluations")
    ap.add_argument("--eval-size", type=int, default=256)
    ap.add_argument("--max-positions", type=int, default=None,
                    help="set the config's max_position_embeddings (and the tokenizer's model_max_length): "
                         "RoPE has no table, the number only bounds prompt + response")
    ap.add_argument("--out", default="fspo/assets/tiny_warmstart")
    a = ap.parse_args(argv)

    torch.manual_seed(a.seed)
    tok = build_tokenizer()
    if a.init:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(a.init, torch_dtype=torch.float32)
    else:
        model = build_tiny_model(seed=a.seed)
    if a.max_positions:
        model.config.max_position_embeddings = tok.model_max_length = int(a.max_positions)
    if a.task == "mod_chain":  # the length-law task (conf/data/mod_chain.yaml)
        task = dict(min_lines=a.min_lines, max_lines=a.max_lines)
        train = ModChainTask("train", size=a.train_size, seed=0, **task)
        val = [ModChainTask("val", size=a.eval_size, seed=0, **task)[i] for i in range(a.eval_size)]
        demo, reward = mod_chain_demo, ChainConsistencyReward()
    else:
        task = dict(max_operand=a.max_operand, max_ops=a.max_ops, min_ops=a.min_ops)
        # the RL train split (conf/data/arithmetic.yaml: seed 0, 20000 problems); validation excludes all of it
        train = ArithmeticTask("train", size=a.train_size, seed=0, **task)
        val = [ArithmeticTask("val", size=a.eval_size, seed=0, exclude_size=a.train_size, **task)[i]
               for i in range(a.eval_size)]
        demo, reward = arithmetic_demo, None
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, a.steps) / a.steps)))
    g = torch.Generator().manual_seed(a.seed)
    slip_rng = random.Random(a.seed)
    history, t0 = [], time.time()
    for step in range(1, a.steps + 1):
        idx = torch.randint(len(train), (a.batch_size * a.bucket,), generator=g).tolist()
        if a.bucket > 1:  # a random window of the pool sorted by length: less padding, about the same lengths
            idx.sort(key=lambda i: len(train[i].answer) if a.task == "arithmetic" else train[i].meta["n"])
            start = int(torch.randint(len(idx) - a.batch_size + 1, (1,), generator=g))
            idx = idx[start:start + a.batch_size]
        ids, att, lab = make_batch([train[i] for i in idx], tok, slip=a.slip, rng=slip_rng, demo=demo)
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0:
            print(json.dumps({"step": step, "loss": round(float(loss.detach()), 4),
                              "elapsed_s": round(time.time() - t0, 1)}), flush=True)
        if step == a.steps:  # saved before its evaluation: an evaluation error loses no training
            _save(model, tok, Path(a.out))
        if step % a.eval_every == 0 or step == a.steps:
            model.eval()
            n = a.max_new_tokens
            by_len = {}
            rec = {"step": step, "loss": float(loss.detach()),
                   "greedy_acc": accuracy(model, tok, val, 0.0, n, reward=reward),
                   "sampled_acc": accuracy(model, tok, val, 1.0, n, reward=reward, by_length=by_len),
                   "paper_decoding_acc": accuracy(model, tok, val, 0.6, n, reward=reward),
                   "sampled_acc_by_length": by_len,
                   "elapsed_s": time.time() - t0}
            model.train()
            history.append(rec)
            print(json.dumps(rec), flush=True)
    out = Path(a.out)
    (out / "warmstart.json").write_text(json.dumps({"args": vars(a), "history": history}, indent=1))
    print(f"saved warm start to {out}")


if __name__ == "__main__":
    main()
