"""LightningDataModule over prompt sources: one training batch = the prompts of one RL step, a dict
``{"prompts": [str], "answers": [str], "index": LongTensor}``; validation iterates its source in order."""
from __future__ import annotations

from typing import List

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from fspo.data.sampler import PromptStepSampler


class _Prompts(Dataset):
    def __init__(self, source):
        self.source = source

    def __len__(self):
        return len(self.source)

    def __getitem__(self, i):
        s = self.source[i]
        return {"prompt": s.prompt, "answer": s.answer, "index": i}


def collate_prompts(items: List[dict]) -> dict:
    return {"prompts": [x["prompt"] for x in items], "answers": [x["answer"] for x in items],
            "index": torch.tensor([x["index"] for x in items], dtype=torch.long)}


class _WholeRun:
    """The prompt sampler as Lightning's batch sampler: iterates from the sampler's position, its length the whole
    run, as Lightning's restored loop progress already counts the steps done."""

    def __init__(self, sampler: PromptStepSampler):
        self.sampler = sampler

    def __iter__(self):
        return iter(self.sampler)

    def __len__(self) -> int:
        return self.sampler.steps


class _PromptLoader(DataLoader):
    """DataLoader whose state is the prompt sampler's position, so Lightning treats it as resumable."""

    def state_dict(self) -> dict:
        return self.batch_sampler.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.sampler.load_state_dict(state)


class PromptDataModule(L.LightningDataModule):
    """``train_source``/``val_source``: PromptSources; ``steps`` RL steps of ``prompts_per_step`` prompts."""

    def __init__(self, train_source, val_source=None, prompts_per_step: int = 16, steps: int = 100,
                 val_batch_size: int = 64, seed: int = 0):
        super().__init__()
        if val_source is not None and len(val_source) == 0:
            raise ValueError("the validation prompt set is empty: set val.size > 0 or disable validation")
        self.train_source, self.val_source = train_source, val_source
        self.sampler = PromptStepSampler(len(train_source), prompts_per_step, steps, seed)
        self.val_batch_size = val_batch_size

    def train_dataloader(self):
        return _PromptLoader(_Prompts(self.train_source), batch_sampler=_WholeRun(self.sampler),
                            collate_fn=collate_prompts)

    def val_dataloader(self):
        if self.val_source is None:
            return []
        return DataLoader(_Prompts(self.val_source), batch_size=self.val_batch_size, shuffle=False,
                          collate_fn=collate_prompts)

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
