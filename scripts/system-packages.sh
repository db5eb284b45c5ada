#!/usr/bin/env bash
# The Debian packages the dev install builds against: mysqlclient (MySQLdb, a write-path
# driver the tests run against MariaDB) compiles from PyPI with the MySQL/MariaDB client
# headers, pkg-config and a C compiler. And iptables: the server-keepalive tests drop a
# client's packets on the loopback to make its host vanish (they skip without it locally,
# fail under CI=true). Installs whichever is missing (apt-get update first); prints nothing
# when all are there, so scripts/test can call it on every run.
set -euo pipefail

packages=(default-libmysqlclient-dev pkg-config build-essential iptables)

if ! command -v dpkg-query >/dev/null 2>&1; then
  # Not Debian: the build itself says what it lacks (mysqlclient's setup names pkg-config
  # and the mysqlclient/mariadb headers), so there is nothing to check here.
  exit 0
fi

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

sudo=()
if [ "$(id -u)" -ne 0 ]; then
  sudo=(sudo)
fi
echo "system packages: installing ${missing[*]} (mysqlclient's build, the fault-injection tests)"
export DEBIAN_FRONTEND=noninteractive
# Other installs may hold dpkg's lock for a while: wait for it instead of failing.
apt=("${sudo[@]}" apt-get -qq -o DPkg::Lock::Timeout=300)
"${apt[@]}" update
"${apt[@]}" install -y --no-install-recommends "${missing[@]}" >/dev/null
