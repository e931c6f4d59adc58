#!/usr/bin/env bash
# The checks that need a GPU, as one script for a short lease of a CUDA machine:
# tests/test_devices.py (every quantity on CUDA equals the CPU result), then the scaling
# study with --device cuda, one problem and quantity at a time so that a time limit keeps
# what finished, and a row at a batch size too large for the CPU study. Results go to $OUT
# (default ./gpu-study): tests.log, profile.log (benchmarks/cuda_profile.py: host against
# GPU time), scaling-<tag>.log (every cell, in significant digits) and scaling-<tag>.tgz
# (each run's .md, .csv, .png). Settings (environment): TESTS=1|0, PROFILE=1|0,
# PROBLEMS="MLP CNN LM GPT-2", QUANTITIES="batch_grad kfac", SIZES=8,128,4096,
# LARGEST=32768 (MLP batch_grad; empty to skip), TAG=all, LIMIT=75 (seconds per problem and
# quantity). Seen on an H100 (2026-11-27): the tests take 30 s, the profile about 40 s, a
# cell 12-20 s, GPT-2's batch_grad at N=4096 more than 40 s.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-study}
TAG=${TAG:-all}
LIMIT=${LIMIT:-75}
mkdir -p "$OUT/scaling-$TAG"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# A machine without a package registry: wheels in .whl/ (optree, the peers; see CONTRIBUTING.md)
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
if [ "${TESTS:-1}" = 1 ]; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_devices.py 2>&1 \
        | tee "$OUT/tests.log" | tail -25
fi
if [ "${PROFILE:-1}" = 1 ]; then  # host against GPU time, and the peak's blocks
    timeout 90 python3 benchmarks/cuda_profile.py 2>&1 | grep -v Warning | tee "$OUT/profile.log"
fi
{
    for problem in ${PROBLEMS:-MLP CNN LM GPT-2}; do
        for quantity in ${QUANTITIES:-batch_grad kfac}; do
            timeout "$LIMIT" python3 benchmarks/scaling.py --device cuda --problems "$problem" \
                --quantities "$quantity" --sizes "${SIZES:-8,128,4096}" --processes 1 \
                --repeats 5 --ranks '' --out "$OUT/scaling-$TAG/$problem-$quantity"
        done
    done
    if [ -n "${LARGEST-32768}" ]; then
        timeout "$LIMIT" python3 benchmarks/scaling.py --device cuda --problems MLP \
            --quantities batch_grad --sizes "${LARGEST-32768}" --processes 1 --repeats 3 \
            --ranks '' --out "$OUT/scaling-$TAG/MLP-largest"
    fi
} 2>&1 | tee "$OUT/scaling-$TAG.log"
tar -czf "$OUT/scaling-$TAG.tgz" -C "$OUT" "scaling-$TAG" && rm -r "${OUT:?}/scaling-$TAG"
