"""Peak memory and wall time of the LM-head log-prob, forward + backward: dense vs chunked.

``dense`` is `fspo.logprobs.response_log_probs`'s computation on the full [K, V] logits
(``(hidden @ weight.T).float() / T``, log_softmax, gather, autograd); ``chunked`` is
`fspo.update.lm_head.chunked_token_logprobs` with ``--chunk`` rows per chunk. Both backpropagate
``logp.sum()`` into ``hidden`` [K, H] and ``weight`` [V, H] (float32, CPU).

Each mode runs in a fresh process (this script re-invoked with ``--mode``) so the peaks do not mix.
The reported ``peak_rss_delta_mib`` is ``ru_maxrss`` after forward + backward minus ``ru_maxrss``
right after the inputs were allocated (the high-water mark first reset to the current RSS through
``/proc/self/clear_refs`` where Linux allows it; what the log-prob itself adds: logits or chunks,
softmax, the hidden / weight gradients).

    python benchmarks/bench_lm_head_memory.py                       # K=2048, H=1024, V=151936, chunk 1024
    python benchmarks/bench_lm_head_memory.py --tokens 512 --out .bench/lm_head.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from _common import ROOT, child_row, emit_row, maxrss_mib, reset_peak_rss, write_json

MODES = ("dense", "chunked")


def worker(args) -> dict:
    import torch

    from fspo.update.lm_head import chunked_token_logprobs

    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, requires_grad=True)
    weight = torch.randn(args.vocab, args.hidden).mul_(args.hidden ** -0.5).requires_grad_(True)
    targets = torch.randint(0, args.vocab, (args.tokens,))
    reset = reset_peak_rss()  # setup temporaries (imports, random init) must not hide the log-prob's peak
    base = maxrss_mib()
    t0 = time.perf_counter()
    if args.mode == "dense":
        logits = (hidden @ weight.t()).float() / args.temperature
        logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        del logits
    else:
        logp, _ = chunked_token_logprobs(hidden, weight, targets, temperature=args.temperature,
                                         chunk_size=args.chunk)
    logp.sum().backward()
    wall = time.perf_counter() - t0
    peak = maxrss_mib()
    return dict(mode=args.mode, tokens=args.tokens, hidden=args.hidden, vocab=args.vocab,
                chunk=args.chunk if args.mode == "chunked" else None, temperature=args.temperature,
                threads=torch.get_num_threads(), peak_reset=reset, baseline_rss_mib=round(base, 1),
                peak_rss_mib=round(peak, 1), peak_rss_delta_mib=round(peak - base, 1),
                wall_s=round(wall, 3), logp_sum=float(logp.detach().sum()),
                grad_hidden_norm=float(hidden.grad.norm()), grad_weight_norm=float(weight.grad.norm()))


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="K: positions (rows of hidden)")
    ap.add_argument("--hidden", type=int, default=1024, help="H")
    ap.add_argument("--vocab", type=int, default=151936, help="V (Qwen3: 151,936)")
    ap.add_argument("--chunk", type=int, default=1024, help="rows per chunk (chunked mode)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", type=str, default=None, help="JSON path for the results")
    ap.add_argument("--mode", choices=MODES, default=None, help=argparse.SUPPRESS)  # worker
    args = ap.parse_args(argv)
    if args.mode is not None:
        emit_row(worker(args))
        return []
    rows = []
    for mode in MODES:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--mode", mode, "--tokens", str(args.tokens),
               "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--chunk", str(args.chunk),
               "--temperature", str(args.temperature)]
        row, out = child_row(cmd, cwd=ROOT, env=dict(os.environ))
        if row is None:
            sys.stderr.write(out.stderr)
            raise SystemExit(f"{mode} worker failed with exit status {out.returncode}")
        rows.append(row)
    print(f"K={args.tokens} H={args.hidden} V={args.vocab} chunk={args.chunk} T={args.temperature} "
          f"threads={rows[0]['threads']}")
    print(f"{'mode':<8} {'peak RSS delta MiB':>19} {'peak RSS MiB':>13} {'wall s':>8} {'sum logp':>14}")
    for r in rows:
        print(f"{r['mode']:<8} {r['peak_rss_delta_mib']:>19.1f} {r['peak_rss_mib']:>13.1f} {r['wall_s']:>8.2f} "
              f"{r['logp_sum']:>14.4f}")
    d, c = rows
    print(f"chunked / dense peak delta: {c['peak_rss_delta_mib'] / max(d['peak_rss_delta_mib'], 1e-9):.3f}; "
          f"|sum logp diff| = {abs(c['logp_sum'] - d['logp_sum']):.3g}; "
          f"grad norms rel diff hidden {abs(c['grad_hidden_norm'] / d['grad_hidden_norm'] - 1):.2g}, "
          f"weight {abs(c['grad_weight_norm'] / d['grad_weight_norm'] - 1):.2g}")
    if args.out:
        write_json(args.out, dict(args={k: v for k, v in vars(args).items() if k != "mode"}, results=rows), indent=2)
    return rows


if __name__ == "__main__":
    main()
