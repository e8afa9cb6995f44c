#!/bin/bash
# Build, test and benchmark jax-dqpost on a CUDA machine in one call:
#   bash tests/gpu_check.sh
# It installs the package from this checkout (no dependencies, no index, no build isolation: they must be there
# already, scikit-build-core >= 1.0 among them, e.g. from the README's install with the [cuda13,test,bench]
# extras) into $TARGET (default: a temporary folder put first on PYTHONPATH), then runs the steps in $STEPS
# (default "tests sanitizer bench"): the whole pytest suite, compute-sanitizer memcheck on corrupt traced varlen offsets
# (tests/sanitize_varlen.py), and the benchmark (`python -m benchmarks`, benchmarks/README.md).
# PYTEST_ARGS replaces the test selection (paths relative to the checkout or absolute), BENCH_ARGS goes to the
# benchmark. Logs (pytest.log; failures.log, each failure's report as it happens) and bench.json/png go to $OUT
# (default: gpu_check_out/ in the checkout).
set -o pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$repo/gpu_check_out}; mkdir -p "$out"
target=${TARGET:-$(mktemp -d)}
steps=${STEPS:-tests sanitizer bench}
export JAX_DQPOST_COMMIT=${JAX_DQPOST_COMMIT:-$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "== date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $JAX_DQPOST_COMMIT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

echo "== build (scikit-build-core + CMake + the FFI handler) into $target"
t0=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps --no-index --target "$target" "$repo" || exit 1
echo "built in $(( $(date +%s) - t0 )) s: $(ls "$target"/jax_dqpost/*.so)"
export PYTHONPATH=$target${PYTHONPATH:+:$PYTHONPATH}
rc=0
if [[ $steps == *tests* ]]; then
  echo "== tests ${PYTEST_ARGS:-}"
  # pytest runs from /tmp (the installed package, not the source tree, is imported): a test path of PYTEST_ARGS
  # relative to the checkout, and an --ignore=PATH's, is made absolute
  args=()
  for arg in ${PYTEST_ARGS:-"$repo/tests"}; do
    [[ $arg != /* && $arg != -* && -e "$repo/${arg%%::*}" ]] && arg="$repo/$arg"
    [[ $arg == --ignore=* && $arg != --ignore=/* ]] && arg="--ignore=$repo/${arg#--ignore=}"
    args+=("$arg")
  done
  # pytest-xdist's workers (tests/conftest.py picks how many), each without JAX's 75% preallocation of the GPU's
  # memory; the log names each test as it ends and failures.log takes each failure's report then (a run cut short
  # still says which failed, and why), the summary names failures, errors and skips, and the 30 slowest tests (to
  # split the suite across calls by time)
  rm -f "$out/failures.log"
  (cd /tmp && XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_DQPOST_TEST_FAILURES="$out/failures.log" \
    python3 -m pytest -v -rfEs --durations=30 -p no:cacheprovider \
    "${args[@]}" 2>&1 | tee "$out/pytest.log" | tail -40) || rc=1
fi
if [[ $steps == *sanitizer* ]]; then
  echo "== compute-sanitizer memcheck: corrupt traced offsets"
  if command -v compute-sanitizer >/dev/null; then
    XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false compute-sanitizer --tool memcheck \
      --error-exitcode 1 python3 "$repo/tests/sanitize_varlen.py" 2>&1 | tee "$out/sanitizer.log" | tail -12
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  else
    echo "compute-sanitizer not found"; rc=1
  fi
fi
if [[ $steps == *bench* ]]; then
  echo "== benchmark: python -m benchmarks ${BENCH_ARGS:-}"
  # the installed jax_dqpost first on the path, benchmarks/ from this checkout after it
  (cd /tmp && PYTHONPATH=$PYTHONPATH:$repo python3 -m benchmarks --out "$out" ${BENCH_ARGS:-} \
    2>"$out/bench_progress.log" | tee "$out/bench.log") || { rc=1; tail -30 "$out/bench_progress.log"; }
fi
exit $rc
