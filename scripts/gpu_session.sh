#!/usr/bin/env bash
# One stage of the GPU work, for a session that is lent a GPU machine (the `device`
# tool: 10 minutes a command, 30 minutes a session). The machine has torch, Triton,
# scikit-learn, hypothesis and matplotlib but no package registry: cswap's other
# dependencies travel as wheels in .whl/ (this script's `wheels` stage makes them
# here, on the development machine; name `.whl` in the run's `carry`).
#
#   bash scripts/gpu_session.sh wheels                 # here, once: .whl/ for Python 3.12 x86-64
#   bash scripts/gpu_session.sh tests                  # there: the gpu-marked tests, then the codec and fault tests
#   bash scripts/gpu_session.sh codecs|runtime|soak|tune|train|sanitize|smoke
#
# Every stage but `wheels` installs cswap (no dependencies) into /tmp/site, runs, and
# copies what it wrote (benchmarks/results/<device>/, a profile, logs) as one
# results-<stage>.tar.gz into $OUT (default ./gpu-out), so it comes back in one file.
# Unpack that under the repo root and commit benchmarks/results/<device>/.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?"usage: $0 wheels|tests|codecs|runtime|soak|tune|train|sanitize|smoke"}
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu-out}

if [ "$stage" = wheels ]; then
    # bayesian-optimization (pure Python) and lz4 (a C extension) are not on the GPU
    # machine; their own needs (numpy, scipy, scikit-learn, colorama, packaging) are.
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl bayesian-optimization==3.4.0 lz4==4.4.5
fi

mkdir -p "$OUT" /tmp/site
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
fi
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . || exit 1
# The installed cswap, not the source tree: cswap.kernels and cswap.models exist only
# installed (package-dir); hence also `python -P -m pytest` (no current folder on sys.path).
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
export CSWAP_HOME=$PWD/benchmarks/results/cswap-home  # the profile cswap-tune writes, kept with the results
export PATH=/tmp/site/bin:$PATH
log=$OUT/$stage.log
{
    echo "# $(date -u +%FT%TZ) stage $stage"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)'
} > "$log" 2>&1

run() { echo "+ $*" | tee -a "$log"; "$@" 2>&1 | tee -a "$log"; return "${PIPESTATUS[0]}"; }
status=0
case "$stage" in
    smoke)    run "$PY" -P -m pytest -q -x -p no:cacheprovider tests/test_runtime_gpu.py -k gradients_equal || status=$? ;;
    tests)    run "$PY" -P -m pytest -q -m gpu -p no:cacheprovider || status=$?
              run "$PY" -P -m pytest -q -p no:cacheprovider tests/test_faults.py tests/test_compile.py tests/test_zvc.py \
                  tests/test_rle.py tests/test_csr.py tests/test_lz4.py tests/test_codecs.py || status=$? ;;
    sanitize) run compute-sanitizer --tool memcheck --error-exitcode 3 "$PY" -P -m pytest -q -x -p no:cacheprovider \
                  tests/test_fuzz.py -k triton || status=$? ;;
    codecs)   run "$PY" benchmarks/codecs.py || status=$? ;;
    # runtime: the benchmark at ImageNet shapes, then the emulator's fidelity: the same run at
    # CIFAR shapes measured on the GPU and predicted by the emulator at the probed PCIe
    # bandwidth, side by side (peak allocated and reserved, stall per tensor, kept_on_gpu).
    runtime)  run "$PY" benchmarks/runtime.py --check-decisions 16 || status=$?
              run "$PY" benchmarks/runtime.py --dataset cifar10 --batch 32 --iters 5 --emulate measured \
                  --providers unpatched vdnn sc cswap || status=$? ;;
    soak)     run "$PY" benchmarks/soak.py || status=$? ;;
    tune)     run cswap-tune --compare --out benchmarks/results/cswap-home/profile-tuned.json || status=$? ;;
    # shellcheck disable=SC2086  # MODELS is a list of names
    train)    run "$PY" benchmarks/train.py --budget-gib 32 --datasets cifar10 --models ${MODELS:-vgg16 resnet18} \
                  || status=$? ;;
    *)        echo "unknown stage $stage" >&2; exit 2 ;;
esac
mkdir -p benchmarks/results
tar -czf "$OUT/results-$stage.tar.gz" --exclude='cpu-*' benchmarks/results
exit "$status"
