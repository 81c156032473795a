#!/usr/bin/env bash
# The GPU check: on a machine where torch sees a CUDA device, run
#   1. the parity and output-safety tests on CUDA (`pytest --cuda`, only their
#      CUDA variants): every merge mode against the dense reference and stock
#      mergekit, the counts, the λ-survival count, out_dtype, NaN/Inf and
#      overflow refusals, and a whole merge (statistics pass included) with
#      mergekit's device set to cuda;
#   2. benchmarks/speed.py at 1.1 B with --cuda (stock `ram --cuda` against ours),
# and print one table: the speed table, captioned with the tests' outcome.
# About 6 minutes on one GPU with 16 cores (the 1.1 B models are built first,
# 8.9 GB under WORKDIR, and kept for the next run).
#
#   bash benchmarks/gpu_check.sh            # PYTHON=.venv/bin/python by default
#   ROUNDS=3 WORKDIR=/big/disk bash benchmarks/gpu_check.sh
#
# Exit status: 0 when the tests passed and the table was made, 1 when a test
# failed (the table is still made), 2 when there is no CUDA device here.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
WORKDIR="${WORKDIR:-${TMPDIR:-/tmp}/ram-gpu-check}"
ROUNDS="${ROUNDS:-1}"
export HF_HUB_OFFLINE=1

if ! device="$("$PY" -c 'import sys, torch
if not torch.cuda.is_available():
    sys.exit(1)
print(torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)')"; then
  echo "gpu_check: torch sees no CUDA device here (torch.cuda.is_available() is False" \
    "with $PY); run this on a machine with a GPU and a CUDA build of torch." >&2
  exit 2
fi
started=$SECONDS
echo "gpu_check: $device"

# Every test file with tests that take `on_device`; -k cuda keeps their CUDA variants.
tests=(
  tests/test_core_kernel.py
  tests/test_core_rule.py
  tests/test_core_counting.py
  tests/test_core_modes.py
  tests/test_integration_methods.py
  tests/test_integration_methods_out_dtype.py
  tests/test_integration_statistics_survival.py
)
log="$(mktemp)"
"$PY" -m pytest -q --cuda -k cuda -p no:cacheprovider "${tests[@]}" 2>&1 | tee "$log"
tests_status=${PIPESTATUS[0]}
summary="$(grep -E '[0-9]+ (passed|failed|errors?|skipped)' "$log" | tail -n 1 | tr -d '=' | xargs)"
rm -f "$log"
# With a device every CUDA variant runs: a skipped one is a failed check.
if [[ "$summary" == *skipped* ]]; then
  tests_status=1
fi

mkdir -p "$WORKDIR"
table="$WORKDIR/speed-cuda.md"
"$PY" benchmarks/speed.py --sizes 1b --rounds "$ROUNDS" --cuda --hash \
  --methods 'stock ram' 'our ram' 'our ramplus (global)' 'our ramplus (tensor)' \
  --workdir "$WORKDIR" --output "$table" >/dev/null
speed_status=$?

echo
echo "GPU check on $device, $((SECONDS - started)) s in all;" \
  "parity and output-safety tests on CUDA: ${summary:-no result} (exit $tests_status)"
if [ "$speed_status" -eq 0 ]; then
  cat "$table"
else
  echo "(no speed table: benchmarks/speed.py exited with $speed_status)"
fi
if [ "$tests_status" -ne 0 ] || [ "$speed_status" -ne 0 ]; then
  exit 1
fi
