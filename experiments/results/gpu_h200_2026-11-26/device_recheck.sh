#!/bin/bash
export PYTHONPATH=$PWD:$PWD/.gpu/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 110 python3 -m pytest -p no:cacheprovider -q -m gpu -rA --timeout 100 tests/test_gpu_lane.py -k "flagship or dcp or lora_under" 2>&1 | tee $OUT/gpu_tests2.log | grep -E "PASS|FAIL|Error|passed|failed" | tail -20
SMOKE="model.source=random prompts_per_step=16 rollout.sampling.n=8 rollout.sampling.max_new_tokens=1024"
timeout ${SMOKE_S:-150} python3 experiments/gpu_smoke.py --model qwen3_1_7b --steps 1 --out $OUT/smoke_1_7b.json -- $SMOKE 2>&1 | tee $OUT/smoke2.log | grep -E "gpu_smoke|phase|^generate|^old|^update|auto-fit|placement|Error" | tail -40
