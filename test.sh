#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what is missing, configures, builds, tests.
#   ./test.sh                 every test (unit, integration, mpi, reference, slow)
#   ./test.sh -L unit         only what ctest selects (arguments go to ctest)
#   PRESET=asan TARGET=unit-tests ./test.sh -L 'unit|fuzz'
#                             the unit suite and bounded fuzzing under ASan + UBSan (clang),
#                             building only what those tests run (TARGET: build targets,
#                             space-separated)
set -euo pipefail
cd "$(dirname "$0")"
preset=${PRESET:-release}
./deploy/install-deps.sh
# mpirun refuses root without these; CI containers run as root.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
cmake --preset "$preset" >/dev/null
# shellcheck disable=SC2086  # TARGET is a list of build targets
cmake --build --preset "$preset" ${TARGET:+--target $TARGET}
ctest --preset "$preset" "$@"
