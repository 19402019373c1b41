"""FSPO in TRL on a CPU, in a minute: FSPOTrainer used exactly like GRPOTrainer (docs/integrations.md).

    pip install 'fspo[trl]'
    python benchmarks/trl_fspo_example.py                 # 2 steps, the tiny warm-started Qwen3, toy reward
    python benchmarks/trl_fspo_example.py --steps 4 --out /tmp/fspo_trl

The model is this project's ~1M-parameter Qwen3 (fspo.models.tiny, committed warm start, its own
character-level tokenizer), the prompts our arithmetic task's ("Q:3+4-2\\nA:"), the reward a toy
one written here: 1 when the completion's "Answer:" line holds the right value, else 0. It prints
the per-length clip fractions TRL logged (``clip_ratio/by_length/<bin>``) and returns TRL's log
history. tests/test_integration_trl.py runs it.
"""
from __future__ import annotations

import argparse
import re
import tempfile


def answer_reward(completions, answer, **_):
    """Toy verifiable reward: 1.0 where the completion's 'Answer: <n>' equals the reference."""
    out = []
    for text, ref in zip(completions, answer):
        m = re.search(r"Answer:\s*(-?\d+)", text)
        out.append(1.0 if m is not None and m.group(1) == str(ref) else 0.0)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps (2 per generation: the second is off-policy)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per generation")
    ap.add_argument("--G", type=int, default=4, help="completions per prompt (num_generations)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--out", default=None, help="output_dir (default: a temporary folder)")
    a = ap.parse_args(argv)

    import torch
    from datasets import Dataset

    from fspo.data.arithmetic import ArithmeticTask
    from fspo.integrations.trl import FSPOConfig, FSPOTrainer
    from fspo.models.loading import load_policy

    torch.manual_seed(0)
    task = ArithmeticTask(split="train", size=a.prompts * a.steps, seed=0, min_ops=2, max_ops=4)
    data = Dataset.from_list([{"prompt": s.prompt, "answer": s.answer} for s in (task[i] for i in range(len(task)))])
    model, tokenizer = load_policy(source="warmstart")
    args = FSPOConfig(
        output_dir=a.out or tempfile.mkdtemp(prefix="fspo_trl_"),
        per_device_train_batch_size=a.prompts * a.G // 2, steps_per_generation=2, num_generations=a.G,
        max_steps=a.steps, max_completion_length=a.max_new_tokens, learning_rate=a.lr, length_bin_width=8,
        use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none", logging_steps=1,
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = FSPOTrainer(model=model, reward_funcs=answer_reward, args=args, train_dataset=data,
                          processing_class=tokenizer)
    trainer.train()
    for row in trainer.state.log_history:
        by_length = {k.rsplit("/", 1)[1]: round(v, 3) for k, v in row.items() if k.startswith("clip_ratio/by_length/")}
        if by_length:
            reward = f"reward {row['reward']:.3f}, " if "reward" in row else ""  # logged on generation steps
            print(f"step {row['step']}: {reward}clip_ratio/region_mean {row['clip_ratio/region_mean']:.4f}, "
                  f"clip_ratio/by_length {by_length}")
    return trainer


if __name__ == "__main__":
    main()
