#!/usr/bin/env bash
# Make sure Fashion-MNIST is where gpulab looks; install Debian's package when it is missing
# and apt is usable. Prints one line either way; never fails the build for missing data
# (gpulab itself explains how to get it).
set -u
PY=${1:-python3}
if "$PY" -c "from gpulab.data.fashion_mnist import find; find()" 2>/dev/null; then
  echo "Fashion-MNIST: found"
  exit 0
fi
if command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo -n"
  if [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; then
    echo "Fashion-MNIST: installing Debian's dataset-fashion-mnist"
    $SUDO apt-get update -qq >/dev/null 2>&1
    if DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1; then
      echo "Fashion-MNIST: installed in /usr/share/datasets/fashion-mnist"
      exit 0
    fi
  fi
fi
echo "Fashion-MNIST: not found and not installable with apt here; gpulab train will download it or say how to get it"
