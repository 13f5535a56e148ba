#!/usr/bin/env bash
# The GPU checks, one bounded step per call: run from the repository root on a
# machine with a CUDA device, as `bash bench/gpu_steps.sh STEP [LOGDIR]`.
#
#   kernels    the Triton kernels' and fused/in-graph populate's CUDA tests
#   models     the CUDA oracles: reference Llama (compiled, Triton attention),
#              Mamba / Jamba / Bamba, GGUF, trace-out, runners and pools
#   replay     bench/bench_replay_host.py  (writes bench/results/replay-host-<device>.*)
#   model      bench/bench_gpu_model.py    (writes bench/results/gpu-model-step-<device>.*)
#   attention  bench/bench_decode_attention.py (the kernel's split sweep)
#   gemv       bench/bench_gemv.py         (the small-batch linears against torch's)
#   suite      the whole suite, CUDA tests included
#
# Each step runs alone (benches want an idle GPU), under its own time limit,
# and tees its output to LOGDIR/STEP.log so a step cut short still leaves its log.
set -uo pipefail
step=${1:?usage: bench/gpu_steps.sh kernels|models|replay|model|attention|gemv|suite [LOGDIR]}
logdir=${2:-.}
mkdir -p "$logdir"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
pytest=(timeout -k 10 "${STEP_SECONDS:-420}" "$py" -m pytest -q -p no:cacheprovider -rfEs)
case $step in
  kernels) cmd=("${pytest[@]}" -m cuda tests/test_fused_populate.py tests/test_in_graph_populate.py
             tests/test_validation_once.py tests/test_host_inputs.py tests/test_triton_model.py
             tests/test_decode_attention.py tests/test_small_batch.py) ;;
  models) cmd=("${pytest[@]}" -m cuda tests/test_oracle.py tests/test_mamba_oracle.py
             tests/test_mamba_pool.py tests/test_gguf_import.py tests/test_trace_out.py
             tests/test_cuda_runner.py tests/test_pools.py tests/test_batch.py) ;;
  replay) cmd=(timeout -k 10 "${STEP_SECONDS:-300}" "$py" -m bench.bench_replay_host) ;;
  model) cmd=(timeout -k 10 "${STEP_SECONDS:-300}" "$py" bench/bench_gpu_model.py --sizes 1,8,32,64) ;;
  attention) cmd=(timeout -k 10 "${STEP_SECONDS:-480}" "$py" -m bench.bench_decode_attention --sizes 64,1) ;;
  gemv) cmd=(timeout -k 10 "${STEP_SECONDS:-300}" "$py" -m bench.bench_gemv) ;;
  suite) cmd=("${pytest[@]}" -x) ;;
  *) echo "bench/gpu_steps.sh: unknown step '$step' (expected kernels, models, replay, model, attention, gemv or suite)" >&2
     exit 2 ;;
esac
"$py" -c "import torch; print('device:', torch.cuda.get_device_name(0))" 2>&1 | tee "$logdir/$step.log"
"${cmd[@]}" 2>&1 | tee -a "$logdir/$step.log"
