#!/usr/bin/env bash
# Install Horovod 0.28.1 (PyTorch + gloo, CPU only) into the active venv.
#
# Horovod 0.28.1, the newest release, does not build against torch >= 2.1 as
# shipped (its CMake asks for C++14), so this builds its sdist with C++17 once
# and caches the wheel outside the checkout, keyed by the Horovod, torch and
# Python versions and the platform: a torch upgrade forces a rebuild.
#
#   cache: ${SYLVIE_COMM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sylvie-comm}/wheels/
#
# Run it with the project venv active (scripts/setup.sh does). It can also be
# sourced: everything runs in a subshell, so it leaves the caller's options,
# traps and directory alone. MAX_JOBS (default 2) sets the build's parallelism.
set -euo pipefail

sylvie_horovod_install() (
  set -euo pipefail
  local version="0.28.1"
  # Bump when the build recipe below changes, so cached wheels get rebuilt.
  local recipe="r1"

  if python - "$version" 2>/dev/null <<'EOF'; then
import sys
import horovod
import horovod.torch  # noqa: F401  (loads the compiled torch ops)
sys.exit(0 if horovod.__version__ == sys.argv[1] else 1)
EOF
    return 0
  fi

  if [ -z "${VIRTUAL_ENV:-}" ]; then
    echo "horovod.sh: no virtual environment is active (source .venv/bin/activate first)" >&2
    return 1
  fi

  # horovod's runtime requirements (setup.py install_requires, cffi because the
  # PyTorch extension is built); the build needs them too (no build isolation).
  local deps=("cffi>=1.4.0" cloudpickle psutil pyyaml packaging "setuptools>=70" wheel)
  if ! python -c "import cffi, cloudpickle, psutil, yaml, packaging, setuptools, wheel" 2>/dev/null; then
    python -m pip install --quiet "${deps[@]}"
  fi

  local key
  key="$(python - "$version" "$recipe" <<'EOF'
import sys, sysconfig
import torch
version, recipe = sys.argv[1:]
py = f"cp{sys.version_info.major}{sys.version_info.minor}"
plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
print(f"horovod-{version}_torch-{torch.__version__}_{py}_{plat}_{recipe}")
EOF
)"
  local cache="${SYLVIE_COMM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sylvie-comm}"
  local wheeldir="$cache/wheels/$key"
  local wheel=""
  wheel="$(find "$wheeldir" -maxdepth 1 -name "horovod-$version-*.whl" 2>/dev/null | head -n1 || true)"

  if [ -z "$wheel" ]; then
    echo "setup: building Horovod $version (4-12 minutes, cached afterwards in $wheeldir)"
    local tmp
    tmp="$(mktemp -d "${TMPDIR:-/tmp}/sylvie-horovod.XXXXXX")"
    # shellcheck disable=SC2064  # expand $tmp now
    trap "rm -rf '$tmp'" EXIT

    # Horovod's bundled gloo needs CMake 3.x (CMake 4 rejects its
    # cmake_minimum_required < 3.5); setup.py runs whatever `cmake` is on PATH,
    # and a pip-installed cmake 4 in the venv would shadow the system one.
    # Put a CMake 3.13+ first on PATH through a private bin dir (not /usr/bin
    # itself, which would shadow the venv's python).
    local cmake_bin="" c v
    for c in "$(command -v cmake || true)" /usr/bin/cmake /usr/local/bin/cmake; do
      [ -n "$c" ] && [ -x "$c" ] || continue
      v="$("$c" --version 2>/dev/null | sed -n 's/^cmake version \([0-9]*\.[0-9]*\).*/\1/p')"
      case "$v" in
        3.1[3-9] | 3.[2-9][0-9]) cmake_bin="$c"; break ;;
      esac
    done
    mkdir -p "$tmp/bin"
    if [ -z "$cmake_bin" ]; then
      # No CMake 3.13+ on this machine: a CMake 3 from PyPI, into the build's own folder
      # (the wheel carries the binary under cmake/data/bin).
      echo "horovod.sh: no CMake 3.13+ found, installing cmake<4 from PyPI for this build" >&2
      if python -m pip install --quiet --target "$tmp/cmake3" "cmake>=3.13,<4"; then
        c="$(find "$tmp/cmake3" -path '*/data/bin/cmake' -type f | head -n1)"
        if [ -n "$c" ] && "$c" --version >/dev/null 2>&1; then cmake_bin="$c"; fi
      fi
    fi
    if [ -n "$cmake_bin" ]; then
      ln -s "$cmake_bin" "$tmp/bin/cmake"
    elif command -v cmake >/dev/null; then
      # Only CMake 4 around: let it accept the old minimums (CMake >= 4.0 reads this).
      export CMAKE_POLICY_VERSION_MINIMUM=3.5
      echo "horovod.sh: no CMake 3.13+ found, trying $(command -v cmake) with CMAKE_POLICY_VERSION_MINIMUM=3.5" >&2
    else
      echo "horovod.sh: building Horovod needs CMake 3.13 or newer (e.g. apt-get install cmake)" >&2
      return 1
    fi
    if ! command -v "${CXX:-c++}" >/dev/null; then
      echo "horovod.sh: building Horovod needs a C++17 compiler (${CXX:-c++} not found)" >&2
      return 1
    fi

    python -m pip download --quiet --no-deps --no-binary :all: "horovod==$version" -d "$tmp/sdist"
    tar -xzf "$tmp/sdist/horovod-$version.tar.gz" -C "$tmp"
    local src="$tmp/horovod-$version" f
    for f in CMakeLists.txt horovod/torch/CMakeLists.txt; do
      if ! grep -q 'set(CMAKE_CXX_STANDARD 14)' "$src/$f"; then
        echo "horovod.sh: $f of horovod $version has no 'set(CMAKE_CXX_STANDARD 14)';" \
          "the C++17 patch for torch >= 2.1 does not apply, the recipe needs updating" >&2
        return 1
      fi
      sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/$f"
    done

    mkdir -p "$cache/logs"
    local log="$cache/logs/$key.log" start=$SECONDS
    # Only the settings below: no GPU operations leaking in from the caller's env.
    unset HOROVOD_GPU HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_BROADCAST HOROVOD_GPU_ALLGATHER
    if ! (cd "$src" && PATH="$tmp/bin:$PATH" \
      HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_CPU_OPERATIONS=gloo \
      HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
      MAKEFLAGS="-j${MAX_JOBS:-2}" \
      python -m pip wheel -v --no-build-isolation --no-deps -w "$tmp/dist" . >"$log" 2>&1); then
      tail -n 60 "$log" >&2
      echo "horovod.sh: building Horovod $version failed (log tail above, full log in $log)" >&2
      return 1
    fi
    local built
    built="$(find "$tmp/dist" -maxdepth 1 -name "horovod-$version-*.whl" | head -n1)"
    if [ -z "$built" ]; then
      echo "horovod.sh: the build produced no wheel (log in $log)" >&2
      return 1
    fi
    # Atomic: a concurrent or interrupted run never sees a half-written wheel.
    mkdir -p "$wheeldir"
    wheel="$wheeldir/$(basename "$built")"
    cp "$built" "$wheeldir/.tmp.$$.whl"
    mv -f "$wheeldir/.tmp.$$.whl" "$wheel"
    echo "setup: built $(basename "$wheel") in $((SECONDS - start))s"
  fi

  python -m pip install --quiet --no-deps --force-reinstall "$wheel"
  if ! python -c "import horovod.torch as hvd" >/dev/null; then
    echo "horovod.sh: $wheel installed but 'import horovod.torch' fails;" \
      "delete $wheeldir to rebuild it" >&2
    return 1
  fi
)

if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  sylvie_horovod_install
  return
fi
sylvie_horovod_install
