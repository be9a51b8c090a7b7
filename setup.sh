#!/usr/bin/env bash
# Sets up a fresh Debian machine (root, Python 3.11) for infinity:
#   ./setup.sh          the package and its runtime needs
#   ./setup.sh --test   the same plus the test tools
# Order matters: the CPU build of torch goes in before the package, so that
# no requirement can pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"

extra=""
[ "${1:-}" = "--test" ] && extra="[test]"

missing=""
for pkg in liburing-dev fio; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
  apt-get update -qq && apt-get install -y -qq $missing >/dev/null
fi

python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".$extra"
