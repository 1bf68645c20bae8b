#!/bin/sh
# Install from Debian what the Mininet and network-namespace tests need: mininet (with mnexec and
# net-tools), bridge-utils, nftables, iproute2. Meant to run before the test suite:
#     sh mininet_topos/setup_deps.sh && .venv/bin/python -m pytest
# A quiet no-op when everything is present; when not root or without apt-get it says what is
# missing and exits 0, and the tests that need those tools skip with that reason.
set -u
need=""
command -v mnexec >/dev/null 2>&1 || need="$need mininet"
command -v brctl >/dev/null 2>&1 || need="$need bridge-utils"
command -v nft >/dev/null 2>&1 || need="$need nftables"
{ command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1; } || need="$need iproute2"
[ -z "$need" ] && exit 0
if [ "$(id -u)" != 0 ]; then
    echo "setup_deps: not root, not installing$need (Mininet/netns tests will skip)" >&2
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup_deps: no apt-get here; install$need with your package manager" >&2
    exit 0
fi
echo "setup_deps: apt-get install$need" >&2
export DEBIAN_FRONTEND=noninteractive
# No recommends: Mininet would pull Open vSwitch, which LTA's topologies do not use.
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends $need >/dev/null; }; then
    echo "setup_deps: apt-get failed; Mininet/netns tests will skip" >&2
fi
exit 0
