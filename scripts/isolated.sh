#!/usr/bin/env bash
# Run a command in a private network namespace with only loopback up, so that whatever it starts (a local
# Ray cluster, which otherwise listens on every interface) is reachable only from this machine, and nothing
# it runs can reach the network. Needs unshare (util-linux) and the right to create namespaces (root, or
# unprivileged user namespaces); where that is unavailable the command runs normally, with a note on stderr.
#   scripts/isolated.sh CMD [ARGS...]
set -euo pipefail
if [[ $# -eq 0 ]]; then
  echo "usage: scripts/isolated.sh CMD [ARGS...]" >&2
  exit 2
fi
if [[ "${MECHGEOM_ISOLATED:-}" == 1 ]]; then
  exec "$@"  # already inside
fi
isolate=(unshare -n)
if [[ $(id -u) -ne 0 ]]; then
  isolate=(unshare -n -r)  # an unprivileged user namespace maps us to root inside, for `ip link`
fi
if command -v unshare > /dev/null && command -v ip > /dev/null && "${isolate[@]}" true 2> /dev/null; then
  exec "${isolate[@]}" env MECHGEOM_ISOLATED=1 bash -c 'ip link set lo up && exec "$@"' isolated "$@"
fi
echo "scripts/isolated.sh: cannot create a network namespace here; running without isolation" >&2
exec "$@"
