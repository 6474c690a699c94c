#!/usr/bin/env bash
# The README's two commands:
#   bash tools/bootstrap.sh demo   install everything, build the default voice, speak a sentence
#   bash tools/bootstrap.sh test   install everything, build the default voice, run the tests
set -euo pipefail
cd "$(dirname "$0")/.."

# python3-venv for the venv; python3-dev and gcc because pip builds systemd-python from source.
APT_PACKAGES="libsystemd-dev pkg-config libportaudio2 systemd python3-venv python3-dev gcc"

install_system() {
    local missing=""
    for pkg in $APT_PACKAGES; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing="$missing $pkg"
    done
    if [ -n "$missing" ]; then
        local sudo=""
        [ "$(id -u)" -eq 0 ] || sudo="sudo"
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $missing
    fi
}

install_python() {
    [ -x .venv/bin/python ] || python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[dev]'
    # pip compiles the bytecode of what it installs, but not of an editable package; where
    # PYTHONDONTWRITEBYTECODE is set (containers, CI) every daemon start would compile edged again.
    .venv/bin/python -m compileall -q edged
}

build_voice() {
    # Deterministic: rebuilt only when the builder or its source changed (manifest records both).
    .venv/bin/python -m tools.build_voice --if-stale
}

case "${1:-demo}" in
    demo|test) ;;
    *)
        echo "usage: $0 demo|test [pytest arguments]" >&2  # before minutes of installing
        exit 2
        ;;
esac

install_system
install_python
build_voice

case "${1:-demo}" in
    demo)
        exec .venv/bin/python -m tools.demo
        ;;
    test)
        shift || true
        exec .venv/bin/python -m pytest -q "$@"
        ;;
esac
