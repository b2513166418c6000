#!/usr/bin/env bash
# Nsight Compute over every case of benchmarks/ncu_targets.py (issue 17's missed kernel targets),
# then the summary. On the device, from the repo root, with PYTHONPATH set (README):
#   bash benchmarks/ncu_targets.sh $OUT/ncu      [case ...]   (default: every case)
set -u
dir=${1:?usage: ncu_targets.sh OUT_DIR [case ...]}
shift
mkdir -p "$dir"
NCU=$(command -v ncu || ls -d /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
"$NCU" --version | tail -1
cases=("$@")
[ ${#cases[@]} -gt 0 ] || mapfile -t cases < <(python3 benchmarks/ncu_targets.py --list)
for c in "${cases[@]}"; do
  start=$(date +%s)
  timeout 150 "$NCU" --clock-control none --profile-from-start off \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section Occupancy --section LaunchStats --section WarpStateStats \
    --csv --page raw python3 benchmarks/ncu_targets.py --case "$c" > "$dir/$c.csv" 2> "$dir/$c.err"
  echo "$c: exit $? in $(( $(date +%s) - start )) s"
done
python3 benchmarks/ncu_targets.py --summarize "$dir" --out "$dir/summary.json"
