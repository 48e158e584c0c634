#!/usr/bin/env bash
# Three GRPO stages on a laptop CPU (~10 min): 16 -> 24 -> 32 new tokens, each stage --init-from
# the previous one. Stage 1 is run in two halves, the second a `--resume auto`, so checkpoint,
# resume and stage hand-over are all exercised. One curves.png shows the three stages.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
$PY grpo.py --config recipes/tiny-staged/stage1.toml --steps 5 "$@"
$PY grpo.py --config recipes/tiny-staged/stage1.toml --resume auto "$@"
$PY grpo.py --config recipes/tiny-staged/stage2.toml --init-from out/tiny-staged/stage1 "$@"
$PY grpo.py --config recipes/tiny-staged/stage3.toml --init-from out/tiny-staged/stage2 "$@"
$PY recipes/plot_stages.py out/tiny-staged/stage1 out/tiny-staged/stage2 out/tiny-staged/stage3 \
    --out out/tiny-staged/curves.png
