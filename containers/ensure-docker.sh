#!/usr/bin/env bash
# Make a Docker engine reachable for the testbed's docker runtime; idempotent, cheap when one already runs.
#
#   1. An engine already answers (DOCKER_HOST, /var/run/docker.sock, or the testbed's own socket): done.
#   2. Otherwise install Debian's docker.io (and debootstrap, used to make the worker image's base offline)
#      if missing, and start dockerd in the background with settings that never touch the host's network:
#        --iptables=false --ip-forward=false --ip-masq=false --bridge=none   (no docker0, no NAT rules, no
#        sysctl changes; testbed containers use network_mode=none and get veths from the testbed)
#        private --data-root, --exec-root, --pidfile and socket (does not collide with a system dockerd).
#      then wait until it answers.
#
# Prints the DOCKER_HOST to use on stdout (last line). Exit 0 when an engine answers, 1 otherwise.
# Environment: TESTBED_DOCKER_DIR (default /run/testbed-docker: socket, pidfile, exec root, log),
#              TESTBED_DOCKER_DATA (default /var/lib/testbed/docker: images and containers).
set -euo pipefail

RUN_DIR=${TESTBED_DOCKER_DIR:-/run/testbed-docker}
DATA_ROOT=${TESTBED_DOCKER_DATA:-/var/lib/testbed/docker}
SOCK="unix://$RUN_DIR/docker.sock"
log() { echo "ensure-docker: $*" >&2; }

answers() {  # answers HOST: true when an engine answers there within a few seconds
    timeout 10 docker -H "$1" version --format '{{.Server.Version}}' >/dev/null 2>&1
}

have_client() { command -v docker >/dev/null 2>&1; }

if have_client; then
    for h in ${DOCKER_HOST:-} unix:///var/run/docker.sock "$SOCK"; do
        if [ -n "$h" ] && answers "$h"; then
            log "engine reachable at $h"
            echo "$h"
            exit 0
        fi
    done
fi
if [ -n "${DOCKER_HOST:-}" ] && [ "$DOCKER_HOST" != "$SOCK" ]; then
    log "DOCKER_HOST=$DOCKER_HOST does not answer; starting the testbed's own engine at $SOCK instead"
fi

if [ "$(id -u)" != 0 ]; then
    log "no engine reachable and not root: run as root, or start Docker yourself and set DOCKER_HOST"
    exit 1
fi

missing=""
command -v dockerd >/dev/null 2>&1 || missing="$missing docker.io"
have_client || missing="$missing docker.io"
command -v debootstrap >/dev/null 2>&1 || missing="$missing debootstrap"
if [ -n "$missing" ]; then
    log "installing$missing"
    export DEBIAN_FRONTEND=noninteractive
    # The package would start the system's dockerd at once (systemd/sysv), which makes docker0 and NAT rules
    # on the host: forbid service starts during the install (policy-rc.d, honoured by invoke-rc.d and
    # deb-systemd-invoke). The units stay as the package installs them.
    added_policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && added_policy=1
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    apt-get install -y -qq --no-install-recommends $missing >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq --no-install-recommends $missing >/dev/null; }
    if [ -n "$added_policy" ]; then rm -f /usr/sbin/policy-rc.d; trap - EXIT; fi
fi

mkdir -p "$RUN_DIR" "$DATA_ROOT"
PIDFILE="$RUN_DIR/dockerd.pid"
if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    log "dockerd (pid $(cat "$PIDFILE")) is starting; waiting"
else
    rm -f "$PIDFILE" "$RUN_DIR/docker.sock"
    log "starting dockerd (data $DATA_ROOT, socket $SOCK, log $RUN_DIR/dockerd.log)"
    # setsid + nohup: dockerd outlives this script and the make/pytest process that ran it.
    setsid nohup dockerd \
        --host "$SOCK" --data-root "$DATA_ROOT" --exec-root "$RUN_DIR/exec" --pidfile "$PIDFILE" \
        --iptables=false --ip-forward=false --ip-masq=false --bridge=none --userland-proxy=false \
        >"$RUN_DIR/dockerd.log" 2>&1 </dev/null &
fi
for _ in $(seq 1 300); do
    if answers "$SOCK"; then
        log "engine ready at $SOCK"
        echo "$SOCK"
        exit 0
    fi
    sleep 0.1
done
log "dockerd did not answer within 30 s; see $RUN_DIR/dockerd.log:"
tail -20 "$RUN_DIR/dockerd.log" >&2 || true
exit 1
