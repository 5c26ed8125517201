#!/usr/bin/env bash
# Makes sure the tools for the cross-ISA kernel tests are here: Debian's aarch64 cross compiler and
# qemu's user-mode emulators. Installs them with apt-get when running as root (CI does); otherwise
# says what to install and fails.
set -euo pipefail
need=()
command -v aarch64-linux-gnu-gcc >/dev/null || need+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
command -v qemu-aarch64-static >/dev/null && command -v qemu-x86_64-static >/dev/null || need+=(qemu-user-static)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing ${need[*]} for the cross-ISA kernel tests" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq "${need[@]}" >/dev/null
else
    echo "error: the cross-ISA kernel tests need the Debian packages: ${need[*]} (apt-get install them, or run 'make test-py test-native')" >&2
    exit 1
fi
