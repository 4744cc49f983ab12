#!/bin/bash
# Serving runs of several commits side by side on one machine (same GPU, same hour): the A/B that
# tells a regression from run-to-run spread. Two steps, because the GPU machine has no git history:
#   benchmarks/commit_ab.sh prepare COMMIT...      # here: each commit's sources into .carry/trees/COMMIT
#   benchmarks/commit_ab.sh run LIMIT_S COMMIT...  # there (carry .carry): each tree's serving sweep,
#                                                  # results and logs under $OUT (default: ./ab_out)
# Each tree runs from its own sources (PYTHONPATH, package-dir links made as pyproject.toml maps
# them); the installed package only supplies its metadata. SWEEP_ARGS overrides the sweep's options.
set -euo pipefail
action=$1; shift
root=$(pwd)
if [ "$action" = prepare ]; then
  for c in "$@"; do
    d=.carry/trees/$c; rm -rf "$d"; mkdir -p "$d"
    git archive "$c" pyproject.toml lazyattn_rag engine kernels integrations benchmarks tests \
      | tar -x -C "$d" --exclude='benchmarks/results/*'
  done
  exit 0
fi
limit=$1; shift
out=${OUT:-$root/ab_out}; mkdir -p "$out"
args=${SWEEP_ARGS:---arch llama-3.1-8b --modes lazy --modes block_attention --budget-gb 10 --repeats 2}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv \
  > "$out/gpu_state.txt" 2>&1 || true
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
i=0
for c in "$@"; do
  i=$((i + 1)); d=$root/.carry/trees/$c; name=ab_${i}_$c
  cd "$d"; mkdir -p benchmarks/results
  for p in kernels engine integrations; do [ -e "lazyattn_rag/$p" ] || ln -s "../$p" "lazyattn_rag/$p"; done
  PYTHONPATH=$d python -c "import lazyattn_rag.engine as e; assert e.__file__.startswith('$d'), e.__file__"
  start=$(date +%s)
  # shellcheck disable=SC2086
  PYTHONPATH=$d timeout "$limit" python benchmarks/serving.py sweep $args --out "$name" > "$out/$name.log" 2>&1 \
    && echo "$c: $(( $(date +%s) - start )) s" || echo "$c: failed (see $name.log)"
  cp "benchmarks/results/$name.json" "$out/" 2>/dev/null || true
  cd "$root"
done
