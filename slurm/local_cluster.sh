#!/usr/bin/env bash
# Local Slurm test cluster: installs the Debian packages if any is missing (needs root), then
# hands over to the Python helper.  Usage: slurm/local_cluster.sh start --nodes 2 | stop | status
set -euo pipefail

packages=(slurm-wlm slurmdbd munge mariadb-server slurm-client)
missing=()
for package in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" \
        || missing+=("$package")
done
if ((${#missing[@]})); then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
fi

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The helper needs only the standard library, so any python3 will do.
exec "${PYTHON:-python3}" -m slurm.local_cluster "$@"
