"""Where and how a run's processes run: the bottom layer of fspo.runtime (imports no other runtime subpackage).

Owns: distributed.py (data-parallel mesh, the FSDP2 strategy, collectives), rank_zero.py (which process is
rank zero, before and after torch.distributed starts), launcher.py (this process's local rank),
precision.py (float32 masters, the bf16 refusal), memory_components.py and memory_plan.py (the per-rank
memory plan, the dry run and the refusal that names a layout that fits) and vllm_support.py (the vLLM
versions supported). Leaves out: checkpoints (fspo.runtime.checkpoints) and the up-front config checks
(fspo.runtime.checks).
"""
