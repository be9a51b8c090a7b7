#!/usr/bin/env bash
# Builds the _aio and _adam extensions with AddressSanitizer + UndefinedBehaviorSanitizer
# (CMake's INFINITY_SANITIZE: build/sanitize, never the package's own build) and runs a
# command against them, in a copy of the package whose extensions are the sanitized ones:
#
#   .ci/sanitize.sh                  the aio, Adam and NF4 kernel tests (tests/test_sanitizers.py runs this)
#   .ci/sanitize.sh python3 -c ...   any command, under the same environment
#
# The Python process preloads the compiler's libasan (the interpreter itself is not
# instrumented, so the runtime must be in place before any allocation); leaks are not
# checked (the interpreter's own never-freed objects would drown ours); every ASan or UBSan
# report ends the process with a failure. No suppressions: a report is a bug to fix.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=$root/build/sanitize
mkdir -p "$build"
python=${PYTHON:-python3}

cmake -S . -B "$build" -DINFINITY_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython_EXECUTABLE="$(command -v "$python")" -Dpybind11_DIR="$("$python" -m pybind11 --cmakedir)" \
  >"$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }
cmake --build "$build" -j "$(nproc)" --target _aio _adam >"$build.build.log" 2>&1 \
  || { cat "$build.build.log"; exit 1; }

# The package with the sanitized extensions in place of the regular ones.
pkg=$build/pkg
rm -rf "$pkg"
mkdir -p "$pkg"
cp -r infinity "$pkg/"
find "$pkg" -name '__pycache__' -prune -exec rm -rf {} + -o -name '*.so' -exec rm -f {} +
cp "$build"/_aio.*.so "$build"/_adam.*.so "$pkg/infinity/"

# libstdc++ is preloaded too: the interpreter does not link it, and ASan resolves the real
# __cxa_throw (which it intercepts) when it starts; without it, the first C++ throw aborts.
libasan=$(${CXX:-c++} -print-file-name=libasan.so)
libstdcxx=$(${CXX:-c++} -print-file-name=libstdc++.so)
for lib in "$libasan" "$libstdcxx"; do
  [ -e "$lib" ] || { echo "sanitize.sh: no $(basename "$lib") next to ${CXX:-c++}" >&2; exit 1; }
done
export LD_PRELOAD="$libasan $libstdcxx"
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:exitcode=87
export PYTHONPATH=$pkg:$root/.ci
# Neither the working directory (python -m puts it first) nor the repository root (pytest's
# rootdir, appended by --import-mode=append) may come before the copy; the plugin
# sanitized_build.py stops the run if `infinity` is not the sanitized copy all the same.
export PYTHONSAFEPATH=1

if [ $# -eq 0 ]; then
  # --capture=sys: a sanitizer report goes to the real stderr, not into a capture file that
  # the aborting process never prints.
  set -- "$python" -m pytest -q --capture=sys -p no:cacheprovider -p sanitized_build \
    --import-mode=append \
    tests/aio tests/optim/test_parity.py tests/optim/test_errors.py tests/optim/test_half_copy.py \
    tests/optim/test_overflow.py tests/optim/test_sum_squares.py tests/optim/test_stream_bound.py \
    tests/weights/test_nf4_kernel.py
fi
exec "$@"
