#!/usr/bin/env bash
# The H100 validation, one step per call (each well inside 10 minutes), from the repository tree:
#
#   benchmarks/gpu_validation.sh STEP OUT_DIR [driver options]     STEP: profile | v2lite | qwen3 | all
#
# On a machine without simpy, put its wheel in .whl/ (see docs/validation/README.md); it is unpacked
# into /tmp/moesim-site and put on PYTHONPATH. Everything else the driver needs (torch with CUDA,
# numpy, pandas, pyarrow, matplotlib, rich, click, pyyaml) must be installed already. Results:
# OUT_DIR/STEP/ and OUT_DIR/STEP.tar.gz; benchmarks/gpu_validation_report.py turns OUT_DIR into
# docs/validation/GPU.md (h200.md on an H200, h100.md on an H100).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import simpy" 2>/dev/null; then
    shopt -s nullglob
    wheels=(.whl/simpy-*.whl)
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "gpu_validation.sh: simpy is not installed and there is no .whl/simpy-*.whl to bring it" >&2
        exit 2
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/moesim-site "${wheels[@]}"
    export PYTHONPATH=/tmp/moesim-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
exec "$PYTHON" benchmarks/gpu_validation.py "$@"
