#!/bin/bash
# Serving runs of several commits on one machine in one call: the A/B that tells a regression
# from run-to-run spread. Two steps, because the GPU machine has no git history:
#   benchmarks/commit_ab.sh prepare COMMIT...      # here: each commit's sources into
#                                                  # .carry/trees/<short hash> (printed)
#   benchmarks/commit_ab.sh run LIMIT_S HASH...    # there (carry .carry): each tree's serving sweep
#                                                  # (at most LIMIT_S seconds each), results, logs
#                                                  # and summary.txt under $OUT (default ./ab_out)
# Trees run one after another, so drift of the machine over the call is confounded with the
# commit: interleave them (run 110 A B A B; each run's files carry its index). Each tree runs from
# its own sources (PYTHONPATH, with the package-dir links pyproject.toml maps); the package
# installed from the working tree supplies the metadata (and would supply a lazyattn_rag module
# a tree lacks: the import check only proves lazyattn_rag.engine is the tree's). SWEEP_ARGS
# overrides the sweep's options; BENCH replaces the whole benchmark (a script and its options,
# e.g. BENCH='benchmarks/decode_step.py --shapes 1x20480 --no-profile'; it must take --out NAME
# and write benchmarks/results/NAME.json).
set -uo pipefail
action=${1:-}; shift || true
root=$(pwd)
if [ "$action" = prepare ]; then
  for c in "$@"; do
    hash=$(git rev-parse --short "$c^{commit}") || exit 1
    d=.carry/trees/$hash; rm -rf "$d"; mkdir -p "$d"
    if ! git archive "$hash" pyproject.toml lazyattn_rag engine kernels integrations benchmarks tests \
        | tar -x -C "$d" --exclude='benchmarks/results/*'; then
      rm -rf "$d"; echo "$c: cannot be archived (no benchmarks/ or tests/ there?)" >&2; exit 1
    fi
    echo "$c -> $d"
  done
  exit 0
fi
[ "$action" = run ] || { echo "usage: $0 prepare COMMIT... | run LIMIT_S HASH..." >&2; exit 2; }
limit=$1; shift
out=${OUT:-$root/ab_out}; mkdir -p "$out"
args=${SWEEP_ARGS:---arch llama-3.1-8b --modes lazy --modes block_attention --budget-gb 10 --repeats 2}
bench=${BENCH:-benchmarks/serving.py sweep $args}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv \
  > "$out/gpu_state.txt" 2>&1
python -m pip install --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1 || echo "install failed (install.log)"
report() { echo "$1" | tee -a "$out/summary.txt"; }
i=0
for c in "$@"; do
  i=$((i + 1)); d=$root/.carry/trees/$c; name=ab_${i}_$c; log=$out/$name.log
  cd "$d" 2>/dev/null || { report "$c: no tree at $d (prepare it)"; continue; }
  mkdir -p benchmarks/results; rm -f "benchmarks/results/$name.json"
  for p in kernels engine integrations; do [ -e "lazyattn_rag/$p" ] || ln -s "../$p" "lazyattn_rag/$p"; done
  if ! PYTHONPATH=$d python -c "import lazyattn_rag.engine as e; assert e.__file__.startswith('$d'), e.__file__" \
      > "$log" 2>&1; then
    report "$c: the tree does not import from itself ($name.log)"; cd "$root"; continue
  fi
  start=$(date +%s); rc=0
  # shellcheck disable=SC2086
  PYTHONPATH=$d timeout -k 30 "$limit" python $bench --out "$name" >> "$log" 2>&1 || rc=$?
  status=ok; [ $rc -eq 124 ] && status="timed out: the JSON holds the runs that finished"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && status="failed, see $name.log"
  report "$c (run $i): rc=$rc, $(( $(date +%s) - start )) s, $status"
  cp "benchmarks/results/$name.json" "$out/" 2>/dev/null
  cd "$root"
done
