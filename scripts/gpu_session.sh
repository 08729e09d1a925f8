#!/usr/bin/env bash
# One stage of the GPU work, for a session that is lent a GPU machine (the `device`
# tool: 10 minutes a command, 15 minutes of device time a session). The machine has torch, Triton,
# scikit-learn, hypothesis and matplotlib but no package registry: cswap's other
# dependencies travel as wheels in .whl/ (this script's `wheels` stage makes them
# here, on the development machine; name `.whl` in the run's `carry`).
#
#   bash scripts/gpu_session.sh wheels                 # here, once: .whl/ for Python 3.12 x86-64
#   bash scripts/gpu_session.sh tests                  # there: the gpu-marked tests
#   bash scripts/gpu_session.sh tests:150 overhead:60 codecs:90   # several stages, each with a time limit (s)
#   The next session's two calls (15 minutes of device time in all; on the H200 on 2026-12-04 headline,
#   trace and codecs took about 1, 1 and 2.5 minutes):
#   bash scripts/gpu_session.sh headline:130 trace:120 codecs-ab:200   # issue 40's steady steps and peaks;
#                                   ZVC's and ZANS's kernels against .base/'s (.base at 8744496, the kernels
#                                   before 2026-12-05's fences and layout: mkdir .base && git archive 8744496 |
#                                   tar -x -C .base; an untracked folder travels with the tree)
#   bash scripts/gpu_session.sh zans-tiles:170 lz4-warps:90            # ZANS's time by tile and programs an SM,
#                                   LZ4's by warps in flight (neither run yet)
#   stages: headline trace smoke tests fuzz overhead overhead-ab seam pyspy codecs codecs-ab zans-tiles lz4-warps
#           runtime soak tune tune-quick train sanitize
#   overhead-ab, codecs-ab: the overhead and codec benchmarks on the GPU, alternating between this tree's cswap
#   and the one in .base/ (an older checkout, e.g. `git archive REV | tar -x -C .base`, named in the run's carry).
#
# Device time is short (minutes a session), so one call runs several stages, each killed
# at its limit so that the ones after it still run. cswap (no dependencies) is installed
# into /tmp/site once; after every stage, what the stages wrote (benchmarks/results/<device>/,
# a profile, logs) is packed as results.tar.gz into $OUT (default ./gpu-out), so a call
# stopped at its own limit still brings back what finished. Unpack it under the repo root
# and commit benchmarks/results/<device>/.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: $0 wheels | STAGE[:SECONDS]..." >&2; exit 2; }
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu-out}

if [ "$1" = wheels ]; then
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
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --ignore-requires-python --target /tmp/site . || exit 1
# The installed cswap, not the source tree: cswap.kernels and cswap.models exist only
# installed (package-dir); hence also `python -P -m pytest` (no current folder on sys.path).
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
export CSWAP_HOME=$PWD/benchmarks/results/cswap-home  # the profile cswap-tune writes, kept with the results
export PATH=/tmp/site/bin:$PATH
log=$OUT/session.log
{
    echo "# $(date -u +%FT%TZ) stages $*"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)'
} > "$log" 2>&1

# run LIMIT CMD...: CMD with its output in the log, killed after LIMIT seconds (0: no limit).
run() {
    local limit=$1; shift
    echo "+ [$(date -u +%T), limit ${limit}s] $*" | tee -a "$log"
    if [ "$limit" -gt 0 ]; then timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$log"
    else "$@" 2>&1 | tee -a "$log"; fi
    local rc=${PIPESTATUS[0]}
    echo "# rc $rc" | tee -a "$log"
    return "$rc"
}
# The tests that need a GPU, by file (a module that fails to import elsewhere must not stop them).
GPU_TESTS=(tests/test_runtime_gpu.py tests/test_zans.py tests/test_codecs.py tests/test_lz4.py tests/test_zvc.py
           tests/test_unmovable.py tests/test_csr.py tests/test_fsdp.py tests/test_rle.py)
PYTEST=("$PY" -P -m pytest -q -rfEs -p no:cacheprovider --continue-on-collection-errors)
# the tree in .base/, installed beside this one (overhead-ab, codecs-ab)
install_base() {
    [ -d /tmp/site-base ] || "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
        --ignore-requires-python --target /tmp/site-base ./.base
}
status=0
for spec in "$@"; do
    stage=${spec%%:*}; limit=0
    [ "$stage" != "$spec" ] && limit=${spec#*:}
    case "$stage" in
        # the twin's runs measured here, beside the H200's and the twin's figures and cswap-plan's (issue 38)
        headline) run "$limit" "$PY" benchmarks/twin.py --gpu || status=$? ;;
        # one profiled step per mode of the same runs: Chrome traces with cswap's stages, memory snapshots
        trace)    run "$limit" "$PY" benchmarks/trace.py || status=$? ;;
        smoke)    run "$limit" "${PYTEST[@]}" -x tests/test_runtime_gpu.py -k gradients_equal || status=$? ;;
        tests)    run "$limit" "${PYTEST[@]}" -n "${WORKERS:-8}" -m gpu "${GPU_TESTS[@]}" || status=$? ;;
        # the decoders' fuzzing against the compiled kernels (test_fuzz runs Triton on the GPU where there is one)
        fuzz)     run "$limit" "${PYTEST[@]}" -n "${WORKERS:-8}" tests/test_fuzz.py -k triton || status=$? ;;
        sanitize) run "$limit" compute-sanitizer --tool memcheck --error-exitcode 3 "${PYTEST[@]}" -x \
                      tests/test_fuzz.py -k triton || status=$? ;;
        # the host's cost per saved tensor on this GPU, beside the CPU stand-ins (issue 26)
        overhead) run "$limit" "$PY" benchmarks/overhead.py --devices cuda lagging --busy || status=$? ;;
        overhead-ab)
                  install_base || exit 1
                  # the device's results folder, named as benchmarks/common.py device_slug names it
                  slug=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -cs 'A-Za-z0-9' '-' \
                         | tr 'A-Z' 'a-z' | sed 's/^-//; s/-$//')
                  ab=benchmarks/results/${slug:-gpu}/overhead-ab
                  for round in 1 2; do
                      for tree in base new; do
                          site=/tmp/site; [ "$tree" = base ] && site=/tmp/site-base
                          PYTHONPATH=$site run "$limit" "$PY" benchmarks/overhead.py --devices cuda --rounds 3 \
                              --steps 5 --providers unpatched minimal keep vdnn cswap --out "$ab/$tree-$round" \
                              || status=$?
                      done
                  done ;;
        seam)     run "$limit" "$PY" benchmarks/cuda_seam.py || status=$? ;;
        # where the training thread's time goes on the CUDA path: py-spy's samples of every thread
        pyspy)    run "$limit" py-spy record --threads --rate 500 --format raw --output "$OUT/pyspy-vdnn.txt" -- \
                      "$PY" benchmarks/overhead.py --devices cuda --providers unpatched vdnn --rounds 6 \
                      --out /tmp/pyspy-run || status=$? ;;
        # shellcheck disable=SC2086  # CODECS_ARGS is a list of options
        codecs)   run "$limit" "$PY" benchmarks/codecs.py ${CODECS_ARGS:-} || status=$? ;;
        # ZANS's encode and decode times by tile size: is its decoder bound by the rANS chain's latency? (issue 41)
        # kernels of .base/ against this tree's, round by round on the same cases (issue 41)
        # shellcheck disable=SC2086  # CODECS_AB_ARGS is a list of options
        codecs-ab) install_base || exit 1
                  run "$limit" "$PY" benchmarks/codecs_ab.py --base-site /tmp/site-base --new-site /tmp/site \
                      -- ${CODECS_AB_ARGS:---codecs zvc zans --sizes-mib 1 256 --sparsities 0.2 0.8 --dtypes fp32 bf16 --no-nvcomp} \
                      || status=$? ;;
        zans-tiles) run "$limit" "$PY" benchmarks/zans_tiles.py || status=$? ;;
        lz4-warps) run "$limit" "$PY" benchmarks/lz4_warps.py || status=$? ;;
        # runtime: the benchmark at ImageNet shapes, then the emulator's fidelity: the same run at
        # CIFAR shapes measured on the GPU and predicted by the emulator at the probed PCIe
        # bandwidth, side by side (peak allocated and reserved, stall per tensor, kept_on_gpu).
        runtime)  run "$limit" "$PY" benchmarks/runtime.py --check-decisions 16 || status=$?
                  run "$limit" "$PY" benchmarks/runtime.py --dataset cifar10 --batch 32 --iters 5 --emulate measured \
                      --providers unpatched vdnn sc cswap || status=$? ;;
        soak)     run "$limit" "$PY" benchmarks/soak.py || status=$? ;;
        # shellcheck disable=SC2086  # TUNE_ARGS is a list of options (e.g. --codecs zvc rle csr zans)
        tune)     run "$limit" cswap-tune --compare --no-progress ${TUNE_ARGS:-} \
                      --out benchmarks/results/cswap-home/profile-tuned.json || status=$? ;;
        tune-quick) run "$limit" cswap-tune --quick --compare --no-progress \
                      --out benchmarks/results/cswap-home/profile-quick.json || status=$? ;;
        # shellcheck disable=SC2086  # MODELS is a list of names
        train)    run "$limit" "$PY" benchmarks/train.py --budget-gib 32 --datasets cifar10 \
                      --models ${MODELS:-vgg16 resnet18} ${TRAIN_ARGS:-} || status=$? ;;
        *)        echo "unknown stage $stage" | tee -a "$log" >&2; status=2 ;;
    esac
    mkdir -p benchmarks/results
    tar -czf "$OUT/results.tar.gz" --exclude='cpu-*' benchmarks/results
done
exit "$status"
