#!/usr/bin/env bash
# The DeepScaleR-1.5B recipe: three GRPO stages (8K -> 16K -> 24K responses), each starting from
# the previous stage's weights, with AIME 2024 avg@16 (T=0.6, top-p 0.95, 32K tokens) after each.
# Needs GPUs and network access to the Hugging Face hub. Extra flags go to every grpo.py call,
# e.g. `recipes/deepscaler.sh --num-trainers 8 --num-engines 8 --ray-address auto`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
prev=""
for stage in 8k 16k 24k; do
    init=()
    [ -n "$prev" ] && init=(--init-from "$prev")
    $PY grpo.py --config "recipes/deepscaler-$stage.toml" "${init[@]}" "$@"
    prev="out/deepscaler-$stage"
    $PY evaluate.py --model "$prev" --backend vllm --data HuggingFaceH4/aime_2024 -n 16 \
        --temperature 0.6 --top-p 0.95 --max-new-tokens 32768 --template boxed \
        --out "$prev/eval-aime24"
done
