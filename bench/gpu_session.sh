#!/usr/bin/env bash
# One device call that runs the GPU checks the open issues wait for, most
# wanted first, under one deadline, so a session's few device minutes go to
# measuring rather than to starting machines:
#
#   bash bench/gpu_session.sh [OUTDIR]
#
# DEADLINE (seconds from now, default 540) bounds the whole call; each step
# of bench/gpu_steps.sh gets at most its own cap and what is left, and a step
# with under 30 s left is skipped (named in the summary). STEPS overrides
# the list. Wheels the image lacks (nvtx, pytest-xdist, execnet) are
# installed from .whl/ when it is there (see bench/gpu_steps.sh). At the end
# OUTDIR (default $OUT, else /tmp/gpu-session) holds logs.tar.gz (every
# step's log) and results.tar.gz (bench/results/ files this call wrote): two
# files, within what a device call brings back.
set -uo pipefail
out=${1:-${OUT:-/tmp/gpu-session}}
mkdir -p "$out"
logs=$(mktemp -d)
deadline=$(( $(date +%s) + ${DEADLINE:-540} ))
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
touch "$logs/.start"
# step:cap seconds. The model step first (issue 30's figures), the kernels'
# tests, TP over NCCL (28), where the step's time goes, then the benches of
# sampling (25) and several steps a launch (27), the replay host time, and
# the CUDA tests.
steps=${STEPS:-model:270 kernels:120 tp:90 profile:120 sampling:120 multistep:150 replay:90 cuda:300}
summary=()
for entry in $steps; do
  [[ $entry == *:* ]] || entry+=":300"  # a step named without its cap
  step=${entry%%:*} cap=${entry##*:}
  left=$(( deadline - $(date +%s) ))
  if [ "$left" -lt 30 ]; then
    summary+=("$step: skipped (${left} s left)")
    continue
  fi
  limit=$(( cap < left ? cap : left ))
  begin=$(date +%s)
  STEP_SECONDS=$limit bash bench/gpu_steps.sh "$step" "$logs" > /dev/null 2>&1
  rc=$?
  summary+=("$step: exit $rc in $(( $(date +%s) - begin )) s (limit $limit s)")
  tail -n 3 "$logs/$step.log" 2>/dev/null | sed "s/^/  $step | /"
done
printf '%s\n' "${summary[@]}" | tee "$logs/summary.log"
tar -czf "$out/logs.tar.gz" -C "$logs" .
find bench/results -type f -newer "$logs/.start" -print0 | tar -czf "$out/results.tar.gz" --null -T -
echo "written: $out/logs.tar.gz $out/results.tar.gz"
