#!/bin/bash
# device check: the 1.7B-shape smoke (MFU per phase, peak vs plan) then the gpu lane.
export PYTHONPATH=$PWD:$PWD/.gpu/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/env.txt
python3 -c "import torch, lightning, transformers, peft, torchmetrics; print('torch', torch.__version__, 'lightning', lightning.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'torchmetrics', torchmetrics.__version__)" 2>&1 | tee -a $OUT/env.txt
SMOKE="model.source=random prompts_per_step=16 rollout.sampling.n=8 rollout.sampling.max_new_tokens=1024"
timeout ${SMOKE_S:-210} python3 experiments/gpu_smoke.py --model qwen3_1_7b --steps 2 --out $OUT/smoke_1_7b.json -- $SMOKE $EXTRA 2>&1 | tee $OUT/smoke.log | grep -v "it/s\]" | tail -40
timeout ${TESTS_S:-300} python3 -m pytest -p no:cacheprovider -q -m gpu -rA --timeout 240 ${TESTS:-tests/test_gpu_lane.py tests/test_gpu_vllm_memory.py tests/test_fsdp_lm_head.py tests/test_fsdp_master_weights.py tests/test_gpu_smoke.py} 2>&1 | tee $OUT/gpu_tests.log | tail -60
