#!/usr/bin/env bash
# The GPU checks, one bounded step per call: run from the repository root on a
# machine with a CUDA device, as `bash bench/gpu_steps.sh STEP [LOGDIR]`.
#
#   kernels    the Triton kernels' (attention, small-batch linears, programmatic
#              launch) and fused/in-graph populate's CUDA tests
#   cuda       every cuda-marked test (with pytest-xdist when importable: -n 8)
#   models     the CUDA oracles: reference Llama (compiled, Triton attention),
#              Mamba / Jamba / Bamba, GGUF, trace-out, runners and pools
#   replay     bench/bench_replay_host.py  (writes bench/results/replay-host-<device>.*)
#   model      bench/bench_gpu_model.py    (writes bench/results/gpu-model-step-<device>.*;
#              MODEL_SIZES and MODEL_VARIANTS pick what it times, see below)
#   attention  bench/bench_decode_attention.py (the kernel's split sweep)
#   profile    bench/bench_gpu_profile.py  (device time by kernel class against each floor)
#   gemv       bench/bench_gemv.py         (the small-batch linears against torch's)
#   sampling   bench/bench_sampling.py     (in-graph sampling's share of the 1.1B step, bs 1 and 64)
#   multistep  bench/bench_multistep.py    (N steps a launch on the 1.1B shape against N = 1)
#   tp         the NCCL TP = 1 tests (collectives captured) and the multi-step sync test
#   suite      the whole suite, CUDA tests included
#
# Each step runs alone (benches want an idle GPU), under its own time limit,
# and tees its output to LOGDIR/STEP.log so a step cut short still leaves its log.
#
# The device image lacks nvtx and pytest-xdist: carry their wheels (device
# README: `pip download --no-deps --only-binary=:all: --python-version 3.12 ...
# -d .whl nvtx pytest-xdist execnet`, `.whl` in .git/info/exclude) and install
# them first into a --target that PYTHONPATH names.
set -uo pipefail
step=${1:?usage: bench/gpu_steps.sh kernels|cuda|models|replay|model|profile|attention|gemv|sampling|multistep|tp|suite [LOGDIR]}
logdir=${2:-.}
mkdir -p "$logdir"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the package and bench/ from the checkout
py=${PYTHON:-python3}
pytest=(timeout -k 10 "${STEP_SECONDS:-420}" "$py" -m pytest -q -p no:cacheprovider -rfEs)
workers=()
"$py" -c "import xdist" 2>/dev/null && workers=(-n "${WORKERS:-8}" --dist loadscope)
# The step's default variants: the measured default and the opt-in levers.
variants=${MODEL_VARIANTS:-graph+compile+triton,graph+compile+triton+pdl,graph+compile+triton+gemv,graph+compile+triton+gemv+pdl,graph+compile+triton+gemv+pdl-inductor}
case $step in
  # The kernels' own files run whole: on a GPU their unmarked tests run compiled.
  kernels) cmd=("${pytest[@]}" tests/test_decode_attention.py tests/test_small_batch.py tests/test_rope_store.py
             tests/test_programmatic_launch.py tests/test_triton_model.py
             tests/test_fused_populate.py tests/test_in_graph_populate.py
             tests/test_validation_once.py tests/test_host_inputs.py) ;;
  cuda) cmd=("${pytest[@]}" "${workers[@]}" -m cuda tests) ;;
  models) cmd=("${pytest[@]}" -m cuda tests/test_oracle.py tests/test_mamba_oracle.py
             tests/test_mamba_pool.py tests/test_gguf_import.py tests/test_trace_out.py
             tests/test_cuda_runner.py tests/test_pools.py tests/test_batch.py) ;;
  replay) cmd=(timeout -k 10 "${STEP_SECONDS:-300}" "$py" -m bench.bench_replay_host) ;;
  model) cmd=(timeout -k 10 "${STEP_SECONDS:-480}" "$py" bench/bench_gpu_model.py
             --sizes "${MODEL_SIZES:-1,64}" --variants "$variants") ;;
  attention) cmd=(timeout -k 10 "${STEP_SECONDS:-480}" "$py" -m bench.bench_decode_attention --sizes 64,1) ;;
  gemv) cmd=(timeout -k 10 "${STEP_SECONDS:-300}" "$py" -m bench.bench_gemv) ;;
  profile) cmd=(timeout -k 10 "${STEP_SECONDS:-300}" "$py" -m bench.bench_gpu_profile) ;;
  sampling) cmd=(timeout -k 10 "${STEP_SECONDS:-300}" "$py" -m bench.bench_sampling) ;;
  multistep) cmd=(timeout -k 10 "${STEP_SECONDS:-300}" "$py" -m bench.bench_multistep --rounds 5) ;;
  tp) cmd=("${pytest[@]}" -m cuda tests/test_tensor_parallel_alone.py
           tests/test_engine_multistep_overlap.py tests/test_multistep_phase.py) ;;
  suite) cmd=("${pytest[@]}" "${workers[@]}" -x) ;;
  *) echo "bench/gpu_steps.sh: unknown step '$step' (expected kernels, cuda, models, replay, model, profile, attention, gemv, sampling, multistep, tp or suite)" >&2
     exit 2 ;;
esac
"$py" -c "import torch; print('device:', torch.cuda.get_device_name(0))" 2>&1 | tee "$logdir/$step.log"
"${cmd[@]}" 2>&1 | tee -a "$logdir/$step.log"
