#!/usr/bin/env bash
# Debian packages for the team set-up without Docker on one machine (README "Team set-up") and for the
# tests that run it for real (tests/flows/test_full_lifecycle.py): PostgreSQL for the Prefect and MLflow
# servers, Chromium and its driver for the UI tests. The tests start their own throwaway PostgreSQL
# cluster (tests/fixtures/postgres.py), so the packaged cluster is not started here.
#
#   bash infra/team/install.sh     # idempotent: apt-get runs only when a package is missing
set -euo pipefail
PACKAGES=(postgresql chromium chromium-driver)
log() { echo "team: $*" >&2; }

missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
((${#missing[@]})) || exit 0
[[ $(id -u) -eq 0 ]] || { log "error: needs root to apt-get install ${missing[*]}"; exit 1; }
log "installing ${missing[*]}"
# Package scripts try to start services; a policy-rc.d that exits 101 stops them (kept if present).
made_policy=0
if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
fi
export DEBIAN_FRONTEND=noninteractive
apt_log=${TMPDIR:-/tmp}/eightfold-team-apt.log
apt-get install -y -q --no-install-recommends "${missing[@]}" >"$apt_log" 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends "${missing[@]}" >"$apt_log" 2>&1; } ||
    { log "error: apt-get install ${missing[*]} failed; see $apt_log"; exit 1; }
((made_policy)) && rm -f /usr/sbin/policy-rc.d
exit 0
