#!/usr/bin/env bash
# The checks that need a CUDA device, as one run on a lent GPU machine (README, "On a GPU"): the CUDA engine
# tests, the decode graphs' static passes, `bench graphs` (graphs against op by op) and `bench spec --quick`. Results and logs go
# to $OUT (the device tool's folder), else /tmp/gpu-check.
#
# That machine's python3 holds a CUDA build of torch, transformers, safetensors, tokenizers, pyyaml and
# pytest; what else the engine imports travels as cp312 wheels in .whl/ (README says which and how), and the
# demo pair, when it travels, under .gpu-home/models/ ($SPECFLEET_HOME; else the tiny pair is used).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1 SPECFLEET_HOME=${SPECFLEET_HOME:-$PWD/.gpu-home}
nvidia-smi -L || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
# --noconftest: the suite's root conftest registers Redis, gateway and Celery fixtures these tests do not use
# each stage has its own time limit, so a hang in one leaves the other's results (the lease is short)
timeout "${GPU_CHECK_TESTS_TIMEOUT_S:-360}" python3 -m pytest -q -rs -p no:cacheprovider --noconftest -p tests.helpers.models \
    tests/workers/engine/test_cuda.py tests/workers/engine/test_decode_graphs.py tests/workers/engine/test_device.py \
    tests/workers/bench/test_graphs_bench.py 2>&1 | tee "$out/pytest.log"
tests_rc=${PIPESTATUS[0]}
# the benches named in GPU_CHECK_BENCHES (default both): `bench graphs` (graphs against op by op) and
# `bench spec --quick` (speculation against plain decoding, both through graphs; typer is on that machine)
bench_rc=0
for bench in ${GPU_CHECK_BENCHES:-graphs spec}; do
    case $bench in
        graphs) cmd=(python3 -m workers.bench.graphs_bench --json "$out/graphs.json") ;;
        spec) cmd=(python3 -c 'import sys; from shared.cli.main import main; sys.argv[0] = "specfleet"; main()'
                   bench spec --quick --json "$out/spec.json") ;;
        *) echo "unknown bench: $bench"; exit 2 ;;
    esac
    timeout "${GPU_CHECK_BENCH_TIMEOUT_S:-300}" "${cmd[@]}" > "$out/$bench.log" 2>&1
    rc=$?
    grep -E "captured|pass costs" "$out/$bench.log" | head -6
    tail -n 60 "$out/$bench.log"
    echo "bench $bench rc=$rc"
    [ "$rc" -eq 0 ] || bench_rc=$rc
done
echo "tests rc=$tests_rc bench rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
