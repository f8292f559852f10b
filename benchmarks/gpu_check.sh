#!/usr/bin/env bash
# The DP step against the non-private one on a GPU (run by hand, alone, on a machine with one GPU).
#
#   bash benchmarks/gpu_check.sh DATA [WHEELS]
#
# DATA: an ingested image dataset (e.g. a CIFAR-10 subset); WHEELS: a folder of wheels of the
# dependencies the machine lacks (installed to /tmp/site first, for a machine without a package
# registry). From the repository's root. Runs, each in a fresh process:
#   1. the peers' step (benchmarks.peers_run_jax), WRN-16-4 at physical 256 / logical 1,024:
#      non-private, DP with the device's clip tuning (its paths chosen by its cost model), DP with
#      each layer's held-gradient paths timed (explicit against grouped, ghost beside: gpu-timed),
#      and, last, DP with the CPU's tuning (chunks sized for a cache, the CPU's shape rule, full float32);
#   2. `dpscale train` on DATA at K = 1 and 4, epsilon inf and 8 (B = 1,024, micro-batch 256),
#      the median step after warm-up and the first (compiling) step, and each run's clip_paths.json.
# Writes $OUT/gpu-check.txt (a line a measurement), $OUT/gpu-check.jsonl (the peers' JSON lines) and
# $OUT/clip-paths-k{1,4}.json (the DP runs' clip_paths.json);
# BUDGET (s, default 540) skips what no longer fits, STEPS (default 40: every second step logs epsilon and is left out) the train runs' steps; MODEL,
# MICRO and BATCH (defaults above) make a small try on a CPU before a GPU's short lease; KS (default "1 4")
# the train runs' K; PEERS=0 leaves out the peers' step; DP_NEED (s, default 90) the budget a DP train run
# must have left to start (one stopped while compiling measures nothing); PROBE_XLA_FLAGS (e.g.
# --xla_gpu_autotune_level=0) one more K = 1 DP run with those flags added, to see where its compilation goes
# (its clip-paths file overwrites the first's). XLA_FLAGS, if set, is said in the log.
set -u
data=${1:?usage: gpu_check.sh DATA [WHEELS]}; wheels=${2:-}
out=${OUT:-/tmp/gpu-check}; mkdir -p "$out"; log=$out/gpu-check.txt; : > "$log"
work=$(mktemp -d)  # stderr of each process: its tail goes to the log when it fails
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$SECONDS; budget=${BUDGET:-540}; steps=${STEPS:-40}
model=${MODEL:-wrn-16-4}; micro=${MICRO:-256}; batch=${BATCH:-1024}; ks=${KS:-1 4}; peers=${PEERS:-1}
if [[ -n $wheels ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl 2>&1 | tail -2
  mkdir -p /tmp/pkg; ln -sfn "$PWD" /tmp/pkg/dpscale; export PYTHONPATH=/tmp/site:/tmp/pkg
fi
say() { echo "$*" | tee -a "$log"; }
left() { echo $(( budget - (SECONDS - start) )); }
say "== $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) | $(python3 -c 'import jax; print("jax", jax.__version__, jax.default_backend())' 2>&1 | tail -1) | commit $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo +dirty)${XLA_FLAGS:+ | XLA_FLAGS=$XLA_FLAGS}"

peers() {  # peers NAME ARGS...: one peers' step measurement, its JSON line kept
  local name=$1; shift
  if (( $(left) < 40 )); then say "SKIP (time) $name"; return; fi
  local s=$SECONDS line
  line=$(timeout "$(left)" python3 -m benchmarks.peers_run_jax --workload "$model" --physical "$micro" --logical "$batch" \
         --warmup 2 --repeats 10 "$@" 2>"$work/$name.err" | grep '^PEERS-RESULT' | tail -1 | cut -d' ' -f2-)
  echo "{\"name\": \"$name\", \"result\": ${line:-null}}" >> "$out/gpu-check.jsonl"
  say "[$((SECONDS - s)) s] $name :: $(echo "$line" | python3 -c 'import json, sys
r = json.loads(sys.stdin.read() or "{}")
print({k: r.get(k) for k in ("status", "examples_per_s", "platform", "clip_paths", "clip_build_s")})' 2>&1 | tail -1)"
  [[ -z $line ]] && tail -5 "$work/$name.err" | tee -a "$log"
}

train() {  # train K EPSILON
  local k=$1 eps=$2 run=$work/runs/k$1-eps$2 need=40
  [[ $eps != inf ]] && need=${DP_NEED:-90}  # a DP run on an H200: ~20 s to start, 35-40 s compiling, its steps
  if (( $(left) < need )); then say "SKIP (time: $(left) s left, a run needs $need) train K=$k eps=$eps"; return; fi
  rm -rf "$run"; mkdir -p "$(dirname "$run")"; local s=$SECONDS
  timeout "$(left)" python3 -m dpscale train "$data" "$run" --model "$model" --epsilon "$eps" --batch-size "$batch" \
    --microbatch-size "$micro" --augmult "$k" --steps "$steps" --checkpoint-every 100000 --seed 7 --private-diagnostics \
    >/dev/null 2>"$work/train-k$k-$eps.err" || tail -3 "$work/train-k$k-$eps.err" | tee -a "$log"
  say "[$((SECONDS - s)) s] train K=$k eps=$eps :: $(python3 - "$run" <<'PY' 2>&1 | tail -1
import json, statistics, sys
from pathlib import Path
from benchmarks.dp_step_cost import per_step_seconds
run = Path(sys.argv[1])
steps = per_step_seconds(run)
records = [json.loads(line) for path in run.glob("*.jsonl") for line in path.read_text().splitlines()]
first = min(r["seconds"] for r in records if r.get("step") == 1 and "seconds" in r)
later = [s for t, s in steps.items() if t > 4]
print(f"median step {statistics.median(later):.4f} s over {len(later)} steps, first step {first:.1f} s"
      if later else f"no step without an epsilon log after step 4 (more --steps); first step {first:.1f} s")
PY
)"
  [[ -f $run/clip_paths.json ]] && cp "$run/clip_paths.json" "$out/clip-paths-k$k.json"
}

if (( peers )); then
  peers nonprivate --framework dpscale-nonprivate; peers dp-device-tuning --framework dpscale
  peers dp-gpu-timed --framework dpscale --clip-tuning gpu-timed  # explicit vs grouped, timed per layer
fi
for k in $ks; do train "$k" inf; train "$k" 8; done
if [[ -n ${PROBE_XLA_FLAGS:-} ]]; then  # where the DP step's compilation goes: one K = 1 DP run again, flags added
  say "-- probe: XLA_FLAGS+=$PROBE_XLA_FLAGS"
  XLA_FLAGS="${XLA_FLAGS:-} $PROBE_XLA_FLAGS" train 1 8
fi
if (( peers )); then peers dp-cpu-tuning --framework dpscale --clip-tuning cpu; fi
say "== done in $((SECONDS - start)) s"
