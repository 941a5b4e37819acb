#!/usr/bin/env bash
# Everything a session with a lent GPU does, in one call from the repository root:
#   bash bench/gpu_session.sh [build] [test] [sanitize] [bench] [bench-pointer]
# (default: all five). Results go to bench/results/gpu-<date>/ and are meant to be committed
# under bench/results/ with the device, versions and date they carry; with $OUT set (the device
# tool's folder, which returns at most 8 files) they also go there as one gpu-session.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
steps=${*:-build test sanitize bench bench-pointer}
stamp=$(date -u +%Y%m%d-%H%M)
out=bench/results/gpu-$stamp
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
status=0

run() {  # run NAME CMD...: log to $out/NAME.log, keep going on failure, remember it
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" >"$out/$name.log" 2>&1; local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s"; tail -n 25 "$out/$name.log"
  [ $rc -eq 0 ] || status=1
}

for step in $steps; do
  case $step in
    build)
      run build python3 -m pip install --no-build-isolation --no-deps -e .
      run info fastattn info ;;
    test)
      run test python3 -m pytest -q --maxfail=25 --durations=15 --junitxml="$out/junit.xml" -p no:cacheprovider ;;
    sanitize)
      if command -v compute-sanitizer >/dev/null; then
        run memcheck compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/sanitize_cuda.py
        run racecheck compute-sanitizer --tool racecheck --error-exitcode 1 python3 bench/sanitize_cuda.py
      else
        echo "compute-sanitizer not found" | tee "$out/sanitize.log"
      fi ;;
    bench)
      run bench fastattn bench --json "$out/bench.json" --plot "$out/bench.png" ;;
    bench-pointer)  # the Triton attention without TMA descriptors / warp specialization
      run bench-pointer env FASTATTN_TRITON_TMA=0 fastattn bench --op attention \
        --providers fastattn-triton,sdpa --json "$out/bench-pointer.json" ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
done
echo "results in $out"
if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/gpu-session.tgz" -C "$(dirname "$out")" "$(basename "$out")"
  echo "packed into \$OUT/gpu-session.tgz"
fi
exit $status
