#!/usr/bin/env bash
# One-off: choose the quickstart's pre-training and DP learning rates on held-out private TRAINING rows (the
# last 150 of the private classes' train split), never the test split. The quickstart's path by hand
# (docs/cli.md), with each pre-training learning rate run twice (fresh secret seeds) and a sweep over the DP
# last layer's learning rate on the features of each backbone, 5 repeats, --holdout 150.
#
#   bash benchmarks/quickstart_defaults.sh WORK_DIR
#   PRETRAIN_LRS="0.01 0.003 0.001" DP_LRS=1,0.5,0.25 bash benchmarks/quickstart_defaults.sh WORK_DIR  # other grids
#
# Prints one table row per (pre-training lr, backbone, DP lr): the held-out top-1 (EMA) of every repeat. The
# scores depend on private training rows, so they are NOT covered by epsilon: keep WORK_DIR to yourself.
set -euo pipefail
work=${1:?usage: bash benchmarks/quickstart_defaults.sh WORK_DIR}
mkdir -p "$work"
cd "$work"
[ -d public ] || dpscale ingest digits public --classes 0,1,2,3,4 >/dev/null
[ -d private ] || dpscale ingest digits private --classes 5,6,7,8,9 >/dev/null
[ -d public-dedup ] || dpscale dedup public private public-dedup >/dev/null
dp_lrs=${DP_LRS:-4,2,1,0.5}
for pretrain_lr in ${PRETRAIN_LRS:-0.1 0.03 0.01}; do
  for backbone_repeat in 0 1; do
    name=pre$pretrain_lr-b$backbone_repeat
    [ -d "runs/$name" ] || dpscale train public-dedup "runs/$name" --epsilon inf --batch-size 128 --steps 200 \
      --learning-rate "$pretrain_lr" --momentum 0.9 --augment-pad 1 --no-flip >/dev/null
    [ -d "backbone-$name" ] || dpscale export-backbone "runs/$name" "backbone-$name" >/dev/null
    entry=$(dpscale featurize private --backbone "backbone-$name" --cache-dir cache |
      python3 -c 'import json, sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])["path"])')
    sweep=sweep-$name-lr${dp_lrs//,/_}
    [ -d "$sweep" ] || dpscale sweep "$entry" "$sweep" --epsilons 8 --learning-rates "$dp_lrs" --batch-size 512 \
      --steps 1000 --repeats 5 --holdout 150 --private-diagnostics >/dev/null
    python3 - "$pretrain_lr" "$backbone_repeat" "$sweep/runs.NOT-PRIVATE.csv" <<'EOF'
import csv, sys
pretrain_lr, backbone_repeat, path = sys.argv[1:]
scores = {}
for row in csv.DictReader(open(path)):
    if row["split"] == "holdout":
        scores.setdefault(float(row["learning_rate"]), []).append(float(row["ema_top1"]))
for lr, values in sorted(scores.items()):
    print(f"| {pretrain_lr} | {backbone_repeat} | {lr:g} | " + " ".join(f"{v:.3f}" for v in values) + " |")
EOF
  done
done
