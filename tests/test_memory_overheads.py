"""The memory plan's overheads beyond weights, states and activations (fspo/runtime/launch/memory_overheads.py),
on hand-computed numbers.

- The longest sequence: a sequence longer than ``ppo.micro_batch_max_tokens`` runs alone in its micro-batch
  (fspo/update/packing.py), so activations and logits are sized for max(budget, prompt + response); the
  1.7B paper preset (budget 8,192, sequences up to 20,000 tokens) is planned at 20,000 tokens, not 8,192.
- On a GPU: the CUDA context, NCCL's buffers (W > 1), vLLM's CUDA-graph pool, fragmentation; under FSDP the
  root's unsharded gradients plus the reduce-scatter input; everywhere: the gathered rollout batch.
"""
from __future__ import annotations

from dataclasses import replace

from conftest import compose_config
from fspo.runtime.launch.memory_components import GIB, Layout, ModelShape, plan_memory
from fspo.runtime.launch.memory_overheads import CUDA_CONTEXT, CUDA_GRAPHS, FRAGMENTATION, NCCL_BUFFERS
from fspo.runtime.launch.memory_plan import layout_of, model_shape

SMALL = ModelShape(vocab=10, hidden=4, layers=3, heads=2, kv_heads=1, head_dim=2, intermediate=8, tied=False)


def test_a_sequence_longer_than_the_budget_sizes_the_update():
    x = Layout(micro_tokens=3, longest_tokens=7)
    p, at_budget = plan_memory(SMALL, x), plan_memory(SMALL, replace(x, longest_tokens=3))
    # per token and layer 4 B * (6H 24 + 4q 16 + 4kv 8 + 4I 32) + norms 28 = 348; logits V 10 x 20 B
    assert p.activations == 7 * 348 * 3 and at_budget.activations == 3 * 348 * 3
    assert p.logits == 7 * 10 * 20 and at_budget.logits == 3 * 10 * 20
    assert plan_memory(SMALL, replace(x, micro_tokens=9)).activations == 9 * 348 * 3  # the budget when longer


def test_paper_1_7b_preset_is_planned_at_its_longest_sequence():
    cfg = compose_config(["+experiment=paper_qwen3_1_7b", "+method=fspo", "memory_plan.device_gib=141"])
    shape = model_shape(cfg.model)
    x = layout_of(cfg, shape, 141 * GIB)
    assert (x.micro_tokens, x.longest_tokens) == (8192, 2000 + 18000)
    p = plan_memory(shape, x)
    assert p.logits == 20000 * 151936 * 22  # dense head, bf16 autocast: 20 + 2 B per logit
    assert p.logits / GIB > 62  # was 25.5 GiB at the 8,192-token budget


def test_gpu_overheads_by_hand():
    x = Layout(ranks=2, dtype_bytes=4, compute_bytes=2, micro_tokens=3, gpu=True, engine="vllm", engine_bytes=2,
               engine_reserved=5000, engine_cuda_graphs=True, rollout_rows=4, longest_tokens=5)
    p = plan_memory(SMALL, x)
    assert p.cuda_context == CUDA_CONTEXT and p.nccl_buffers == NCCL_BUFFERS and p.cuda_graphs == CUDA_GRAPHS
    assert p.root_grads == (552 - 3 * 156) * (2 + 4)  # the root: embeddings + head + final norm
    assert p.rollout_batch == 4 * 5 * 32
    rest = {k: v for k, v in p.parts.items() if k != "fragmentation"}
    resident = sum(v for k, v in rest.items() if p.phases[k] == "resident")
    train = sum(v for k, v in rest.items() if p.phases[k] == "train")
    assert p.fragmentation == int(FRAGMENTATION * (resident + max(train, p.phase_total("generate"))))
    assert p.peak == resident + p.fragmentation + max(train, p.phase_total("generate"))
    one = plan_memory(SMALL, replace(x, ranks=1, engine_cuda_graphs=False))
    assert one.nccl_buffers == one.root_grads == one.cuda_graphs == 0 and one.cuda_context == CUDA_CONTEXT
    cpu = plan_memory(SMALL, replace(x, gpu=False))
    assert cpu.cuda_context == cpu.nccl_buffers == cpu.cuda_graphs == cpu.fragmentation == 0
    assert plan_memory(SMALL, replace(x, lora_rank=2)).root_grads == 0  # the LoRA root is frozen


def test_layout_reads_the_overheads_from_the_config():
    cfg = compose_config(["+experiment=paper_8xh200", "+method=fspo", "memory_plan.device_gib=141"])
    x = layout_of(cfg, model_shape(cfg.model), 141 * GIB)
    assert x.gpu and x.engine_cuda_graphs and x.rollout_rows == 128 * 16 and x.ranks == 8
    eager = compose_config(["+experiment=paper_8xh200", "+method=fspo", "memory_plan.device_gib=141",
                            "rollout.engine.enforce_eager=true"])
    assert not layout_of(eager, model_shape(eager.model), 141 * GIB).engine_cuda_graphs
    assert not layout_of(compose_config([]), model_shape(compose_config([]).model), GIB).gpu
