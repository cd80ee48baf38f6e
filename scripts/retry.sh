#!/usr/bin/env bash
# retry.sh N COMMAND...: run COMMAND up to N times, waiting a little longer after each failure.
# For installs from the package registries, whose large downloads are sometimes cut off mid-way
# (pip's own --resume-retries continues a download; this starts the whole command again).
set -uo pipefail
tries="$1"
shift
for ((i = 1; i <= tries; i++)); do
  "$@" && exit 0
  status=$?
  if ((i < tries)); then
    echo "retry.sh: '$*' failed (exit $status), attempt $i of $tries; trying again in $((10 * i)) s" >&2
    sleep $((10 * i))
  fi
done
echo "retry.sh: '$*' failed $tries times" >&2
exit "$status"
