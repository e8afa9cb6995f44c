#!/bin/bash
# Build, test and benchmark jax-dqpost on the GPU machine in one call (see GPU_RESULTS.md for runs):
#   ../shared/device/stage.sh --peer && git rev-parse HEAD > .device/COMMIT     (here, before the run)
#   source .device/setup.sh && bash tools/gpu_check.sh                          (on the GPU machine)
# STEPS (default "tests sanitizer bench") picks steps; the build always runs. BENCH_ARGS go to the benchmark.
set -o pipefail
repo=$(pwd)
out=${OUT:-/tmp/out}; mkdir -p "$out"
steps=${STEPS:-tests sanitizer bench}
echo "== date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
echo "== commit: $(cat .device/COMMIT 2>/dev/null || echo unknown)"
export JAX_DQPOST_COMMIT=$(cut -c1-7 .device/COMMIT 2>/dev/null)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"

echo "== build (pip install --no-build-isolation: scikit-build-core + CMake + the FFI handler)"
t0=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps --no-index --target /tmp/pkg "$repo" || exit 1
echo "built in $(( $(date +%s) - t0 )) s: $(ls /tmp/pkg/jax_dqpost/*.so)"
export PYTHONPATH=/tmp/pkg:$PYTHONPATH
rc=0
if [[ $steps == *tests* ]]; then
  echo "== tests ${PYTEST_ARGS:-}"
  # 4 workers (pytest-xdist), each without JAX's 75% preallocation of the GPU's memory
  (cd /tmp && XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -n 4 -q -rA -p no:warnings -p no:cacheprovider \
    ${PYTEST_ARGS:-"$repo/tests"} 2>&1 | tee "$out/pytest.log" | grep -E -v "^PASSED" | tail -40) || rc=1
fi
if [[ $steps == *sanitizer* ]]; then
  echo "== compute-sanitizer memcheck: corrupt traced offsets"
  if command -v compute-sanitizer >/dev/null; then
    XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false compute-sanitizer --tool memcheck \
      --error-exitcode 1 python3 "$repo/tools/sanitize_varlen.py" 2>&1 | tee "$out/sanitizer.log" | tail -12
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  else
    echo "compute-sanitizer not found"; rc=1
  fi
fi
if [[ $steps == *bench* ]]; then
  echo "== benchmark: python -m jax_dqpost.bench ${BENCH_ARGS:-}"
  (cd /tmp && python3 -m jax_dqpost.bench --out "$out" ${BENCH_ARGS:-} 2>"$out/bench_progress.log" | tee "$out/bench.log") \
    || { rc=1; tail -30 "$out/bench_progress.log"; }
fi
exit $rc
