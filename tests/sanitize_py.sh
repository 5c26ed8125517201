#!/usr/bin/env bash
# The Python side on an ASan + UBSan build of the extension: builds cpumla into build/sanitize/ (a
# copy of the package with a sanitized _cpumla, so the in-place build is left alone), then runs a
# smoke and parity subset against it with libasan preloaded (Python itself is not built with ASan, so
# the runtime must come first; leaks are not checked: the interpreter keeps memory until exit).
# Any ASan or UBSan report aborts the run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PY:-python3}
cc=${CC:-gcc}
out=$root/build/sanitize
flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g"

rm -rf "$out/cpumla"
mkdir -p "$out"
(cd "$root" && tar --exclude='*.so' --exclude='__pycache__' --exclude='_cpumla.c' -cf - cpumla) | tar -xf - -C "$out"
(cd "$root" && CC="$cc $flags" LDFLAGS="${LDFLAGS:-} -fsanitize=address,undefined" \
    "$py" setup.py -q build_ext --build-lib "$out" --build-temp "$out/tmp") >/dev/null
libasan=$("$cc" -print-file-name=libasan.so)

export LD_PRELOAD=$libasan
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export CPUMLA_TEST_SANITIZED=1
cd "$out"                     # cpumla is imported from here, not from the source tree
"$py" -c "import cpumla.native as n, sys; sys.exit(0 if n.__file__.startswith('$out') else 'not the sanitized build')"
"$py" -m cpumla smoke --dummy-weights -p 12 -n 4
"$py" -m pytest -q -p no:cacheprovider "$root/tests/models/test_parity.py" "$root/tests/robustness/test_nan.py" \
    "$root/tests/robustness/test_native_args.py" "$root/tests/robustness/test_fuzz.py" \
    "$root/tests/robustness/test_hostile_input.py" "$root/tests/runtime/test_streaming.py" \
    "$root/tests/runtime/test_speculative.py" -k "not cli and not closed_stdout and not path and not override_key and not tensor_name" \
    "${@}"
