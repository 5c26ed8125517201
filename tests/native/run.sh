#!/usr/bin/env bash
# Builds the kernel library and the C kernel test runner, then runs it.
#   tests/native/run.sh host      native build, run here (x86-64 or aarch64)
#   tests/native/run.sh arm       aarch64-linux-gnu-gcc cross build, run under qemu-aarch64-static
#   tests/native/run.sh nehalem   x86-64 build run under qemu-x86_64-static -cpu Nehalem (no AVX:
#                                 only scalar may be chosen, nothing may SIGILL)
# Each library file is compiled on its own with its flags from cpumla/native/csrc/FLAGS and
# -I csrc/include -I csrc, as setup.py does. Objects go to build/native-<target>/, each at its source's
# path under csrc/ (the runner's own under tests/). Extra arguments are passed to the runner (-v: every
# failure; --small: smaller shapes, for slow emulators). The full table takes ~10 s under qemu.
#   SANITIZE=address  (host only) build with ASan + UBSan, any report fails the run
#   SANITIZE=thread   (host only) build with TSan: the thread pool and the library lock under test
set -euo pipefail

target=${1:-host}
shift || true
root=$(cd "$(dirname "$0")/../.." && pwd)
csrc=$root/cpumla/native/csrc
tests=$root/tests/native
out=$root/build/native-$target
san=()
case ${SANITIZE:-} in
'') ;;
address)
    san=(-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g)
    export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
    export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
    out=$out-asan
    ;;
thread)
    san=(-fsanitize=thread -fno-omit-frame-pointer -g)
    export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1}
    out=$out-tsan
    ;;
*)
    echo "SANITIZE must be address or thread" >&2
    exit 2
    ;;
esac
[ ${#san[@]} = 0 ] || [ "$target" = host ] || { echo "SANITIZE needs the host target" >&2; exit 2; }

case $target in
host)
    cc=${CC:-gcc}
    arch=$(uname -m)
    runner=()
    args=()
    ;;
arm)
    cc=${CC:-aarch64-linux-gnu-gcc}
    arch=aarch64
    runner=(qemu-aarch64-static -L /usr/aarch64-linux-gnu)
    args=()
    ;;
nehalem)
    [ "$(uname -m)" = x86_64 ] || { echo "nehalem needs an x86-64 host" >&2; exit 2; }
    cc=${CC:-gcc}
    arch=x86_64
    runner=(qemu-x86_64-static -cpu Nehalem)
    args=(--expect-isa scalar)
    ;;
*)
    echo "usage: $0 host|arm|nehalem [runner args]" >&2
    exit 2
    ;;
esac

mkdir -p "$out"
common=$(awk '$1 == "COMMON" { $1 = ""; print }' "$csrc/FLAGS")
pids=()
objs=()
listed=()
while read -r file farch fflags; do
    case $file in '' | \#* | COMMON) continue ;; esac
    listed+=("$file")
    [ "$farch" = any ] || [ "$farch" = "$arch" ] || continue
    [ -f "$csrc/$file" ] || { echo "FLAGS lists $file but $csrc/$file is missing" >&2; exit 2; }
    obj=$out/${file%.c}.o
    mkdir -p "$(dirname "$obj")"
    objs+=("$obj")
    # shellcheck disable=SC2086
    $cc $common $fflags "${san[@]}" -DCPUMLA_FLAGS="\"$(echo $common $fflags)\"" -I"$csrc/include" -I"$csrc" \
        -c "$csrc/$file" -o "$obj" &
    pids+=($!)
done <"$csrc/FLAGS"
while read -r f; do
    name=${f#"$csrc"/}
    [[ " ${listed[*]} " == *" $name "* ]] || echo "warning: $name is not listed in FLAGS: not built" >&2
done < <(find "$csrc" -name '*.c' | sort)
test_objs=()
mkdir -p "$out/tests"
for src in "$tests"/*.c; do          # the runner: test_kernels.c's main, the other test files, harness.c
    t=$(basename "$src" .c)
    test_objs+=("$out/tests/$t.o")
    # shellcheck disable=SC2086
    $cc $common "${san[@]}" -Wno-unused-function -I"$csrc/include" -I"$csrc" -c "$tests/$t.c" -o "$out/tests/$t.o" &
    pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
[ $status = 0 ] || { echo "build failed" >&2; exit 1; }
$cc "${san[@]}" -o "$out/test_kernels" "${test_objs[@]}" "${objs[@]}" -lm -lpthread

echo "== $target: ${runner[*]:-native} $out/test_kernels ${args[*]:-} $*"
if [ "$target" = arm ]; then
    # qemu's default CPU has the dot-product extension (neon_q_dot.c); a Cortex-A57 has not (neon_q.c)
    "${runner[@]}" "$out/test_kernels" "${args[@]}" "$@"
    echo "== arm without the dot-product extension: QEMU_CPU=cortex-a57"
    QEMU_CPU=cortex-a57 exec "${runner[@]}" "$out/test_kernels" "${args[@]}" "$@"
fi
exec "${runner[@]}" "$out/test_kernels" "${args[@]}" "$@"
