#!/usr/bin/env bash
# One device call for issue 20: bench/sim_fidelity.py on the GPU at hand (in-process engine,
# random-real shapes) with a warm-in before the calibration, beside the GPU's clocks and the
# host's CPU frequency every 5 s; the results folder (without the weights) packed into $OUT,
# since the device tool brings back at most 8 files.
#
#   OUT=DIR bash bench/gpu_fidelity.sh                       # on the GPU machine (~6-8 min)
#   OUT=DIR SHAPES=random-small REQ=20 WARM=5 bash bench/gpu_fidelity.sh   # the same path on a CPU
set -u
OUT=${OUT:-/tmp/gpu-fidelity-out}
REQ=${REQ:-300}; WARM=${WARM:-90}; SEED=${SEED:-3}; LIMIT=${LIMIT:-500}; SHAPES=${SHAPES:-random-real}
RESULTS=${RESULTS:-/tmp/gpu-fidelity}
mkdir -p "$OUT"; rm -rf "$RESULTS"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,utilization.gpu,power.draw,temperature.gpu \
    --format=csv -l 5 > "$OUT/gpu.csv" 2>&1 &
  SMI=$!
fi
(while true; do
   echo "$(date +%s) $(awk '/MHz/ {s += $4; n++} END {printf "%.0f", s / n}' /proc/cpuinfo) $(cut -d' ' -f1 /proc/loadavg)"
   sleep 5
 done) > "$OUT/host.txt" &
HOST=$!
timeout "$LIMIT" python3 bench/sim_fidelity.py --backend in-process --shapes "$SHAPES" --requests "$REQ" \
  --seed "$SEED" --warm-in "$WARM" --out "$RESULTS" > "$OUT/fidelity.log" 2>&1
echo "rc=$?" >> "$OUT/fidelity.log"
kill "$HOST" ${SMI:+"$SMI"} 2>/dev/null
tar czf "$OUT/results.tgz" --exclude='*.safetensors' -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
grep -v "^\(light\|mid\|high\) .* \(TTFT\|TBT\|E2E\|throughput\)" "$OUT/fidelity.log" | tail -60
grep "^\(light\|mid\|high\) *all " "$OUT/fidelity.log"
